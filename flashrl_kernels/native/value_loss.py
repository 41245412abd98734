"""PPO's clipped value loss on the native CPU kernels (csrc/cpu/value_loss.cpp).

One parallel pass makes the per-token gradient coefficients and one float64 vector of
statistics; `finalize` (shared with the torch and Triton backends) turns it into the loss,
the metrics and the scale, so every backend reports them the same way.
"""
from __future__ import annotations

import torch

from ..torch_impl.value_loss import finalize


def value_loss_forward(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, agg, divisor,
                       uniform_len, need_grad=True):
    # only seq-mean-token-mean changes the token math (1/n_i per sequence); the other modes differ in the divisor
    stats, g_tok = torch.ops.flashrl_native.value_loss_forward(
        values, old_values if clip_range > 0 else None, returns, mask, cu_seqlens, float(clip_range),
        agg == "seq-mean-token-mean", bool(need_grad),
    )
    loss, metrics, scale = finalize(stats, normalizer, divisor, agg)
    return loss, metrics, g_tok, scale


def value_loss_backward(grad_loss, g_tok, scale, dtype):
    return torch.ops.flashrl_native.value_loss_backward(grad_loss, g_tok, scale, dtype)
