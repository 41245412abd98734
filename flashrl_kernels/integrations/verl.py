"""Drop-in kernels for verl 0.9 (FSDP / Megatron actors on Ray, vLLM rollout).

    import flashrl_kernels
    flashrl_kernels.patch("verl")     # or FLASHRL_PATCH=verl (applied by verl's plugin loader at `import verl`)

What `patch()` does (verl >= 0.9, < 0.10; other versions are refused with a RuntimeError):

- registers two policy losses in verl's registry (`actor_rollout_ref.actor.policy_loss.loss_mode`):
  - `flashrl`: verl's `vanilla` (PPO clip with clip-higher, the dual clip with `clip_ratio_c`, which
    vanilla always applies) computed by `flashrl_kernels.policy_loss`;
  - `flashrl_gspo`: verl's `gspo` (GSPO-token: the sequence ratio with a stop-gradient, our
    `importance_sampling_level="sequence_token"`), same;
  both with verl's `agg_loss` semantics for every `loss_agg_mode` (token-mean, token-sum,
  seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm) and the data-parallel normalisers of
  `config.global_batch_info`, `rollout_is_weights` (TIS) applied after clipping, and verl's metric names
  (`actor/pg_clipfrac`, `actor/ppo_kl`, `actor/pg_clipfrac_lower`), computed exactly as verl does;
- replaces `logprobs_from_logits` (in `verl.utils.torch_functional` and in every verl module that imported
  it by name) with `flashrl_kernels.token_logprobs`, and `entropy_from_logits` /
  `entropy_from_logits_with_chunking` with its entropy output (no [N, V] softmax);
- replaces `verl.utils.experimental.torch_functional.FusedLinearForPPO` (the `use_fused_kernels` path) with one
  on `flashrl_kernels.linear_token_logprobs` (hidden states + lm_head weight, no [N, V] logits).

`unpatch()` restores every replaced object and removes the registry entries (verl has no unregister call;
the entries are popped from `POLICY_LOSS_REGISTRY`). Both are idempotent. See docs/integrations/verl.md.
"""
from __future__ import annotations

import importlib
import sys

import torch

SUPPORTED_VERL = (0, 9)  # major, minor of the verl releases this adapter was written and tested against
SUPPORTED_RANGE = ">=0.9,<0.10"
LOSS_NAMES = ("flashrl", "flashrl_gspo")

_LOGPROB_MODULES = (  # verl modules that import logprobs_from_logits by name (checked against 0.9.1)
    "verl.utils.torch_functional",
    "verl.workers.engine.fsdp.transformer_impl",
    "verl.workers.engine.automodel.transformer_impl",
    "verl.workers.engine.torchtitan.transformer_impl",
    "verl.workers.rollout.naive.naive_rollout",
    "verl.trainer.ppo.prefix_grouper_utils",
)
_VANILLA_LOG_RATIO_CLAMP = 20.0  # verl's vanilla clamps log(ratio) to +-20 before exp
_GSPO_LOG_RATIO_MAX = 10.0  # verl's gspo clamps the log of the sequence ratio at 10

_originals: dict[tuple[str, str], object] = {}  # (module, attribute) -> verl's object
_patched = False
_patching = False


def _check_version() -> str:
    from ._versions import import_or_explain, release_of, require_supported

    verl = import_or_explain("verl", "verl", SUPPORTED_RANGE)
    version = getattr(verl, "__version__", "unknown")
    release = release_of(version)
    return require_supported("verl", "verl", version, release is not None and release[:2] == SUPPORTED_VERL,
                             SUPPORTED_RANGE, "It registers losses with verl's calling convention and replaces "
                             "functions whose signatures change between releases")


# ---------------------------------------------------------------------------------------------- losses

def _normalizer(agg: str, mask: torch.Tensor, info: dict):
    """The divisor that makes policy_loss's sum equal verl's agg_loss(..., **global_batch_info)."""
    dp = info.get("dp_size") or 1
    if agg == "token-mean":
        n = info.get("batch_num_tokens")
        if n is None:
            if dp > 1:
                raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
            return None  # policy_loss's default: this micro-batch's valid tokens
        return n / dp
    if agg == "token-sum":
        return 1.0 / dp
    gbs = info.get("global_batch_size")
    if gbs is None:
        if dp > 1:
            raise ValueError("global_batch_size is required when dp_size > 1")
        gbs = (mask.sum(-1) > 0).sum().to(torch.float32)  # non-empty sequences (verl excludes empty ones)
    norm = gbs / dp
    if agg == "seq-mean-token-sum-norm":
        lsf = info.get("loss_scale_factor")
        norm = norm * (mask.shape[-1] if lsf is None else lsf)
    return norm


_FLASHRL_AGG = {  # verl's agg mode -> LossConfig.loss_agg_mode (the divisor comes from _normalizer)
    "token-mean": "token-mean",
    "token-sum": "token-sum",
    "seq-mean-token-mean": "seq-mean-token-mean",
    "seq-mean-token-sum": "seq-mean-token-sum",
    "seq-mean-token-sum-norm": "seq-mean-token-sum",
}


