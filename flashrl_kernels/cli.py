"""The `flashrl-kernels` command line."""
from __future__ import annotations

import argparse
import datetime
import platform
import sys

import torch


def _cmd_info(args) -> int:
    import flashrl_kernels as fk
    from flashrl_kernels import _backend

    print(f"flashrl_kernels {fk.__version__}")
    print(f"python {platform.python_version()}  torch {torch.__version__}  ", end="")
    try:
        import triton

        print(f"triton {triton.__version__}")
    except ImportError:
        print("triton not installed")
    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    ops = {"token_logprobs": "token_logprobs_forward", "linear_token_logprobs": "linear_logprobs_stats",
           "policy_loss": "policy_loss_forward", "value_loss": "value_loss_forward", "gae": "gae_forward",
           "quantize_rows": "quantize_rows_forward"}
    for dev in devices:
        if dev.type == "cuda":
            name = torch.cuda.get_device_name(dev)
        else:
            from flashrl_kernels import _cpu

            isa = " ".join(_cpu.isa_flags()) or "none of " + ", ".join(_cpu.ISA_FLAGS)
            amx = "; AMX permitted" if _cpu.amx_permitted() else ""
            name = f"{_cpu.cpu_name()}; {isa}{amx}"
        print(f"\n{dev.type} ({name})")
        for b in _backend.BACKENDS:
            reason = _backend.availability(b, dev)
            print(f"  {b:<10} {'available' if reason is None else 'unavailable: ' + reason}")
        for op, fn in ops.items():
            try:
                chosen = _backend.selected_backend(dev, fn)
            except Exception as exc:
                chosen = f"error: {exc}"
            print(f"  {op:<22} runs on {chosen}")
        if dev.type == "cpu":
            print(f"  {_quantized_linear_line()}")
            print(f"  {_bf16_activation_line()}")
            print(f"  {_sampler_line()}")
            from flashrl_kernels import _cpu_gemm

            for dt in (torch.bfloat16, torch.float16):
                try:
                    line = _cpu_gemm.describe(dt)
                except Exception as exc:
                    line = f"CPU {dt} GEMM: error: {exc}"
                print(f"  {line}")
    print()
    print(fk.native_status().summary())
    return 0


def _cmd_build(args) -> int:
    """Compile the native CPU kernels now rather than inside the first CPU op call (a container image, or before
    many ranks start), and optionally compile-check the other CPU capabilities' code (docs/native.md)."""
    import tempfile

    from flashrl_kernels import _native

    st = _native.native_status(load=True)
    print(st.summary())
    if not st.loaded:
        return 1
    for cap in args.compile_check:
        print(f"compile check {cap}: compiling {len(_native.sources())} sources ...", flush=True)
        with tempfile.TemporaryDirectory() as d:
            try:
                seconds = _native.compile_check(cap, d)
            except RuntimeError as e:
                print(f"compile check {cap}: failed\n{e}")
                return 1
        print(f"compile check {cap}: all {len(_native.sources())} sources compiled in {seconds:.1f} s "
              "(objects only, -O0; nothing linked or run)")
    return 0


def _quantized_linear_line() -> str:
    """Which native kernel the vLLM plugin's INT8 W8A8 layers run on this CPU (docs/native.md)."""
    from flashrl_kernels import _backend, _native

    if not _backend.native_built():
        return "INT8 W8A8 linear: native library not built (the torch backend's dequantize-and-GEMM)"
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, qlinear_capabilities

    caps, packed = qlinear_capabilities(), packed_w8a8_capabilities()
    avx2_tiles = {"avx2": "AVX2 tiles (vpmaddwd)", "avx_vnni": "AVX-VNNI tiles (ymm vpdpbusd)",
                  "avx_vnni_emulated": "AVX-VNNI tiles emulated with AVX2 (FLASHRL_NATIVE_EMULATE; a test mode, slow)"}
    if packed["kernel"] in avx2_tiles:
        return f"INT8 W8A8 linear: packed weights, {avx2_tiles[packed['kernel']]}"
    if packed["kernel"]:
        brgemm = (f"oneDNN brgemm ({'AMX-INT8 tiles' if packed['amx'] else 'VNNI'}) from {packed['brgemm_min_m']} "
                  "tokens" if packed["brgemm_min_m"] else "no brgemm")
        if packed["amx_min_m"]:
            how = " emulated (FLASHRL_NATIVE_EMULATE=amx: a test mode, slow)" if packed["amx_emulated"] else ""
            brgemm = (f"AMX-INT8 tiles driven by flashrl{how} from {packed['amx_min_m']} tokens"
                      + (f"; {brgemm} where K % 64 != 0" if packed["brgemm_min_m"] else ""))
        return f"INT8 W8A8 linear: VNNI-packed weights (tiles; {brgemm})"
    if caps["w8a8"]:
        kind = "AVX2 (vpmaddwd)" if _native.native_status().capability == "AVX2" else "VNNI"
        return f"INT8 W8A8 linear: plain-layout {kind} kernel (FLASHRL_NATIVE_PACKED=0)"
    return "INT8 linear: weight-only (no integer dot products here: AVX-512 without VNNI, or a portable build)"


