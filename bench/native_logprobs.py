"""The native CPU token_logprobs kernels against the CPU peers, side by side.

`flashrl-kernels bench --op token_logprobs` already times every backend
(native included) against eager torch and torch.compile; this script adds
what the native issue asks for in one run: interleaved repeats (every repeat
runs every implementation once, so a noisy neighbour slows all of them
alike), medians and per-repeat ratio medians, accuracy vs float64, and the
fraction of the machine's copy bandwidth.

    PYTHONPATH=. python bench/native_logprobs.py [--rows 1024] [--vocab 151936] [--repeats 9] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


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


def _accuracy(n, v, compile_peer, rows=128):
    """Max |logp - float64 logp| of each implementation on the first `rows` rows of the benchmark input."""
    x, y = _inputs(n, v)
    x, y = x[:rows], y[:rows]
    ref = torch.log_softmax(x.double(), -1).gather(-1, y[:, None]).squeeze(-1)
    impls = {"torch.compile": _compiled_peer} if compile_peer else {}
    impls.update({"eager": _peer, "flashrl native": _flashrl})
    return {k: float((f(x, y).double() - ref).abs().max()) for k, f in impls.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--copy-mib", type=int, default=1024, help="size of the bandwidth-probe copy")
    p.add_argument("--no-compile", action="store_true", help="leave torch.compile out (it compiles for minutes)")
    a = p.parse_args(argv)
    n, v = a.rows, a.vocab
    from flashrl_kernels import native_status

    print(native_status(load=True).summary())
    print(f"threads: {torch.get_num_threads()}, size N={n} V={v} bf16, {a.repeats} interleaved repeats")
    bw = copy_bandwidth(a.copy_mib << 20)
    thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "")
    print(f"copy bandwidth (read+write): {bw / 1e9:.1f} GB/s; THP_MEM_ALLOC_ENABLE={thp!r}")
    peers = {"fwd": {"eager": _fwd(_peer, n, v)}, "fwd+bwd": {"eager": _fwd_bwd(_peer, n, v)}}
    if not a.no_compile:
        peers["fwd"] = {"torch.compile": _fwd(_compiled_peer, n, v), **peers["fwd"]}
        peers["fwd+bwd"]["torch.compile"] = _fwd_bwd(_compiled_peer, n, v)
    peers["fwd"]["flashrl native"] = _fwd(_flashrl, n, v)
    peers["fwd+bwd"]["flashrl native"] = _fwd_bwd(_flashrl, n, v)
    moved = {"fwd": n * v * 2, "fwd+bwd": 3 * n * v * 2}
    results = {}
    for mode, impls in peers.items():
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
        results[mode] = med
        del fns
    acc = _accuracy(n, v, not a.no_compile, rows=min(n, 128))
    print("\nmax |logp - float64| on the first rows:", {k: f"{e:.2e}" for k, e in acc.items()})
    return results, acc


if __name__ == "__main__":
    main()
