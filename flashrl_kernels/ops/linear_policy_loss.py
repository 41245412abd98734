"""torch.library op for the fused policy head, and the public function `linear_policy_loss`.

flashrl::linear_policy_loss (hidden [N,H], weight [V,H], bias?, targets [N], old_logp?, advantages, mask?,
                             cu_seqlens, rollout_logp?, ref_logp?, normalizer?, positive?, <config scalars>,
                             divisor, uniform_len, temperature, need_hidden, need_weight, need_bias,
                             fp32_accumulate)
                            -> (loss, metrics, grad_hidden, grad_weight, grad_bias, logp, entropy)

The loss of `policy_loss(linear_token_logprobs(hidden, weight, targets, ...), old_logp, advantages, ...)`
without the [N, V] logits and with 6NHV of matmul instead of 8NHV: the gradients are formed in the forward,
chunk by chunk, while each chunk's logits are in memory (torch_impl/linear_policy_loss.py), and the backward
multiplies them by the incoming grad_loss. Canonical inputs as for flashrl::policy_loss (flat [N] token
tensors, cu_seqlens [S+1], uniform_len for padded batches).

Vocab-parallel (process_group given): eager autograd.Function around the backend loop, which merges the
chunk statistics over the group; as for linear_token_logprobs, the collectives stay outside custom ops.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._backend import implementation
from .._checks import (
    check_cu_seqlens,
    first_true,
    value_checks_enabled,
)
from ..loss_config import METRIC_NAMES, LossConfig, LossOutput
from .linear_logprobs import _check_inputs, _vocab_slice
from .policy_loss import _canonical, _check_config, _check_finite, _loss_inputs, config_scalars

LINEAR_METRIC_NAMES = METRIC_NAMES + ("logp_mean",)


def _scalars(eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta, entropy_coef):
    return (eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta, entropy_coef)


def _run(hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, normalizer,
         positive, scalars, nll_coef, divisor, uniform_len, temperature, need_hidden, need_weight, need_bias,
         fp32_accumulate, **group_args):
    fwd = implementation("linear_policy_loss_forward", hidden.device)
    loss, metrics, logp_mean, gh, gw, gb, logp, ent = fwd(
        hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, normalizer,
        positive, scalars, nll_coef, divisor, uniform_len, temperature, need_hidden, need_weight, need_bias,
        fp32_accumulate, **group_args,
    )
    metrics = torch.cat([metrics.float().reshape(-1), logp_mean.float().reshape(1)])
    return loss, metrics, gh, gw, gb, logp, ent


@torch.library.custom_op("flashrl::linear_policy_loss", mutates_args=())
def _linear_policy_loss_op(
    hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, old_logp: Tensor | None,
    advantages: Tensor, mask: Tensor | None, cu_seqlens: Tensor, rollout_logp: Tensor | None,
    ref_logp: Tensor | None, normalizer: Tensor | None, positive: Tensor | None,
    eps_low: float, eps_high: float, dual_clip: float, importance_sampling_level: str, tis_mode: str,
    tis_min: float, tis_max: float, tis_sequence_reduce: str, loss_agg_mode: str, beta: float, entropy_coef: float,
    nll_coef: float, divisor: float, uniform_len: int, temperature: float, need_hidden: bool, need_weight: bool,
    need_bias: bool, fp32_accumulate: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    scalars = _scalars(eps_low, eps_high, dual_clip, importance_sampling_level, tis_mode, tis_min, tis_max,
                       tis_sequence_reduce, loss_agg_mode, beta, entropy_coef)
    return _run(hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp,
                normalizer, positive, scalars, nll_coef, divisor, uniform_len, temperature, need_hidden, need_weight,
                need_bias, fp32_accumulate)


@_linear_policy_loss_op.register_fake
def _(hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, normalizer,
      positive, eps_low, eps_high, dual_clip, importance_sampling_level, tis_mode, tis_min, tis_max,
      tis_sequence_reduce, loss_agg_mode, beta, entropy_coef, nll_coef, divisor, uniform_len, temperature,
      need_hidden, need_weight, need_bias, fp32_accumulate):
    f32 = torch.float32
    n = hidden.shape[0]
    return (
        hidden.new_empty((), dtype=f32),
        hidden.new_empty((len(LINEAR_METRIC_NAMES),), dtype=f32),
        torch.empty_like(hidden) if need_hidden else hidden.new_empty(0),
        torch.empty_like(weight) if need_weight else hidden.new_empty(0),
        torch.empty_like(bias) if (need_bias and bias is not None) else hidden.new_empty(0),
        hidden.new_empty((n,), dtype=f32),
        hidden.new_empty((n,), dtype=f32),
    )


def _scaled_grads(ctx, grad_loss, gh, gw, gb):
    """The forward's gradients times grad_loss: handed over as they are for grad_loss = 1 (loss.backward() on
    a CPU, checked without a device sync), else scaled in place (no second [V, H] buffer; a later backward
    through the same graph then fails autograd's saved-tensor version check)."""
    need = ctx.needs_input_grad
    keep = [need[0] and gh.numel(), need[1] and gw.numel(), need[2] and gb.numel()]
    grads = [g if k else None for g, k in zip((gh, gw, gb), keep)]
    if torch.compiler.is_compiling() or type(grad_loss) is not torch.Tensor:  # traced (fake / functional tensors)
        return [None if g is None else g * grad_loss.to(g.dtype) for g in grads]
    if grad_loss.device.type == "cpu" and float(grad_loss) == 1.0:
        return grads
    return [None if g is None else g.mul_(grad_loss.to(g.dtype)) for g in grads]


def _setup_context(ctx, inputs, output):
    _, _, gh, gw, gb, _, _ = output
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(gh, gw, gb)


def _backward(ctx, grad_loss, *_unused):
    if grad_loss is None:
        return (None,) * 31
    return tuple(_scaled_grads(ctx, grad_loss, *ctx.saved_tensors)) + (None,) * 28


torch.library.register_autograd("flashrl::linear_policy_loss", _backward, setup_context=_setup_context)


class _VocabParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, args, group, vocab_start, vocab_total):
        loss, metrics, gh, gw, gb, logp, ent = _run(hidden, weight, bias, *args, group=group,
                                                    vocab_start=vocab_start, vocab_total=vocab_total)
        ctx.save_for_backward(gh, gw, gb)
        ctx.mark_non_differentiable(metrics, logp, ent)
        return loss, metrics, logp, ent

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        return tuple(_scaled_grads(ctx, grad_loss, *ctx.saved_tensors)) + (None,) * 4


