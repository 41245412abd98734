"""Triton policy loss: one program per sequence.

Why one program per sequence: every per-sequence quantity the loss needs
(valid-token count for seq-mean-token-mean, the GSPO sequence ratio s_i, the
sequence TIS ratio, the GSPO gradient sum) becomes a scalar local to one
program, so there are no atomics, no second launch, and results are
deterministic. A program walks its sequence in BLOCK-token tiles (BLOCK from the typical
sequence length, 256..1024, known on the host without a sync); when a
per-sequence value is needed before the token terms (GSPO, sequence TIS,
seq-mean-token-mean) it makes a first pass over the tiles (the sequence's few
KiB stay in L2 for the second). Each program writes one row of statistics
[S, 19]; one more program (loss_finalize.policy_finalize, the torch backend's
combine_stats + finalize arithmetic) makes the loss and the metrics (VAPO's NLL
term: the torch finish). All hyper-parameters are
tl.constexpr. The backward is one more per-sequence pass:
grad = (g_tok + mask * seq_coef[i]) * grad_loss / divisor.

Load width: a sequence starts at a runtime cu_seqlens offset, which the compiler
cannot prove aligned, so every loop starts at that offset rounded down to a
multiple of ALIGN tokens: the tiles inside the sequence load and store without
a mask (vector loads on the GPU), the first and last ones with one.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..torch_impl.policy_loss import N_STATS, combine_stats, finish
from ._host import next_power_of_2
from .loss_finalize import policy_finalize

_LEVELS = {"token": 0, "sequence": 1, "sequence_token": 2}
ALIGN = 16  # tokens: a sequence's tiles start at a multiple of this (see the module docstring)
_TIS = {"none": 0, "token_truncate": 1, "token_mask": 2, "sequence_truncate": 3, "sequence_mask": 4}


@triton.jit
def _tis_weight(log_rho, TIS: tl.constexpr, TIS_MIN: tl.constexpr, TIS_MAX: tl.constexpr):
    rho = tl.exp(log_rho)
    outside = (rho < TIS_MIN) | (rho > TIS_MAX)
    if TIS == 1 or TIS == 3:
        w = tl.minimum(tl.maximum(rho, TIS_MIN), TIS_MAX)
    else:
        w = tl.where(outside, 0.0, rho)
    return w, outside


@triton.jit
def _ld(PTR, offs, valid, FULL: tl.constexpr, GUARD: tl.constexpr):
    """PTR[offs] in fp32, 0 where not `valid`. FULL: the tile lies inside the sequence, so the load needs no mask
    (vectorized); GUARD: valid may still be False there (a token mask), so the value is selected."""
    if FULL:
        x = tl.load(PTR + offs).to(tl.float32)
        if GUARD:
            x = tl.where(valid, x, 0.0)
    else:
        x = tl.load(PTR + offs, mask=valid, other=0.0).to(tl.float32)
    return x


@triton.jit
def _valid(MASK, offs, inb, FULL: tl.constexpr, HAS_MASK: tl.constexpr):
    """In-sequence tokens that the mask keeps."""
    valid = inb
    if HAS_MASK:
        if FULL:
            valid = inb & (tl.load(MASK + offs) != 0)
        else:
            valid = inb & (tl.load(MASK + offs, mask=inb, other=0) != 0)
    return valid


@triton.jit
def _st(PTR, offs, value, inb, FULL: tl.constexpr):
    if FULL:
        tl.store(PTR + offs, value)
    else:
        tl.store(PTR + offs, value, mask=inb)


@triton.jit
def _pass1_loads(LOGP, OLD, ROLL, MASK, offs, inb, FULL: tl.constexpr, HAS_MASK: tl.constexpr, TIS: tl.constexpr):
    valid = _valid(MASK, offs, inb, FULL, HAS_MASK)
    lp = _ld(LOGP, offs, valid, FULL, HAS_MASK)
    old = _ld(OLD, offs, valid, FULL, HAS_MASK)
    roll = lp
    if TIS >= 3:
        roll = _ld(ROLL, offs, valid, FULL, HAS_MASK)
    return valid, lp, old, roll


@triton.jit
def _pass2_loads(LOGP, OLD, ADV, MASK, ROLL, REF, ENT, offs, inb, FULL: tl.constexpr, HAS_MASK: tl.constexpr,
                 ADV_PER_SEQ: tl.constexpr, HAS_ROLL: tl.constexpr, HAS_REF: tl.constexpr, HAS_ENT: tl.constexpr):
    valid = _valid(MASK, offs, inb, FULL, HAS_MASK)
    lp = _ld(LOGP, offs, valid, FULL, HAS_MASK)
    old = _ld(OLD, offs, valid, FULL, HAS_MASK)
    a = lp
    if not ADV_PER_SEQ:
        a = _ld(ADV, offs, valid, FULL, HAS_MASK)
    roll = lp
    if HAS_ROLL:
        roll = _ld(ROLL, offs, valid, FULL, HAS_MASK)
    ref = lp
    if HAS_REF:
        ref = _ld(REF, offs, valid, FULL, HAS_MASK)
    h = lp
    if HAS_ENT:
        h = _ld(ENT, offs, valid, FULL, HAS_MASK)
    return valid, lp, old, a, roll, ref, h


@triton.jit
def _policy_loss_fwd_kernel(
    LOGP, OLD, ADV, MASK, CU, ROLL, REF, ENT, G_TOK, G_ENT, SEQ_COEF, STATS, N,
    LEVEL: tl.constexpr, TIS: tl.constexpr, TIS_MEAN: tl.constexpr, SEQ_MEAN: tl.constexpr,
    HAS_MASK: tl.constexpr, ADV_PER_SEQ: tl.constexpr, HAS_ROLL: tl.constexpr, HAS_REF: tl.constexpr,
    HAS_ENT: tl.constexpr, HAS_DUAL: tl.constexpr, NEED_PASS1: tl.constexpr,
    EPS_LOW: tl.constexpr, EPS_HIGH: tl.constexpr, DUAL_C: tl.constexpr, TIS_MIN: tl.constexpr,
    TIS_MAX: tl.constexpr, BETA: tl.constexpr, ENT_COEF: tl.constexpr, NSTATS: tl.constexpr, BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(CU + seq), 0), N)
    end = tl.minimum(tl.maximum(tl.load(CU + seq + 1), start), N)
    lo = 1.0 - EPS_LOW
    hi = 1.0 + EPS_HIGH
    idx = tl.arange(0, BLOCK)
    base = (start // ALIGN) * ALIGN  # tiles start at multiples of ALIGN: masked head, unmasked (vectorized) middle

    # ---- pass 1: per-sequence sums needed before the token terms ----
    cnt = tl.zeros((), tl.float32)
    sum_lr = tl.zeros((), tl.float32)
    sum_tis = tl.zeros((), tl.float32)
    if NEED_PASS1:
        for k in range(base, end, BLOCK):
            offs = k + idx
            inb = (offs >= start) & (offs < end)
            if (k >= start) & (k + BLOCK <= end):
                valid, lp, old, roll = _pass1_loads(LOGP, OLD, ROLL, MASK, offs, inb, True, HAS_MASK, TIS)
            else:
                valid, lp, old, roll = _pass1_loads(LOGP, OLD, ROLL, MASK, offs, inb, False, HAS_MASK, TIS)
            cnt += tl.sum(valid.to(tl.float32), axis=0)
            sum_lr += tl.sum(tl.where(valid, lp - old, 0.0), axis=0)
            if TIS >= 3:
                sum_tis += tl.sum(tl.where(valid, old - roll, 0.0), axis=0)
    n1 = tl.maximum(cnt, 1.0)
    s = tl.exp(sum_lr / n1)
    alpha = 1.0
    if SEQ_MEAN:
        alpha = 1.0 / n1
    seq_w = 1.0
    seq_out = 0.0
    if TIS >= 3:
        d = sum_tis
        if TIS_MEAN:
            d = sum_tis / n1
        w_s, o_s = _tis_weight(d, TIS, TIS_MIN, TIS_MAX)
        seq_w = w_s
        seq_out = o_s.to(tl.float32)
    a_seq = 0.0
    if ADV_PER_SEQ:
        a_seq = tl.load(ADV + seq).to(tl.float32)

    # ---- pass 2: token terms, gradient coefficients, statistics ----
    q = tl.zeros((), tl.float32)
    c_low = tl.zeros((), tl.float32)
    c_high = tl.zeros((), tl.float32)
    c_dual = tl.zeros((), tl.float32)
    sum_r = tl.zeros((), tl.float32)
    max_r = tl.full((), float("-inf"), tl.float32)
    min_r = tl.full((), float("inf"), tl.float32)
    sum_w = tl.zeros((), tl.float32)
    max_w = tl.full((), float("-inf"), tl.float32)
    min_w = tl.full((), float("inf"), tl.float32)
    n_out = tl.zeros((), tl.float32)
    sum_mkl = tl.zeros((), tl.float32)
    sum_kl = tl.zeros((), tl.float32)
    sum_ent = tl.zeros((), tl.float32)
    g_seq = tl.zeros((), tl.float32)
    cnt2 = tl.zeros((), tl.float32)
    sum_lr2 = tl.zeros((), tl.float32)
    for k in range(base, end, BLOCK):
        offs = k + idx
        inb = (offs >= start) & (offs < end)
        full = (k >= start) & (k + BLOCK <= end)
        if full:
            valid, lp, old, a, roll, ref, h = _pass2_loads(LOGP, OLD, ADV, MASK, ROLL, REF, ENT, offs, inb, True,
                                                           HAS_MASK, ADV_PER_SEQ, HAS_ROLL, HAS_REF, HAS_ENT)
        else:
            valid, lp, old, a, roll, ref, h = _pass2_loads(LOGP, OLD, ADV, MASK, ROLL, REF, ENT, offs, inb, False,
                                                           HAS_MASK, ADV_PER_SEQ, HAS_ROLL, HAS_REF, HAS_ENT)
        vf = valid.to(tl.float32)
        lr = tl.where(valid, lp - old, 0.0)
        if ADV_PER_SEQ:
            a = a_seq * vf
        r_tok = tl.exp(lr)
        if LEVEL == 0:
            r = r_tok
        else:
            r = s + tl.zeros_like(lr)
        pos = a > 0
        neg = a < 0
        upper = tl.minimum(r, hi)
        lower = tl.maximum(r, lo)
        if HAS_DUAL:
            lower = tl.minimum(lower, DUAL_C)
        rc = tl.where(pos, upper, lower)
        loss_t = -a * rc
        g = tl.where(rc == r, -a * r, 0.0)
        c_low += tl.sum((neg & (r < lo)).to(tl.float32), axis=0)
        c_high += tl.sum((pos & (r > hi)).to(tl.float32), axis=0)
        if HAS_DUAL:
            c_dual += tl.sum((neg & (r > DUAL_C)).to(tl.float32), axis=0)
        if HAS_ROLL:
            x = tl.where(valid, old - roll, 0.0)
            sum_mkl += tl.sum(tl.exp(x) - 1.0 - x, axis=0)
        if TIS == 1 or TIS == 2:
            w, outside = _tis_weight(x, TIS, TIS_MIN, TIS_MAX)
            loss_t = loss_t * w
            g = g * w
            sum_w += tl.sum(w * vf, axis=0)
            max_w = tl.maximum(max_w, tl.max(tl.where(valid, w, float("-inf")), axis=0))
            min_w = tl.minimum(min_w, tl.min(tl.where(valid, w, float("inf")), axis=0))
            n_out += tl.sum((outside & valid).to(tl.float32), axis=0)
        if TIS >= 3:
            loss_t = loss_t * seq_w
            g = g * seq_w
        if LEVEL == 1:
            g_seq += tl.sum(g, axis=0)
            g = tl.zeros_like(g)
        if HAS_REF:
            y = tl.where(valid, ref - lp, 0.0)
            e = tl.exp(y)
            kl = e - y - 1.0
            sum_kl += tl.sum(kl, axis=0)
            if BETA != 0.0:
                loss_t += BETA * kl
                g += BETA * (1.0 - e)
        if HAS_ENT:
            sum_ent += tl.sum(h, axis=0)
            if ENT_COEF != 0.0:
                loss_t -= ENT_COEF * h
        q += tl.sum(loss_t, axis=0)
        if full:
            if HAS_ENT:
                _st(G_ENT, offs, (-ENT_COEF * alpha) * vf, inb, True)
            _st(G_TOK, offs, g * alpha, inb, True)
        else:
            if HAS_ENT:
                _st(G_ENT, offs, (-ENT_COEF * alpha) * vf, inb, False)
            _st(G_TOK, offs, g * alpha, inb, False)
        sum_r += tl.sum(r_tok * vf, axis=0)
        max_r = tl.maximum(max_r, tl.max(tl.where(valid, r_tok, float("-inf")), axis=0))
        min_r = tl.minimum(min_r, tl.min(tl.where(valid, r_tok, float("inf")), axis=0))
        if not NEED_PASS1:
            cnt2 += tl.sum(vf, axis=0)
            sum_lr2 += tl.sum(lr, axis=0)

    if not NEED_PASS1:
        cnt = cnt2
        s = tl.exp(sum_lr2 / tl.maximum(cnt, 1.0))
    if TIS == 0:
        sum_w = cnt
        max_w = tl.where(cnt > 0, 1.0, float("-inf"))
        min_w = tl.where(cnt > 0, 1.0, float("inf"))
    if TIS >= 3:
        sum_w = seq_w * cnt
        max_w = tl.where(cnt > 0, seq_w, float("-inf"))
        min_w = tl.where(cnt > 0, seq_w, float("inf"))
        n_out = seq_out * cnt
    if LEVEL == 1:
        tl.store(SEQ_COEF + seq, g_seq / n1 * alpha)  # g already holds the factor r = s_i
    ne = cnt > 0
    row = STATS + seq * NSTATS
    tl.store(row + 0, cnt)
    tl.store(row + 1, ne.to(tl.float32))
    tl.store(row + 2, q * alpha)
    tl.store(row + 3, c_low)
    tl.store(row + 4, c_high)
    tl.store(row + 5, c_dual)
    tl.store(row + 6, sum_r)
    tl.store(row + 7, max_r)
    tl.store(row + 8, min_r)
    tl.store(row + 9, sum_w)
    tl.store(row + 10, min_w)
    tl.store(row + 11, max_w)
    tl.store(row + 12, n_out)
    tl.store(row + 13, sum_mkl)
    tl.store(row + 14, sum_kl)
    tl.store(row + 15, sum_ent)
    tl.store(row + 16, tl.where(ne, s, 0.0))
    tl.store(row + 17, tl.where(ne, s, float("inf")))
    tl.store(row + 18, tl.where(ne, s, float("-inf")))


@triton.jit
def _policy_bwd_tile(G_TOK, G_ENT, MASK, GRAD_LOGP, GRAD_ENT, offs, inb, gs, coef, FULL: tl.constexpr,
                     HAS_SEQ: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENT: tl.constexpr):
    g = _ld(G_TOK, offs, inb, FULL, False) * gs
    if HAS_SEQ:
        if HAS_MASK:
            g += coef * _valid(MASK, offs, inb, FULL, True).to(tl.float32)
        else:
            g += coef
    _st(GRAD_LOGP, offs, g, inb, FULL)
    if HAS_ENT:
        _st(GRAD_ENT, offs, _ld(G_ENT, offs, inb, FULL, False) * gs, inb, FULL)


@triton.jit
def _policy_loss_bwd_kernel(
    G_TOK, G_ENT, SEQ_COEF, MASK, CU, GRAD_LOSS, SCALE, GRAD_LOGP, GRAD_ENT, N,
    HAS_SEQ: tl.constexpr, HAS_MASK: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr,
    ALIGN: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(CU + seq), 0), N)
    end = tl.minimum(tl.maximum(tl.load(CU + seq + 1), start), N)
    gs = tl.load(GRAD_LOSS).to(tl.float32) * tl.load(SCALE)
    coef = 0.0
    if HAS_SEQ:
        coef = tl.load(SEQ_COEF + seq) * gs
    idx = tl.arange(0, BLOCK)
    for k in range((start // ALIGN) * ALIGN, end, BLOCK):
        offs = k + idx
        inb = (offs >= start) & (offs < end)
        if (k >= start) & (k + BLOCK <= end):
            _policy_bwd_tile(G_TOK, G_ENT, MASK, GRAD_LOGP, GRAD_ENT, offs, inb, gs, coef, True, HAS_SEQ, HAS_MASK,
                             HAS_ENT)
        else:
            _policy_bwd_tile(G_TOK, G_ENT, MASK, GRAD_LOGP, GRAD_ENT, offs, inb, gs, coef, False, HAS_SEQ, HAS_MASK,
                             HAS_ENT)


def _block(n: int, nseq: int, uniform_len: int) -> tuple[int, int]:
    """Tile size from the (typical) sequence length, known on the host without a sync; and num_warps."""
    typical = uniform_len if uniform_len > 0 else max(1, n // max(nseq, 1))
    block = min(1024, max(256, next_power_of_2(typical)))
    # 2 tokens per thread up to 512 (the forward keeps ~20 live values per token; the former 512 / 4 warps and
    # 2048 / 8 warps spilled on sm_80 / sm_90), 4 at 1024 / 8 warps: 16 warps spilled 8 bytes on sm_80 at 40
    # registers, 8 warps use up to 128 with none (docs/gpu.md)
    return block, min(8, block // 64)


def register_cap(device: torch.device) -> dict:
    """Launch options of the forward kernel: on CUDA a cap of 128 registers per thread (.maxnreg). Without it
    ptxas keeps 64-80 registers for occupancy and spills 4-20 bytes on sm_80 in the masked-head tiles; with it,
    109-114 registers and no spill (16 warps per SM). HIP launches take no such option."""
    return {"maxnreg": 128} if device.type == "cuda" and torch.version.hip is None else {}


def policy_loss_forward(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, normalizer,
                        eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta,
                        entropy_coef, divisor, uniform_len, positive=None, nll_coef=0.0):
    n = logp.numel()
    nseq = cu_seqlens.numel() - 1
    dev = logp.device
    f32 = torch.float32
    lev, tis = _LEVELS[level], _TIS[tis_mode]
    seq_mean = agg == "seq-mean-token-mean"  # the other modes differ only in finalize's divisor (token-sum: 1)
    has_ent = entropy is not None
    g_tok = torch.empty(n, dtype=f32, device=dev)
    g_ent = torch.empty(n if has_ent else 0, dtype=f32, device=dev)
    seq_coef = torch.empty(nseq if lev == 1 else 0, dtype=f32, device=dev)
    stats = torch.empty((nseq, N_STATS), dtype=f32, device=dev)
    mask_arg = mask.view(torch.uint8) if mask is not None else logp
    block, warps = _block(n, nseq, uniform_len)
    _policy_loss_fwd_kernel[(nseq,)](
        logp, old_logp, advantages, mask_arg, cu_seqlens,
        rollout_logp if rollout_logp is not None else logp, ref_logp if ref_logp is not None else logp,
        entropy if has_ent else logp, g_tok, g_ent if has_ent else g_tok, seq_coef if lev == 1 else g_tok, stats, n,
        LEVEL=lev, TIS=tis, TIS_MEAN=tis_reduce == "mean", SEQ_MEAN=seq_mean, HAS_MASK=mask is not None,
        ADV_PER_SEQ=advantages.numel() != n, HAS_ROLL=rollout_logp is not None, HAS_REF=ref_logp is not None,
        HAS_ENT=has_ent, HAS_DUAL=dual_clip > 0, NEED_PASS1=(lev != 0 or tis >= 3 or seq_mean),
        EPS_LOW=float(eps_low), EPS_HIGH=float(eps_high), DUAL_C=float(dual_clip) if dual_clip > 0 else math.inf,
        TIS_MIN=float(tis_min), TIS_MAX=float(tis_max), BETA=float(beta), ENT_COEF=float(entropy_coef),
        NSTATS=N_STATS, BLOCK=block, ALIGN=ALIGN, num_warps=warps, **register_cap(dev),
    )
    if positive is None:  # merge + finalize in one launch (loss_finalize.py)
        loss, metrics, scale = policy_finalize(stats, normalizer, divisor, agg)
        return loss, metrics, g_tok, g_ent, seq_coef, scale
    return finish(combine_stats(stats), g_tok, g_ent, seq_coef, logp, mask, cu_seqlens, uniform_len, normalizer,
                  divisor, agg, positive, nll_coef)


def policy_loss_backward(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, uniform_len):
    n = g_tok.numel()
    nseq = cu_seqlens.numel() - 1
    grad_logp = torch.empty_like(g_tok)
    has_ent = g_ent.numel() > 0
    grad_ent = torch.empty_like(g_ent)
    block, warps = _block(n, nseq, uniform_len)
    _policy_loss_bwd_kernel[(nseq,)](
        g_tok, g_ent if has_ent else g_tok, seq_coef if seq_coef.numel() else g_tok,
        mask.view(torch.uint8) if mask is not None else g_tok, cu_seqlens, grad_loss.reshape(()).float(), scale,
        grad_logp, grad_ent if has_ent else grad_logp, n,
        HAS_SEQ=seq_coef.numel() > 0, HAS_MASK=mask is not None, HAS_ENT=has_ent, BLOCK=block, ALIGN=ALIGN,
        num_warps=warps,
    )
    return grad_logp, grad_ent
