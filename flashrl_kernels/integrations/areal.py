"""Drop-in kernels for AReaL 1.0 (the asynchronous RL system: FSDP / Megatron / Archon engines, vLLM or SGLang
rollout servers, local or Ray workers).

    import flashrl_kernels
    flashrl_kernels.patch("areal")       # in the launch script, before the trainer is built
                                         # (or FLASHRL_PATCH=areal and `import flashrl_kernels` there)

AReaL has no registry for its losses or its log-prob kernels: modules import them by name from
`areal.utils.functional`. `patch()` (AReaL >= 1.0, < 1.1; other versions are refused with a RuntimeError)
replaces them where they are defined, in the `areal.utils.functional` package (so modules imported later bind
ours) and in every AReaL module already imported that bound them by name:

- `gather_logprobs` / `gather_logprobs_entropy` (bound in `areal.engine.fsdp_engine`, `megatron_engine`,
  `experimental.engine.archon_engine`, `models.tree_attn.functional`): `flashrl_kernels.token_logprobs` on the
  packed `[total_tokens, V]` logits, in one pass, no `[N, V]` fp32 softmax kept for the backward;
  vocab-parallel logits (a `tp_group` of size > 1) go to AReaL's own function (one warning);
- `ppo_actor_loss_fn` (bound in `areal.trainer.ppo.actor`): `flashrl_kernels.policy_loss` with AReaL's
  decoupled split, `old_logp = proximal_logprobs`, `rollout_logp = old_logprobs` (AReaL's "old" is the
  inference engine's, the behaviour policy), every `RejectionSamplingConfig` (level, action, metric, agg,
  bounds), GSPO's sequence level, the dual clip, AReaL's divisor and AReaL's per-token statistics;
- `ppo_critic_loss_fn` (bound in `areal.trainer.ppo.critic`): `flashrl_kernels.value_loss` (the "mse" loss;
  "huber" goes to AReaL's own function, one warning);
- AReaL's train controllers (`TrainController`, `GatewayTrainController`) create their engines in the worker
  processes through `flashrl_kernels.integrations.areal.<EngineClass>` (for example `...areal.FSDPPPOActor`),
  a subclass of AReaL's engine that calls `patch()` in the worker before the engine is built: every worker
  process that AReaL starts (its local scheduler's RPC servers, Ray actors) is patched by the one line above.

GAE stays AReaL's: it is written inline in `PPOActor._compute_advantages` with the reward shaping around it,
so replacing it would mean copying that method (docs/integrations/areal.md).

`unpatch()` restores every replaced object, including in modules imported while patched. Both are idempotent.
`call_counts()` tells how many calls went through flashrl (and how many fell back), `status()` what is patched
in this process; `<engine>.flashrl_status()` asks a worker. See docs/integrations/areal.md.
"""
from __future__ import annotations

import collections
import functools
import importlib
import logging
import math
import os
import sys
import warnings

import torch

SUPPORTED_AREAL = (1, 0)  # major, minor of the AReaL releases this adapter was written and tested against
SUPPORTED_RANGE = ">=1.0,<1.1"

# Where each replaced function is defined, and the modules that import it by name (checked against 1.0.4).
_SOURCES = {
    "gather_logprobs": "areal.utils.functional.vocab_parallel",
    "gather_logprobs_entropy": "areal.utils.functional.vocab_parallel",
    "ppo_actor_loss_fn": "areal.utils.functional.functional",
    "ppo_critic_loss_fn": "areal.utils.functional.functional",
}
_BINDINGS = {
    "gather_logprobs": ("areal.utils.functional", "areal.engine.fsdp_engine", "areal.engine.megatron_engine",
                        "areal.experimental.engine.archon_engine", "areal.models.tree_attn.functional"),
    "ppo_actor_loss_fn": ("areal.utils.functional", "areal.trainer.ppo.actor"),
    "ppo_critic_loss_fn": ("areal.utils.functional", "areal.trainer.ppo.critic"),
}
_BINDINGS["gather_logprobs_entropy"] = _BINDINGS["gather_logprobs"]

