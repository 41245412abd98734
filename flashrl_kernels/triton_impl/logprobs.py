"""Triton token log-probabilities and entropy.

One program per row. Forward: one pass over the row with an online
log-sum-exp in fp32 (running max m, s = sum exp(u - m), w = sum exp(u - m)(u - m)
so that entropy = log s - w / s without the cancellation of lse - E[u]).
Backward: one more pass, recomputing p from the saved lse with the same
arithmetic, writing the gradient in the logits dtype. Tail tiles load -inf.
Temperature, flags and block size are constexpr; no host sync.

Load width: a row starts wherever the logits' strides put it (row * 32003
elements is not 16-byte aligned), so each loop starts at the row's first
element rounded down to a multiple of ALIGN elements (from the tensor's
16-byte aligned base) and walks aligned tiles: the tiles inside the row load
without a mask (128-bit loads on the GPU), the first and the last one with a
mask (a masked head and tail). The backward's stores share the loads'
alignment when the gradient row and the logits row start at the same offset
modulo ALIGN (SAME_PHASE, decided on the host from the strides).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .._checks import rows_as_3d
from ._host import next_power_of_2

ALIGN = 16  # elements: a row's loop starts at a multiple of this (>= 16 bytes in every dtype)


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
def row_frame(e0, ALIGN: tl.constexpr):
    """A row starting at element e0 of its tensor, as (a0, head): e0 = a0 + head, a0 a multiple of ALIGN."""
    return (e0 // ALIGN) * ALIGN, (e0 % ALIGN).to(tl.int32)


@triton.jit
def aligned_row_tile(ROW, c, head, length, other, BLOCK: tl.constexpr):
    """Elements ROW[c : c + BLOCK] as fp32, where ROW (the tensor's pointer + a0) is ALIGN-aligned, c a multiple of
    ALIGN, and the row occupies ROW[head : head + length] (`other` elsewhere); and their column indices.
    Tiles inside the row load without a mask (vectorized), the row's two ends with one. Offsets stay int32."""
    offs = c + tl.arange(0, BLOCK)
    if (c >= head) & (c + BLOCK <= head + length):
        x = tl.load(ROW + offs).to(tl.float32)
    else:
        x = tl.load(ROW + offs, mask=(offs >= head) & (offs < head + length), other=other).to(tl.float32)
    return x, offs - head


@triton.jit
def _token_logprobs_fwd_kernel(
    X, stride_b, stride_t, T_LEN, TGT, LOGP, ENT, LSE, V, ignore_index,
    TEMPERATURE: tl.constexpr, HAS_IGNORE: tl.constexpr, RETURN_ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr,
    ALIGN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T_LEN
    e0 = b * stride_b + (row - b * T_LEN) * stride_t  # the row is X[e0 : e0 + V]
    x_row = X + e0
    tgt = tl.load(TGT + row).to(tl.int64)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    a0, head = row_frame(e0, ALIGN)
    for c in range(0, V + head, BLOCK_V):
        u, _ = aligned_row_tile(X + a0, c, head, V, float("-inf"), BLOCK_V)
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
def store_row_tile(PTR, c, head, length, value, D0, SAME_PHASE: tl.constexpr, ALIGN: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Store `value`, the tile aligned_row_tile(.., c, head, length, ..) loaded, into the row
    PTR[D0 : D0 + length]. SAME_PHASE: D0 = head modulo ALIGN (checked on the host), so the stores are as aligned
    as the loads."""
    offs = c + tl.arange(0, BLOCK)
    if SAME_PHASE:
        ptrs = PTR + ((D0 - head) // ALIGN) * ALIGN + offs
    else:
        ptrs = PTR + D0 + (offs - head)
    if (c >= head) & (c + BLOCK <= head + length):
        tl.store(ptrs, value)
    else:
        tl.store(ptrs, value, mask=(offs >= head) & (offs < head + length))


@triton.jit
def _token_logprobs_bwd_kernel(
    X, stride_b, stride_t, T_LEN, TGT, GRAD_LOGP, GRAD_ENT, LSE, ENT, GRAD_X, V, ignore_index,
    TEMPERATURE: tl.constexpr, HAS_IGNORE: tl.constexpr, HAS_GRAD_ENT: tl.constexpr, BLOCK_V: tl.constexpr,
    SAME_PHASE: tl.constexpr, ALIGN: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T_LEN
    e0 = b * stride_b + (row - b * T_LEN) * stride_t
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
    a0, head = row_frame(e0, ALIGN)
    for c in range(0, V + head, BLOCK_V):
        u, col = aligned_row_tile(X + a0, c, head, V, float("-inf"), BLOCK_V)
        if TEMPERATURE != 1.0:
            u = u / TEMPERATURE
        g = logprob_grad_block(u, col, tgt, lse, g_lp, g_h, h, TEMPERATURE, HAS_GRAD_ENT)
        store_row_tile(GRAD_X, c, head, V, g.to(GRAD_X.dtype.element_ty), row * V, SAME_PHASE, ALIGN, BLOCK_V)


def block_v(v: int) -> int:
    return min(next_power_of_2(v), 4096)


def same_phase(row_starts_a: list[tuple[int, int]], row_starts_b: list[tuple[int, int]]) -> bool:
    """Whether two row layouts, each given as (stride, extent) pairs whose combinations give a row's start, put
    every row at the same offset modulo ALIGN: their strides agree modulo ALIGN wherever the extent exceeds 1."""
    return all(n <= 1 or (sa - sb) % ALIGN == 0 for (sa, n), (sb, _) in zip(row_starts_a, row_starts_b))


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
        BLOCK_V=block_v(v), ALIGN=ALIGN, num_warps=8,
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
        BLOCK_V=block_v(v), SAME_PHASE=same_phase([(x3.stride(0), x3.shape[0]), (x3.stride(1), t_len)],
                                                  [(t_len * v, x3.shape[0]), (v, t_len)]),
        ALIGN=ALIGN, num_warps=8,
    )
    return grad.view(logits.shape)