def _sampler_line() -> str:
    """Which vLLM CPU engines draw tokens with flashrl's native sampler (docs/quantized_rollout.md)."""
    from flashrl_kernels import _backend
    from flashrl_kernels.integrations.vllm.sampler import sampler_mode

    try:
        mode = sampler_mode()
    except ValueError as exc:
        return f"vLLM token sampler: {exc}"
    if not _backend.native_built():
        return "vLLM token sampler: vLLM's (native library not built)"
    who = {"auto": "the flashrl_int8 / flashrl_fp8 engines", "all": "every CPU engine", "0": "no engine"}[mode]
    return f"vLLM token sampler: flashrl's native one in {who} (FLASHRL_VLLM_SAMPLER={mode}), vLLM's elsewhere"


def _bf16_activation_line() -> str:
    """Which driver the weight-only FP8 / INT8 layers and the bf16 LM head run for bf16 tokens (docs/native.md)."""
    from flashrl_kernels import _backend

    if not _backend.native_built():
        return "FP8 / bf16-head linear: native library not built"
    from flashrl_kernels.native.quantize import qlinear_capabilities

    caps = qlinear_capabilities()
    if not caps["vector"]:
        return "FP8 / bf16-head linear: portable build (ATen)"
    kernel = "vdpbf16ps tiles" if caps["bf16_dot"] else "fp32 FMA tiles (no AVX-512 BF16)"
    if caps["bf16_dot"]:
        kernel += ", fp8 widened by " + ("VBMI byte tables" if caps["fp8_byte_tables"] else "word tables (no AVX-512 VBMI)")
    brgemm = ""
    if caps["bf16_brgemm_min_m"]:
        unit = "AMX-BF16 tiles" if caps["amx_bf16"] else "AVX-512 BF16"
        brgemm = f"oneDNN brgemm ({unit}) from {caps['bf16_brgemm_min_m']} tokens"
    if caps["amx_bf16_min_m"]:
        how = " emulated (FLASHRL_NATIVE_EMULATE=amx: a test mode, slow)" if caps["amx_emulated"] else ""
        kernel += (f"; AMX-BF16 tiles driven by flashrl{how} from {caps['amx_bf16_min_m']} tokens"
                   f" (the bf16 head from {caps['amx_head_min_m']}"
                   + (f"; fp8 / int8 rows re-laid as B from {caps['amx_wb_min_m']}" if caps["amx_wb_min_m"] else "")
                   + ")" + (f"; {brgemm} where K % 32 != 0" if brgemm else ""))
    elif brgemm:
        kernel += f"; {brgemm}"
    return f"FP8 / bf16-head linear: {kernel}"


def _standalone_module(name: str):
    """The benchmark module `name` if it runs on its own (`STANDALONE = True`, e.g. rollout), else None."""
    import importlib

    mod = importlib.import_module(f"flashrl_kernels.benchmarks.{name}")
    return mod if getattr(mod, "STANDALONE", False) else None


