"""Benchmarks of the native CPU token_logprobs kernels against the CPU peers.

As a harness module: `cases(quick, device)` returns the cases (CPU only; an
empty list on other devices). As a script, the issue's targets side by side
in one run, interleaved (every repeat runs every implementation once, so a
noisy neighbour slows all of them alike), with medians, ratios, accuracy vs
float64 and the fraction of the machine's copy bandwidth:

    python -m flashrl_kernels.benchmarks.native_logprobs [--rows 1024] [--vocab 151936] [--repeats 9]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

try:
    from .harness import Case
except ImportError:  # the harness lands separately; keep the module usable on its own
    from collections.abc import Callable
    from dataclasses import dataclass

    @dataclass
    class Case:  # same fields as flashrl_kernels.benchmarks.harness.Case
        op: str
        impl: str
        mode: str
        size: str
        make: Callable[[], Callable[[], object]]
        bytes: int | None = None
        flops: int | None = None
        baseline: bool = False


OP = "token_logprobs"


def _inputs(n, v, dtype=torch.bfloat16, seed=0, requires_grad=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n, v, generator=g) * 3).to(dtype).requires_grad_(requires_grad)
    y = torch.randint(0, v, (n,), generator=g)
    return x, y


def _peer(x, y):
    return torch.log_softmax(x.float(), dim=-1).gather(-1, y[:, None]).squeeze(-1)


def _flashrl(x, y):
    import flashrl_kernels as fk

    with fk.use_backend("native"):
        return fk.token_logprobs(x, y)


def _fwd(fn, n, v):
    def make():
        x, y = _inputs(n, v)
        return lambda: fn(x, y)
    return make


def _fwd_bwd(fn, n, v):
    def make():
        x, y = _inputs(n, v, requires_grad=True)
        g = torch.randn(n, generator=torch.Generator().manual_seed(1))

        def step():
            x.grad = None
            (fn(x, y) * g).sum().backward()
            return x.grad
        return step
    return make


_compiled = {}


def _compiled_peer(x, y):
    if "f" not in _compiled:
        _compiled["f"] = torch.compile(_peer, dynamic=False)
    return _compiled["f"](x, y)


def cases(quick: bool, device: torch.device) -> list[Case]:
    if torch.device(device).type != "cpu":
        return []
    from flashrl_kernels import _backend

    if not _backend.native_built():
        return []
    n, v = (64, 32000) if quick else (1024, 151936)
    size = f"N={n} V={v} bf16"
    fwd_bytes = n * v * 2 + n * 16
    out = [
        Case(OP, "torch.compile log_softmax+gather", "fwd", size, _fwd(_compiled_peer, n, v), fwd_bytes, baseline=True),
        Case(OP, "eager log_softmax+gather", "fwd", size, _fwd(_peer, n, v), fwd_bytes),
        Case(OP, "flashrl native", "fwd", size, _fwd(_flashrl, n, v), fwd_bytes),
        Case(OP, "eager log_softmax+gather", "fwd+bwd", size, _fwd_bwd(_peer, n, v), 3 * n * v * 2, baseline=True),
        Case(OP, "torch.compile log_softmax+gather", "fwd+bwd", size, _fwd_bwd(_compiled_peer, n, v), 3 * n * v * 2),
        Case(OP, "flashrl native", "fwd+bwd", size, _fwd_bwd(_flashrl, n, v), 3 * n * v * 2),
    ]
    return out


# ---------------------------------------------------------------- script


def copy_bandwidth(nbytes=1 << 30, repeats=7) -> float:
    """Bytes per second of a large tensor copy (read + write counted), median of repeats."""
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        ts.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(ts)


def _accuracy(n, v, rows=128):
    """Max |logp - float64 logp| of each implementation on the first `rows` rows of the benchmark input."""
    x, y = _inputs(n, v)
    x, y = x[:rows], y[:rows]
    ref = torch.log_softmax(x.double(), -1).gather(-1, y[:, None]).squeeze(-1)
    got = {
        "torch.compile": _compiled_peer(x, y),
        "eager": _peer(x, y),
        "flashrl native": _flashrl(x, y),
    }
    return {k: float((g.double() - ref).abs().max()) for k, g in got.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    n, v = a.rows, a.vocab
    from flashrl_kernels import native_status

    print(native_status(load=True).summary())
    print(f"threads: {torch.get_num_threads()}, size N={n} V={v} bf16, {a.repeats} interleaved repeats")
    bw = copy_bandwidth()
    print(f"copy bandwidth (read+write): {bw / 1e9:.1f} GB/s; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', '')!r}")
    groups = {
        "fwd": {
            "torch.compile": _fwd(_compiled_peer, n, v),
            "eager": _fwd(_peer, n, v),
            "flashrl native": _fwd(_flashrl, n, v),
        },
        "fwd+bwd": {
            "eager": _fwd_bwd(_peer, n, v),
            "torch.compile": _fwd_bwd(_compiled_peer, n, v),
            "flashrl native": _fwd_bwd(_flashrl, n, v),
        },
    }
    moved = {"fwd": n * v * 2, "fwd+bwd": 3 * n * v * 2}
    for mode, impls in groups.items():
        fns = {k: make() for k, make in impls.items()}
        for f in fns.values():  # warm-up (compiles)
            f()
        times = {k: [] for k in fns}
        for _ in range(a.repeats):
            for k, f in fns.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        base = next(iter(times))
        med = {k: statistics.median(ts) for k, ts in times.items()}
        print(f"\n{mode} (ratio = {base} / impl; per-repeat ratio median in brackets)")
        for k, ts in times.items():
            per = statistics.median(b / t for b, t in zip(times[base], ts))
            gbs = moved[mode] / med[k]
            print(f"  {k:16s} {med[k] * 1e3:8.1f} ms  x{med[base] / med[k]:5.2f} [x{per:4.2f}]  "
                  f"{gbs / 1e9:5.1f} GB/s = {gbs / bw:4.0%} of copy bw")
        del fns
    print("\nmax |logp - float64| on 128 rows:", {k: f"{e:.2e}" for k, e in _accuracy(n, v).items()})


if __name__ == "__main__":
    main()
