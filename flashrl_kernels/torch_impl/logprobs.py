"""Chunked PyTorch token log-probabilities and entropy (any device).

Rows are processed in chunks whose fp32 temporaries stay within
`chunk_bytes()` (env FLASHRL_CHUNK_BYTES, default 8 MiB: small enough that the
several elementwise passes per chunk hit the CPU's caches, large enough that
Python overhead per chunk stays small), so extra memory is independent of
the number of rows. Forward: lse and the target logit per row,
entropy as log(s) - sum(e * (z - m)) / s with e = exp(z - m), which avoids the
cancellation of lse - E[z] when logits are large. Backward, per row:
    dlogp/dz_k = (1[k = y] - p_k) / T
    dH/dz_k    = -p_k (log p_k + H) / T
"""
from __future__ import annotations

import os

import torch

from .._checks import iter_row_chunks, rows_as_3d

_F32_MIN = torch.finfo(torch.float32).min


def chunk_bytes() -> int:
    return int(os.environ.get("FLASHRL_CHUNK_BYTES", str(8 << 20)))


def _rows_per_chunk(v: int, temporaries: int) -> int:
    return max(1, chunk_bytes() // (4 * v * temporaries))


def _target_info(targets, v, ignore_index):
    t = targets.reshape(-1)
    ignored = t == ignore_index if ignore_index is not None else torch.zeros_like(t, dtype=torch.bool)
    valid = (t >= 0) & (t < v)
    safe = torch.where(valid, t, torch.zeros_like(t)).long()
    return ignored, valid, safe


def token_logprobs_forward(logits, targets, temperature, ignore_index, return_entropy):
    x3 = rows_as_3d(logits, "logits")
    v = x3.shape[-1]
    n = x3.shape[0] * x3.shape[1]
    ignored, valid, safe = _target_info(targets, v, ignore_index)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if return_entropy else logp.new_empty(0)
    for r0, r1, chunk in iter_row_chunks(x3, _rows_per_chunk(v, 2)):
        z = chunk.to(torch.float32, copy=True)  # fresh buffer: the caller's logits are never written
        if temperature != 1.0:
            z.div_(temperature)
        m = z.amax(dim=-1, keepdim=True)
        m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # all -inf row: keep exp() finite
        z.sub_(m)
        zt = z.gather(1, safe[r0:r1, None])[:, 0]
        e = torch.exp(z)  # measured faster than torch.logsumexp on CPU
        s = e.sum(-1)
        log_s = torch.log(s)
        if return_entropy:
            z.clamp_(min=_F32_MIN)  # -inf entries have e = 0; keep 0 * z finite
            ent[r0:r1] = log_s - (e * z).sum(-1) / s
        lse[r0:r1] = m[:, 0] + log_s
        logp[r0:r1] = zt - log_s
    nan = torch.full_like(logp, float("nan"))
    logp = torch.where(valid, logp, nan)
    zero = torch.zeros_like(logp)
    logp = torch.where(ignored, zero, logp)
    if return_entropy:
        ent = torch.where(ignored, zero, ent)
    return logp, ent, lse


def token_logprobs_backward(grad_logprobs, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    x3 = rows_as_3d(logits, "logits")
    v = x3.shape[-1]
    n = x3.shape[0] * x3.shape[1]
    ignored, valid, safe = _target_info(targets, v, ignore_index)
    keep = (~ignored & valid).float()
    g_lp = grad_logprobs.reshape(-1).float() * keep
    g_h = grad_entropy.reshape(-1).float() * keep if grad_entropy is not None else None
    grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    inv_t = 1.0 / temperature
    for r0, r1, chunk in iter_row_chunks(x3, _rows_per_chunk(v, 2)):
        z = chunk.to(torch.float32, copy=True)
        if temperature != 1.0:
            z.div_(temperature)
        logp_all = z.sub_(lse[r0:r1, None])
        p = torch.exp(logp_all)
        if g_h is not None:
            # -g_h * p * (log p + H); clamp keeps p = 0 entries at 0 instead of 0 * -inf
            term = logp_all.clamp_(min=_F32_MIN).add_(entropy[r0:r1, None]).mul_(p).mul_(-g_h[r0:r1, None])
            term.addcmul_(p, g_lp[r0:r1, None], value=-1.0)
        else:
            term = p.mul_(-g_lp[r0:r1, None])
        term.scatter_add_(1, safe[r0:r1, None], g_lp[r0:r1, None])
        if temperature != 1.0:
            term.mul_(inv_t)
        grad[r0:r1] = term
    return grad.view(logits.shape)