def _rollout_options_given(args) -> list[str]:
    """The --op rollout options given on this command line (those whose value is not the parser's default)."""
    given = [f"--{name.replace('_', '-')}" for name in ("layers", "hidden", "engines", "kv_cache_dtype", "cases",
                                                       "quant_options", "profile")
             if getattr(args, name) is not None]
    if args.interleave is not None:
        given.append("--interleave" if args.interleave else "--no-interleave")
    if args.eager:
        given.append("--eager")
    if args.engine_mode != "inproc":
        given.append("--engine-mode")
    return given


def _positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return n


def _cmd_bench(args) -> int:
    from flashrl_kernels.benchmarks import harness

    modules = harness.op_modules()
    if args.op:
        unknown = sorted(set(args.op) - set(modules))
        if unknown:
            print(f"unknown op(s) {', '.join(unknown)}; available: {', '.join(modules)}", file=sys.stderr)
            return 2
        modules = args.op
    else:
        modules = harness.op_modules(include_optional=False)
    # standalone benchmarks (whole engines: --op rollout) have their own driver and never enter the harness
    standalone = [(m, mod) for m in modules if (mod := _standalone_module(m)) is not None]
    modules = [m for m in modules if m not in {name for name, _ in standalone}]
    # an option no op of this run reads is a mistake worth saying, not a silent no-op
    unused = [] if standalone else _rollout_options_given(args)
    if not modules and args.impl is not None:
        unused.append("--impl (rollout: --engines)")
    if unused:
        print(f"flashrl-kernels bench: {', '.join(unused)}: not used by --op {', '.join(args.op or modules)}",
              file=sys.stderr)
        return 2
    rc = 0
    for name, mod in standalone:
        sub_args = args
        if args.json and (modules or len(standalone) > 1):  # one JSON file per driver: FILE -> FILE.<op>.json
            import os

            stem, ext = os.path.splitext(args.json)
            sub_args = argparse.Namespace(**{**vars(args), "json": f"{stem}.{name}{ext or '.json'}"})
        rc = max(rc, mod.main(sub_args))
    if not modules:
        return rc
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    copy_gbps = harness.copy_bandwidth_gbps(device)
    print(f"device {device}  measured copy bandwidth {copy_gbps:.1f} GB/s (read + write)", flush=True)
    results = harness.run(
        modules, quick=args.quick, device=device, repeats=args.repeats, memory=not args.no_memory,
        impl_filter=args.impl,
    )
    print(harness.format_table(results, copy_gbps))
    if args.json:
        with open(args.json, "w") as f:
            f.write(harness.results_json(
                results, device=str(device), copy_gbps=copy_gbps, quick=args.quick,
                date=datetime.datetime.now().isoformat(timespec="seconds"), torch=torch.__version__,
            ))
        print(f"wrote {args.json}")
    return max(rc, 1 if any(r.error and r.impl.startswith("flashrl") for r in results) else 0)


def _add_train_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """One flag per TrainConfig field (--rollout-quant int8, --dynamic-sampling true, ...); the help names the
    allowed values of the options that have a fixed set, and the command's own out_dir default."""
    import dataclasses

    from flashrl_kernels.trainer import config as c

    choices = {"task": c.TASKS, "reward": c.REWARD_NAMES, "rollout_engine": c.ROLLOUT_ENGINES,
               "rollout_quant": c.ROLLOUT_QUANTS, "kv_cache_dtype": c.KV_CACHE_DTYPES, "rollout_mode": c.ROLLOUT_MODES,
               "interrupt": c.INTERRUPTS, "frontend_cpus": ("trainer", "engine"), "proximal": c.PROXIMALS,
               "algo": c.ALGOS, "advantage": c.ADVANTAGES, "level": c.LEVELS, "tis": c.TIS_MODES,
               "loss_agg": c.AGG_MODES}
    group = parser.add_argument_group("training options (override the config file)")
    # default=SUPPRESS: a flag not given leaves no attribute, so _train_config keeps the config file's value (or
    # TrainConfig's default), while an explicit `--dual-clip none` is there as None and overrides it.
    for f in dataclasses.fields(c.TrainConfig):
        default = f"runs/{command}" if f.name == "out_dir" else f.default  # (_config_or_none's)
        if "None" in str(f.type):
            kind = _parse_optional_float
        else:
            kind = {bool: _parse_bool, int: int, float: float, str: str}[type(default)]
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f"opt_{f.name}", type=kind, default=argparse.SUPPRESS,
                           metavar="FLOAT|none" if kind is _parse_optional_float else type(default).__name__.upper(),
                           help=(f"one of {', '.join(choices[f.name])}; " if f.name in choices else "")
                           + f"default: {default!r}" + (" (the algo's)" if default is None else ""))


