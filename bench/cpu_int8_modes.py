"""INT8 weight-only against dynamic W8A8 in the native CPU linear, measured on this CPU: what "auto" should pick.

    python bench/cpu_int8_modes.py                      # M = 1 8 32 256, 3 rounds, Qwen2.5-0.5B's 24 layers
    python bench/cpu_int8_modes.py --m 8 --layers 4 --json modes.json

Times the linears of one forward of Qwen2.5-0.5B's shapes (--layers x qkv 1152 x 896, o 896 x 896, gate_up
9728 x 896, down 896 x 4864) on bf16 tokens, per-row int8 weights in the plain [out, in] layout, both ways the
native `qlinear` runs them:
  weight-only  act_quant=False: the rows widened (to fp32, or to bf16 on AVX-512 BF16 CPUs), float dot products
  w8a8         act_quant=True: tokens quantized per token, integer dot products (AVX-512 VNNI's vpdpbusd,
               AVX2's vpmaddwd)
and, where the build has one (AVX-512 VNNI, AVX2), the packed W8A8 kernel the vLLM plugin's layers run there. The vLLM plugin's
`activation_quant="auto"` is W8A8 exactly where this build has native integer dot products
(`qlinear_capabilities()["w8a8"]`); this script is the measurement behind that rule for a CPU class
(docs/quantized_rollout.md, "Which activation mode"). Rounds alternate the modes in one process; every number is
the median of --repeats calls of the whole set.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down (out, in)


def measure(ms: list[int], layers: int, rounds: int, repeats: int, log=print) -> dict:
    import torch

    from flashrl_kernels import _native

    _native.native_status(load=True)
    from flashrl_kernels.native.quantize import (
        _quantize_rows,
        packed_w8a8_capabilities,
        qlinear_capabilities,
        quantize_rows_packed_,
    )

    if not qlinear_capabilities()["w8a8"]:
        raise SystemExit("this build has no native W8A8 kernel (AVX-512 without VNNI, or a portable build): "
                         "INT8 runs weight-only here, W8A8 only as an emulation on the weight-only kernel")
    op = torch.ops.flashrl_native
    torch.manual_seed(0)
    plain, packed = [], []
    with_packed = packed_w8a8_capabilities()["available"]
    for n, k in SHAPES * layers:
        w = torch.empty(n, k).normal_(0, 0.05)
        plain.append(_quantize_rows(w, torch.int8))
        if with_packed:
            q, s, c = torch.empty(n, k, dtype=torch.int8), torch.empty(n), torch.empty(n, dtype=torch.int32)
            quantize_rows_packed_(w, q, s, c, 0)
            packed.append((q, s, c))
    modes = {
        "weight-only": lambda xs: [op.qlinear(xs[q.shape[1]], q, s, None, False) for q, s in plain],
        "w8a8": lambda xs: [op.qlinear(xs[q.shape[1]], q, s, None, True) for q, s in plain],
    }
    if with_packed:
        modes["w8a8 packed"] = lambda xs: [op.qlinear_packed(xs[q.shape[1]], q, s, c, None) for q, s, c in packed]
    raw = {name: {str(m): [] for m in ms} for name in modes}
    for r in range(rounds):
        for m in ms:
            xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES}}
            for name, fn in modes.items():  # alternated within the round: a slow phase hits every mode
                fn(xs)
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    fn(xs)
                    ts.append(time.perf_counter() - t0)
                raw[name][str(m)].append(statistics.median(ts) * 1e3)
        log(f"round {r + 1}/{rounds} done", flush=True)
    return raw


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,8,32,256", help="token counts (comma list)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--json", help="write the raw times here")
    args = ap.parse_args(argv)
    ms = sorted({int(v) for v in args.m.split(",") if v.strip()})

    from flashrl_kernels._cpu import cpu_name, isa_flags

    print(f"CPU: {cpu_name()}; flags: {' '.join(isa_flags())}")
    raw = measure(ms, args.layers, args.rounds, args.repeats)
    macs = sum(n * k for n, k in SHAPES) * args.layers
    names = list(raw)
    print(f"\n{args.layers} layers' linears, bf16 tokens; ms per call of the set (median over {args.rounds} rounds); "
          "GFLOP/s of W8A8; weight-only / W8A8 per round (> 1: W8A8 faster)")
    print("| M | " + " | ".join(f"{n} ms" for n in names) + " | w8a8 GFLOP/s | weight-only / w8a8 per round |")
    print("|---|" + "---|" * (len(names) + 2))
    summary = {}
    for m in ms:
        med = {n: statistics.median(raw[n][str(m)]) for n in names}
        per = [a / b for a, b in zip(raw["weight-only"][str(m)], raw["w8a8"][str(m)])]
        summary[m] = statistics.median(per)
        print(f"| {m} | " + " | ".join(f"{med[n]:.1f}" for n in names) +
              f" | {2 * m * macs / med['w8a8'] / 1e6:.1f} | {' '.join(f'{p:.2f}' for p in per)} |")
    won = [m for m in ms if summary[m] > 1.0]
    print("W8A8 was faster at every M measured" if len(won) == len(ms) else
          f"W8A8 was faster at M = {won or 'none'} only: check the 'auto' rule for this CPU class")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "flags": isa_flags(), "layers": args.layers,
                                               "raw": raw, "weight_only_over_w8a8": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
