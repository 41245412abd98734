"""Sweep the Triton quantized-linear tile plans on one GPU, to set `plan_tiles` (triton_impl/qlinear.py) by measurement.

    python bench/gpu_sweep_qlinear.py            # one NVIDIA GPU, about 3 minutes on an H200; installs nothing
    python bench/gpu_sweep_qlinear.py --dry-run  # plumbing on the CPU (Triton interpreter, tiny sizes)

For 7B layer shapes, W8A16 (int8 and fp8 codes) and W8A8 INT8, and M from 1 to 4096, every plan of a small grid
(tile shape, warps, stages, split-K; for W8A16 also the transposed tiles, swap_ab) is checked against an fp32 product and timed as device time: several weight
copies (together over 3x the L2, so each call reads its weight from memory) captured in one CUDA graph, median
of the replays. Beside them: the plan `plan_tiles` picks today, bf16 F.linear, and for INT8 torch._int_mm plus
our epilogue. Prints the best plan per case and writes everything to $OUT/gpu_sweep_qlinear.json.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_check import graph_replay_ms  # (bench/ is not a package: imported from this folder)

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]
TOKENS = [1, 16, 64, 128, 256, 512, 1024, 2048, 4096]
# (block_m, block_n, block_k, warps, stages)
TILES = [
    (16, 64, 128, 4, 3), (16, 128, 128, 4, 4), (32, 64, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 64, 4, 4), (128, 256, 64, 8, 3),
]
# transposed tiles (TilePlan.swap_ab, W8A16): block_n is the wgmma's row side (64 per warpgroup)
SWAP_TILES = [
    (16, 64, 128, 4, 3), (16, 128, 128, 4, 4), (32, 128, 128, 4, 3), (64, 64, 128, 4, 3), (64, 128, 64, 4, 4),
    (64, 128, 128, 4, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (256, 128, 64, 8, 3),
]
SPLITS = [1, 2, 4, 8]
MODES = {"W8A16 int8": (0, "int8"), "W8A16 fp8": (0, "fp8"), "W8A8 int8": (1, "int8")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--budget-s", type=float, default=420.0, help="stop starting new cases after this many seconds")
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="comma-separated M values")
    args = ap.parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    import triton

    from flashrl_kernels.triton_impl import qlinear as ql
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on a CPU", file=sys.stderr)
        return 2
    dev = torch.device("cpu" if dry else "cuda")
    cap, is_hip, sms = ql.device_facts(dev)
    l2 = (torch.cuda.get_device_properties(dev).L2_cache_size if not dry else 1 << 20)
    name = torch.cuda.get_device_name() if not dry else "cpu (dry run)"
    print(f"gpu_sweep_qlinear on {name}: capability {cap}, {sms} SMs, L2 {l2 >> 20} MiB", flush=True)
    shapes = SHAPES if not dry else [(96, 256)]
    tokens = [int(t) for t in args.tokens.split(",")] if not dry else [1, 40]
    tiles = TILES if not dry else [(16, 64, 128, 4, 3), (32, 64, 64, 4, 3)]
    swap_tiles = SWAP_TILES if not dry else [(16, 64, 128, 4, 3), (32, 64, 64, 4, 3)]
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad:
        print(f"unknown modes {bad}; known: {list(MODES)}", file=sys.stderr)
        return 2
    t0 = time.time()

    def dev_ms(fns):
        """Median device time of one call: the calls in fns (one per weight copy) captured in one graph."""
        if dry:
            t = time.perf_counter()
            fns[0]()
            return (time.perf_counter() - t) * 1e3
        return graph_replay_ms(torch, fns)

    results = []
    gen = torch.Generator(device="cpu").manual_seed(3)
    for n, k in shapes:
        copies = max(2, min(8, -(-3 * l2 // (n * k))))  # int8 weight bytes per copy: n * k
        w = [(torch.randn(n, k, generator=gen) * 0.02).to(dev, torch.bfloat16) for _ in range(copies)]
        bias = (torch.randn(n, generator=gen) * 0.1).to(dev, torch.bfloat16)
        x_all = torch.randn(max(tokens), k, generator=gen).to(dev, torch.bfloat16)
        for m in tokens:
            x = x_all[:m]
            base = dev_ms([lambda wi=wi, x=x, bias=bias: torch.nn.functional.linear(x, wi, bias) for wi in w])
            for mode in modes:
                x_codes, qname = MODES[mode]
                qdtype = torch.int8 if qname == "int8" else ql.FP8
                if time.time() - t0 > args.budget_s:
                    print(f"budget spent: skipped {mode} N={n} K={k} M={m}", flush=True)
                    continue
                qs = [quantize_rows(wi, qdtype) for wi in w]
                decode = 0 if qdtype == torch.int8 else ql.fp8_decode_mode(cap, is_hip)
                if x_codes:
                    xq, xs = quantize_rows(x, torch.int8)
                    xin, xsc = xq, xs
                    xf = xq.float() * xs[:, None]
                else:
                    xin, xsc, xf = x, None, x.float()
                q0, s0 = qs[0]
                ref = xf @ (q0.float() * s0[:, None]).T + bias.float()
                tol = 1e-2 * float(ref.abs().max()) + 1e-3
                cur = ql.plan_tiles(m, n, k, sms, is_hip, 2, int8_dot=x_codes == 1, capability=cap,
                                    weight_only=x_codes == 0)
                rows = []
                plans = []
                grid = [(t, False) for t in tiles] + ([(t, True) for t in swap_tiles] if x_codes == 0 else [])
                for ((bm, bn, bk, warps, stages), swap), split in itertools.product(grid, SPLITS):
                    if bm > max(16, triton.next_power_of_2(m)) or (m > 64 and bm < 64):
                        continue
                    steps = triton.cdiv(k, bk)
                    if split > 1 and steps // split < 4:
                        continue
                    k_split = triton.cdiv(steps, split) * bk
                    plans.append(ql.TilePlan(bm, bn, bk, triton.cdiv(k, k_split), k_split, warps, stages, swap))
                if cur not in plans:
                    plans.append(cur)
                for plan in plans:
                    try:
                        y = ql.w8_linear(xin, xsc, q0, s0, bias, torch.bfloat16, x_codes, decode, plan)
                        err = float((y.float() - ref).abs().max())
                        if not err <= tol:
                            rows.append({"plan": plan.__dict__, "error": f"err {err:.3g} > tol {tol:.3g}"})
                            continue
                        ms = dev_ms([
                            lambda q=q, s=s, plan=plan, xin=xin, xsc=xsc, x_codes=x_codes, decode=decode, bias=bias:
                            ql.w8_linear(xin, xsc, q, s, bias, torch.bfloat16, x_codes, decode, plan)
                            for q, s in qs])
                        rows.append({"plan": plan.__dict__, "ms": ms, "current": plan == cur})
                    except Exception as exc:
                        rows.append({"plan": plan.__dict__, "error": f"{type(exc).__name__}: {str(exc)[:120]}"})
                extra = {}
                if x_codes and not dry and m > 16:
                    try:
                        extra["torch_int_mm"] = dev_ms([lambda q=q, s=s, xin=xin, xsc=xsc, bias=bias: ql.int_mm_scaled(
                            xin, xsc, q, s, bias, torch.bfloat16) for q, s in qs])
                    except Exception as exc:
                        extra["torch_int_mm"] = f"{type(exc).__name__}: {str(exc)[:80]}"
                ok = [r for r in rows if "ms" in r]
                best = min(ok, key=lambda r: r["ms"]) if ok else None
                for swap in (False, True):
                    side = [r for r in ok if r["plan"]["swap_ab"] == swap]
                    if side:
                        extra["best_swap" if swap else "best_plain"] = min(side, key=lambda r: r["ms"])
                cur_ms = next((r["ms"] for r in ok if r.get("current")), None)
                res = {"mode": mode, "n": n, "k": k, "m": m, "bf16_ms": base, "current_plan": cur.__dict__,
                       "current_ms": cur_ms, "best": best, "extra": extra, "rows": rows}
                results.append(res)
                bp = best["plan"] if best else {}
                print(f"{mode:10s} N={n:5d} K={k:5d} M={m:4d}  bf16 {base * 1e3:7.1f} us  current "
                      f"{(cur_ms or float('nan')) * 1e3:7.1f} us  best {(best['ms'] if best else float('nan')) * 1e3:7.1f}"
                      f" us {bp.get('block_m')}x{bp.get('block_n')}x{bp.get('block_k')} w{bp.get('num_warps')} "
                      f"s{bp.get('num_stages')} split{bp.get('split_k')}"
                      + (f"  int_mm {extra['torch_int_mm'] * 1e3:7.1f} us" if isinstance(extra.get("torch_int_mm"),
                                                                                        float) else "")
                      + "".join(f"  {tag} {extra[key]['ms'] * 1e3:7.1f} us" for key, tag in
                                (("best_plain", "plain"), ("best_swap", "swap")) if key in extra and x_codes == 0)
                      + (" swap" if bp.get("swap_ab") else ""),
                      flush=True)
                errs = [r["error"] for r in rows if "error" in r]
                if errs:
                    print(f"    {len(errs)} plans failed, first: {errs[0]}", flush=True)
        del w
        if not dry:
            torch.cuda.empty_cache()
    out = Path(os.environ.get("OUT", "."))
    out.mkdir(parents=True, exist_ok=True)  # a new $OUT must not lose the sweep after the whole run
    (out / "gpu_sweep_qlinear.json").write_text(json.dumps({"device": name, "capability": cap, "sms": sms,
                                                             "results": results}, indent=1))
    print(f"total {time.time() - t0:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
