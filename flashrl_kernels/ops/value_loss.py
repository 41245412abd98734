"""torch.library ops for PPO's clipped value loss, and the public function `value_loss`.

flashrl::value_loss          (values, old_values, returns, mask?, cu_seqlens, normalizer?, clip_range,
                              loss_agg_mode, divisor, uniform_len, need_grad) -> (loss, metrics, g_tok, scale)
flashrl::value_loss_backward (grad_loss, g_tok, scale, dtype) -> grad_values

Both work on the canonical form of ops/policy_loss.py: flat token tensors [N], an optional
bool mask [N] and int64 cu_seqlens [S+1]. Padded [B, T] inputs become N = B*T with
cu_seqlens = T * arange(B + 1) and uniform_len = T; packed inputs keep their cu_seqlens
and uniform_len = 0. clip_range = 0.0 in the op means "no clipping".

Per valid token (v = values, o = old_values, R = returns, c = clip_range):
    v_c = clamp(v, o - c, o + c)        (= o + clamp(v - o, -c, c); this form returns an unclipped v exactly)
    l   = max((v - R)^2, (v_c - R)^2)   (with clipping, ties take the unclipped term; else (v - R)^2)
    loss = 0.5 * aggregate(l) / D       (the loss_agg_mode and divisor D of policy_loss)
The forward also returns what the backward needs: g_tok [N] fp32, d(0.5 * aggregate(l))/dv
per token before the final 1/D (v - R where the unclipped term is taken, 0 where the
clipped term is strictly larger, times 1/n_i for seq-mean-token-mean, 0 at masked positions),
and scale = 1/D. The backward is one elementwise pass: grad = g_tok * grad_loss * scale,
written in the values' dtype. need_grad=False (values needs no gradient, or grad mode is off):
g_tok is empty and never written, which saves its 4 bytes/token.

`value_loss` runs the op's own functions through an autograd.Function outside torch.compile and dispatch modes
(ops/_eager.py: the custom-op call alone cost more than the kernel at trainer sizes).
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
    parse_normalizer,
    sequence_layout,
    value_checks_enabled,
)
from ..loss_config import LOSS_AGG_MODES, LossOutput, _choice
from ._eager import eager_function, needs_op
from .policy_loss import _check_finite

# Names (and order) of the metrics every backend returns. Stable: renaming one is an API change.
VALUE_METRIC_NAMES = (
    "vf_clip_frac",        # share of valid tokens where the clipped term is strictly larger (0 without clip_range)
    "explained_variance",  # 1 - Var(R - v) / Var(R) over valid tokens (population variances); 0 when Var(R) = 0
    "value_mean",          # mean of values over valid tokens
    "return_mean",         # mean of returns over valid tokens
    "value_error_mean",    # mean of (v - R)^2 over valid tokens (the unclipped squared error)
    "num_tokens",          # number of valid tokens
)

# old_values / returns: any float dtype (GAE returns are often fp32 or fp64); values: the trainable dtypes
ANY_FLOAT_DTYPES = FLOAT_DTYPES + (torch.float64,)


def _value_loss_forward(
    values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor | None, cu_seqlens: Tensor,
    normalizer: Tensor | None, clip_range: float, loss_agg_mode: str, divisor: float, uniform_len: int,
    need_grad: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fwd = implementation("value_loss_forward", values.device)
    return fwd(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, loss_agg_mode, divisor,
               uniform_len, need_grad)


_value_loss_op = torch.library.custom_op("flashrl::value_loss", _value_loss_forward, mutates_args=())


@_value_loss_op.register_fake
def _(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, loss_agg_mode, divisor, uniform_len,
      need_grad):
    f32 = torch.float32
    return (
        values.new_empty((), dtype=f32),
        values.new_empty((len(VALUE_METRIC_NAMES),), dtype=f32),
        values.new_empty((values.shape[0] if need_grad else 0,), dtype=f32),
        values.new_empty((), dtype=f32),
    )


def _value_loss_backward(grad_loss: Tensor, g_tok: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    bwd = implementation("value_loss_backward", g_tok.device)
    return bwd(grad_loss, g_tok, scale, dtype)


_value_loss_backward_op = torch.library.custom_op("flashrl::value_loss_backward", _value_loss_backward,
                                                  mutates_args=())


@_value_loss_backward_op.register_fake
def _(grad_loss, g_tok, scale, dtype):
    return torch.empty_like(g_tok, dtype=dtype)


def _setup_context(ctx, inputs, output):
    values = inputs[0]
    _, _, g_tok, scale = output
    ctx.set_materialize_grads(False)  # only the loss is differentiable: no zero-filled grads for g_tok
    ctx.save_for_backward(g_tok, scale)
    ctx.values_dtype = values.dtype


def _backward_with(backward_fn):
    def _backward(ctx, grad_loss, *_unused):
        g_tok, scale = ctx.saved_tensors
        if grad_loss is None:
            grad_loss = torch.zeros_like(scale)
        return (backward_fn(grad_loss, g_tok, scale, ctx.values_dtype),) + (None,) * 10

    return _backward


# the op's backward calls the backward op (so a compiled graph holds it); the eager Function calls its body
torch.library.register_autograd("flashrl::value_loss", _backward_with(torch.ops.flashrl.value_loss_backward),
                                setup_context=_setup_context)
_ValueLossFunction = eager_function("ValueLossFunction", _value_loss_forward, _setup_context,
                                    _backward_with(_value_loss_backward))


# ---- public wrapper ----

def _canonical(values, old_values, returns, mask, cu_seqlens):
    """Checks names, dtypes, devices and shapes; returns (flat values, old, returns, mask, cu int64, uniform_len)."""
    check_tensor("values", values, dtypes=FLOAT_DTYPES)
    check_tensor("old_values", old_values, dtypes=ANY_FLOAT_DTYPES)
    check_tensor("returns", returns, dtypes=ANY_FLOAT_DTYPES)
    if mask is not None:
        check_tensor("mask", mask)
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES)
    check_same_device(values=values, old_values=old_values, returns=returns, mask=mask, cu_seqlens=cu_seqlens)
    shape = tuple(values.shape)
    for name, t in (("old_values", old_values), ("returns", returns), ("mask", mask)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have the shape of values {shape}, got {tuple(t.shape)}")
    cu, uniform_len = sequence_layout("values", values, cu_seqlens)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask != 0

    def flat(x):
        return None if x is None else x.reshape(-1).contiguous()

    return flat(values), flat(old_values), flat(returns), flat(mask), cu, uniform_len


def _check_clip_range(clip_range) -> float:
    if clip_range is None:
        return 0.0
    if isinstance(clip_range, bool) or not isinstance(clip_range, (int, float)):
        raise TypeError(f"clip_range must be a Python float or None, got {type(clip_range).__name__}")
    c = float(clip_range)
    if not math.isfinite(c) or not c > 0.0:
        raise ValueError(f"clip_range must be a finite number > 0 (or None for no clipping), got {clip_range}")
    return c


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    clip_range: float | None = None,
    loss_agg_mode: str = "token-mean",
    normalizer=None,
) -> LossOutput:
    """PPO's clipped value loss (verl `compute_value_loss`, TRL PPO); see docs/value_loss.md.

    values: the critic's predictions (fp32 / bf16 / fp16, differentiable); old_values: the
    critic's predictions at rollout time; returns: the targets (any float dtype, no gradient).
    Inputs are padded [B, T] (with an optional mask, True/nonzero = token counts) or packed
    [total_tokens] with cu_seqlens [S + 1] (int32/int64, starting at 0, non-decreasing; a mask
    [total_tokens] may be given too). clip_range: c > 0 clips v to old_values +- c in the second
    term (None: plain squared error, old_values is not read). loss_agg_mode / normalizer: as in
    `policy_loss` (seq-mean-token-sum-norm divides by the padded T; packed inputs need a normalizer).
    The loss is 0.5 * aggregate(per-token loss); vf_coef is the caller's.
    Returns LossOutput(loss, metrics): loss is a 0-d fp32 tensor, differentiable w.r.t. values
    (gradient in values' dtype); metrics maps VALUE_METRIC_NAMES to detached 0-d fp32 tensors (no host sync).
    """
    clip = _check_clip_range(clip_range)
    _choice("loss_agg_mode", loss_agg_mode, LOSS_AGG_MODES)
    v, old, ret, m, cu, uniform_len = _canonical(values, old_values, returns, mask, cu_seqlens)
    norm_t, divisor = parse_normalizer(normalizer, v.device, "values")
    if loss_agg_mode == "seq-mean-token-sum-norm" and norm_t is None and divisor == 0.0:
        if cu_seqlens is not None:
            raise ValueError(
                "loss_agg_mode='seq-mean-token-sum-norm' divides by a constant; with packed inputs pass it as "
                "normalizer (e.g. the maximum response length, times the number of sequences for verl >= 0.5)"
            )
        divisor = float(values.shape[1])  # the padded length, as policy_loss (and verl's loss_scale_factor default)
    checks = value_checks_enabled()
    if checks and cu_seqlens is not None:
        check_cu_seqlens(cu, v.numel())
    need_grad = torch.is_grad_enabled() and values.requires_grad
    args = (v, old, ret, m, cu, norm_t, clip, loss_agg_mode, divisor, int(uniform_len), need_grad)
    if needs_op(v, old, ret, m, cu, norm_t):
        loss, mvec, _, _ = torch.ops.flashrl.value_loss(*args)
    else:
        loss, mvec, _, _ = _ValueLossFunction.apply(*args)
    if checks:
        named = [("values", v), ("returns", ret)] + ([("old_values", old)] if clip > 0.0 else [])
        _check_finite(loss, named, m)
    return LossOutput(loss, dict(zip(VALUE_METRIC_NAMES, mvec.detach().unbind(0))))
