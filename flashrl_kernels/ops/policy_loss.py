"""torch.library ops for the clipped policy loss, and the public function `policy_loss`.

flashrl::policy_loss          (logp, old_logp, advantages, mask?, cu_seqlens, rollout_logp?, ref_logp?, entropy?,
                               normalizer?, <config scalars>, divisor, uniform_len)
                              -> (loss, metrics, g_tok, g_ent, seq_coef, scale)
flashrl::policy_loss_backward (grad_loss, g_tok, g_ent, seq_coef, mask?, cu_seqlens, scale, uniform_len)
                              -> (grad_logp, grad_entropy)

Both work on one canonical form, built by the public wrapper from either
input layout: flat token tensors [N], an optional bool mask [N], int64
cu_seqlens [S+1] and advantages [S] (per sequence) or [N] (per token). Padded
[B, T] inputs become N = B*T with cu_seqlens = T * arange(B + 1) and
uniform_len = T (a hint the torch backend uses to reshape instead of gather);
packed inputs keep their cu_seqlens and uniform_len = 0.

The forward also returns what the backward needs, so the backward is one pass:
g_tok (per-token gradient coefficient), g_ent (entropy gradient coefficient,
empty without entropy), seq_coef (per-sequence coefficient of GSPO's
gradient through the sequence ratio, empty otherwise) and scale = 1/divisor.
grad_logp = (g_tok + mask * seq_coef[seq]) * grad_loss * scale.

`policy_loss` runs the op's own functions through an autograd.Function outside torch.compile and dispatch modes
(ops/_eager.py: the custom-op call alone cost more than the kernel at trainer sizes, on a CPU and on a GPU).
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from .._backend import implementation
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_cu_seqlens,
    check_same_device,
    check_tensor,
    first_true,
    parse_normalizer,
    sequence_layout,
    value_checks_enabled,
)
from ..loss_config import METRIC_NAMES, LossConfig, LossOutput
from ._eager import eager_function, needs_op


def _policy_loss_forward(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor | None, cu_seqlens: Tensor,
    rollout_logp: Tensor | None, ref_logp: Tensor | None, entropy: Tensor | None, normalizer: Tensor | None,
    eps_low: float, eps_high: float, dual_clip: float, importance_sampling_level: str, tis_mode: str,
    tis_min: float, tis_max: float, tis_sequence_reduce: str, loss_agg_mode: str, beta: float, entropy_coef: float,
    divisor: float, uniform_len: int, positive: Tensor | None, nll_coef: float,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    fwd = implementation("policy_loss_forward", logp.device)
    return fwd(
        logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, normalizer,
        eps_low, eps_high, dual_clip, importance_sampling_level, tis_mode, tis_min, tis_max, tis_sequence_reduce,
        loss_agg_mode, beta, entropy_coef, divisor, uniform_len, positive, nll_coef,
    )


_policy_loss_op = torch.library.custom_op("flashrl::policy_loss", _policy_loss_forward, mutates_args=())


@_policy_loss_op.register_fake
def _(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, normalizer, eps_low, eps_high,
      dual_clip, importance_sampling_level, tis_mode, tis_min, tis_max, tis_sequence_reduce, loss_agg_mode, beta,
      entropy_coef, divisor, uniform_len, positive, nll_coef):
    f32 = torch.float32
    n = logp.shape[0]
    nseq = cu_seqlens.shape[0] - 1
    has_seq = importance_sampling_level == "sequence" or (positive is not None and nll_coef != 0.0)
    return (
        logp.new_empty((), dtype=f32),
        logp.new_empty((len(METRIC_NAMES),), dtype=f32),
        logp.new_empty((n,), dtype=f32),
        logp.new_empty((n if entropy is not None else 0,), dtype=f32),
        logp.new_empty((nseq if has_seq else 0,), dtype=f32),
        logp.new_empty((), dtype=f32),
    )


def _policy_loss_backward(
    grad_loss: Tensor, g_tok: Tensor, g_ent: Tensor, seq_coef: Tensor, mask: Tensor | None, cu_seqlens: Tensor,
    scale: Tensor, uniform_len: int,
) -> tuple[Tensor, Tensor]:
    bwd = implementation("policy_loss_backward", g_tok.device)
    return bwd(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, uniform_len)


_policy_loss_backward_op = torch.library.custom_op("flashrl::policy_loss_backward", _policy_loss_backward,
                                                   mutates_args=())


@_policy_loss_backward_op.register_fake
def _(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, uniform_len):
    return torch.empty_like(g_tok), torch.empty_like(g_ent)


def _setup_context(ctx, inputs, output):
    logp, entropy, mask, cu_seqlens, uniform_len = inputs[0], inputs[7], inputs[3], inputs[4], inputs[21]
    _, _, g_tok, g_ent, seq_coef, scale = output
    # only the loss is differentiable; without this autograd would hand the backward zero-filled
    # gradients for the other outputs (g_tok alone is [N] fp32: a 4 MB fill per step at 1M tokens)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(g_tok, g_ent, seq_coef, mask, cu_seqlens, scale)
    ctx.uniform_len = uniform_len
    ctx.logp_dtype = logp.dtype
    ctx.ent_dtype = None if entropy is None else entropy.dtype


def _backward_with(backward_fn):
    def _backward(ctx, grad_loss, *_unused):
        g_tok, g_ent, seq_coef, mask, cu_seqlens, scale = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = torch.zeros_like(scale)
        grad_logp, grad_ent = backward_fn(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, ctx.uniform_len)
        grad_ent = None if ctx.ent_dtype is None else grad_ent.to(ctx.ent_dtype)
        return (grad_logp.to(ctx.logp_dtype), None, None, None, None, None, None, grad_ent) + (None,) * 16

    return _backward


# the op's backward calls the backward op (so a compiled graph holds it); the eager Function calls its body
torch.library.register_autograd("flashrl::policy_loss", _backward_with(torch.ops.flashrl.policy_loss_backward),
                                setup_context=_setup_context)
_PolicyLossFunction = eager_function("PolicyLossFunction", _policy_loss_forward, _setup_context,
                                     _backward_with(_policy_loss_backward))


# ---- public wrapper ----

def _check_config(config):
    if config is None:
        return LossConfig()
    if not isinstance(config, LossConfig):
        raise TypeError(f"config must be a flashrl_kernels.LossConfig, got {type(config).__name__}")
    return config


def _same_shape(name, t, shape, like="logp"):
    if t is not None and tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name} must have the shape of {like} {tuple(shape)}, got {tuple(t.shape)}")


def _canonical(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, like="logp"):
    """Checks shapes and returns (flat tensors..., cu_seqlens int64, uniform_len).

    `like` names the tensor whose shape the others must have in error messages.
    """
    check_tensor(like, logp, dtypes=FLOAT_DTYPES)
    check_tensor("old_logp", old_logp, dtypes=FLOAT_DTYPES)
    check_tensor("advantages", advantages, dtypes=FLOAT_DTYPES)
    for name, t in (("rollout_logp", rollout_logp), ("ref_logp", ref_logp), ("entropy", entropy)):
        if t is not None:
            check_tensor(name, t, dtypes=FLOAT_DTYPES)
    if mask is not None:
        check_tensor("mask", mask)
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES)
    check_same_device(logp=logp, old_logp=old_logp, advantages=advantages, mask=mask, cu_seqlens=cu_seqlens,
                      rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=entropy)
    shape = tuple(logp.shape)
    for name, t in (("old_logp", old_logp), ("rollout_logp", rollout_logp), ("ref_logp", ref_logp),
                    ("entropy", entropy), ("mask", mask)):
        _same_shape(name, t, shape, like)
    cu, uniform_len = sequence_layout(like, logp, cu_seqlens)
    adv_shape = tuple(advantages.shape)
    if cu_seqlens is None:
        b, t = shape
        if adv_shape in ((b,), (b, 1)):
            adv = advantages.reshape(b)
        elif adv_shape == (b, t):
            adv = advantages.reshape(-1)
        else:
            raise ValueError(f"advantages must have shape [B] = ({b},), [B, 1] or [B, T] = {shape}, got {adv_shape}")
    else:
        nseq = cu.numel() - 1
        # [total_tokens] (logp's shape) is per token, [S, 1] per sequence, [S] per sequence unless S equals
        # total_tokens (then it has logp's shape and is read per token: pass [S, 1])
        if adv_shape == (nseq, 1):
            adv = advantages.reshape(nseq)
            if nseq == shape[0]:  # the backends read a [total_tokens] vector per token: expand it
                adv = adv.repeat_interleave(cu.diff(), output_size=nseq)
        elif advantages.dim() == 1 and advantages.numel() in (nseq, shape[0]):
            adv = advantages
        else:
            raise ValueError(
                f"advantages must have shape [num_seqs] = ({nseq},), [num_seqs, 1] or [total_tokens] = ({shape[0]},) "
                f"for packed inputs, got {adv_shape}"
            )
    if mask is not None and mask.dtype != torch.bool:
        mask = mask != 0

    def flat(x):
        return None if x is None else x.reshape(-1).contiguous()

    return (flat(logp), flat(old_logp), adv.contiguous(), flat(mask), cu, flat(rollout_logp),
            flat(ref_logp), flat(entropy), uniform_len)


def _positive_flags(positive, nseq, device):
    """The per-sequence `positive` flags as fp32 0/1 [S] (None stays None)."""
    if positive is None:
        return None
    check_tensor("positive", positive, dtypes=None)
    if positive.device != device:
        raise ValueError(f"positive is on {positive.device} but logp is on {device}")
    if positive.numel() != nseq or positive.dim() > 2 or (positive.dim() == 2 and positive.shape[1] != 1):
        raise ValueError(f"positive must hold one flag per sequence, shape [{nseq}] (or [{nseq}, 1]), "
                         f"got {tuple(positive.shape)}")
    return positive.reshape(nseq).ne(0).to(torch.float32)


def _loss_inputs(cfg, roll, ref, positive, nseq, normalizer, cu_seqlens, padded_shape, device, name):
    """Checks that every term of cfg has its input; returns (positive flags [S] or None, normalizer tensor or
    None, divisor) with the divisor policy_loss's finalize uses (0.0: the mode's default)."""
    if cfg.tis_mode != "none" and roll is None:
        raise ValueError(f"tis_mode={cfg.tis_mode!r} needs rollout_logp (the rollout engine's log-probabilities)")
    if cfg.beta != 0.0 and ref is None:
        raise ValueError(f"beta={cfg.beta} needs ref_logp (the reference policy's log-probabilities)")
    pos = _positive_flags(positive, nseq, device)
    if cfg.nll_coef != 0.0 and pos is None:
        raise ValueError(f"nll_coef={cfg.nll_coef} needs positive (one flag per sequence: rewarded positively or not)")
    norm_t, divisor = parse_normalizer(normalizer, device, name)
    if normalizer is None and cfg.normalizer is not None:
        divisor = float(cfg.normalizer)
    if cfg.loss_agg_mode == "seq-mean-token-sum-norm" and norm_t is None and divisor == 0.0:
        if cu_seqlens is not None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' divides by a constant; with packed inputs pass it as "
                "normalizer (e.g. the maximum response length, times the number of sequences for TRL dr_grpo)"
            )
        divisor = float(padded_shape[1])  # the padded length, as verl does
    return pos, norm_t, divisor


def config_scalars(cfg):
    """The op schema's config scalars, in order: eps_low ... entropy_coef (nll_coef travels apart)."""
    return (float(cfg.eps_low), float(cfg.eps_high), float(cfg.dual_clip or 0.0), cfg.importance_sampling_level,
            cfg.tis_mode, float(cfg.tis_min), float(cfg.tis_max), cfg.tis_sequence_reduce, cfg.loss_agg_mode,
            float(cfg.beta), float(cfg.entropy_coef))


