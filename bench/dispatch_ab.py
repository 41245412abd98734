"""A/B of the native CPU linears' dispatch settings inside ONE process, the variants alternated call by call.

    python bench/dispatch_ab.py --variant tiles:FLASHRL_NATIVE_AMX_MIN_M=0 --variant amx:FLASHRL_NATIVE_AMX_MIN_M=1 \\
        --kernels int8 --m 1,4,8,32 --rounds 9
    python bench/dispatch_ab.py --engines bf16,flashrl_int8,flashrl_fp8 --cases decode8,prefill --rounds 3 \\
        --variant new: --variant brgemm:FLASHRL_NATIVE_AMX_MIN_M=0,FLASHRL_NATIVE_AMX_BF16_MIN_M=0,FLASHRL_NATIVE_AMX_HEAD_MIN_M=0

Why: the thresholds are read once per process, so bench/cpu_linear_dispatch.py runs each driver in its own
process, round by round. On a shared VM whose memory bandwidth moves between processes (the 2026-12-06 AMX
guest: the same INT8 set took 14 to 23 ms at 1 token from one process to the next) that comparison contradicted
itself. Here FLASHRL_NATIVE_DISPATCH_LIVE=1 makes the library read the dispatch variables at every call
(`dispatch_int` in csrc/cpu/cpu_features.h: FLASHRL_NATIVE_AMX_MIN_M, _AMX_BF16_MIN_M, _AMX_HEAD_MIN_M,
_AMX_PF_KB, _BRGEMM_MIN_M, _BF16_BRGEMM_MIN_M, _THP, _AVX2_PAIR_ROWS, _AVX2_PF), so the variants share the
machine's every phase.

A variant is NAME:VAR=V,VAR=V (no assignments: the process's defaults); a variable one variant sets is unset for
the others. An unset variable reads as the value the process cached at its first call, which is the first variant's
when that one set it: give every variant an explicit value of a variable that any variant sets. Kernels (default): the 24 layers' linears of Qwen2.5-0.5B's shapes as flashrl_int8 (packed W8A8) or
flashrl_fp8 (weight-only) run them, or the 151936 x 896 bf16 head, per token count M. --engines: whole in-process
compiled vLLM engines on the rollout bench's checkpoint (--layers deep) and cases (flashrl-kernels bench --op rollout), bf16
timed once per round as the reference. Prints per case the median time of each variant and the median of its
per-round ratio to the first variant (< 1: faster).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ["FLASHRL_NATIVE_DISPATCH_LIVE"] = "1"  # before the library is loaded


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    name, _, body = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: NAME:VAR=V,VAR=V")
    env = {}
    for item in filter(None, body.split(",")):
        var, eq, value = item.partition("=")
        if not eq or not var.startswith("FLASHRL_NATIVE_"):
            raise SystemExit(f"--variant {text!r}: {item!r} is not FLASHRL_NATIVE_...=VALUE")
        env[var] = value
    return name, env


def apply(env: dict[str, str], every: set[str]) -> None:
    for var in every:
        if var in env:
            os.environ[var] = env[var]
        else:
            os.environ.pop(var, None)


def kernel_runs(kernels: list[str], ms: list[int], layers: int, vocab: int):
    """{(kernel, M): callable} for the linears as the engines run them (cpu_linear_dispatch.py's set)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from cpu_linear_dispatch import linear_runs

    return {(k, f"M={m}"): fn for m, runs in linear_runs(ms, layers, vocab, kernels).items() for k, fn in runs.items()}


def engine_runs(engines: list[str], names: list[str], layers: int):
    """{(engine, case): callable} on in-process compiled engines; also (token counts per case)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    import vllm

    from flashrl_kernels.benchmarks import rollout as R

    cfg, specs = R.model_config(layers, R.DEFAULT_HIDDEN), R.case_specs(False)
    ckpt = R.build_checkpoint(R.checkpoint_dir(os.environ.get("FLASHRL_BENCH_CACHE", "/tmp/flashrl_sync_bench"), cfg),
                              cfg)
    prompts = {n: R.make_prompts(specs[n], cfg["vocab"]) for n in names}
    kw = {"dtype": "bfloat16", "max_model_len": R.MAX_MODEL_LEN, "max_num_seqs": R.MAX_NUM_SEQS,
          "kv_cache_memory_bytes": 256 << 20, "enable_prefix_caching": False, "seed": 0}
    runs = {}
    for e in engines:
        llm = vllm.LLM(str(ckpt), quantization=None if e == "bf16" else e, **kw)
        for n in names:
            runs[(e, n)] = lambda llm=llm, n=n: R._generate(llm, prompts[n], specs[n])
    return runs


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variant", action="append", required=True, help="NAME:VAR=V,VAR=V (repeat; the first is the base)")
    ap.add_argument("--kernels", default="int8,fp8,head")
    ap.add_argument("--m", default="1,4,8,16,32,64", help="token counts (kernels)")
    ap.add_argument("--layers", type=int, default=24, help="layers of the linears (kernels) or of the engine model")
    ap.add_argument("--vocab", type=int, default=151936, help="LM head rows (hidden size 896)")
    ap.add_argument("--engines", help="in-process vLLM engines instead of kernels: bf16,flashrl_int8,flashrl_fp8")
    ap.add_argument("--cases", default="decode8,prefill", help="rollout bench cases (engines)")
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args(argv)
    variants = [parse_variant(v) for v in args.variant]
    every = {var for _, env in variants for var in env}
    if args.engines:
        engines = args.engines.split(",")
        runs = engine_runs(engines, args.cases.split(","), args.layers)
    else:
        runs = kernel_runs(args.kernels.split(","), [int(m) for m in args.m.split(",")], args.layers, args.vocab)
    from flashrl_kernels import _cpu

    print(f"{_cpu.cpu_name()} ({' '.join(_cpu.isa_flags())}); dispatch read at every call; {args.rounds} rounds, "
          "variants alternated call by call")
    print("| case | " + " | ".join(f"{n} ms" for n, _ in variants) + " | " +
          " | ".join(f"{n} / {variants[0][0]}" for n, _ in variants[1:]) + " |")
    print("|---" * (2 * len(variants)) + "|")
    by_case: dict[str, list] = {}
    for (what, case), fn in runs.items():
        by_case.setdefault(case, []).append((what, fn))
    for case, items in by_case.items():
        for what, fn in items:
            plain = what == "bf16"  # the engines' reference: its dispatch is oneDNN's, timed once a round
            vs = variants[:1] if plain else variants
            for _, env in vs:  # warm: first-call set-up of each path (oneDNN kernels, compiled graphs)
                apply(env, every)
                fn()
            ts = [[] for _ in vs]
            for _ in range(args.rounds):
                for i, (_, env) in enumerate(vs):
                    apply(env, every)
                    t0 = time.perf_counter()
                    fn()
                    ts[i].append(time.perf_counter() - t0)
            med = [statistics.median(t) * 1e3 for t in ts]
            ratios = [statistics.median([a / b for a, b in zip(t, ts[0])]) for t in ts[1:]]
            cells = [f"{v:.0f}" if v >= 100 else f"{v:.3g}" for v in med] + ["-"] * (len(variants) - len(vs))
            cells += [f"{r:.2f}" for r in ratios] + ["-"] * (len(variants) - len(vs))
            print(f"| {what} {case} | " + " | ".join(cells) + " |", flush=True)
    apply({}, every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