# ---- public wrapper ----

def _check_targets(targets, mask, vocab):
    bad = (targets < 0) | (targets >= vocab)
    if mask is not None:
        bad = bad & mask
    i = first_true(bad)
    if i is not None:
        raise ValueError(f"targets[{i}] (flat) = {int(targets[i])} is outside the vocabulary [0, {vocab}) at a "
                         "position the mask keeps")


def linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    old_logp: Tensor | None,
    advantages: Tensor,
    *,
    bias: Tensor | None = None,
    mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    temperature: float = 1.0,
    config: LossConfig | None = None,
    normalizer=None,
    positive: Tensor | None = None,
    process_group=None,
    fp32_grad_accumulation: bool = False,
    return_logprobs: bool = False,
):
    """The clipped policy loss straight from the last hidden states and the lm_head weight; see
    docs/linear_policy_loss.md.

    Equals `policy_loss(logp, old_logp, advantages, entropy=entropy, ...)` with `logp, entropy =
    linear_token_logprobs(hidden, weight, targets, bias=bias, temperature=temperature, return_entropy=True)`,
    gradients to hidden, weight and bias included, without the [N, V] logits and with 6NHV of matmul instead of
    the composition's 8NHV (the gradients are formed in the forward pass; the backward only scales them).

    hidden [B, T, H] with targets and the token tensors [B, T] (padded), or hidden [N, H] with [N] token
    tensors and cu_seqlens [S + 1] (packed). mask: True/nonzero = the token counts; masked positions never
    reach a GEMM and their targets are not read (padding ids such as -100 are fine). old_logp None: on-policy
    (the ratio is 1; its gradient is the policy gradient). config, normalizer, positive: as for policy_loss
    (entropy_coef uses the entropy computed here). process_group: vocab-parallel, as for linear_token_logprobs
    (each rank passes its slice of the vocabulary rows of weight and bias; the loss, metrics and grad_hidden
    are the full-vocabulary ones on every rank).
    fp32_grad_accumulation: grad_weight sums over row chunks; False (default) accumulates it in the weight's
    dtype (one rounding per chunk), True in an fp32 buffer of V * H * 4 bytes.
    Returns LossOutput(loss, metrics) with metrics over LINEAR_METRIC_NAMES (policy_loss's plus logp_mean), or
    (LossOutput, logp, entropy) with return_logprobs (detached fp32, targets' shape, 0 at masked positions).
    """
    cfg = _check_config(config)
    if hidden.dim() < 2:
        raise ValueError(f"hidden must be [B, T, H] (padded) or [N, H] (packed), got shape {tuple(hidden.shape)}")
    temperature, _ = _check_inputs(hidden, weight, targets, bias, temperature, None, process_group)
    # the token tensors' layout is checked against a float stand-in with the targets' shape
    stand_in = torch.zeros((), dtype=torch.float32, device=hidden.device).expand(targets.shape)
    (_, old, adv, m, cu, roll, ref, _, uniform_len) = _canonical(
        stand_in, stand_in if old_logp is None else old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp,
        None, like="targets",
    )
    if old_logp is None:
        old = None
    pos, norm_t, divisor = _loss_inputs(cfg, roll, ref, positive, cu.numel() - 1, normalizer, cu_seqlens,
                                        targets.shape, hidden.device, "hidden")
    h2 = hidden.reshape(-1, hidden.shape[-1])
    tgt = targets.reshape(-1).long().contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    b = None if bias is None else bias.contiguous()
    grad_on = torch.is_grad_enabled()
    need_h = grad_on and hidden.requires_grad
    need_w = grad_on and weight.requires_grad
    need_b = grad_on and bias is not None and bias.requires_grad
    scalars = config_scalars(cfg)
    checks = value_checks_enabled()
    if checks and cu_seqlens is not None:
        check_cu_seqlens(cu, tgt.numel())
    if process_group is None:
        vocab_total = weight.shape[0]
        if vocab_total == 0:
            raise ValueError("weight has no vocabulary rows (V = 0)")
        if checks:
            _check_targets(tgt, m, vocab_total)
        loss, mvec, _, _, _, logp, ent = torch.ops.flashrl.linear_policy_loss(
            h2, w, b, tgt, old, adv, m, cu, roll, ref, norm_t, pos, *scalars, float(cfg.nll_coef), divisor,
            int(uniform_len), temperature, need_h, need_w, need_b, bool(fp32_grad_accumulation),
        )
    else:
        vocab_start, vocab_total = _vocab_slice(weight, process_group)
        if vocab_total == 0:
            raise ValueError("weight has no vocabulary rows on any rank (V = 0)")
        if checks:
            _check_targets(tgt, m, vocab_total)
        args = (tgt, old, adv, m, cu, roll, ref, norm_t, pos, scalars, float(cfg.nll_coef), divisor, int(uniform_len),
                temperature, need_h, need_w, need_b, bool(fp32_grad_accumulation))
        loss, mvec, logp, ent = _VocabParallel.apply(h2, w, b, args, process_group, vocab_start, vocab_total)
    if checks:
        _check_finite(loss, (("old_logp", old), ("advantages", adv), ("rollout_logp", roll), ("ref_logp", ref)), m)
        if not bool(torch.isfinite(loss)):
            raise ValueError("the loss is not finite: hidden, weight or bias hold NaN/inf at a position the mask keeps")
    mvec = mvec.detach()
    out = LossOutput(loss, {name: mvec[i] for i, name in enumerate(LINEAR_METRIC_NAMES)})
    if return_logprobs:
        return out, logp.detach().view(targets.shape), ent.detach().view(targets.shape)
    return out