def _parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("1", "true", "yes", "on"):
        return True
    if low in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def _parse_optional_float(text: str):
    return None if text.lower() in ("none", "null", "off") else float(text)


def _train_config(args, base: dict):
    from flashrl_kernels.trainer.config import TrainConfig

    # Only the flags given are in args (default=SUPPRESS); None is an explicit `none`, like `null` in the file.
    # Precedence: the command's defaults (`base`), then the config file, then the flags given.
    overrides = {k.removeprefix("opt_"): v for k, v in vars(args).items() if k.startswith("opt_")}
    if getattr(args, "config", None):
        return TrainConfig.from_yaml(args.config, overrides, defaults=base)
    return TrainConfig.from_dict(dict(base, **overrides))


def _run_training(cfg, resume=None) -> int:
    from flashrl_kernels.trainer.run import format_summary, train

    summary = train(cfg, resume=resume)
    print()
    print(format_summary(summary))
    return 0


def _config_or_none(args, command: str):
    """The TrainConfig the command line asks for, or None after saying what is wrong with it."""
    from flashrl_kernels.trainer.rollout import check_kv_cache_dtype

    try:
        cfg = _train_config(args, {"out_dir": f"runs/{command}"})
        check_kv_cache_dtype(cfg.kv_cache_dtype)  # what this machine's vLLM supports
        if cfg.is_async:
            cfg.split_cpus()  # engine_cpus / trainer_cpus against the CPUs this process may use
        return cfg
    except (ValueError, TypeError, OSError) as exc:
        print(f"flashrl-kernels {command}: {exc}", file=sys.stderr)
        return None


def _cmd_demo(args) -> int:
    cfg = _config_or_none(args, "demo")
    if cfg is None:
        return 2
    # what this run is (the demo's defaults: GRPO, arithmetic, INT8 with TIS), not what the defaults are
    task = {"arith": "arithmetic", "chain": "chain-sum"}[cfg.task]
    print(f"flashrl-kernels demo: {cfg.algo.upper()} on the built-in {task} task, {cfg.rollout_quant.upper()} rollout "
          f"{'without TIS' if cfg.tis == 'none' else 'with TIS'} (tiny Qwen2, CPU-sized; see "
          "`flashrl-kernels train --help` for every option)", flush=True)
    return _run_training(cfg)


def _cmd_ablate(args) -> int:
    from flashrl_kernels.trainer.ablation import ablation_configs, format_ablation, run_ablation

    cfg = _config_or_none(args, "ablate")
    if cfg is None:
        return 2
    try:
        ablation_configs(cfg)  # every row's options, before the first run
    except ValueError as exc:
        print(f"flashrl-kernels ablate: {exc}", file=sys.stderr)
        return 2
    rows = run_ablation(cfg)
    print()
    print(format_ablation(rows))
    return 0


def _cmd_train(args) -> int:
    import os

    cfg = _config_or_none(args, "train")
    if cfg is None:
        return 2
    if args.resume and not os.path.isfile(os.path.join(args.resume, "trainer_state.pt")):
        # here, not as torch.load's traceback after the warm start and the engine's start-up
        inner = os.path.join(args.resume, "checkpoint")
        hint = f" (did you mean {inner}?)" if os.path.isfile(os.path.join(inner, "trainer_state.pt")) else ""
        print(f"flashrl-kernels train: --resume {args.resume}: no checkpoint there (trainer_state.pt){hint}",
              file=sys.stderr)
        return 2
    return _run_training(cfg, resume=args.resume)


