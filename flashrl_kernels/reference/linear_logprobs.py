"""float64 reference for fused linear log-probabilities: the spec.

    z = hidden @ weight.T + bias          (float64 here; fp32 accumulation in the kernels)
    logp, entropy = token_logprobs_spec(z, targets, temperature, ignore_index)

The backend interface works on one slice of the vocabulary (rows
[vocab_start, vocab_start + V_local) of the full weight), so that the same
functions serve the single-process op (one slice = everything) and each rank
of the vocab-parallel form:

- linear_logprobs_stats(hidden, weight, bias, target_local, T, return_entropy)
  -> (m, s, w, zt), fp32 [N]: over the slice's u = z / T,
     m = max_k u_k, s = sum_k exp(u_k - m), w = sum_k exp(u_k - m) (u_k - m),
     zt = u at target_local if 0 <= target_local < V_local else 0.
  Merged over slices (see ops/linear_logprobs.py): lse = m + log s,
  entropy = log s - w / s, logp = zt - lse.
- linear_logprobs_backward(grad_logp, grad_ent, hidden, weight, bias,
  target_local, lse, ent, T, need_hidden, need_weight, need_bias, fp32_accumulate)
  -> (grad_hidden, grad_weight, grad_bias) with the *global* lse and entropy;
  grad_logp / grad_ent are already zero on ignored rows; the one-hot term is
  added only where 0 <= target_local < V_local. Gradients not asked for come
  back as empty tensors.
"""
from __future__ import annotations

import torch

from .logprobs import token_logprobs_spec


def linear_token_logprobs_spec(hidden, weight, targets, bias=None, temperature=1.0, ignore_index=None):
    """Differentiable float64 (logprobs, entropy) of targets under softmax((hidden @ weight.T + bias) / T)."""
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return token_logprobs_spec(z, targets, temperature, ignore_index)


def _logits64(hidden, weight, bias, temperature):
    z = hidden.double() @ weight.double().T
    if bias is not None:
        z = z + bias.double()
    return z / temperature


def linear_logprobs_stats(hidden, weight, bias, target_local, temperature, return_entropy):
    u = _logits64(hidden, weight, bias, temperature)
    v = u.shape[-1]
    m = u.amax(-1)
    m_ref = torch.where(torch.isneginf(m), torch.zeros_like(m), m)
    d = u - m_ref[:, None]
    e = torch.exp(d)
    s = e.sum(-1)
    w = torch.where(e > 0, e * d, torch.zeros_like(e)).sum(-1)
    owned = (target_local >= 0) & (target_local < v)
    safe = torch.where(owned, target_local, torch.zeros_like(target_local)).long()
    zt = torch.where(owned, u.gather(1, safe[:, None])[:, 0], torch.zeros_like(m))
    return m.float(), s.float(), w.float(), zt.float()


def linear_logprobs_backward(
    grad_logp, grad_ent, hidden, weight, bias, target_local, lse, ent, temperature,
    need_hidden, need_weight, need_bias, fp32_accumulate,
):
    u = _logits64(hidden, weight, bias, temperature)
    v = u.shape[-1]
    logp_all = u - lse.double()[:, None]
    p = torch.exp(logp_all)
    g_lp = grad_logp.double()[:, None]
    g = -g_lp * p
    if grad_ent is not None:
        g = g - grad_ent.double()[:, None] * p * torch.where(p > 0, logp_all + ent.double()[:, None], 0.0)
    owned = (target_local >= 0) & (target_local < v)
    safe = torch.where(owned, target_local, torch.zeros_like(target_local)).long()
    g.scatter_add_(1, safe[:, None], torch.where(owned[:, None], g_lp, 0.0))
    g = g / temperature
    # gradients not asked for: distinct empty tensors (op outputs must not alias each other)
    gh = (g @ weight.double()).to(hidden.dtype) if need_hidden else hidden.new_empty(0)
    gw = (g.T @ hidden.double()).to(weight.dtype) if need_weight else hidden.new_empty(0)
    gb = g.sum(0).to(bias.dtype) if (need_bias and bias is not None) else hidden.new_empty(0)
    return gh, gw, gb
