"""float64 reference of PPO's clipped value loss: readable, slow, differentiable. The spec.

`value_loss_spec` takes the public inputs (padded [B, T] + mask, or packed [total] +
cu_seqlens, optionally with a mask too), walks the sequences one by one in Python and
builds the loss from float64 torch ops, so autograd gives the reference gradient w.r.t.
values. Nothing here is shared with the fast backends.

Semantics fixed here (and documented in docs/value_loss.md):
- v_c = clamp(v, old - c, old + c) (= old + clamp(v - old, -c, c), written as verl and TRL write it: a v
  inside the range is returned exactly, so rounding never makes an unclipped token look clipped);
  l = max((v - R)^2, (v_c - R)^2) with clip_range c, else (v - R)^2. Where both terms are equal the
  unclipped one is taken (its gradient, v - R, is used; the clipped term has none where it is larger).
  A NaN in the clipped term is kept (so a non-finite old value at a valid position shows in the loss).
- loss = 0.5 * aggregate(l) / D with policy_loss's modes and divisors.
- explained_variance = 1 - Var(R - v) / Var(R) with population variances over the valid
  tokens; 0 when Var(R) = 0 (no valid token, one valid token, or constant returns).

`value_loss_forward` / `value_loss_backward` adapt the spec to the backend interface (flat
token tensors + cu_seqlens, see ops/value_loss.py): the whole gradient comes from autograd
and is returned in `g_tok`, with scale = 1.
"""
from __future__ import annotations

import torch

from ..loss_config import LOSS_AGG_MODES
from ..ops.value_loss import VALUE_METRIC_NAMES
from .policy_loss import _autograd_enabled, _split, spec_normalizer


def value_loss_spec(values, old_values, returns, *, mask=None, cu_seqlens=None, clip_range=None,
                    loss_agg_mode="token-mean", normalizer=None):
    """Returns (loss, metrics) in float64; the loss is differentiable w.r.t. values."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}")
    nseq = values.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1
    vs = _split(values, mask, cu_seqlens, nseq)
    olds = _split(old_values, mask, cu_seqlens, nseq)
    rets = _split(returns, mask, cu_seqlens, nseq)

    seq_sums = []
    n_clip = 0.0
    for i in range(nseq):
        v, o, r = vs[i], olds[i], rets[i]
        unclipped = (v - r) ** 2
        if clip_range is not None:
            v_clipped = torch.clamp(v, o - clip_range, o + clip_range)
            clipped = (v_clipped - r) ** 2
            use_clipped = ~(clipped <= unclipped)  # strictly larger, or NaN
            per_token = torch.where(use_clipped, clipped, unclipped)
            n_clip += float((clipped > unclipped).sum())
        else:
            per_token = unclipped
        total = per_token.sum()
        if loss_agg_mode == "seq-mean-token-mean":
            total = total / max(v.numel(), 1)
        seq_sums.append(total)

    ntok = sum(v.numel() for v in vs)
    nonempty = sum(1 for v in vs if v.numel() > 0)
    if normalizer is not None:
        divisor = normalizer
    elif loss_agg_mode == "token-mean":
        divisor = max(ntok, 1)
    elif loss_agg_mode == "token-sum":
        divisor = 1.0
    elif loss_agg_mode == "seq-mean-token-sum-norm":
        if cu_seqlens is not None:
            raise ValueError("loss_agg_mode='seq-mean-token-sum-norm' with packed inputs needs a normalizer")
        divisor = values.shape[1]
    else:
        divisor = max(nonempty, 1)
    loss = 0.5 * sum(seq_sums, torch.zeros((), dtype=torch.float64)) / divisor

    with torch.no_grad():
        v_all = torch.cat([x.detach() for x in vs]) if nseq else torch.zeros(0, dtype=torch.float64)
        r_all = torch.cat(rets) if nseq else torch.zeros(0, dtype=torch.float64)
        err = r_all - v_all

        def mean(x):
            return float(x.sum()) / x.numel() if x.numel() else 0.0

        def var(x):  # population variance
            return mean((x - mean(x)) ** 2) if x.numel() else 0.0

        var_r = var(r_all)
        ev = 1.0 - var(err) / var_r if var_r > 0 else 0.0
        metrics = {
            "vf_clip_frac": n_clip / ntok if ntok else 0.0,
            "explained_variance": ev,
            "value_mean": mean(v_all),
            "return_mean": mean(r_all),
            "value_error_mean": mean(err ** 2),
            "num_tokens": float(ntok),
        }
    return loss, {k: torch.tensor(v, dtype=torch.float64) for k, v in metrics.items()}


# ---- backend interface (flat tokens + cu_seqlens; see ops/value_loss.py) ----

def value_loss_forward(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, agg, divisor,
                       uniform_len, need_grad):
    norm = spec_normalizer(normalizer, divisor, agg)
    v = values.detach().double().requires_grad_(True)
    # A custom op runs below the autograd dispatch keys; re-enable them to differentiate the spec here.
    with _autograd_enabled(), torch.enable_grad():
        loss, metrics = value_loss_spec(
            v, old_values, returns, mask=mask, cu_seqlens=cu_seqlens,
            clip_range=clip_range if clip_range > 0 else None, loss_agg_mode=agg, normalizer=norm,
        )
        (g,) = torch.autograd.grad(loss, [v], allow_unused=True) if loss.requires_grad else (None,)
    g_tok = torch.zeros_like(v) if g is None else g
    if not need_grad:
        g_tok = g_tok.new_zeros(0)
    mvec = torch.stack([metrics[k] for k in VALUE_METRIC_NAMES]).float().to(values.device)
    one = torch.ones((), dtype=torch.float32, device=values.device)
    return loss.detach().float().to(values.device), mvec, g_tok.float(), one


def value_loss_backward(grad_loss, g_tok, scale, dtype):
    return (g_tok.double() * (grad_loss.double() * scale.double())).to(dtype)


__all__ = ["value_loss_backward", "value_loss_forward", "value_loss_spec"]
