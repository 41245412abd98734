"""Which driver the native CPU linears should run at each token count, measured on this CPU.

    python bench/cpu_linear_dispatch.py                        # M = 1 4 8 16 32 64 512, 3 rounds
    python bench/cpu_linear_dispatch.py --m 8,32 --rounds 5 --json dispatch.json
    python bench/cpu_linear_dispatch.py --layers 4             # scaled down (fewer layers, same shapes)
    python bench/cpu_linear_dispatch.py --vocab 32000          # another LM head size
    python bench/cpu_linear_dispatch.py --drivers brgemm,amx   # AMX CPUs: oneDNN's brgemm vs the tiles flashrl drives

On AVX-512 VNNI / BF16 CPUs (the AVX-512 build): the tiles against oneDNN's brgemm, below. On AVX2 builds: the
packed W8A8 kernel's two tile sets, vpmaddwd against AVX-VNNI's ymm vpdpbusd (FLASHRL_NATIVE_CPU_DISABLE=avxvnni
runs the former; on a CPU without AVX-VNNI the latter runs emulated, FLASHRL_NATIVE_EMULATE=avxvnni: a check of
the tiles' structure, not a speed path), int8 layers only.

Times the linears of one forward of Qwen2.5-0.5B's shapes (--layers x qkv 1152 x 896, o 896 x 896,
gate_up 9728 x 896, down 896 x 4864; and the 151936 x 896 LM head) for M tokens, as the rollout engines
run them:
  int8   flashrl_int8's layers: the VNNI-packed W8A8 kernel, tiles vs oneDNN's u8 x s8 brgemm
         (FLASHRL_NATIVE_BRGEMM_MIN_M; AMX-INT8 tiles on AMX CPUs)
  fp8    flashrl_fp8's layers: weight-only, bf16 tokens, tiles vs brgemm on rows widened to bf16
         (FLASHRL_NATIVE_BF16_BRGEMM_MIN_M; AMX-BF16 tiles on AMX CPUs)
  head   the bf16 LM head of both engines (the same switch as fp8, the rows read in place)
--drivers picks the two (AVX-512 builds): tiles, brgemm, amx (AMX-INT8 / AMX-BF16 tiles driven by the library
itself, qlinear_packed.cpp's amx driver and qlinear.cpp's drive_amx_rows, FLASHRL_NATIVE_AMX_MIN_M /
FLASHRL_NATIVE_AMX_BF16_MIN_M / _AMX_HEAD_MIN_M; without AMX it runs emulated in scalar code, FLASHRL_NATIVE_EMULATE=amx:
a check of the plumbing, its times mean nothing).
The thresholds are read once per process, so each driver runs in its own fresh process, the two
alternated round by round; every number is the median of --repeats calls of the whole set. Prints, per
kernel and M, the medians, brgemm's time over the tiles' in each round, and the smallest M from which
brgemm won at every larger M measured: the default to set for this CPU class (docs/native.md, "Dispatch").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down (out, in)
HIDDEN = 896
KERNELS = ("int8", "fp8", "head")
# the environment of each driver's processes: the brgemm and amx thresholds (AVX-512 builds)
_NO_AMX = {"FLASHRL_NATIVE_AMX_MIN_M": "0", "FLASHRL_NATIVE_AMX_BF16_MIN_M": "0", "FLASHRL_NATIVE_AMX_HEAD_MIN_M": "0",
           "FLASHRL_NATIVE_EMULATE": ""}
DRIVERS = {"tiles": {"FLASHRL_NATIVE_BRGEMM_MIN_M": "0", "FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "0", **_NO_AMX},
           "brgemm": {"FLASHRL_NATIVE_BRGEMM_MIN_M": "1", "FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "1", **_NO_AMX},
           # brgemm below it: a call the amx drivers refuse (K % 64 / K % 32) runs what the brgemm process runs
           "amx": {"FLASHRL_NATIVE_BRGEMM_MIN_M": "1", "FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "1",
                   "FLASHRL_NATIVE_AMX_MIN_M": "1", "FLASHRL_NATIVE_AMX_BF16_MIN_M": "1",
                   "FLASHRL_NATIVE_AMX_HEAD_MIN_M": "1"}}


def avx512_drivers(names: list[str], cpu_has_amx: bool) -> dict[str, dict[str, str]]:
    """The two AVX-512 drivers to compare, each as the environment that selects it (amx emulated without AMX)."""
    unknown = [n for n in names if n not in DRIVERS]
    if len(names) != 2 or len(set(names)) != 2 or unknown:
        raise SystemExit(f"--drivers takes two of {', '.join(DRIVERS)}, got {','.join(names)}")
    out = {}
    for n in names:
        env = dict(DRIVERS[n])
        if n == "amx":
            env["FLASHRL_NATIVE_EMULATE"] = "" if cpu_has_amx else "amx"
        out[n] = env
    return out


def avx2_drivers(cpu_has_avx_vnni: bool) -> dict[str, dict[str, str]]:
    """The AVX2 build's two packed W8A8 tile sets (avx2: vpmaddwd), each as the environment that selects it (the second
    one emulated where the CPU lacks AVX-VNNI)."""
    vnni = {} if cpu_has_avx_vnni else {"FLASHRL_NATIVE_EMULATE": "avxvnni"}
    return {"avx2": {"FLASHRL_NATIVE_CPU_DISABLE": "avxvnni", "FLASHRL_NATIVE_EMULATE": ""},
            "avx_vnni" if cpu_has_avx_vnni else "avx_vnni_emulated": vnni}


def linear_runs(ms: list[int], layers: int, vocab: int, kernels) -> dict:
    """{M: {kernel: callable}}: each runs the layers' linears (int8: packed W8A8, fp8: weight-only) or the bf16 head
    on M random tokens, as the engines call them (bench/dispatch_ab.py times the same set)."""
    import torch

    from flashrl_kernels import _native

    _native.native_status(load=True)
    from flashrl_kernels.native.quantize import _quantize_rows, quantize_rows_packed_

    torch.manual_seed(0)
    int8, fp8 = [], []
    for n, k in SHAPES * layers if {"int8", "fp8"} & set(kernels) else []:
        w = torch.empty(n, k).normal_(0, 0.05)
        if "int8" in kernels:
            q, s, c = torch.empty(n, k, dtype=torch.int8), torch.empty(n), torch.empty(n, dtype=torch.int32)
            quantize_rows_packed_(w, q, s, c, 0)
            int8.append((q, s, c))
        if "fp8" in kernels:
            fp8.append(_quantize_rows(w, torch.float8_e4m3fn))
    head = torch.empty(vocab if "head" in kernels else 1, HIDDEN).normal_(0, 0.05).bfloat16()
    out = {}
    for m in ms:
        xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES} | {HIDDEN}}
        runs = {
            "int8": lambda xs=xs: [torch.ops.flashrl_native.qlinear_packed(xs[q.shape[1]], q, s, c, None)
                                   for q, s, c in int8],
            "fp8": lambda xs=xs: [torch.ops.flashrl_native.qlinear(xs[q.shape[1]], q, s, None, False) for q, s in fp8],
            "head": lambda xs=xs: torch.ops.flashrl_native.bf16_linear(xs[HIDDEN], head, None),
        }
        out[m] = {k: runs[k] for k in kernels}
    return out


def _child(ms: list[int], layers: int, vocab: int, repeats: int, kernels: tuple[str, ...]) -> dict:
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, qlinear_capabilities

    runs_by_m = linear_runs(ms, layers, vocab, kernels)
    # what this process runs: the parent checks that the two drivers really differ
    out = {"caps": {"int8": packed_w8a8_capabilities()["brgemm_min_m"],
                    "bf16": qlinear_capabilities()["bf16_brgemm_min_m"],
                    "amx_int8": packed_w8a8_capabilities()["amx_min_m"],
                    "amx_bf16": qlinear_capabilities()["amx_bf16_min_m"],
                    "amx_head": qlinear_capabilities()["amx_head_min_m"],
                    "packed": packed_w8a8_capabilities()["kernel"]}}
    for m in ms:
        runs = runs_by_m[m]
        res = {}
        for name, fn in ((k, runs[k]) for k in kernels):
            fn()  # warm: brgemm kernels are generated on first use
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            res[name] = statistics.median(ts) * 1e3
        out[str(m)] = res
    return out


def _run_child(driver: str, env: dict[str, str], ms: list[int], layers: int, vocab: int, repeats: int,
               kernels: tuple[str, ...]) -> dict:
    cmd = [sys.executable, __file__, "--child", "--m", ",".join(map(str, ms)), "--layers", str(layers),
           "--vocab", str(vocab), "--repeats", str(repeats), "--kernels", ",".join(kernels)]
    r = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"{driver} run failed:\n{r.stdout[-2000:]}{r.stderr[-4000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    caps = out.pop("caps")
    if driver in DRIVERS:
        want = 0 if driver == "tiles" else 1
        want_amx = 1 if driver == "amx" else 0
        ran = (caps["int8"] == want and caps["bf16"] == want and caps["amx_int8"] == want_amx
               and caps["amx_bf16"] == want_amx and caps["amx_head"] == want_amx)
    else:
        ran = caps["packed"] == driver
    if not ran:
        raise SystemExit(f"the {driver} process did not run the {driver} driver ({caps}; ignored on this CPU?)")
    return out


def threshold(ms: list[int], ratios: dict[int, float]) -> int:
    """The smallest M from which the second driver (ratio < 1: less time) won at every larger M; 0 when it never did."""
    best = 0
    for m in sorted(ms, reverse=True):
        if ratios[m] >= 1.0:
            break
        best = m
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--m", default="1,4,8,16,32,64,512", help="token counts (comma list)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151936, help="LM head rows (hidden size 896)")
    ap.add_argument("--json", help="write the raw times here")
    ap.add_argument("--drivers", default="tiles,brgemm",
                    help=f"the two AVX-512 drivers to compare, first,second (of {', '.join(DRIVERS)})")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--kernels", default=",".join(KERNELS), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    ms = sorted({int(v) for v in args.m.split(",") if v.strip()})
    if args.child:
        print(json.dumps(_child(ms, args.layers, args.vocab, args.repeats, tuple(args.kernels.split(",")))))
        return 0

    from flashrl_kernels._cpu import cpu_flags, cpu_name, isa_flags
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, qlinear_capabilities

    print(f"CPU: {cpu_name()}; flags: {' '.join(isa_flags())}; threads: {os.cpu_count()}")
    packed = packed_w8a8_capabilities()["kernel"]
    print(f"packed W8A8 kernel here: {packed}; int8 brgemm from {packed_w8a8_capabilities()['brgemm_min_m'] or 'never'}, "
          f"bf16 brgemm from {qlinear_capabilities()['bf16_brgemm_min_m'] or 'never'}")
    if packed in ("avx2", "avx_vnni"):
        drivers, kernels = avx2_drivers("avx_vnni" in cpu_flags()), ("int8",)
    elif packed == "avx512_vnni" and qlinear_capabilities()["bf16_dot"]:
        # AMX the library may use: on the CPU and not hidden by FLASHRL_NATIVE_CPU_DISABLE (else: emulated)
        amx_usable = "amx_int8" in cpu_flags() and "amx" not in os.environ.get("FLASHRL_NATIVE_CPU_DISABLE", "")
        drivers, kernels = avx512_drivers(args.drivers.split(","), amx_usable), KERNELS
        if drivers.get("amx", {}).get("FLASHRL_NATIVE_EMULATE") == "amx":
            print("amx: this CPU has no AMX-INT8: the amx driver runs emulated in scalar code (its times mean nothing)")
    else:
        print("no second driver to compare on this CPU and build")
        return 0
    first, second = drivers
    raw = {d: [] for d in drivers}
    for r in range(args.rounds):
        for d, env in drivers.items():  # alternated: a slow phase of the machine hits both drivers
            t0 = time.perf_counter()
            raw[d].append(_run_child(d, env, ms, args.layers, args.vocab, args.repeats, kernels))
            print(f"round {r + 1}/{args.rounds} {d}: {time.perf_counter() - t0:.0f} s", flush=True)
    summary = {}
    head = f" + {args.vocab} x {HIDDEN} head" if "head" in kernels else ""
    print(f"\n{args.layers} layers{head}; ms per call of the set, median over {args.rounds} rounds; "
          f"{second} / {first} per round (< 1: {second} faster)")
    print(f"| kernel | M | {first} ms | {second} ms | {second} / {first} per round |")
    print("|---|---|---|---|---|")
    for k in kernels:
        ratios = {}
        for m in ms:
            t = [run[str(m)][k] for run in raw[first]]
            b = [run[str(m)][k] for run in raw[second]]
            per = [bb / tt for tt, bb in zip(t, b)]
            ratios[m] = statistics.median(per)
            print(f"| {k} | {m} | {statistics.median(t):.2f} | {statistics.median(b):.2f} | "
                  f"{' '.join(f'{p:.2f}' for p in per)} |")
        summary[k] = {"median_ratio": ratios, f"{second}_from": threshold(ms, ratios)}
    for k in kernels:
        frm = summary[k][f"{second}_from"]
        print(f"{k}: {second} won from M = {frm} on" if frm else f"{k}: {first} won (or tied) at the largest M")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu_name(), "flags": isa_flags(), "layers": args.layers,
                                               "vocab": args.vocab, "raw": raw, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
