"""Token log-probabilities and entropy on the native CPU kernels (csrc/cpu/token_logprobs.cpp).

Thin wrappers: the [B, T, V] row view (strided rows, unit vocabulary stride)
is built here, the kernels do the rest in one pass per row for the forward
and one for the backward, fp32 accumulation, gradient in the logits dtype.
"""
from __future__ import annotations

import torch

from .._checks import rows_as_3d


def token_logprobs_forward(logits, targets, temperature, ignore_index, return_entropy):
    x3 = rows_as_3d(logits, "logits")
    return torch.ops.flashrl_native.token_logprobs_forward(
        x3, targets.reshape(-1).contiguous(), float(temperature), ignore_index, bool(return_entropy)
    )


def token_logprobs_backward(grad_logprobs, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    x3 = rows_as_3d(logits, "logits")
    g_lp = grad_logprobs.reshape(-1).float().contiguous()
    g_h = grad_entropy.reshape(-1).float().contiguous() if grad_entropy is not None else None
    grad = torch.ops.flashrl_native.token_logprobs_backward(
        g_lp, g_h, x3, targets.reshape(-1).contiguous(), lse.reshape(-1).contiguous(),
        entropy.reshape(-1).contiguous(), float(temperature), ignore_index,
    )
    return grad.view(logits.shape)
