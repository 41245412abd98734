"""policy_loss / value_loss against eager torch and torch.compile at trainer micro-batch sizes, forward alone and
forward + backward, on the CPU (the default native backend).

    python bench/loss_call_overhead.py

At 4K-130K tokens the per-call overhead (dispatch, finalize, checks) matters as much as the kernel; bench/RESULTS.md
("policy_loss / value_loss at trainer micro-batch sizes") has the numbers. Medians of three interleaved rounds.
"""
from __future__ import annotations

import statistics
import time

import torch

from flashrl_kernels._cpu import isa_flags
from flashrl_kernels.benchmarks import policy_loss as policy_bench
from flashrl_kernels.benchmarks import value_loss as value_bench

SIZES = ((8, 512), (8, 2048), (64, 2048), (256, 4096))


def median_ms(step, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main() -> None:
    torch.set_num_threads(min(2, torch.get_num_threads()))
    dev = torch.device("cpu")
    print(f"CPU ISA flags: {' '.join(isa_flags())}; threads {torch.get_num_threads()}")
    for name, mod in (("policy_loss", policy_bench), ("value_loss", value_bench)):
        for b, t in SIZES:
            for backward in (False, True):
                reps = 200 if b * t <= 20000 else (60 if b * t <= 200000 else 15)
                fns = {"flashrl": mod._flashrl("native"), "eager": mod.eager_loss, "compile": mod._compiled_eager()}
                steps = {k: mod._maker(f, b, t, dev, backward)() for k, f in fns.items()}
                runs = {k: [] for k in steps}
                for _ in range(3):  # interleaved rounds
                    for k, step in steps.items():
                        runs[k].append(median_ms(step, reps // 3 + 1))
                r = {k: statistics.median(v) for k, v in runs.items()}
                print(f"{name:11s} B={b:3d} T={t:4d} {'fwd+bwd' if backward else 'fwd    '}  flashrl {r['flashrl']:7.3f}"
                      f"  eager {r['eager']:7.3f}  compile {r['compile']:7.3f} ms  vs eager {r['eager'] / r['flashrl']:.2f}x"
                      f"  vs compile {r['compile'] / r['flashrl']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