def _cmd_gpu_audit(args) -> int:
    """Compile every Triton kernel for GPUs that are not here; exit 1 on a compile failure or a spill."""
    import json
    import warnings

    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    try:
        from flashrl_kernels import gpu_audit
    except ImportError as exc:
        print(f"gpu-audit needs triton: {exc}", file=sys.stderr)
        return 2
    try:
        archs = gpu_audit.parse_archs(args.arch)
    except ValueError as exc:
        print(f"gpu-audit: {exc}", file=sys.stderr)
        return 2
    progress = None
    if args.verbose:
        def progress(r):
            print(f"  {r.arch:>6} {r.kernel:<26} {'ok ' if r.ok else 'ERR'} regs={r.registers:<4} "
                  f"spill={r.spill_bytes:<5} {r.spec}  {r.error}", file=sys.stderr, flush=True)
    if args.jobs is not None and args.jobs < 1:
        print(f"gpu-audit: --jobs must be at least 1, got {args.jobs}", file=sys.stderr)
        return 2
    rows = gpu_audit.run_audit(archs, quick=args.quick, only=args.only, progress=progress, jobs=args.jobs)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(gpu_audit.rows_to_json(rows), f, indent=1)
    if not rows:  # a filter that matches nothing (a typo) must not pass as "0 with problems"
        print(f"gpu-audit: no specialization matches --only {args.only!r} for --arch {','.join(archs)}",
              file=sys.stderr)
        return 2
    if not args.no_table:
        print(gpu_audit.format_table(rows, detail=args.detail))
    bad = gpu_audit.failures(rows)
    if not args.no_table:
        print(f"\n{len(rows)} compiled specializations, {len(bad)} with problems "
              "(compiled only: nothing here ran on a GPU)")
    return 1 if bad else 0


