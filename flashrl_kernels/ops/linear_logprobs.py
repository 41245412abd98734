"""torch.library ops for fused linear log-probabilities, and the public function.

flashrl::linear_token_logprobs           (hidden [N,H], weight [V,H], bias?, targets [N], T, ignore_index,
                                          return_entropy, fp32_accumulate) -> (logp, entropy, lse)  one process
flashrl::linear_logprobs_stats           (hidden, weight_slice, bias_slice?, target_local, T, return_entropy)
                                          -> (m, s, w, zt)          per-rank statistics (vocab-parallel form)
flashrl::linear_token_logprobs_backward  (grad_logp, grad_ent?, hidden, weight, bias?, target_local, lse,
                                          entropy, T, need_hidden, need_weight, need_bias, fp32_accumulate)
                                          -> (grad_hidden, grad_weight, grad_bias)
All three dispatch at run time to the selected backend (see _backend.py).

Vocab-parallel (process_group given): the collectives run in Python, in a
torch.autograd.Function around the per-rank ops, not inside a custom op: a
custom op is opaque to torch.compile anyway, and keeping the all-reduces
outside keeps every op a pure per-device function that opcheck, the fake
kernels and every backend can test without a process group. The vocab-
parallel path is therefore eager-only (torch.compile graph-breaks on it);
the single-process op is fully compile-compatible.
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
    value_checks_enabled,
)


def _finalize(m, s, w, zt, targets, vocab, ignore_index, return_entropy):
    """(logp, entropy, lse) from merged per-row statistics."""
    log_s = torch.log(s)
    lse = m + log_s
    valid = (targets >= 0) & (targets < vocab)
    logp = torch.where(valid, zt - lse, torch.full_like(lse, float("nan")))
    zero = torch.zeros_like(lse)
    ignored = targets == ignore_index if ignore_index is not None else None
    if ignored is not None:
        logp = torch.where(ignored, zero, logp)
    if return_entropy:
        ent = log_s - w / s
        if ignored is not None:
            ent = torch.where(ignored, zero, ent)
    else:
        ent = lse.new_empty(0)
    return logp, ent, lse


def _masked_grads(grad_logp, grad_ent, targets, vocab, ignore_index, lse):
    keep = (targets >= 0) & (targets < vocab)
    if ignore_index is not None:
        keep = keep & (targets != ignore_index)
    zero = torch.zeros_like(lse)
    g_lp = torch.where(keep, grad_logp, zero) if grad_logp is not None else zero
    g_h = torch.where(keep, grad_ent, zero) if grad_ent is not None else None
    return g_lp, g_h


# ---- per-rank statistics ----

@torch.library.custom_op("flashrl::linear_logprobs_stats", mutates_args=())
def _stats_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, target_local: Tensor, temperature: float,
    return_entropy: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fn = implementation("linear_logprobs_stats", hidden.device)
    m, s, w, zt = fn(hidden, weight, bias, target_local, temperature, return_entropy)
    return m, s, w, zt


@_stats_op.register_fake
def _(hidden, weight, bias, target_local, temperature, return_entropy):
    n = hidden.shape[0]
    return tuple(hidden.new_empty(n, dtype=torch.float32) for _ in range(4))


# ---- single-process forward ----

@torch.library.custom_op("flashrl::linear_token_logprobs", mutates_args=())
def _linear_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
    ignore_index: int | None, return_entropy: bool, fp32_accumulate: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    # fp32_accumulate is not used here: it travels in the schema to the backward (setup_context)
    fn = implementation("linear_logprobs_stats", hidden.device)
    m, s, w, zt = fn(hidden, weight, bias, targets, temperature, return_entropy)
    return _finalize(m, s, w, zt, targets, weight.shape[0], ignore_index, return_entropy)


@_linear_op.register_fake
def _(hidden, weight, bias, targets, temperature, ignore_index, return_entropy, fp32_accumulate):
    n = hidden.shape[0]
    out = hidden.new_empty(n, dtype=torch.float32)
    ent = torch.empty_like(out) if return_entropy else hidden.new_empty(0, dtype=torch.float32)
    return out, ent, torch.empty_like(out)


# ---- backward (shared by both forms) ----

@torch.library.custom_op("flashrl::linear_token_logprobs_backward", mutates_args=())
def _linear_backward_op(
    grad_logp: Tensor, grad_entropy: Tensor | None, hidden: Tensor, weight: Tensor, bias: Tensor | None,
    target_local: Tensor, lse: Tensor, entropy: Tensor, temperature: float, need_hidden: bool,
    need_weight: bool, need_bias: bool, fp32_accumulate: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    fn = implementation("linear_logprobs_backward", hidden.device)
    gh, gw, gb = fn(
        grad_logp, grad_entropy, hidden, weight, bias, target_local, lse, entropy, temperature,
        need_hidden, need_weight, need_bias and bias is not None, fp32_accumulate,
    )
    return gh, gw, gb


@_linear_backward_op.register_fake
def _(grad_logp, grad_entropy, hidden, weight, bias, target_local, lse, entropy, temperature, need_hidden,
      need_weight, need_bias, fp32_accumulate):
    gh = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
    gw = torch.empty_like(weight) if need_weight else hidden.new_empty(0)
    gb = torch.empty_like(bias) if (need_bias and bias is not None) else hidden.new_empty(0)
    return gh, gw, gb


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, targets, temperature, ignore_index, return_entropy, fp32_accumulate = inputs
    _, ent, lse = output
    ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
    ctx.temperature = temperature
    ctx.ignore_index = ignore_index
    ctx.return_entropy = return_entropy
    ctx.fp32_accumulate = fp32_accumulate


def _backward(ctx, grad_logp, grad_entropy, _grad_lse):
    hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
    g_lp, g_h = _masked_grads(
        grad_logp, grad_entropy if ctx.return_entropy else None, targets, weight.shape[0], ctx.ignore_index, lse
    )
    need = ctx.needs_input_grad
    gh, gw, gb = torch.ops.flashrl.linear_token_logprobs_backward(
        g_lp, g_h, hidden, weight, bias, targets, lse, ent, ctx.temperature, need[0], need[1],
        bool(need[2]) and bias is not None, ctx.fp32_accumulate,
    )
    return (
        gh if need[0] else None, gw if need[1] else None, gb if (need[2] and bias is not None) else None,
        None, None, None, None, None,
    )


torch.library.register_autograd("flashrl::linear_token_logprobs", _backward, setup_context=_setup_context)


# ---- vocab-parallel form ----

def _vocab_slice(weight, group):
    import torch.distributed as dist

    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    sizes = torch.zeros(world, dtype=torch.int64)
    sizes[rank] = weight.shape[0]
    if weight.device.type != "cpu":
        sizes = sizes.to(weight.device)
    dist.all_reduce(sizes, group=group)
    sizes = sizes.tolist()
    return sum(sizes[:rank]), sum(sizes)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, ignore_index, return_entropy, group,
                vocab_start, vocab_total, fp32_accumulate):
        from ..torch_impl.linear_logprobs import merge_over_group

        target_local = targets - vocab_start
        m, s, w, zt = torch.ops.flashrl.linear_logprobs_stats(
            hidden, weight, bias, target_local, temperature, return_entropy
        )
        logp, ent, lse = _finalize(*merge_over_group(m, s, w, zt, group), targets, vocab_total, ignore_index,
                                   return_entropy)
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.args = (temperature, ignore_index, return_entropy, group, vocab_start, vocab_total, fp32_accumulate)
        ctx.mark_non_differentiable(lse)
        return logp, ent, lse

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_lse):
        import torch.distributed as dist

        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, ignore_index, return_entropy, group, vocab_start, vocab_total, fp32_accumulate = ctx.args
        g_lp, g_h = _masked_grads(
            grad_logp, grad_entropy if return_entropy else None, targets, vocab_total, ignore_index, lse
        )
        need = ctx.needs_input_grad
        gh, gw, gb = torch.ops.flashrl.linear_token_logprobs_backward(
            g_lp, g_h, hidden, weight, bias, targets - vocab_start, lse, ent, temperature, need[0], need[1],
            bool(need[2]) and bias is not None, fp32_accumulate,
        )
        if need[0]:
            # every rank holds the same hidden; its gradient is the sum of the ranks' vocab slices
            gh32 = gh.float()
            dist.all_reduce(gh32, group=group)
            gh = gh32.to(hidden.dtype)
        return (
            gh if need[0] else None, gw if need[1] else None, gb if (need[2] and bias is not None) else None,
            None, None, None, None, None, None, None, None,
        )


# ---- checks and the public function ----

def _check_inputs(hidden, weight, targets, bias, temperature, ignore_index, process_group):
    check_tensor("hidden", hidden, dtypes=FLOAT_DTYPES, ndim_min=1)
    check_tensor("weight", weight, dtypes=FLOAT_DTYPES)
    check_tensor("targets", targets, dtypes=INDEX_DTYPES)
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
    check_same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D [V, H] (vocabulary rows), got shape {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(
            f"weight dtype {str(weight.dtype).replace('torch.', '')} must equal hidden dtype "
            f"{str(hidden.dtype).replace('torch.', '')}"
        )
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden size mismatch: hidden has H = {hidden.shape[-1]} (last dim of {tuple(hidden.shape)}) but "
            f"weight [V, H] has H = {weight.shape[1]}"
        )
    if bias is not None:
        if tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"bias must have shape [V] = ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != weight.dtype:
            raise TypeError(
                f"bias dtype {str(bias.dtype).replace('torch.', '')} must equal weight dtype "
                f"{str(weight.dtype).replace('torch.', '')}"
            )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have shape hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}"
        )
    if weight.shape[0] == 0 and process_group is None:
        raise ValueError("weight has no vocabulary rows (V = 0)")
    if hidden.shape[-1] == 0:
        raise ValueError("hidden has an empty hidden dimension (H = 0)")
    if targets.numel() == 0:
        raise ValueError(f"empty batch: hidden of shape {tuple(hidden.shape)} has no rows")
    return check_temperature(temperature), check_ignore_index(ignore_index)


def _check_values(targets, lse, vocab, ignore_index):
    check_logprob_values(
        targets, lse, vocab, ignore_index,
        "row {i} (flat) has no defined log-softmax: hidden, weight or bias hold NaN/inf there, or every logit is -inf",
    )


def linear_token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    return_entropy: bool = False,
    ignore_index: int | None = None,
    process_group=None,
    fp32_grad_accumulation: bool = True,
):
    """Log-probabilities (and entropy) of `targets` under softmax((hidden @ weight.T + bias) / temperature),
    without ever holding the [N, V] logits.

    hidden [..., H] and weight [V, H] (same dtype: bf16/fp16/fp32), bias [V] or None, targets [...]
    int64/int32. Returns fp32 logprobs [...] or (logprobs, entropy), equal to
    `token_logprobs(hidden @ weight.T + bias, targets, ...)`. Positions where targets == ignore_index give 0
    and no gradient. Differentiable w.r.t. hidden, weight and bias.

    process_group: vocab-parallel form. Each rank passes its contiguous slice of the vocabulary rows of
    weight (and of bias), ranks in order; targets are global ids and hidden is the same on every rank. The
    result equals the single-process one on every rank; grad_hidden is summed over the group here (do not
    all-reduce it again); grad_weight / grad_bias are the rank's slices.

    fp32_grad_accumulation: the backward keeps the one gradient whose sum spans chunks (grad_hidden when
    N <= V, else grad_weight) in an fp32 buffer, min(N, V) * H * 4 bytes. False accumulates it in the
    parameter dtype instead (saves that buffer, rounds once per chunk).
    """
    temperature, ignore_index = _check_inputs(hidden, weight, targets, bias, temperature, ignore_index, process_group)
    out_shape = targets.shape
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).contiguous()
    if process_group is None:
        vocab_total = weight.shape[0]
        logp, ent, lse = torch.ops.flashrl.linear_token_logprobs(
            h2, weight, bias, t1, temperature, ignore_index, bool(return_entropy), bool(fp32_grad_accumulation)
        )
    else:
        vocab_start, vocab_total = _vocab_slice(weight, process_group)
        if vocab_total == 0:
            raise ValueError("weight has no vocabulary rows on any rank (V = 0)")
        logp, ent, lse = _VocabParallel.apply(
            h2, weight, bias, t1, temperature, ignore_index, bool(return_entropy), process_group,
            vocab_start, vocab_total, bool(fp32_grad_accumulation),
        )
    if value_checks_enabled():
        _check_values(t1, lse, vocab_total, ignore_index)
    logp = logp.view(out_shape)
    return (logp, ent.view(out_shape)) if return_entropy else logp