# The train engines AReaL's controllers may ask a worker to build (import paths as in AReaL 1.0.4); each has a
# same-named subclass here that patches the worker first.
_ENGINE_CLASSES = {
    "FSDPPPOActor": "areal.engine.fsdp_engine",
    "FSDPPPOCritic": "areal.engine.fsdp_engine",
    "FSDPLMEngine": "areal.engine.fsdp_engine",
    "FSDPRWEngine": "areal.engine.fsdp_engine",
    "FSDPDPOEngine": "areal.engine.fsdp_engine",
    "MegatronPPOActor": "areal.engine.megatron_engine",
    "MegatronPPOCritic": "areal.engine.megatron_engine",
    "MegatronLMEngine": "areal.engine.megatron_engine",
    "MegatronRWEngine": "areal.engine.megatron_engine",
    "MegatronDPOEngine": "areal.engine.megatron_engine",
    "ArchonPPOActor": "areal.experimental.engine.archon_engine",
    "ArchonPPOCritic": "areal.experimental.engine.archon_engine",
    "ArchonLMEngine": "areal.experimental.engine.archon_engine",
    "ArchonRWEngine": "areal.experimental.engine.archon_engine",
    "ArchonDPOEngine": "areal.experimental.engine.archon_engine",
}
_CONTROLLERS = (
    ("areal.infra.controller.train_controller", "TrainController"),
    ("areal.experimental.training_service.controller.controller", "GatewayTrainController"),
)

logger = logging.getLogger(__name__)

_originals: dict[str, object] = {}        # function name -> AReaL's function (from its defining module)
_controller_inits: dict[tuple[str, str], object] = {}  # (module, class) -> AReaL's __init__
_engine_subclasses: dict[str, type] = {}
_calls: collections.Counter = collections.Counter()
_warned: set = set()
_patched = False


class FlashrlFallbackWarning(UserWarning):
    """A call ran AReaL's own code because flashrl_kernels does not compute that configuration."""


def _warn_once(reason: str) -> None:
    if reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"flashrl_kernels AReaL integration: {reason}; using AReaL's own function for it",
                      FlashrlFallbackWarning, stacklevel=3)


def call_counts() -> dict:
    """Calls that went through flashrl_kernels (name) and calls that fell back to AReaL (name + ':fallback')."""
    return dict(_calls)


def _check_version() -> str:
    from ._versions import import_or_explain, release_of, require_supported

    areal = import_or_explain("AReaL", "areal", SUPPORTED_RANGE)
    version = getattr(areal, "__version__", "unknown")
    release = release_of(version)
    return require_supported("AReaL", "areal", version, release is not None and release[:2] == SUPPORTED_AREAL,
                             SUPPORTED_RANGE, "It replaces functions that AReaL imports by name and whose signatures "
                             "and statistics change between releases")


# ---------------------------------------------------------------------------------------------- log-probs

def _vocab_parallel(tp_group) -> bool:
    return tp_group is not None and torch.distributed.get_world_size(tp_group) > 1


def _token_logprobs(logits, labels, temperature, entropy):
    from flashrl_kernels import token_logprobs

    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"logits and labels must be tensors, got {type(logits).__name__} and "
                        f"{type(labels).__name__}")
    if logits.dim() < 1 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels must have the shape of logits without its vocabulary dimension, got logits "
                         f"{tuple(logits.shape)} and labels {tuple(labels.shape)}")
    if logits.dim() < 2 or logits.shape[0] == 0:
        raise ValueError(f"logits must have at least one row (AReaL's gather functions require it), got shape "
                         f"{tuple(logits.shape)}")
    return token_logprobs(logits, labels, temperature=float(temperature), return_entropy=entropy)


