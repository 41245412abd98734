"""float64 reference for token log-probabilities and entropy: the spec.

For logits z (last dim V), temperature T and target y:
    logp   = z[y]/T - logsumexp(z/T)
    entropy = -sum_k p_k log p_k,  p = softmax(z/T)   (0 log 0 = 0)
Positions whose target equals `ignore_index` give 0 for both.
"""
from __future__ import annotations

import torch


def token_logprobs_spec(logits, targets, temperature=1.0, ignore_index=None):
    """Differentiable float64 (logprobs, entropy). Out-of-range targets give NaN."""
    z = logits.double() / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    v = z.shape[-1]
    ignored = targets == ignore_index if ignore_index is not None else torch.zeros_like(targets, dtype=torch.bool)
    in_range = (targets >= 0) & (targets < v)
    safe = torch.where(in_range, targets, torch.zeros_like(targets)).long()
    logp = logp_all.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
    logp = torch.where(in_range, logp, torch.full_like(logp, float("nan")))
    p = logp_all.exp()
    # p log p with 0 log 0 = 0, written so that autograd gives 0 (not NaN) at p = 0
    logp_finite = torch.where(p > 0, logp_all, torch.zeros_like(logp_all))
    entropy = -(p * logp_finite).sum(-1)
    zero = torch.zeros_like(logp)
    return torch.where(ignored, zero, logp), torch.where(ignored, zero, entropy)


# ---- backend interface (same names in every backend package) ----

def token_logprobs_forward(logits, targets, temperature, ignore_index, return_entropy):
    logp, entropy = token_logprobs_spec(logits, targets, temperature, ignore_index)
    lse = torch.logsumexp(logits.double() / temperature, dim=-1)
    ent = entropy.float().reshape(-1) if return_entropy else logp.new_empty(0, dtype=torch.float32)
    return logp.float().reshape(-1), ent, lse.float().reshape(-1)


def token_logprobs_backward(grad_logprobs, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    """Closed form, float64 (autograd is not reachable below the op's dispatch):
    dlogp/dz_k = (1[k = y] - p_k) / T,   dH/dz_k = -p_k (log p_k + H) / T."""
    v = logits.shape[-1]
    z = logits.double().reshape(-1, v) / temperature
    logp_all = torch.log_softmax(z, dim=-1)
    p = logp_all.exp()
    t = targets.reshape(-1)
    keep = (t >= 0) & (t < v)
    if ignore_index is not None:
        keep &= t != ignore_index
    g_lp = torch.where(keep, grad_logprobs.double(), 0.0)[:, None]
    onehot = torch.nn.functional.one_hot(torch.where(keep, t, 0).long(), v).double()
    g = g_lp * (onehot - p)
    if grad_entropy is not None:
        h = -(p * torch.where(p > 0, logp_all, 0.0)).sum(-1, keepdim=True)
        g_h = torch.where(keep, grad_entropy.double(), 0.0)[:, None]
        g = g - g_h * p * (torch.where(p > 0, logp_all, 0.0) + h)
    return (g / temperature).to(logits.dtype).view(logits.shape)