def _capabilities(text: str) -> list[str]:
    caps = [c.strip().upper() for c in text.split(",") if c.strip()]
    bad = [c for c in caps if c not in ("AVX512", "AVX2", "DEFAULT")]
    if bad or not caps:
        raise argparse.ArgumentTypeError(f"expected capabilities from AVX512,AVX2,DEFAULT, got {text!r}")
    return caps


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="flashrl-kernels", description="flashrl_kernels: kernels for RL training of LLMs")
    sub = p.add_subparsers(dest="command", required=True)

    info = sub.add_parser("info", help="versions, devices and which backend each op runs on")
    info.set_defaults(func=_cmd_info)

    bu = sub.add_parser("build", help="compile the native CPU kernels now (else on first CPU use) and say where "
                                      "they are cached")
    bu.add_argument("--compile-check", type=_capabilities, default=[], metavar="LIST",
                    help="also compile every source for these other CPU capabilities, from AVX512,AVX2,DEFAULT "
                         "(objects only: catches a compile error in code this CPU never builds)")
    bu.set_defaults(func=_cmd_build)

    bench = sub.add_parser("bench", help="time the ops against the paths trainers use today")
    bench.add_argument("--op", action="append",
                       help="op to benchmark (repeatable); default: all ops (trl_grpo, a whole TRL step, and "
                            "rollout, whole vLLM engines, only by name)")
    bench.add_argument("--quick", action="store_true", help="small sizes, fewer repeats (a smoke run)")
    bench.add_argument("--repeats", type=_positive_int, default=None,
                       help="timed repeats per case (default 5, quick 3; rollout: 3)")
    bench.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available; rollout: vLLM's)")
    bench.add_argument("--impl", default=None, help="only implementations whose name contains this (plus baselines)")
    bench.add_argument("--no-memory", action="store_true", help="skip the peak-memory measurement")
    bench.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    ro = bench.add_argument_group("--op rollout (vLLM generate throughput of bf16 / vLLM W8A8 / flashrl_int8 / "
                                  "flashrl_fp8 engines; see flashrl_kernels/benchmarks/rollout.py)")
    ro.add_argument("--layers", type=_positive_int, default=None, metavar="N",
                    help="decoder layers (default 24; quick 2)")
    ro.add_argument("--hidden", type=_positive_int, default=None, metavar="H",
                    help="hidden size (default 896 = Qwen2.5-0.5B; quick 128); heads of 64, 2 KV heads, "
                         "intermediate ~5.43 H")
    ro.add_argument("--engines", default=None, metavar="LIST",
                    help="comma-separated, from bf16,vllm_w8a8,flashrl_int8,flashrl_fp8 (default: all four; "
                         "vllm_w8a8 is vLLM's own INT8 engine on a compressed-tensors checkpoint of the same weights)")
    ro.add_argument("--kv-cache-dtype", default=None, metavar="LIST",
                    help="comma-separated vLLM KV cache dtypes, from auto,fp8,fp8_e4m3,fp8_e5m2: every engine runs "
                         "under each (default: auto, the model's bf16)")
    ro.add_argument("--cases", default=None, metavar="LIST",
                    help="comma-separated, from decode8,decode32,prefill,rollout8,rollout32,tail8 (default: "
                         "decode8,decode32,prefill; rollout8 / rollout32 ask for logprobs=0 as RL rollouts do; "
                         "tail8 is rollout8 whose requests stop after 16, 32, ..., 128 tokens: a rollout's long tail)")
    ro.add_argument("--eager", action=argparse.BooleanOptionalAction, default=False,
                    help="enforce_eager=True for the engines (default: --no-eager, vLLM's default compiled mode; "
                         "eager starts faster)")
    ro.add_argument("--engine-mode", default="inproc", choices=("inproc", "mp", "tp2"),
                    help="inproc: in-process engine (default; VLLM_ENABLE_V1_MULTIPROCESSING=0); mp: vLLM's default "
                         "multi-process engine; tp2: tensor parallel 2 with the mp executor, one CPU set per rank "
                         "(VLLM_CPU_OMP_THREADS_BIND, default: this process's CPUs split in two)")
    ro.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="keep every engine alive and run each repeat of a case on all of them in turn, so that a "
                         "machine that slows down or speeds up affects all engines alike (default: on for "
                         "--engine-mode inproc, off for mp / tp2)")
    ro.add_argument("--quant-options", default=None, metavar="JSON",
                    help="options for the flashrl engines, passed as hf_overrides={'quantization_config_dict_json': "
                         "JSON}, e.g. '{\"activation_quant\": \"dynamic\"}'")
    ro.add_argument("--profile", type=_positive_int, default=None, metavar="N",
                    help="after the timed runs, one more generate per engine and case under torch.profiler: its N "
                         "costliest ops by self CPU time (in-process engines; also in --json)")
    bench.set_defaults(func=_cmd_bench)

    demo = sub.add_parser("demo", help="a short GRPO run of the reference trainer: INT8 rollout + TIS (CPU, minutes)")
    _add_train_flags(demo, "demo")
    demo.set_defaults(func=_cmd_demo)

    ab = sub.add_parser("ablate", help="bf16 vs INT8/FP8 rollout, with and without TIS, GRPO vs GFPO: one table")
    _add_train_flags(ab, "ablate")
    ab.set_defaults(func=_cmd_ablate)

    tr = sub.add_parser("train", help="the reference GRPO/GSPO trainer with every option")
    tr.add_argument("--config", default=None, metavar="FILE.yaml", help="options as a YAML mapping")
    tr.add_argument("--resume", default=None, metavar="DIR", help="resume from a checkpoint folder (<out_dir>/checkpoint)")
    _add_train_flags(tr, "train")
    tr.set_defaults(func=_cmd_train)

    ga = sub.add_parser("gpu-audit", help="compile every Triton kernel for sm_80/86/90/100 and gfx942 without a GPU: "
                                          "registers, spills, shared memory, occupancy, load width")
    ga.add_argument("--arch", default="80,86,90,100,gfx942", help="comma-separated targets (default: all five)")
    ga.add_argument("--quick", action="store_true", help="a representative subset of the specializations")
    ga.add_argument("--json", default=None, metavar="FILE", help="also write every row as JSON")
    ga.add_argument("--only", default=None, metavar="TEXT",
                    help="only the specializations whose 'kernel label' contains TEXT (e.g. float8, policy_loss_fwd)")
    ga.add_argument("--detail", action="store_true", help="one table line per compiled specialization")
    ga.add_argument("--no-table", action="store_true", help=argparse.SUPPRESS)
    ga.add_argument("--verbose", "-v", action="store_true",
                    help="print each compile as it finishes (stderr; with --jobs > 1, each target's when it is done)")
    ga.add_argument("--jobs", "-j", type=int, default=None, metavar="N",
                    help="targets compiled at once, one process each (default: one per target, up to the CPU count)")
    ga.set_defaults(func=_cmd_gpu_audit)
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