def gather_logprobs(logits, labels, temperature: float = 1.0, tp_group=None, chunk_size: int = 1024):
    """AReaL's `gather_logprobs` on `flashrl_kernels.token_logprobs`: fp32 log-probs of `labels` under
    softmax(logits / temperature), logits `[..., V]` in any float dtype. `chunk_size` is accepted and unused (the
    kernel works in vocabulary tiles and keeps no [N, V] softmax for the backward)."""
    if _vocab_parallel(tp_group):
        _warn_once("vocab-parallel logits (tp_group of size > 1) are not computed by token_logprobs")
        _calls["gather_logprobs:fallback"] += 1
        return _originals["gather_logprobs"](logits, labels, temperature, tp_group, chunk_size)
    _calls["gather_logprobs"] += 1
    return _token_logprobs(logits, labels, temperature, entropy=False)


def gather_logprobs_entropy(logits, labels, temperature: float = 1.0, tp_group=None, chunk_size: int = 1024):
    """AReaL's `gather_logprobs_entropy` on `flashrl_kernels.token_logprobs(..., return_entropy=True)`: fp32
    log-probs and entropy of softmax(logits / temperature) in one pass over the logits."""
    if _vocab_parallel(tp_group):
        _warn_once("vocab-parallel logits (tp_group of size > 1) are not computed by token_logprobs")
        _calls["gather_logprobs_entropy:fallback"] += 1
        return _originals["gather_logprobs_entropy"](logits, labels, temperature, tp_group, chunk_size)
    _calls["gather_logprobs_entropy"] += 1
    return _token_logprobs(logits, labels, temperature, entropy=True)


# ---------------------------------------------------------------------------------------------- layouts

class _Layout:
    """Per-sequence reductions over AReaL's two layouts: padded `[B, T]` (one row per sequence) or packed
    `[total_tokens]` with `cu_seqlens [S + 1]` (a packed batch without cu_seqlens is one sequence)."""

    def __init__(self, like: torch.Tensor, cu_seqlens, needs_sequences: bool = False):
        self.padded = like.dim() == 2
        self.cu = None
        if self.padded:
            return
        if like.dim() != 1:
            raise ValueError(f"expected 1-D (packed) or 2-D (padded) tensors, got ndim={like.dim()}")
        n = like.shape[0]
        if cu_seqlens is None:
            if needs_sequences:
                raise ValueError(
                    "cu_seqlens is required for 1D tensors (packed format) when the importance ratio or the "
                    "rejection sampling is per sequence; for a single sequence use "
                    "cu_seqlens=torch.tensor([0, seq_len], dtype=torch.int32)")
            cu_seqlens = torch.tensor([0, n], device=like.device)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.numel() < 1:
            raise ValueError("cu_seqlens must be a 1-D tensor [num_seqs + 1]")
        self.cu = cu_seqlens.to(device=like.device, dtype=torch.int64)
        lengths = self.cu[1:] - self.cu[:-1]
        if int(self.cu[0]) != 0 or int(self.cu[-1]) != n or bool((lengths < 0).any()):
            raise ValueError(f"cu_seqlens must start at 0, be non-decreasing and end at the number of tokens {n}, got "
                             f"{cu_seqlens.tolist()}")
        self.nseq = lengths.numel()
        self.index = torch.repeat_interleave(torch.arange(self.nseq, device=like.device), lengths, output_size=n)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        if self.padded:
            return x.sum(-1)
        return x.new_zeros(self.nseq).index_add_(0, self.index, x)

    def max(self, x: torch.Tensor) -> torch.Tensor:
        if self.padded:
            return x.max(-1).values
        return x.new_full((self.nseq,), float("-inf")).scatter_reduce_(0, self.index, x, reduce="amax")

    def tokens(self, per_seq: torch.Tensor) -> torch.Tensor:
        return per_seq[:, None] if self.padded else per_seq[self.index]


# ---------------------------------------------------------------------------------------------- actor loss

def _in_bounds(metric, lower, upper):
    inside = metric <= upper
    return inside & (metric >= lower) if lower is not None else inside


def _kl_metric(name, prox, behav):
    """AReaL's KLEstimator values of log(pi_prox / pi_behave) per token (fp32, no clamp)."""
    d = prox.float() - behav.float()
    if name == "kl_k1":
        return d
    if name == "kl_k2":
        return d * d / 2.0
    return torch.exp(-d) - 1.0 + d  # kl_k3


