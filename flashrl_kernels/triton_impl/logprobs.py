"""Triton token log-probabilities and entropy.

One program per row. Forward: one pass over the row with an online
log-sum-exp in fp32 (running max m, s = sum exp(u - m), w = sum exp(u - m)(u - m)
so that entropy = log s - w / s without the cancellation of lse - E[u]).
Backward: one more pass, recomputing p from the saved lse with the same
arithmetic, writing the gradient in the logits dtype. Tail tiles load -inf.
Temperature, flags and block size are constexpr; no host sync.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import rows_as_3d


@triton.jit
def online_lse_step(u, m, s, w, RETURN_ENTROPY: tl.constexpr):
    """Fold one block of scaled logits `u` into a row's running statistics.

    m: running max; s = sum exp(u - m); w = sum exp(u - m) (u - m) (entropy = log s - w / s).
    While every value seen is -inf, the reference point stays 0 so no exp(-inf - -inf) arises.
    """
    m_new = tl.maximum(m, tl.max(u, axis=0))
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m - m_ref)
    e = tl.exp(u - m_ref)
    if RETURN_ENTROPY:
        shift = s * tl.where(s > 0, m - m_ref, 0.0)
        w = alpha * (w + shift) + tl.sum(e * tl.where(e > 0, u - m_ref, 0.0), axis=0)
    s = s * alpha + tl.sum(e, axis=0)
    return m_new, s, w


@triton.jit
def logprob_grad_block(u, offs, tgt, lse, g_lp, g_h, h, TEMPERATURE: tl.constexpr, HAS_GRAD_ENT: tl.constexpr):
    """Gradient of g_lp * logp + g_h * H w.r.t. the raw logits z of one block (u = z / T):
    dlogp/dz_k = (1[k = y] - p_k) / T,  dH/dz_k = -p_k (log p_k + H) / T."""
    logp = u - lse
    p = tl.exp(logp)
    g = -g_lp * p
    if HAS_GRAD_ENT:
        g = g - g_h * p * tl.where(p > 0, logp + h, 0.0)
    g = tl.where(offs == tgt, g + g_lp, g)
    if TEMPERATURE != 1.0:
        g = g / TEMPERATURE
    return g


@triton.jit
def _token_logprobs_fwd_kernel(
    X, stride_b, stride_t, T_LEN, TGT, LOGP, ENT, LSE, V, ignore_index,
    TEMPERATURE: tl.constexpr, HAS_IGNORE: tl.constexpr, RETURN_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T_LEN
    x_row = X + b * stride_b + (row - b * T_LEN) * stride_t
    tgt = tl.load(TGT + row).to(tl.int64)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        u = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        if TEMPERATURE != 1.0:
            u = u / TEMPERATURE
        m, s, w = online_lse_step(u, m, s, w, RETURN_ENTROPY)

    log_s = tl.log(s)
    lse = m + log_s
    valid = (tgt >= 0) & (tgt < V)
    u_t = tl.load(x_row + tl.where(valid, tgt, 0)).to(tl.float32)
    if TEMPERATURE != 1.0:
        u_t = u_t / TEMPERATURE
    logp = tl.where(valid, u_t - lse, float("nan"))
    ent = log_s - w / s
    if HAS_IGNORE:
        logp = tl.where(tgt == ignore_index, 0.0, logp)
        ent = tl.where(tgt == ignore_index, 0.0, ent)
    tl.store(LOGP + row, logp)
    tl.store(LSE + row, lse)
    if RETURN_ENTROPY:
        tl.store(ENT + row, ent)


@triton.jit
def _token_logprobs_bwd_kernel(
    X, stride_b, stride_t, T_LEN, TGT, GRAD_LOGP, GRAD_ENT, LSE, ENT, GRAD_X, V, ignore_index,
    TEMPERATURE: tl.constexpr, HAS_IGNORE: tl.constexpr, HAS_GRAD_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T_LEN
    x_row = X + b * stride_b + (row - b * T_LEN) * stride_t
    g_row = GRAD_X + row * V
    tgt = tl.load(TGT + row).to(tl.int64)
    keep = (tgt >= 0) & (tgt < V)
    if HAS_IGNORE:
        keep = keep & (tgt != ignore_index)
    g_lp = tl.where(keep, tl.load(GRAD_LOGP + row), 0.0)
    lse = tl.load(LSE + row)
    g_h = 0.0
    h = 0.0
    if HAS_GRAD_ENT:
        g_h = tl.where(keep, tl.load(GRAD_ENT + row), 0.0)
        h = tl.load(ENT + row)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        u = tl.load(x_row + offs, mask=mask, other=float("-inf")).to(tl.float32)
        if TEMPERATURE != 1.0:
            u = u / TEMPERATURE
        g = logprob_grad_block(u, offs, tgt, lse, g_lp, g_h, h, TEMPERATURE, HAS_GRAD_ENT)
        tl.store(g_row + offs, g.to(GRAD_X.dtype.element_ty), mask=mask)


def block_v(v: int) -> int:
    return min(triton.next_power_of_2(v), 4096)


def _launch_geometry(logits):
    x3 = rows_as_3d(logits, "logits")
    b, t, v = x3.shape
    return x3, b * t, t, v


def token_logprobs_forward(logits, targets, temperature, ignore_index, return_entropy):
    x3, n, t_len, v = _launch_geometry(logits)
    tgt = targets.reshape(-1)
    logp = torch.empty(n, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(logp)
    ent = torch.empty_like(logp) if return_entropy else logp.new_empty(0)
    _token_logprobs_fwd_kernel[(n,)](
        x3, x3.stride(0), x3.stride(1), t_len, tgt, logp, ent if return_entropy else logp, lse, v,
        0 if ignore_index is None else ignore_index,
        TEMPERATURE=float(temperature), HAS_IGNORE=ignore_index is not None, RETURN_ENTROPY=return_entropy,
        BLOCK_V=block_v(v), num_warps=8,
    )
    return logp, ent, lse


def token_logprobs_backward(grad_logprobs, grad_entropy, logits, targets, lse, entropy, temperature, ignore_index):
    x3, n, t_len, v = _launch_geometry(logits)
    grad = torch.empty((n, v), dtype=logits.dtype, device=logits.device)
    g_lp = grad_logprobs.reshape(-1).float().contiguous()
    has_ge = grad_entropy is not None
    g_h = grad_entropy.reshape(-1).float().contiguous() if has_ge else g_lp
    _token_logprobs_bwd_kernel[(n,)](
        x3, x3.stride(0), x3.stride(1), t_len, targets.reshape(-1), g_lp, g_h, lse,
        entropy if has_ge else lse, grad, v, 0 if ignore_index is None else ignore_index,
        TEMPERATURE=float(temperature), HAS_IGNORE=ignore_index is not None, HAS_GRAD_ENT=has_ge,
        BLOCK_V=block_v(v), num_warps=8,
    )
    return grad.view(logits.shape)
