"""linear_token_logprobs on the torch backend vs the native CPU epilogues, side by side.

Both backends run the same tile loops and ATen GEMMs (torch_impl/linear_logprobs.py);
only the per-tile epilogue differs (torch: ~10 elementwise passes per tile;
native: one C++ pass per tile row, csrc/cpu/linear_logprobs.cpp). So this
script times, in one run:

1. the epilogues alone on one fp32 logits tile (default 2048 x 1024, the CPU
   tile size for N >= 2048), next to the tile's GEMM, which predicts the
   whole-op gain: saved = (torch epilogue - native epilogue) x tiles;
2. the whole op, forward and forward+backward, interleaved repeats (every
   repeat runs both backends, so a noisy neighbour slows both alike), medians
   and the median of the per-repeat ratios.

    PYTHONPATH=. python bench/native_linear_logprobs.py [--rows 1024] [--hidden 896] [--vocab 151936]
        [--dtype bf16] [--repeats 5] [--tile 2048x1024] [--threads 2] [--modes fwd,fwd+bwd]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _load():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def _times_ms(fn, repeats):
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append((time.perf_counter() - t) * 1e3)
    return ts


def epilogue_times(rows, cols, hidden, dtype, repeats=15, seed=0):
    """(min, median) ms of each epilogue (and of the tile GEMM) on one [rows, cols] tile.

    Each epilogue call is preceded by a copy of the tile into its scratch buffer (the epilogues overwrite
    it); that copy's own (min, median) is subtracted. On a shared machine the min is the better estimate of
    the cost, the median says how much the neighbours took.
    """
    from flashrl_kernels.native import linear_logprobs as nat
    from flashrl_kernels.torch_impl import linear_logprobs as tim

    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, hidden, generator=g).to(dtype)
    w = (torch.randn(cols, hidden, generator=g) / hidden**0.5).to(dtype)
    z = tim.logits_tile(h, w)
    tgt = torch.randint(0, 4 * cols, (rows,), generator=g)  # a quarter of the rows own their target here
    lse = torch.logsumexp(z, 1) + 3.0
    ent = torch.rand(rows, generator=g) * 5
    g_lp, g_h = torch.randn(rows, generator=g), torch.randn(rows, generator=g)

    buf = torch.empty_like(z)  # the epilogues overwrite their tile: refreshed from z before each call
    m = torch.empty(rows)
    s, ww, zt = torch.empty(rows), torch.empty(rows), torch.empty(rows)

    def fwd(epi):
        def run():
            buf.copy_(z)
            m.fill_(float("-inf"))
            s.zero_()
            ww.zero_()
            epi(buf, None, tgt, 1.0, True, m, s, ww, zt)

        return run

    def bwd(epi):
        def run():
            buf.copy_(z)
            return epi(buf, None, tgt, 1.0, lse, ent, g_lp, g_h, dtype)

        return run

    def stats(ts, minus=(0.0, 0.0)):
        return min(ts) - minus[0], statistics.median(ts) - minus[1]

    copy = stats(_times_ms(lambda: buf.copy_(z), repeats))
    out = {"tile GEMM (logits_tile)": stats(_times_ms(lambda: tim.logits_tile(h, w), repeats))}
    for name, make, epi in [
        ("fwd epilogue torch", fwd, tim._fwd_epilogue_torch),
        ("fwd epilogue native", fwd, nat._fwd_epilogue),
        ("bwd epilogue torch", bwd, tim._bwd_epilogue_torch),
        ("bwd epilogue native", bwd, nat._bwd_epilogue),
    ]:
        out[name] = stats(_times_ms(make(epi), repeats), copy)
    out["(tile copy, subtracted)"] = copy
    return out


def _inputs(n, h, v, dtype, grad, seed=1234):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype).requires_grad_(grad)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).requires_grad_(grad)
    targets = torch.randint(0, v, (n,), generator=g)
    gout = torch.randn(n, generator=g)
    return hidden, weight, targets, gout


def _step(backend, mode, inputs):
    import flashrl_kernels as fk

    hidden, weight, targets, gout = inputs

    def run():
        with fk.use_backend(backend):
            if mode == "fwd":
                with torch.no_grad():
                    return fk.linear_token_logprobs(hidden, weight, targets, return_entropy=True)
            hidden.grad = None
            weight.grad = None
            lp, ent = fk.linear_token_logprobs(hidden, weight, targets, return_entropy=True)
            ((lp - 0.01 * ent) * gout).sum().backward()
            return hidden.grad

    return run


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=896)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tile", default="2048x1024", help="rows x cols of the epilogue-alone tile")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--modes", default="fwd,fwd+bwd", help="whole-op modes to time; empty: the epilogues only")
    a = p.parse_args(argv)
    from flashrl_kernels import native_status
    from flashrl_kernels.torch_impl.linear_logprobs import tile_shape

    n, h, v, dtype = a.rows, a.hidden, a.vocab, DTYPES[a.dtype]
    if a.threads:
        torch.set_num_threads(a.threads)
    print(native_status(load=True).summary())
    rows, cols = tile_shape(n, v, torch.device("cpu"))
    tiles = -(-n // rows) * -(-v // cols)
    print(
        f"threads {torch.get_num_threads()}, N={n} H={h} V={v} {a.dtype}, op tiles {rows}x{cols} ({tiles}), "
        f"{a.repeats} interleaved repeats, load {_load()}"
    )

    tr, tc = (int(x) for x in a.tile.lower().split("x"))
    epi = epilogue_times(tr, tc, h, dtype)
    print(f"\none {tr}x{tc} fp32 tile (H={h} {a.dtype} GEMM), ms: min / median")
    for k, (lo, med) in epi.items():
        print(f"  {k:26s} {lo:8.2f} / {med:8.2f}")
    for d in ("fwd", "bwd"):
        t, nt = epi[f"{d} epilogue torch"][0], epi[f"{d} epilogue native"][0]
        print(
            f"  {d} epilogue torch/native (min): x{t / nt:.1f}; per op ({tiles} tiles of "
            f"{rows}x{cols}), scaled: {t * rows * cols / (tr * tc) * tiles:.0f} vs "
            f"{nt * rows * cols / (tr * tc) * tiles:.0f} ms"
        )

    results = {}
    for mode in filter(None, a.modes.split(",")):
        inputs = _inputs(n, h, v, dtype, mode != "fwd")
        fns = {b: _step(b, mode, inputs) for b in ("torch", "native")}
        for f in fns.values():
            f()  # warm-up
        times = {b: [] for b in fns}
        for _ in range(a.repeats):
            for b, f in fns.items():
                t = time.perf_counter()
                f()
                times[b].append(time.perf_counter() - t)
        med = {b: statistics.median(ts) * 1e3 for b, ts in times.items()}
        per = statistics.median(t / nt for t, nt in zip(times["torch"], times["native"]))
        print(
            f"\n{mode}: torch {med['torch']:.0f} ms, native {med['native']:.0f} ms, "
            f"torch/native x{med['torch'] / med['native']:.2f} [per-repeat x{per:.2f}], "
            f"spread torch {1e3 * (max(times['torch']) - min(times['torch'])):.0f} ms / native "
            f"{1e3 * (max(times['native']) - min(times['native'])):.0f} ms, load {_load()}"
        )
        results[mode] = med
    return epi, results


if __name__ == "__main__":
    main()