@torch.no_grad()
def _rejection_sampling(prox, behav, mask, layout, rs):
    """AReaL 1.0's rejection sampling between the proximal and the behaviour policy: returns (kept mask, behaviour
    weight (0 outside the kept mask), the filtered / clamped share as a float)."""
    d = prox.float() - behav.float()
    log_r = torch.where(torch.isfinite(d), d, 0.0)  # as AReaL: a non-finite log-ratio counts as 0
    weight = torch.exp(log_r)
    ratio_metric = rs.metric == "ratio"
    metric = weight if ratio_metric else _kl_metric(rs.metric, prox, behav)
    lower, upper = rs.lower, rs.upper
    lo = lower if lower is not None else 0.0
    keep = mask
    if rs.level == "sequence":
        agg_src = log_r if ratio_metric else metric  # the ratio metric aggregates in log space
        masked = torch.where(mask, agg_src, 0.0)
        n_valid = layout.sum(mask.to(torch.int64))
        n = n_valid.clamp(min=1).to(agg_src.dtype)
        if ratio_metric:  # the weight is the sequence's geometric-mean ratio
            weight = layout.tokens(torch.exp(layout.sum(torch.where(mask, log_r, 0.0)) / n)).expand_as(log_r)
        if rs.agg == "sum":
            seq = layout.sum(masked)
        elif rs.agg == "mean":
            seq = layout.sum(masked) / n
        elif rs.agg == "max":
            seq = layout.max(agg_src.masked_fill(~mask, float("-inf")))
            seq = torch.where(n_valid == 0, torch.zeros_like(seq), seq)
        else:
            raise ValueError(f"Unknown agg method: {rs.agg}")
        ok = layout.tokens(_in_bounds(torch.exp(seq) if ratio_metric else seq, lower, upper)).expand_as(mask)
        if rs.action == "mask":
            keep = mask & ok
            clamped = weight
        else:
            clamped = torch.where(~ok, weight.clamp(min=lo, max=upper), weight)
    else:
        if rs.action == "mask":
            keep = mask & _in_bounds(metric, lower, upper)
            clamped = weight
        else:
            clamped = weight.clamp(min=lo, max=upper)
    total = max(int(mask.sum()), 1)
    if rs.action == "mask":
        share = int((mask & ~keep).sum()) / total
    else:
        share = int((mask & (clamped != weight)).sum()) / total
    return keep, torch.where(keep, clamped, 0.0), share


def _policy_loss_tis(rs):
    """The LossConfig TIS fields that compute AReaL's behaviour weight inside policy_loss, or None where the op's
    TIS modes cannot express it (KL metrics; sequence filters on the sum or max of the log-ratios: AReaL filters
    on them but weighs by the geometric mean; an infinite upper bound); the weight is then computed here and folded
    into the advantages."""
    if rs is None:
        return {"tis_mode": "none"}
    if rs.metric != "ratio" or (rs.level == "sequence" and rs.agg != "mean") or not math.isfinite(rs.upper):
        return None
    level = "token" if rs.level == "token" else "sequence"
    return {"tis_mode": f"{level}_{'truncate' if rs.action == 'clamp' else 'mask'}",
            "tis_min": float(rs.lower) if rs.lower is not None else 0.0, "tis_max": float(rs.upper),
            "tis_sequence_reduce": "mean"}