def _clip_ranges(config):
    eps = config.clip_ratio
    lo = config.clip_ratio_low if config.clip_ratio_low is not None else eps
    hi = config.clip_ratio_high if config.clip_ratio_high is not None else eps
    return float(lo), float(hi)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1e-8)  # verl_F.masked_mean's value


def _loss(level: str, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
    from flashrl_kernels import LossConfig, policy_loss

    if loss_agg_mode not in _FLASHRL_AGG:
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    lo, hi = _clip_ranges(config)
    mask = response_mask.to(log_prob.dtype)
    old = old_log_prob.detach()
    d = (log_prob - old).detach()
    if level == "token":
        c = float(config.get("clip_ratio_c", 3.0))
        if not c > 1.0:
            raise ValueError(f"clip_ratio_c (the dual clip) must be > 1.0, got {c}")
        # verl clamps log(ratio) to +-20 (value and zero gradient there): the same on those tokens only
        over = d.abs() > _VANILLA_LOG_RATIO_CLAMP
        lp = torch.where(over, old + d.clamp(-_VANILLA_LOG_RATIO_CLAMP, _VANILLA_LOG_RATIO_CLAMP), log_prob)
        dual = c
    else:
        # gspo clamps the log sequence ratio at 10 (value e^10, no gradient): the same on those sequences
        n = mask.sum(-1).clamp(min=1)
        seq_log = (d * mask).sum(-1) / n
        over = (seq_log > _GSPO_LOG_RATIO_MAX)[:, None].expand_as(d)
        shift = (seq_log - _GSPO_LOG_RATIO_MAX).clamp(min=0)[:, None]
        lp = torch.where(over, log_prob.detach(), log_prob)
        old = old + shift
        dual = None
    # every term of the clipped loss is linear in the advantage for a given sign, so w * loss(A) = loss(w A)
    # for the non-negative rollout-correction weights (verl multiplies them in after clipping)
    adv = advantages if rollout_is_weights is None else advantages * rollout_is_weights.detach()
    cfg = LossConfig(eps_low=lo, eps_high=hi, dual_clip=dual, importance_sampling_level=level,
                     loss_agg_mode=_FLASHRL_AGG[loss_agg_mode])
    info = dict(getattr(config, "global_batch_info", None) or {})
    out = policy_loss(lp, old, adv, mask=response_mask, config=cfg,
                      normalizer=_normalizer(loss_agg_mode, response_mask, info))
    metrics = _verl_metrics(level, d, old_log_prob, advantages, mask, lo, hi, dual)
    return out.loss, metrics


@torch.no_grad()
def _verl_metrics(level, d, old_log_prob, advantages, mask, lo, hi, dual):
    """verl's three metrics, by verl's definitions (on the unweighted advantages)."""
    if level == "token":
        log_r = d.clamp(-_VANILLA_LOG_RATIO_CLAMP, _VANILLA_LOG_RATIO_CLAMP)
    else:
        seq = (d * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_r = seq[:, None].clamp(max=_GSPO_LOG_RATIO_MAX).expand_as(d)
    r = torch.exp(log_r)
    a = advantages
    loss1, loss2 = -a * r, -a * r.clamp(1 - lo, 1 + hi)
    clipfrac = _masked_mean((loss2 > loss1).to(mask.dtype), mask)
    if dual is not None:
        lower = _masked_mean(((torch.maximum(loss1, loss2) > -a * dual) & (a < 0)).to(mask.dtype), mask)
    else:
        lower = torch.zeros(())
    ppo_kl = _masked_mean(-(d.clamp(-_VANILLA_LOG_RATIO_CLAMP, _VANILLA_LOG_RATIO_CLAMP) if level == "token" else d),
                          mask)
    return {"actor/pg_clipfrac": clipfrac.item(), "actor/ppo_kl": ppo_kl.item(),
            "actor/pg_clipfrac_lower": lower.item()}


def flashrl_policy_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None,
                        rollout_is_weights=None):
    """verl's `vanilla` policy loss (PPO clip, clip-higher, dual clip) on flashrl_kernels.policy_loss."""
    if config is None:
        raise ValueError("the flashrl policy loss needs verl's actor config")
    return _loss("token", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights)


def flashrl_gspo_loss(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="seq-mean-token-mean",
                      config=None, rollout_is_weights=None):
    """verl's `gspo` policy loss (GSPO-token, no dual clip) on flashrl_kernels.policy_loss."""
    if config is None:
        raise ValueError("the flashrl_gspo policy loss needs verl's actor config")
    return _loss("sequence_token", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                 rollout_is_weights)


# ---------------------------------------------------------------------------------------------- log-probs

def logprobs_from_logits(logits, labels, inplace_backward=True):
    """verl's `logprobs_from_logits(logits, labels, inplace_backward)` on flashrl_kernels.token_logprobs."""
    from flashrl_kernels import token_logprobs

    del inplace_backward  # token_logprobs never keeps a [N, V] softmax for the backward
    shape = logits.shape[:-1]
    lp = token_logprobs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
    return lp.view(shape)


def _entropy(logits: torch.Tensor) -> torch.Tensor:
    from flashrl_kernels import token_logprobs

    flat = logits.reshape(-1, logits.shape[-1])
    # the entropy does not depend on the targets; token 0 for every row
    _, ent = token_logprobs(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device),
                            return_entropy=True)
    return ent.view(logits.shape[:-1])


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """verl's `entropy_from_logits` (same dtype as the logits) without its [N, V] softmax."""
    return _entropy(logits).to(logits.dtype)


