"""torch.library ops for token log-probabilities and entropy, and the public function.

flashrl::token_logprobs           (logits, targets, T, ignore_index, return_entropy) -> (logp, entropy, lse)
flashrl::token_logprobs_backward  (grad_logp, grad_entropy?, logits, targets, lse, entropy, T, ignore_index)
                                  -> grad_logits
Both dispatch at run time to the selected backend (see _backend.py). `lse`
is saved for the backward and not exposed.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._backend import implementation
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_ignore_index,
    check_logprob_values,
    check_same_device,
    check_temperature,
    check_tensor,
    rows_as_3d,
    value_checks_enabled,
)


@torch.library.custom_op("flashrl::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: Tensor, targets: Tensor, temperature: float, ignore_index: int | None, return_entropy: bool
) -> tuple[Tensor, Tensor, Tensor]:
    fwd = implementation("token_logprobs_forward", logits.device)
    logp, ent, lse = fwd(logits, targets, temperature, ignore_index, return_entropy)
    return logp.view(targets.shape), ent.view(targets.shape) if return_entropy else ent, lse.view(targets.shape)


@_token_logprobs_op.register_fake
def _(logits, targets, temperature, ignore_index, return_entropy):
    out = logits.new_empty(targets.shape, dtype=torch.float32)
    ent = torch.empty_like(out) if return_entropy else logits.new_empty(0, dtype=torch.float32)
    return out, ent, torch.empty_like(out)


@torch.library.custom_op("flashrl::token_logprobs_backward", mutates_args=())
def _token_logprobs_backward_op(
    grad_logprobs: Tensor,
    grad_entropy: Tensor | None,
    logits: Tensor,
    targets: Tensor,
    lse: Tensor,
    entropy: Tensor,
    temperature: float,
    ignore_index: int | None,
) -> Tensor:
    bwd = implementation("token_logprobs_backward", logits.device)
    grad = bwd(
        grad_logprobs.reshape(-1), None if grad_entropy is None else grad_entropy.reshape(-1), logits, targets,
        lse.reshape(-1), entropy.reshape(-1), temperature, ignore_index,
    )
    return grad.view(logits.shape)


@_token_logprobs_backward_op.register_fake
def _(grad_logprobs, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, targets, temperature, ignore_index, return_entropy = inputs
    _, ent, lse = output
    ctx.save_for_backward(logits, targets, lse, ent)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.return_entropy = return_entropy


def _backward(ctx, grad_logprobs, grad_entropy, _grad_lse):
    logits, targets, lse, ent = ctx.saved_tensors
    if grad_logprobs is None:
        grad_logprobs = torch.zeros_like(lse)
    if not ctx.return_entropy:
        grad_entropy = None
    grad = torch.ops.flashrl.token_logprobs_backward(
        grad_logprobs, grad_entropy, logits, targets, lse, ent, ctx.temperature, ctx.ignore_index
    )
    return grad, None, None, None, None


torch.library.register_autograd("flashrl::token_logprobs", _backward, setup_context=_setup_context)


def _check_inputs(logits, targets, temperature, ignore_index):
    check_tensor("logits", logits, dtypes=FLOAT_DTYPES, ndim_min=1)
    check_tensor("targets", targets, dtypes=INDEX_DTYPES)
    check_same_device(logits=logits, targets=targets)
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"targets must have shape logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if logits.shape[-1] == 0:
        raise ValueError("logits has an empty vocabulary dimension (V = 0)")
    if targets.numel() == 0:
        raise ValueError(f"empty batch: logits of shape {tuple(logits.shape)} has no rows")
    rows_as_3d(logits, "logits")  # raises on strides the kernels cannot index
    return check_temperature(temperature), check_ignore_index(ignore_index)


def _check_values(logits, targets, lse, ignore_index):
    check_logprob_values(
        targets, lse, logits.shape[-1], ignore_index,
        "logits row {i} (flat) has no defined log-softmax: it contains NaN or +inf, or every entry is -inf",
    )


def token_logprobs(
    logits: Tensor,
    targets: Tensor,
    *,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int | None = None,
):
    """Log-probabilities (and entropy) of `targets` under softmax(logits / temperature).

    logits [..., V] in bf16/fp16/fp32 (rows may be strided, the vocabulary dim
    must be contiguous), targets [...] int64/int32. Returns fp32 logprobs [...]
    or (logprobs, entropy). Positions where targets == ignore_index give 0 and
    no gradient. Differentiable w.r.t. logits through both outputs. The
    caller's logits are never written.
    """
    temperature, ignore_index = _check_inputs(logits, targets, temperature, ignore_index)
    targets = targets.contiguous()
    logp, ent, lse = torch.ops.flashrl.token_logprobs(logits, targets, temperature, ignore_index, bool(return_entropy))
    if value_checks_enabled():
        _check_values(logits, targets, lse, ignore_index)
    return (logp, ent) if return_entropy else logp
