"""Triton fused linear log-probabilities: cuBLAS GEMM per tile + Triton epilogues.

Design (justified in docs/linear_logprobs.md): the tile loops of
torch_impl/linear_logprobs.py, with each [rows, cols] logits tile produced by
one library GEMM in fp32 (cuBLAS on a GPU; `out_dtype=float32` where torch
allows it) and consumed by one Triton kernel, instead of the ~10 elementwise
torch passes of the torch epilogue:

- forward tile kernel: one program per tile row; adds bias, divides by T,
  runs an online log-sum-exp over the row's columns (max m, s = sum e^(u-m),
  w = sum e^(u-m) (u-m)), picks the target's u if this tile owns it, and
  merges (m, s, w) into the row's running statistics in place. One read of
  the tile.
- backward tile kernel: one program per tile row; recomputes p = e^(u - lse)
  from the saved lse and writes dZ = (g_lp (1[k=y] - p) - g_h p (log p + H)) / T
  in the operand dtype for the two gradient GEMMs. One read, one write.
The GEMMs dominate (2NHV flops forward, 6NHV backward); the epilogues add
4 bytes (forward) and 4 + 2 bytes (backward) per logit of memory traffic.
Each row loop walks tiles aligned to ALIGN elements of the tile's storage, with
a masked head and tail (as in logprobs.py): vectorized loads whatever the
tile's width (32003 columns, or the last vocab block's 3331).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_impl.linear_logprobs import backward_loop, stats_loop
from .logprobs import ALIGN, block_v, logprob_grad_block, online_lse_step, row_frame, same_phase, store_row_tile


@triton.jit
def _scaled_tile(ROW, BIAS, c, head, length, HAS_BIAS: tl.constexpr, TEMPERATURE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One aligned tile of a tile row (the frame of logprobs.aligned_row_tile) as (z + bias) / T in fp32, -inf
    outside the row; and the columns. Tiles inside the row load without a mask, the row's ends with one."""
    offs = c + tl.arange(0, BLOCK)
    col = offs - head
    if (c >= head) & (c + BLOCK <= head + length):
        u = tl.load(ROW + offs)
        if HAS_BIAS:
            u = u + tl.load(BIAS + col).to(tl.float32)
    else:
        inside = (offs >= head) & (offs < head + length)
        u = tl.load(ROW + offs, mask=inside, other=float("-inf"))
        if HAS_BIAS:
            u = u + tl.load(BIAS + col, mask=inside, other=0.0).to(tl.float32)
    if TEMPERATURE != 1.0:
        u = u / TEMPERATURE
    return u, col


