"""Clipped policy loss on the native CPU kernels (csrc/cpu/policy_loss.cpp).

The kernel makes the per-token gradient coefficients and one vector of
statistics in one parallel pass over the sequences; `finalize` (shared with
the torch and Triton backends) turns the statistics into the loss and the
metrics, so every backend reports them the same way.
"""
from __future__ import annotations

import torch

from ..torch_impl.policy_loss import finish

_LEVELS = {"token": 0, "sequence": 1, "sequence_token": 2}
_TIS = {"none": 0, "token_truncate": 1, "token_mask": 2, "sequence_truncate": 3, "sequence_mask": 4}


def policy_loss_forward(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, normalizer,
                        eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta,
                        entropy_coef, divisor, uniform_len, positive=None, nll_coef=0.0):
    # only seq-mean-token-mean changes the token math (seq_mean: per-sequence 1/n_i); the other modes
    # (token-mean, token-sum, seq-mean-token-sum[-norm]) differ only in the divisor that `finalize` picks
    stats, g_tok, g_ent, seq_coef = torch.ops.flashrl_native.policy_loss_forward(
        logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy,
        float(eps_low), float(eps_high), float(dual_clip), _LEVELS[level], _TIS[tis_mode], tis_reduce == "mean",
        agg == "seq-mean-token-mean", float(tis_min), float(tis_max), float(beta), float(entropy_coef),
    )
    return finish(stats, g_tok, g_ent, seq_coef, logp, mask, cu_seqlens, uniform_len, normalizer, divisor, agg,
                  positive, nll_coef)


def policy_loss_backward(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, uniform_len):
    return torch.ops.flashrl_native.policy_loss_backward(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale)