def entropy_from_logits_with_chunking(logits: torch.Tensor, chunk_size: int = 2048) -> torch.Tensor:
    """verl's chunked entropy (fp32 out); flashrl's kernel never holds more than a tile, so no chunks."""
    del chunk_size
    return _entropy(logits).float()


class FusedLinearForPPO(torch.nn.Module):
    """verl's `FusedLinearForPPO` (hidden states + lm_head weight -> log-probs, entropy; the path of
    `actor_rollout_ref.model.use_fused_kernels`) on `linear_token_logprobs`: no [N, V] logits in any dtype,
    forward or backward. Same constructor and call as verl's; chunk_size / impl_backend are accepted and
    unused. Outputs as verl's: fp32 log-probs, entropy in the hidden states' dtype."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size, self.impl_backend = chunk_size, impl_backend

    def forward(self, hidden_states, vocab_weights, input_ids, temperature: float = 1.0):
        from flashrl_kernels import linear_token_logprobs

        if hidden_states.ndim not in (2, 3) or tuple(input_ids.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(f"hidden_states [N, H] or [B, T, H] and input_ids of its leading shape, got "
                             f"{tuple(hidden_states.shape)} and {tuple(input_ids.shape)}")
        logp, ent = linear_token_logprobs(hidden_states, vocab_weights, input_ids.to(torch.int64),
                                          temperature=float(temperature), return_entropy=True)
        return logp.float(), ent.to(hidden_states.dtype)


# ---------------------------------------------------------------------------------------------- patch

def _module(module_name: str):
    module = sys.modules.get(module_name)
    if module is None:
        try:
            module = importlib.import_module(module_name)
        except Exception:
            return None  # an optional verl backend whose own dependencies are missing: nothing to patch there
    return module


def _set(module_name: str, attr: str, value) -> None:
    module = _module(module_name)
    if module is None or not hasattr(module, attr):
        return
    _originals.setdefault((module_name, attr), getattr(module, attr))
    setattr(module, attr, value)


def patch() -> None:
    """Register the flashrl losses with verl and route its log-probs through flashrl_kernels. Idempotent."""
    global _patching
    if _patched or _patching:  # _patching: `import verl` below runs our verl.plugins entry point, which patches
        return
    _patching = True
    try:
        _patch()
    finally:
        _patching = False


def _patch() -> None:
    global _patched
    _check_version()
    from verl.trainer.ppo import core_algos

    for name in LOSS_NAMES:
        if name in core_algos.POLICY_LOSS_REGISTRY:
            raise RuntimeError(f"verl already has a policy loss named {name!r}; not overriding it")
    core_algos.register_policy_loss("flashrl")(flashrl_policy_loss)
    core_algos.register_policy_loss("flashrl_gspo")(flashrl_gspo_loss)
    # import them all before replacing anything: a module first imported after verl.utils.torch_functional is
    # patched binds our function by name, which unpatch() would then "restore"
    for module_name in _LOGPROB_MODULES:
        _module(module_name)
    for module_name in _LOGPROB_MODULES:
        _set(module_name, "logprobs_from_logits", logprobs_from_logits)
    # looked up on verl.utils.torch_functional at call time, or bound at FSDPEngine.__init__ (patch before
    # building engines, as FLASHRL_PATCH does)
    _set("verl.utils.torch_functional", "entropy_from_logits", entropy_from_logits)
    _set("verl.utils.torch_functional", "entropy_from_logits_with_chunking", entropy_from_logits_with_chunking)
    # verl's model forwards import it from this module at call time
    _set("verl.utils.experimental.torch_functional", "FusedLinearForPPO", FusedLinearForPPO)
    _patched = True


def unpatch() -> None:
    """Undo patch(): verl's functions back, the flashrl losses out of its registry. Idempotent."""
    global _patched
    if not _patched:
        return
    from verl.trainer.ppo import core_algos

    for name, fn in (("flashrl", flashrl_policy_loss), ("flashrl_gspo", flashrl_gspo_loss)):
        if core_algos.POLICY_LOSS_REGISTRY.get(name) is fn:
            del core_algos.POLICY_LOSS_REGISTRY[name]
    for (module_name, attr), original in _originals.items():
        module = sys.modules.get(module_name)
        if module is not None:
            setattr(module, attr, original)
    _originals.clear()  # the next patch() records what verl holds then
    _patched = False


def is_patched() -> bool:
    return _patched
