"""vLLM's own INT8 engine as a baseline: a compressed-tensors W8A8 checkpoint written from a bf16 one.

    from flashrl_kernels.testing.w8a8_checkpoint import build_w8a8_checkpoint
    build_w8a8_checkpoint(bf16_dir, w8a8_dir)      # then vllm.LLM(str(w8a8_dir)) serves it with vLLM's kernels

The format is what llm-compressor writes for its "W8A8" int preset (format "int-quantized"): every linear
layer's weight as per-output-channel symmetric int8 codes [out, in] plus `weight_scale` [out, 1], dynamic
per-token symmetric int8 activations, `lm_head` (and the embeddings, which are no Linear) left in the model
dtype. vLLM reads it with its CompressedTensorsW8A8Int8 scheme, whose CPU kernel is oneDNN's int8 GEMM (on AMX
CPUs sgl-kernel's AMX int8 GEMM where the shapes allow), the engine a user picks instead of `flashrl_int8`.

The codes and scales are flashrl_kernels.quantize_rows' (round half to even, scale = amax / 127), which is also
how `flashrl_int8` quantizes at load: both engines hold the same int8 weights, so a benchmark between them
compares kernels only. No llm-compressor needed (it would pull its own torch).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

# the Linear weights of the decoder layers (Qwen2 / Llama names); everything else is copied unchanged
LINEAR_SUFFIXES = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
                   "up_proj.weight", "down_proj.weight")


def quantization_config() -> dict:
    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "group_size": None, "block_structure": None,
              "actorder": None, "observer": "minmax", "observer_kwargs": {}}
    return {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {**scheme, "strategy": "channel", "dynamic": False},
            "input_activations": {**scheme, "strategy": "token", "dynamic": True, "observer": None},
            "output_activations": None,
        }},
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }


def build_w8a8_checkpoint(src: str | Path, dst: str | Path) -> Path:
    """Write `dst` (created; existing files overwritten) from the single-file safetensors checkpoint `src`."""
    from safetensors.torch import load_file, save_file

    import flashrl_kernels as fk

    src, dst = Path(src), Path(dst)
    if not (src / "model.safetensors").exists():
        raise FileNotFoundError(f"{src}: no model.safetensors (a single-file bf16/fp32 checkpoint is expected)")
    dst.mkdir(parents=True, exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    n_linear = 0
    for name, t in tensors.items():
        if name.endswith(LINEAR_SUFFIXES) and t.dim() == 2:
            q, scale = fk.quantize_rows(t, torch.int8)
            out[name] = q.contiguous()
            out[name.removesuffix("weight") + "weight_scale"] = scale.view(-1, 1).contiguous()
            n_linear += 1
        else:
            out[name] = t.contiguous()
    if not n_linear:
        raise ValueError(f"{src}: no linear weight named *{'/'.join(LINEAR_SUFFIXES)}")
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quantization_config()
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in src.iterdir():  # tokenizer, generation config
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy2(f, dst / f.name)
    return dst
