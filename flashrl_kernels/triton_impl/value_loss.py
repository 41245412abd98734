"""Triton value loss: a (sequence, part) grid of programs, partial statistics rows, a tiny finish.

Program (i, p) handles part p of sequence i: the sequence is cut into SPLIT contiguous
chunks of whole BLOCK-token tiles (SPLIT and BLOCK from the typical sequence length and the
number of SMs, known on the host without a sync), so a batch of a few long sequences still
fills the GPU. Each program writes the per-token gradient coefficient g_tok for its tokens
and one row of partial statistics (torch_impl/value_loss.py's STAT_NAMES): sums, plus the
second moments of R and R - v about the program's own mean, accumulated tile by tile with
Chan et al.'s pairwise update. The finish (one program, `loss_finalize.value_finalize`: the same float64
arithmetic as the torch backend's `combine_stats` + `finalize`) merges the rows and recounts the non-empty
sequences from the per-part valid counts, so the kernel needs no atomics and the result is deterministic.

seq-mean-token-mean needs the valid count n_i of the whole sequence before the token terms:
without a mask it is the length; with one, each program first counts its sequence's mask
(1 byte per token, an L2 hit for all but the first part). The other modes differ only in the
divisor `finalize` picks. The backward is one flat elementwise pass
grad = g_tok * grad_loss * scale, stored in the values' dtype.

Load width: parts and tiles start at the sequence's cu_seqlens offset rounded down to a
multiple of ALIGN tokens, so the tiles inside a part load without a mask (vector loads),
and the first and last one with one (as in policy_loss.py).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..torch_impl.value_loss import N_STATS
from ._host import cdiv, cuda_index, next_power_of_2, sm_count
from .loss_finalize import value_finalize
from .policy_loss import ALIGN, _ld, _st, _valid


@triton.jit
def _value_tile(V, OLD, RET, MASK, offs, inb, FULL: tl.constexpr, HAS_MASK: tl.constexpr, HAS_CLIP: tl.constexpr):
    """valid, v, R, old of one tile (0 where not valid); FULL: the tile lies inside its part (unmasked loads)."""
    valid = _valid(MASK, offs, inb, FULL, HAS_MASK)
    v = _ld(V, offs, valid, FULL, HAS_MASK)    # masked / out of range: v = R = old = 0,
    r = _ld(RET, offs, valid, FULL, HAS_MASK)  # so every term below is 0 there
    o = v
    if HAS_CLIP:
        o = _ld(OLD, offs, valid, FULL, HAS_MASK)
    return valid, v, r, o


@triton.jit
def _value_loss_fwd_kernel(
    V, OLD, RET, MASK, CU, G_TOK, STATS, N, SPLIT,
    HAS_MASK: tl.constexpr, HAS_CLIP: tl.constexpr, SEQ_MEAN: tl.constexpr, STORE_G: tl.constexpr, CLIP: tl.constexpr,
    NSTATS: tl.constexpr, BLOCK: tl.constexpr, ALIGN: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(CU + seq), 0), N)
    end = tl.minimum(tl.maximum(tl.load(CU + seq + 1), start), N)
    base = (start // ALIGN) * ALIGN  # parts and tiles start at multiples of ALIGN: masked head, vectorized middle
    chunk = tl.cdiv(tl.cdiv(end - base, BLOCK), SPLIT) * BLOCK
    lo = base + part * chunk  # past `end` for parts without tokens: their loop is empty
    hi = tl.minimum(lo + chunk, end)
    idx = tl.arange(0, BLOCK)

    alpha = 1.0
    if SEQ_MEAN:
        if HAS_MASK:
            cnt_seq = tl.zeros((), tl.float32)
            for k in range(base, end, BLOCK):
                offs = k + idx
                inb = (offs >= start) & (offs < end)
                if (k >= start) & (k + BLOCK <= end):
                    cnt_seq += tl.sum(_valid(MASK, offs, inb, True, True).to(tl.float32), axis=0)
                else:
                    cnt_seq += tl.sum(_valid(MASK, offs, inb, False, True).to(tl.float32), axis=0)
        else:
            cnt_seq = (end - start).to(tl.float32)
        alpha = 1.0 / tl.maximum(cnt_seq, 1.0)

    cnt = tl.zeros((), tl.float32)
    q = tl.zeros((), tl.float32)
    n_clip = tl.zeros((), tl.float32)
    sum_v = tl.zeros((), tl.float32)
    sum_err2 = tl.zeros((), tl.float32)
    sum_r = tl.zeros((), tl.float32)
    m2_r = tl.zeros((), tl.float32)
    sum_e = tl.zeros((), tl.float32)
    m2_e = tl.zeros((), tl.float32)
    for k in range(lo, hi, BLOCK):
        offs = k + idx
        inb = (offs >= start) & (offs < hi)
        full = (k >= start) & (k + BLOCK <= hi)
        if full:
            valid, v, r, o = _value_tile(V, OLD, RET, MASK, offs, inb, True, HAS_MASK, HAS_CLIP)
        else:
            valid, v, r, o = _value_tile(V, OLD, RET, MASK, offs, inb, False, HAS_MASK, HAS_CLIP)
        d = v - r
        l1 = d * d
        if HAS_CLIP:
            vc = tl.minimum(tl.maximum(v, o - CLIP), o + CLIP)
            dc = vc - r
            l2 = dc * dc
            use2 = l2 > l1
            # ties take the unclipped term; + (o - o) keeps a non-finite old value visible in the loss
            loss_t = tl.where(use2, l2, l1) + (o - o)
            g = tl.where(use2, 0.0, d)
            n_clip += tl.sum(use2.to(tl.float32), axis=0)
        else:
            loss_t = l1
            g = d
        if STORE_G:
            if full:
                _st(G_TOK, offs, g * alpha, inb, True)
            else:
                _st(G_TOK, offs, g * alpha, inb, False)
        q += tl.sum(loss_t, axis=0)
        sum_err2 += tl.sum(l1, axis=0)
        sum_v += tl.sum(v, axis=0)
        # this tile's count, sums and centred second moments, merged into the running ones (Chan et al.)
        vf = valid.to(tl.float32)
        nt = tl.sum(vf, axis=0)
        e = -d
        sr = tl.sum(r, axis=0)
        se = tl.sum(e, axis=0)
        nt1 = tl.maximum(nt, 1.0)
        cr = (r - sr / nt1) * vf
        ce = (e - se / nt1) * vf
        w = cnt * nt / tl.maximum(cnt + nt, 1.0)
        dr = sr / nt1 - sum_r / tl.maximum(cnt, 1.0)
        de = se / nt1 - sum_e / tl.maximum(cnt, 1.0)
        m2_r += tl.sum(cr * cr, axis=0) + dr * dr * w
        m2_e += tl.sum(ce * ce, axis=0) + de * de * w
        cnt += nt
        sum_r += sr
        sum_e += se

    row = STATS + (seq * SPLIT + part) * NSTATS
    tl.store(row + 0, cnt)
    tl.store(row + 1, 0.0)  # n_seq: recounted by combine_stats from the per-part counts
    tl.store(row + 2, q * alpha)
    tl.store(row + 3, n_clip)
    tl.store(row + 4, sum_v)
    tl.store(row + 5, sum_err2)
    tl.store(row + 6, sum_r)
    tl.store(row + 7, m2_r)
    tl.store(row + 8, sum_e)
    tl.store(row + 9, m2_e)


@triton.jit
def _value_loss_bwd_kernel(G_TOK, GRAD_LOSS, SCALE, OUT, N, BF16: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inb = offs < N
    gs = tl.load(GRAD_LOSS).to(tl.float32) * tl.load(SCALE)
    full = start + BLOCK <= N  # every block but the last: unmasked (vectorized) whatever N is
    if full:
        g = tl.load(G_TOK + offs) * gs
    else:
        g = tl.load(G_TOK + offs, mask=inb, other=0.0) * gs
    if BF16:
        # round to nearest even in the fp32 bits first: the interpreter's fp32 -> bf16 cast truncates,
        # the GPU's rounds; after this both are exact, so the tested path is the GPU's
        bits = g.to(tl.int32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        g = (bits & -65536).to(tl.float32, bitcast=True)
    if full:
        tl.store(OUT + offs, g.to(OUT.dtype.element_ty))
    else:
        tl.store(OUT + offs, g.to(OUT.dtype.element_ty), mask=inb)


def _launch_config(n: int, nseq: int, uniform_len: int, device: torch.device) -> tuple[int, int, int]:
    """(BLOCK, SPLIT, num_warps) from the typical sequence length, known on the host without a sync."""
    typical = uniform_len if uniform_len > 0 else max(1, n // max(nseq, 1))
    block = min(1024, max(128, next_power_of_2(typical)))
    if device.type == "cuda":
        target = 4 * sm_count(cuda_index(device))
    else:  # the interpreter: few, large programs
        target = 1
    tiles = cdiv(typical, block)
    want = cdiv(target, max(nseq, 1))  # parts per sequence to reach `target` programs
    tiles_per_part = max(1, tiles // want)
    split = cdiv(tiles, tiles_per_part)
    return block, split, 4


def value_loss_forward(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, agg, divisor,
                       uniform_len, need_grad=True):
    n = values.numel()
    if n == 0:  # nothing to launch over (and no valid pointer to pass): the torch backend's answer
        from ..torch_impl.value_loss import value_loss_forward as torch_forward

        return torch_forward(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, agg, divisor,
                             uniform_len, need_grad)
    nseq = cu_seqlens.numel() - 1
    dev = values.device
    block, split, warps = _launch_config(n, nseq, uniform_len, dev)
    g_tok = torch.empty(n if need_grad else 0, dtype=torch.float32, device=dev)
    rows = torch.empty((nseq * split, N_STATS), dtype=torch.float32, device=dev)
    has_clip = clip_range > 0
    _value_loss_fwd_kernel[(nseq, split)](
        values, old_values if has_clip else values, returns, mask.view(torch.uint8) if mask is not None else values,
        cu_seqlens, g_tok if need_grad else rows, rows, n, split,  # rows: a valid dummy pointer, never written
        HAS_MASK=mask is not None, HAS_CLIP=has_clip, SEQ_MEAN=agg == "seq-mean-token-mean", STORE_G=bool(need_grad),
        CLIP=float(clip_range), NSTATS=N_STATS, BLOCK=block, ALIGN=ALIGN, num_warps=warps,
    )
    loss, metrics, scale = value_finalize(rows, split, normalizer, divisor, agg)  # one launch (loss_finalize.py)
    return loss, metrics, g_tok, scale


def value_loss_backward(grad_loss, g_tok, scale, dtype):
    n = g_tok.numel()
    out = torch.empty(n, dtype=dtype, device=g_tok.device)
    if n == 0:
        return out
    block = 2048
    _value_loss_bwd_kernel[(cdiv(n, block),)](
        g_tok, grad_loss.reshape(()).float(), scale, out, n, BF16=dtype == torch.bfloat16, BLOCK=block, num_warps=4,
    )
    return out