@triton.jit
def _linear_fwd_tile_kernel(
    Z, stride_z, BIAS, TGT, M, S, W, ZT, COLS,
    HAS_BIAS: tl.constexpr, TEMPERATURE: tl.constexpr, RETURN_ENTROPY: tl.constexpr, BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    e0 = r * stride_z  # the tile row is Z[e0 : e0 + COLS]
    z_row = Z + e0
    tgt = tl.load(TGT + r).to(tl.int64)

    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    w = tl.zeros((), tl.float32)
    a0, head = row_frame(e0, ALIGN)
    for c in range(0, COLS + head, BLOCK):
        u, _ = _scaled_tile(Z + a0, BIAS, c, head, COLS, HAS_BIAS, TEMPERATURE, BLOCK)
        m, s, w = online_lse_step(u, m, s, w, RETURN_ENTROPY)

    # the target's u, if this tile holds it
    owned = (tgt >= 0) & (tgt < COLS)
    safe = tl.where(owned, tgt, 0)
    u_t = tl.load(z_row + safe)
    if HAS_BIAS:
        u_t = u_t + tl.load(BIAS + safe).to(tl.float32)
    if TEMPERATURE != 1.0:
        u_t = u_t / TEMPERATURE
    zt_old = tl.load(ZT + r)
    tl.store(ZT + r, tl.where(owned, u_t, zt_old))

    # merge the tile's (m, s, w) into the row's running statistics
    m_old = tl.load(M + r)
    s_old = tl.load(S + r)
    m_new = tl.maximum(m_old, m)
    m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    a_old = tl.exp(m_old - m_ref)
    a_t = tl.exp(m - m_ref)
    if RETURN_ENTROPY:
        w_old = tl.load(W + r)
        w_new = a_old * (w_old + s_old * tl.where(s_old > 0, m_old - m_ref, 0.0)) + a_t * (
            w + s * tl.where(s > 0, m - m_ref, 0.0)
        )
        tl.store(W + r, w_new)
    tl.store(S + r, s_old * a_old + s * a_t)
    tl.store(M + r, m_new)


@triton.jit
def _linear_bwd_tile_kernel(
    Z, stride_z, BIAS, TGT, LSE, ENT, GLP, GH, DZ, stride_dz, COLS,
    HAS_BIAS: tl.constexpr, TEMPERATURE: tl.constexpr, HAS_GH: tl.constexpr, BLOCK: tl.constexpr,
    SAME_PHASE: tl.constexpr, ALIGN: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)
    e0 = r * stride_z
    tgt = tl.load(TGT + r).to(tl.int64)
    lse = tl.load(LSE + r)
    g_lp = tl.load(GLP + r)
    g_h = 0.0
    h = 0.0
    if HAS_GH:
        g_h = tl.load(GH + r)
        h = tl.load(ENT + r)
    a0, head = row_frame(e0, ALIGN)
    for c in range(0, COLS + head, BLOCK):
        u, col = _scaled_tile(Z + a0, BIAS, c, head, COLS, HAS_BIAS, TEMPERATURE, BLOCK)
        g = logprob_grad_block(u, col, tgt, lse, g_lp, g_h, h, TEMPERATURE, HAS_GH)
        store_row_tile(DZ, c, head, COLS, g.to(DZ.dtype.element_ty), r * stride_dz, SAME_PHASE, ALIGN, BLOCK)


def _fwd_epilogue(z, bias_c, tgt_c, temperature, return_entropy, m, s, w, zt):
    rows, cols = z.shape
    _linear_fwd_tile_kernel[(rows,)](
        z, z.stride(0), bias_c if bias_c is not None else z, tgt_c, m, s, w, zt, cols,
        HAS_BIAS=bias_c is not None, TEMPERATURE=float(temperature), RETURN_ENTROPY=bool(return_entropy),
        BLOCK=block_v(cols), ALIGN=ALIGN, num_warps=8,
    )


def _bwd_epilogue(z, bias_c, tgt_c, temperature, lse, ent, g_lp, g_h, out_dtype, out=None):
    """dZ of the tile into `out` (may be z itself) or a new tensor of out_dtype."""
    rows, cols = z.shape
    dz = torch.empty((rows, cols), dtype=out_dtype, device=z.device) if out is None else out
    has_gh = g_h is not None
    _linear_bwd_tile_kernel[(rows,)](
        z, z.stride(0), bias_c if bias_c is not None else z, tgt_c, lse, ent if has_gh else lse,
        g_lp, g_h if has_gh else g_lp, dz, dz.stride(0), cols,
        HAS_BIAS=bias_c is not None, TEMPERATURE=float(temperature), HAS_GH=has_gh,
        BLOCK=block_v(cols), SAME_PHASE=same_phase([(z.stride(0), rows)], [(dz.stride(0), rows)]), ALIGN=ALIGN,
        num_warps=8,
    )
    return dz


def linear_logprobs_stats(hidden, weight, bias, target_local, temperature, return_entropy):
    return stats_loop(hidden, weight, bias, target_local, temperature, return_entropy, epilogue=_fwd_epilogue)


def linear_logprobs_backward(
    grad_logp, grad_ent, hidden, weight, bias, target_local, lse, ent, temperature,
    need_hidden, need_weight, need_bias, fp32_accumulate,
):
    return backward_loop(
        grad_logp.float().contiguous(), None if grad_ent is None else grad_ent.float().contiguous(),
        hidden, weight, bias, target_local, lse, ent, temperature,
        need_hidden, need_weight, need_bias, fp32_accumulate, epilogue=_bwd_epilogue,
    )