def _check_actor_args(logprobs, proximal_logprobs, old_logprobs, advantages, loss_mask, c_clip,
                      importance_sampling_level):
    for name, t in (("logprobs", logprobs), ("proximal_logprobs", proximal_logprobs),
                    ("old_logprobs", old_logprobs), ("advantages", advantages), ("loss_mask", loss_mask)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(logprobs.shape):
            raise ValueError(f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(t.shape)}")
    if importance_sampling_level not in ("token", "sequence"):
        raise ValueError(f"Invalid importance_sampling_level: {importance_sampling_level}. "
                         "Must be 'token' or 'sequence'.")
    if c_clip is not None and not c_clip > 1.0:
        raise ValueError(f"c_clip (the dual clip) must be > 1.0, got {c_clip}")


def ppo_actor_loss_fn(logprobs, proximal_logprobs, old_logprobs, advantages, eps_clip, loss_mask,
                      eps_clip_higher=None, c_clip=None, rejection_sampling=None, importance_sampling_level="token",
                      cu_seqlens=None):
    """AReaL's `ppo_actor_loss_fn` (decoupled PPO) on `flashrl_kernels.policy_loss`; same arguments, loss,
    gradient and statistics.

    logprobs: pi_theta (differentiable); proximal_logprobs: pi_prox, the trainer's recompute before the update
    (policy_loss's `old_logp`: the PPO ratio is clipped against it); old_logprobs: pi_behave, the inference
    engine's (policy_loss's `rollout_logp`: the rejection-sampling weight exp(prox - behave)). Padded `[B, T]` or
    packed `[total_tokens]` with `cu_seqlens`. The loss is divided by the number of valid tokens of `loss_mask`
    before rejection sampling, as AReaL does."""
    _check_actor_args(logprobs, proximal_logprobs, old_logprobs, advantages, loss_mask, c_clip,
                      importance_sampling_level)
    eps_high = eps_clip if eps_clip_higher is None else eps_clip_higher
    if not 0.0 <= eps_clip < 1.0 or not 0.0 <= eps_high < math.inf or (c_clip is not None and math.isinf(c_clip)):
        _warn_once(f"eps_clip={eps_clip}, eps_clip_higher={eps_clip_higher}, c_clip={c_clip} are outside "
                   "policy_loss's range")
        _calls["ppo_actor_loss_fn:fallback"] += 1
        return _originals["ppo_actor_loss_fn"](
            logprobs=logprobs, proximal_logprobs=proximal_logprobs, old_logprobs=old_logprobs,
            advantages=advantages, eps_clip=eps_clip, loss_mask=loss_mask, eps_clip_higher=eps_clip_higher,
            c_clip=c_clip, rejection_sampling=rejection_sampling,
            importance_sampling_level=importance_sampling_level, cu_seqlens=cu_seqlens)
    from flashrl_kernels import LossConfig, policy_loss

    _calls["ppo_actor_loss_fn"] += 1
    rs = rejection_sampling
    layout = _Layout(logprobs, cu_seqlens, needs_sequences=importance_sampling_level == "sequence" or (
        rs is not None and rs.level == "sequence"))
    prox = proximal_logprobs.detach()
    behav = old_logprobs.detach()
    mask0 = loss_mask.bool()
    count = mask0.count_nonzero().clamp(min=1).to(torch.float32)  # AReaL's divisor: valid tokens before filtering
    if rs is not None:
        keep, weight, share = _rejection_sampling(prox, behav, mask0, layout, rs)
    else:
        keep, weight, share = mask0, None, 0.0
    sequence = importance_sampling_level == "sequence"
    adv = advantages.detach()
    if sequence:  # GSPO: one ratio per sequence and the sequence's mean advantage over the kept tokens
        n_keep = layout.sum(keep.to(torch.int64)).clamp(min=1).to(adv.dtype)
        seq_adv = layout.sum(torch.where(keep, adv, 0.0)) / n_keep
    tis = _policy_loss_tis(rs)
    kwargs = {}
    if tis is None:  # the weight computed above, folded into the advantages: w * L(A) = L(w * A) for w >= 0
        tis = {"tis_mode": "none"}
        adv_arg = (layout.tokens(seq_adv).expand_as(adv) if sequence else adv) * weight
    else:  # packed GSPO: per token, as policy_loss reads an [S] that is also [total_tokens] as per token
        adv_arg = (seq_adv if layout.padded else layout.tokens(seq_adv)) if sequence else adv
        if rs is not None:
            d = prox.float() - behav.float()
            kwargs["rollout_logp"] = torch.where(torch.isfinite(d), behav, prox)  # AReaL: a non-finite ratio is 1
    cfg = LossConfig(eps_low=float(eps_clip), eps_high=float(eps_high),
                     dual_clip=None if c_clip is None else float(c_clip),
                     importance_sampling_level=importance_sampling_level, loss_agg_mode="token-mean", **tis)
    if not layout.padded:
        kwargs["cu_seqlens"] = layout.cu
    out = policy_loss(logprobs, prox, adv_arg, mask=keep, config=cfg, normalizer=count, **kwargs)
    stat = _actor_stats(logprobs.detach(), prox, behav, adv, keep, weight, share, layout,
                        seq_adv if sequence else None, float(eps_clip), float(eps_high), c_clip)
    return out.loss, stat


@torch.no_grad()
def _actor_stats(lp, prox, behav, adv, keep, weight, share, layout, seq_adv, eps_low, eps_high, c_clip):
    """AReaL's per-token statistics (the `stat` dict its actor logs), by AReaL's definitions: the loss per token
    (after the behaviour weight, before masking), the ratio used, the log-ratio to the proximal policy, the clip
    and dual-clip masks, and with rejection sampling the behaviour weight, its log-ratio, mask and filtered share."""
    if seq_adv is None:
        ratio = torch.where(keep, torch.exp(lp - prox), 0.0)
        a = adv
    else:
        n = layout.sum(keep.to(torch.int64)).clamp(min=1).to(lp.dtype)
        s = torch.exp(layout.sum(torch.where(keep, lp - prox, 0.0)) / n)
        ratio = torch.where(keep, layout.tokens(s).expand_as(lp), 0.0)
        a = torch.where(keep, layout.tokens(seq_adv).expand_as(lp), 0.0)
    pg1 = -a * ratio
    pg2 = -a * ratio.clamp(1.0 - eps_low, 1.0 + eps_high)
    clip_mask = pg1 < pg2
    pg = torch.maximum(pg1, pg2)
    if c_clip is not None:
        pg3 = torch.sign(a) * c_clip * a
        dual_mask = pg3 < pg
        pg = torch.minimum(pg, pg3)
    else:
        dual_mask = torch.zeros_like(clip_mask)
    if weight is not None:
        pg = pg * weight
    stat = {"loss": pg, "importance_weight": ratio, "approx_kl": lp - prox, "clip_mask": clip_mask & keep,
            "dual_clip_mask": dual_mask & keep}
    if weight is not None:
        behave_mask = (weight > 0) & keep
        stat.update(behave_approx_kl=torch.where(behave_mask, prox - behav, 0.0), behave_imp_weight=weight,
                    behave_mask=behave_mask, filtered_fraction=share)
    return stat


# ---------------------------------------------------------------------------------------------- critic loss

def ppo_critic_loss_fn(value, old_value, target_value, value_eps_clip, loss_mask=None, loss_fn_type="mse"):
    """AReaL's `ppo_critic_loss_fn` on `flashrl_kernels.value_loss`: max(0.5 (v - R)^2, 0.5 (v_clip - R)^2) with
    v_clip = old + clamp(v - old, +-value_eps_clip), averaged over the valid tokens (all tokens when loss_mask is
    None); any shape. Same loss, gradient and statistics (clip_mask, per-token loss). The "huber" loss, and a
    clip range <= 0, go to AReaL's own function."""
    if loss_fn_type not in ("mse", "huber"):
        raise NotImplementedError(f"Unknown loss fn type: {loss_fn_type}")
    if loss_fn_type == "huber" or not float(value_eps_clip) > 0.0:
        _warn_once("the huber critic loss is not computed by value_loss" if loss_fn_type == "huber"
                   else f"value_eps_clip={value_eps_clip} (value_loss clips with a positive range)")
        _calls["ppo_critic_loss_fn:fallback"] += 1
        return _originals["ppo_critic_loss_fn"](value, old_value, target_value, value_eps_clip, loss_mask,
                                                loss_fn_type)
    from flashrl_kernels import value_loss

    for name, t in (("old_value", old_value), ("target_value", target_value), ("loss_mask", loss_mask)):
        if t is not None and tuple(t.shape) != tuple(value.shape):
            raise ValueError(f"{name} must have the shape of value {tuple(value.shape)}, got {tuple(t.shape)}")
    _calls["ppo_critic_loss_fn"] += 1
    if target_value.is_inference():
        target_value = target_value.clone()
    if old_value.is_inference():
        old_value = old_value.clone()
    flat = (1, value.numel())  # one row: token-mean over the valid tokens, whatever the caller's layout
    out = value_loss(value.reshape(flat), old_value.reshape(flat), target_value.reshape(flat),
                     mask=None if loss_mask is None else loss_mask.reshape(flat), clip_range=float(value_eps_clip),
                     loss_agg_mode="token-mean")
    with torch.no_grad():
        v = value.detach()
        clipped = old_value + (v - old_value).clamp(-value_eps_clip, value_eps_clip)
        l1 = 0.5 * (v - target_value) ** 2
        l2 = 0.5 * (clipped - target_value) ** 2
        clip_mask = l2 > l1
        if loss_mask is not None:
            clip_mask = clip_mask & loss_mask.bool()
        stat = {"clip_mask": clip_mask, "loss": torch.maximum(l1, l2)}
    return out.loss, stat


# ---------------------------------------------------------------------------------------------- worker processes

def _engine_subclass(name: str) -> type:
    """`flashrl_kernels.integrations.areal.<name>`: AReaL's engine class `name`, whose constructor patches the
    process it runs in first. AReaL's controllers send workers an engine class by import path; with this path the
    worker imports this module, and building the engine patches AReaL there."""
    cls = _engine_subclasses.get(name)
    if cls is not None:
        return cls
    base = getattr(importlib.import_module(_ENGINE_CLASSES[name]), name)

    def __init__(self, *args, **kwargs):
        patch()
        base.__init__(self, *args, **kwargs)

    def flashrl_status(self, check: bool = False) -> dict:
        """What is patched in this (worker) process; check=True also runs AReaL's bound functions on small
        random inputs against AReaL's originals (see `status`)."""
        return status(check=check)

    cls = type(name, (base,), {
        "__init__": __init__, "flashrl_status": flashrl_status, "__module__": __name__, "__qualname__": name,
        "__doc__": f"AReaL's {base.__module__}.{name}; building it patches AReaL in this process first "
                   "(flashrl_kernels.integrations.areal.patch).",
    })
    _engine_subclasses[name] = cls
    return cls


def __getattr__(name: str):
    if name in _ENGINE_CLASSES:
        return _engine_subclass(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _worker_engine(engine):
    """The engine a patched controller sends to its workers: ours for AReaL's own engine classes (a class or an
    import path), anything else unchanged."""
    if isinstance(engine, str):
        module, _, name = engine.rpartition(".")
        if _ENGINE_CLASSES.get(name) == module:
            return f"{__name__}.{name}"
        return engine
    if isinstance(engine, type) and _ENGINE_CLASSES.get(engine.__name__) == engine.__module__ and \
            engine.__qualname__ == engine.__name__:
        return _engine_subclass(engine.__name__)
    return engine


def _controller_init(original):
    @functools.wraps(original)
    def __init__(self, train_engine, *args, **kwargs):
        original(self, _worker_engine(train_engine), *args, **kwargs)

    __init__._flashrl_original = original
    return __init__


# ---------------------------------------------------------------------------------------------- patch

_REPLACEMENTS = {
    "gather_logprobs": gather_logprobs,
    "gather_logprobs_entropy": gather_logprobs_entropy,
    "ppo_actor_loss_fn": ppo_actor_loss_fn,
    "ppo_critic_loss_fn": ppo_critic_loss_fn,
}


def _binding_modules(name):
    return (_SOURCES[name],) + _BINDINGS[name]


def patch() -> None:
    """Route AReaL's log-probs, entropy, actor and critic losses through flashrl_kernels, in this process and in
    every worker that AReaL's controllers start from now on. Idempotent."""
    global _patched
    if _patched:
        return
    version = _check_version()
    for name, source in _SOURCES.items():
        _originals.setdefault(name, getattr(importlib.import_module(source), name))
    importlib.import_module("areal.utils.functional")
    for name, fn in _REPLACEMENTS.items():
        for module_name in _binding_modules(name):
            module = sys.modules.get(module_name)  # modules imported later bind ours from the package
            if module is not None and getattr(module, name, None) is _originals[name]:
                setattr(module, name, fn)
    for module_name, cls_name in _CONTROLLERS:
        try:
            cls = getattr(importlib.import_module(module_name), cls_name)
        except Exception as e:  # an optional AReaL component whose own dependencies are missing
            logger.debug("flashrl_kernels: not patching %s.%s (%s)", module_name, cls_name, e)
            continue
        init = cls.__dict__["__init__"]
        if not hasattr(init, "_flashrl_original"):
            _controller_inits[(module_name, cls_name)] = init
            cls.__init__ = _controller_init(init)
    _warned.clear()
    _patched = True
    logger.info("flashrl_kernels patched areal %s (pid %d): gather_logprobs[_entropy] -> token_logprobs, "
                "ppo_actor_loss_fn -> policy_loss, ppo_critic_loss_fn -> value_loss; train controllers build "
                "patching engines in their workers", version, os.getpid())


def unpatch() -> None:
    """Undo patch(): AReaL's functions back everywhere they were bound, its controllers' own constructors.
    Idempotent."""
    global _patched
    if not _patched:
        return
    for name, fn in _REPLACEMENTS.items():
        for module_name in _binding_modules(name):
            module = sys.modules.get(module_name)
            if module is not None and getattr(module, name, None) is fn:
                setattr(module, name, _originals[name])
    for (module_name, cls_name), init in _controller_inits.items():
        cls = getattr(sys.modules[module_name], cls_name)
        cls.__init__ = init
    _controller_inits.clear()
    _patched = False
    logger.info("flashrl_kernels unpatched areal: AReaL's own functions are back")


def is_patched() -> bool:
    return _patched


def status(check: bool = False) -> dict:
    """What is patched in this process: {"patched", "pid", "bound": {"module.name": True if flashrl's}, "calls"}.
    check=True also runs AReaL's bound `gather_logprobs_entropy` (as the FSDP engine sees it) and
    `ppo_actor_loss_fn` (as the PPO actor sees it) on small random inputs and reports, under "check", the largest
    difference from AReaL's own functions and whether the calls went through flashrl."""
    bound = {}
    for name, fn in _REPLACEMENTS.items():
        for module_name in _binding_modules(name):
            module = sys.modules.get(module_name)
            if module is not None and hasattr(module, name):
                bound[f"{module_name}.{name}"] = getattr(module, name) is fn
    out = {"patched": _patched, "pid": os.getpid(), "bound": bound, "calls": call_counts()}
    if check:
        out["check"] = _self_check()
    return out


def _self_check() -> dict:
    from areal.engine import fsdp_engine
    from areal.trainer.ppo import actor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(12, 50, generator=g) * 3
    labels = torch.randint(0, 50, (12,), generator=g)
    before = call_counts()
    lp, ent = fsdp_engine.gather_logprobs_entropy(logits, labels, temperature=0.7)
    lp0, ent0 = _originals["gather_logprobs_entropy"](logits, labels, temperature=0.7)
    prox = lp0 + 0.3 * torch.randn(12, generator=g)
    behav = prox + 0.3 * torch.randn(12, generator=g)
    adv = torch.randn(12, generator=g)
    mask = torch.rand(12, generator=g) > 0.2
    args = {"proximal_logprobs": prox, "old_logprobs": behav, "advantages": adv, "eps_clip": 0.2,
            "loss_mask": mask, "c_clip": 3.0}
    loss, _ = actor.ppo_actor_loss_fn(logprobs=lp0, **args)
    loss0, _ = _originals["ppo_actor_loss_fn"](logprobs=lp0, **args)
    after = call_counts()
    return {
        "max_abs_diff": max(float((lp - lp0).abs().max()), float((ent - ent0).abs().max()),
                            float((loss - loss0).abs())),
        "through_flashrl": all(after.get(k, 0) > before.get(k, 0)
                               for k in ("gather_logprobs_entropy", "ppo_actor_loss_fn")),
    }
