"""float64 reference for the fused policy head: the spec.

    logp, entropy = linear_token_logprobs_spec(hidden, weight, targets, bias, T)
    loss, metrics = policy_loss_spec(logp, old_logp (or logp, detached), advantages, ..., entropy=entropy)

differentiated by autograd in float64. Targets at masked positions are never
read (any value, e.g. a padding id of -100, is fine there).
"""
from __future__ import annotations

import torch

from ..loss_config import METRIC_NAMES
from .linear_logprobs import linear_token_logprobs_spec
from .policy_loss import _autograd_enabled, _config, policy_loss_spec, spec_normalizer


def linear_policy_loss_spec(hidden, weight, targets, old_logp, advantages, *, bias=None, mask=None, cu_seqlens=None,
                            rollout_logp=None, ref_logp=None, temperature=1.0, config=None, normalizer=None,
                            positive=None):
    """(loss, metrics, logp, entropy) in float64, differentiable w.r.t. hidden, weight and bias.

    Flat canonical form: hidden [N, H], targets [N], cu_seqlens [S + 1] (or None: one token per sequence
    is not meant; pass cu_seqlens), mask [N] bool or None. old_logp None: on-policy (old = logp, detached).
    """
    safe = targets if mask is None else torch.where(mask, targets, torch.zeros_like(targets))
    logp, ent = linear_token_logprobs_spec(hidden, weight, safe, bias, temperature)
    if mask is not None:
        logp = torch.where(mask, logp, torch.zeros_like(logp))
        ent = torch.where(mask, ent, torch.zeros_like(ent))
    old = logp.detach() if old_logp is None else old_logp
    loss, metrics = policy_loss_spec(logp, old, advantages, mask=mask, cu_seqlens=cu_seqlens,
                                     rollout_logp=rollout_logp, ref_logp=ref_logp, entropy=ent, config=config,
                                     normalizer=normalizer, positive=positive)
    return loss, metrics, logp, ent


def linear_policy_loss_forward(hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp,
                               ref_logp, normalizer, positive, scalars, nll_coef, divisor, uniform_len, temperature,
                               need_hidden, need_weight, need_bias, fp32_accumulate, group=None, **_):
    if group is not None:
        raise NotImplementedError("the reference backend has no vocab-parallel form of linear_policy_loss")
    cfg = _config(*scalars, nll_coef)
    norm = spec_normalizer(normalizer, divisor, cfg.loss_agg_mode)
    need_bias = need_bias and bias is not None
    with _autograd_enabled(), torch.enable_grad():
        h = hidden.detach().double().requires_grad_(need_hidden)
        w = weight.detach().double().requires_grad_(need_weight)
        b = None if bias is None else bias.detach().double().requires_grad_(need_bias)
        loss, metrics, logp, ent = linear_policy_loss_spec(
            h, w, targets, old_logp, advantages, bias=b, mask=mask, cu_seqlens=cu_seqlens, rollout_logp=rollout_logp,
            ref_logp=ref_logp, temperature=temperature, config=cfg, normalizer=norm, positive=positive,
        )
        inputs = [t for t, need in ((h, need_hidden), (w, need_weight), (b, need_bias)) if need]
        grads = list(torch.autograd.grad(loss, inputs, allow_unused=True)) if inputs and loss.requires_grad else []

    def take(need, like):
        if not need:
            return hidden.new_empty(0)
        g = grads.pop(0) if grads else None
        return torch.zeros_like(like) if g is None else g.to(like.dtype)

    gh, gw = take(need_hidden, hidden), take(need_weight, weight)
    gb = take(need_bias, bias) if need_bias else hidden.new_empty(0)
    dev = hidden.device
    mvec = torch.stack([metrics[k] for k in METRIC_NAMES]).float().to(dev)
    n_valid = logp.numel() if mask is None else int(mask.sum())
    logp_mean = (logp.detach().sum() / max(n_valid, 1)).float()
    return (loss.detach().float(), mvec, logp_mean, gh, gw, gb, logp.detach().float(), ent.detach().float())