def _check_finite(loss, inputs, mask):
    """After the op: one host sync; a non-finite loss is traced back to the input that caused it."""
    if math.isfinite(float(loss.detach())):  # (one host read; cheaper than an isfinite op on a CPU)
        return
    for name, t in inputs:
        if t is None:
            continue
        bad = ~torch.isfinite(t)
        if mask is not None and bad.shape == mask.shape:
            bad = bad & mask
        i = first_true(bad)
        if i is not None:
            raise ValueError(f"{name} holds a non-finite value at a valid position (flat index {i}): {float(t.reshape(-1)[i])}")


def policy_loss(
    logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    *,
    mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    entropy: Tensor | None = None,
    config: LossConfig | None = None,
    normalizer=None,
    positive: Tensor | None = None,
) -> LossOutput:
    """Clipped policy loss (PPO/GRPO/DAPO/GSPO) with TIS, KL and entropy terms; see docs/policy_loss.md.

    Inputs are padded [B, T] (with an optional mask, True/nonzero = token counts) or packed
    [total_tokens] with cu_seqlens [S + 1] (int32/int64, starting at 0, non-decreasing; a mask
    [total_tokens] may be given too). advantages: per sequence ([B], [B, 1] / [S], [S, 1]) or per token (logp's shape).
    normalizer (float or 0-d tensor) overrides config.normalizer and the mode's divisor for this call.
    positive: one flag per sequence ([B] / [B, 1] padded, [S] packed; bool or numbers, nonzero = the
    response was rewarded positively) for VAPO's NLL term, config.nll_coef; it also fills the
    nll_mean / num_positive_tokens metrics.
    Returns LossOutput(loss, metrics): loss is a 0-d fp32 tensor, differentiable w.r.t. logp and
    entropy; metrics maps METRIC_NAMES to detached 0-d fp32 tensors (no host sync).
    """
    cfg = _check_config(config)
    (lp, old, adv, m, cu, roll, ref, ent, uniform_len) = _canonical(
        logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy
    )
    if cfg.entropy_coef != 0.0 and ent is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} needs entropy")
    pos, norm_t, divisor = _loss_inputs(cfg, roll, ref, positive, cu.numel() - 1, normalizer, cu_seqlens,
                                        logp.shape, lp.device, "logp")
    checks = value_checks_enabled()
    if checks and cu_seqlens is not None:
        check_cu_seqlens(cu, lp.numel())
    args = (lp, old, adv, m, cu, roll, ref, ent, norm_t, *config_scalars(cfg), divisor, int(uniform_len), pos,
            float(cfg.nll_coef))
    if needs_op(lp, old, adv, m, cu, roll, ref, ent, norm_t, pos):
        loss, mvec, _, _, _, _ = torch.ops.flashrl.policy_loss(*args)
    else:
        loss, mvec, _, _, _, _ = _PolicyLossFunction.apply(*args)
    if checks:
        _check_finite(loss, (("logp", lp), ("old_logp", old), ("advantages", adv), ("rollout_logp", roll),
                             ("ref_logp", ref), ("entropy", ent)), m)
    return LossOutput(loss, dict(zip(METRIC_NAMES, mvec.detach().unbind(0))))
