"""policy_loss / value_loss against eager torch and torch.compile at trainer micro-batch sizes, forward alone and
forward + backward: on the CPU (the default native backend) or on a CUDA GPU (the triton backend).

    python bench/loss_call_overhead.py                 # CPU
    python bench/loss_call_overhead.py --device cuda   # one GPU: calls back to back, then one synchronize

At 4K-130K tokens the per-call overhead (dispatch, finalize, checks) matters as much as the kernel; bench/RESULTS.md
("policy_loss / value_loss at trainer micro-batch sizes") has the numbers. Medians of three interleaved rounds. On a
GPU a call's time is the wall time of `reps` calls issued back to back and one synchronize, divided by reps: the
host's launch cost where it exceeds the kernels' device time (as in a trainer that does not wait for the loss).
flashrl runs twice there: with the value checks on (the default: one host sync per call) and off.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import flashrl_kernels as fk
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


def back_to_back_ms(step, reps: int) -> float:
    """GPU: reps calls issued back to back, one synchronize; wall time per call."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e3


def _checks_off(step):
    def run():
        fk.set_value_checks(False)
        try:
            step()
        finally:
            fk.set_value_checks(True)
    return run


def profile(dev, b, t) -> None:
    """Where a call's host time goes: torch.profiler over 20 calls of each op (fwd, fwd+bwd), top ops by self CPU
    time, and the number of kernel launches per call."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    for name, mod in (("policy_loss", policy_bench), ("value_loss", value_bench)):
        for backward in (False, True):
            step = mod._maker(mod._flashrl("triton" if dev.type == "cuda" else "native"), b, t, dev, backward)()
            for _ in range(3):
                step()
            with torch_profile(activities=activities) as prof:
                for _ in range(20):
                    step()
                if dev.type == "cuda":
                    torch.cuda.synchronize()
            events = prof.key_averages()
            launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx",
                                                                "cudaLaunchKernelExC"))
            print(f"== {name} B={b} T={t} {'fwd+bwd' if backward else 'fwd'}: {launches / 20:.1f} kernel launches "
                  "per call")
            print(events.table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--sizes", default=",".join(f"{b}x{t}" for b, t in SIZES), help="BxT,... (default: %(default)s)")
    ap.add_argument("--profile", action="store_true",
                    help="instead of timing: torch.profiler's top host ops of flashrl's calls at the first size")
    args = ap.parse_args(argv)
    sizes = [tuple(int(v) for v in st.split("x")) for st in args.sizes.split(",")]
    if args.profile:
        return profile(torch.device(args.device), *sizes[0])
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    if gpu:
        print(f"GPU {torch.cuda.get_device_name()}, torch {torch.__version__}")
    else:
        torch.set_num_threads(min(2, torch.get_num_threads()))
        print(f"CPU ISA flags: {' '.join(isa_flags())}; threads {torch.get_num_threads()}")
    timer = back_to_back_ms if gpu else median_ms
    for name, mod in (("policy_loss", policy_bench), ("value_loss", value_bench)):
        for b, t in sizes:
            for backward in (False, True):
                reps = 200 if b * t <= 20000 else (60 if b * t <= 200000 else 15)
                fns = {"flashrl": mod._flashrl("triton" if gpu else "native"), "eager": mod.eager_loss,
                       "compile": mod._compiled_eager()}
                steps = {k: mod._maker(f, b, t, dev, backward)() for k, f in fns.items()}
                if gpu:
                    steps["flashrl, checks off"] = _checks_off(mod._maker(fns["flashrl"], b, t, dev, backward)())
                for step in steps.values():  # warm-up (compiles)
                    step()
                runs = {k: [] for k in steps}
                for _ in range(3):  # interleaved rounds
                    for k, step in steps.items():
                        runs[k].append(timer(step, reps // 3 + 1))
                r = {k: statistics.median(v) for k, v in runs.items()}
                off = f"  checks off {r['flashrl, checks off']:7.3f}" if gpu else ""
                print(f"{name:11s} B={b:3d} T={t:4d} {'fwd+bwd' if backward else 'fwd    '}  flashrl {r['flashrl']:7.3f}"
                      f"{off}  eager {r['eager']:7.3f}  compile {r['compile']:7.3f} ms  vs eager "
                      f"{r['eager'] / r['flashrl']:.2f}x  vs compile {r['compile'] / r['flashrl']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
