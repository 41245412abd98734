"""Triton GAE: one program per sequence, scanning backwards block by block.

A program walks its sequence from the end in BLOCK-token blocks. Within a
block both recurrences of GAE are reverse linear scans x_j = a_j x_{j+1} + b_j
(see torch_impl/gae.py), solved with `tl.associative_scan(reverse=True)` on
(a, b) pairs composed by (a1, b1) o (a2, b2) = (a1 a2, b1 a2 + b2) (the
carried element first, as Triton's own linear-recurrence test writes it):

  1. next value: y_j = V of the first valid token after j in the sequence;
     the block loads mask / values shifted by one token (L1 hits) so that
     y_j = a_j y_{j+1} + b_j with (a, b) = (0, V_{j+1}) at a valid j + 1,
     (1, 0) at a masked one, and y = carry (the block to the right) past it;
  2. delta = r + gamma * y - V at valid tokens, 0 at masked ones;
  3. advantages and returns: (a, b) = (gamma * lam, delta) at valid tokens,
     (1, 0) at masked ones; one scan of four tensors (lam and critic_lam), or
     of two when critic_lam is lam.

Each scan's value at the block's first token is the carry into the next
block to the left. The next-value scan is exact in fp32 (a is 0 or 1); delta
and the advantage / returns scans are float64 on GPUs with fast float64
(`accumulate_fp64`: data-centre parts), with gamma (passed as fp32 hi + lo)
and the float64 lambdas unrounded: in fp32, gamma * lam = 0.999 is 1.3e-8
off and its powers over a 1000-token horizon put the returns ~1e-5
(relative) off the spec, 1.27e-4 at B = 512, T = 8192 on the H200. GPUs with
1/32 - 1/64-rate float64 keep fp32 scans. Outputs are rounded to fp32 once.
Whitening: each program also writes its sequence's float64 (count, mean, M2)
(blocks merged with Chan's formula);
a small float64 torch reduction over the sequences makes (mean, rstd) on
the device (no host sync), and a second elementwise kernel applies them.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from ..torch_impl.gae import wide_lambdas
from ._host import cdiv, cuda_index, next_power_of_2, split_double

WHITEN_EPS = 1e-8
ALIGN = 16  # tokens: blocks end at multiples of this (vector loads; see _gae_fwd_kernel)
MAX_BLOCK = 1024  # tests lower it to exercise the carries across blocks under the interpreter


@triton.jit
def _lin(a1, b1, a2, b2):
    return a1 * a2, b1 * a2 + b2


@triton.jit
def _lin2(a1, b1, c1, d1, a2, b2, c2, d2):
    return a1 * a2, b1 * a2 + b2, c1 * c2, d1 * c2 + d2


@triton.jit
def _first(x, idx):
    """The value of x at index 0 of the block (as a scalar)."""
    return tl.sum(tl.where(idx == 0, x, 0.0), axis=0)


@triton.jit
def _gae_tile(R, V, MASK, offs, inb, FULL: tl.constexpr, HAS_MASK: tl.constexpr):
    """Valid-token mask, rewards and values of one block (r, v = 0 outside the sequence)."""
    if FULL:
        r = tl.load(R + offs).to(tl.float32)
        v = tl.load(V + offs).to(tl.float32)
        m = inb
        if HAS_MASK:
            m = (tl.load(MASK + offs) != 0) & inb
    else:
        r = tl.load(R + offs, mask=inb, other=0.0).to(tl.float32)
        v = tl.load(V + offs, mask=inb, other=0.0).to(tl.float32)
        m = inb
        if HAS_MASK:
            m = (tl.load(MASK + offs, mask=inb, other=0) != 0) & inb
    return m, r, v


@triton.jit
def _gae_fwd_kernel(R, V, MASK, CU, LAM, CLAM, ADV, RET, STATS, N, gamma_hi, gamma_lo,
                    HAS_MASK: tl.constexpr, TWO: tl.constexpr, WHITEN: tl.constexpr, BLOCK: tl.constexpr,
                    ALIGN: tl.constexpr, FP64: tl.constexpr):
    seq = tl.program_id(0).to(tl.int64)
    start = tl.minimum(tl.maximum(tl.load(CU + seq), 0), N)
    end = tl.minimum(tl.maximum(tl.load(CU + seq + 1), start), N)
    if FP64:  # fp32 halves -> float64 (the tensor first: a plain float in the interpreter)
        gamma = (tl.zeros((), tl.float64) + gamma_hi) + gamma_lo
    else:
        gamma = tl.zeros((), tl.float32) + gamma_hi
    f64 = gamma.dtype  # the accumulation dtype: float64, or fp32 on GPUs with slow float64
    gl = gamma * tl.load(LAM + seq).to(f64)
    gc = gamma * tl.load(CLAM + seq).to(f64)
    idx = tl.arange(0, BLOCK)
    nv = tl.zeros((), tl.float32)  # carries from the block to the right
    ca = tl.zeros((), f64)
    cr = tl.zeros((), f64)
    cnt = tl.zeros((), f64)  # whitening: running count, mean, M2 of the sequence's advantages
    mean = tl.zeros((), f64)
    m2 = tl.zeros((), f64)
    # blocks end at multiples of ALIGN (the first one at `end` rounded up): the blocks inside the sequence load
    # and store without a mask (vectorized); past `end` the scan elements are identities, so nothing leaks left
    top = ((end + ALIGN - 1) // ALIGN) * ALIGN
    nblocks = tl.cdiv(top - start, BLOCK)
    for k in range(nblocks):
        first = top - (k + 1) * BLOCK
        offs = first + idx
        inb = (offs >= start) & (offs < end)
        offs1 = offs + 1
        inb1 = (offs1 >= start) & (offs1 < end)
        full = (first >= start) & (first + BLOCK <= end)
        if full:
            m, r, v = _gae_tile(R, V, MASK, offs, inb, True, HAS_MASK)
        else:
            m, r, v = _gae_tile(R, V, MASK, offs, inb, False, HAS_MASK)
        v1 = tl.load(V + offs1, mask=inb1, other=0.0).to(tl.float32)  # shifted by one token: unaligned, L1 hits
        if HAS_MASK:
            m1 = (tl.load(MASK + offs1, mask=inb1, other=0) != 0) & inb1
        else:
            m1 = inb1
        # 1. next valid value
        ya, yb = tl.associative_scan((tl.where(m1, 0.0, 1.0), tl.where(m1, v1, 0.0)), 0, _lin, reverse=True)
        y = ya * nv + yb
        # 2. TD residual
        v64 = v.to(f64)
        delta = tl.where(m, r.to(f64) + gamma * y.to(f64) - v64, 0.0)
        # 3. advantages (and returns)
        aa = tl.where(m, gl, 1.0)
        if TWO:
            pa, pb, qa, qb = tl.associative_scan((aa, delta, tl.where(m, gc, 1.0), delta), 0, _lin2, reverse=True)
            adv64 = pa * ca + pb
            rr = qa * cr + qb
            cr = _first(rr, idx)
        else:
            pa, pb = tl.associative_scan((aa, delta), 0, _lin, reverse=True)
            adv64 = pa * ca + pb
            rr = adv64
        nv = _first(y, idx)
        ca = _first(adv64, idx)
        adv = adv64.to(tl.float32)
        ret = (rr + v64).to(tl.float32)
        if full:
            tl.store(ADV + offs, tl.where(m, adv, 0.0))
            tl.store(RET + offs, tl.where(m, ret, 0.0))
        else:
            tl.store(ADV + offs, tl.where(m, adv, 0.0), mask=inb)
            tl.store(RET + offs, tl.where(m, ret, 0.0), mask=inb)
        if WHITEN:
            bn = tl.sum(m.to(f64), axis=0)
            bmean = tl.sum(tl.where(m, adv64, 0.0), axis=0) / tl.maximum(bn, 1.0)
            d = tl.where(m, adv64 - bmean, 0.0)
            bm2 = tl.sum(d * d, axis=0)
            tot = cnt + bn
            delta_mean = bmean - mean
            w = tl.where(tot > 0, bn / tl.maximum(tot, 1.0), 0.0)
            mean = mean + delta_mean * w
            m2 = m2 + bm2 + delta_mean * delta_mean * cnt * w
            cnt = tot
    if WHITEN:
        tl.store(STATS + seq * 3, cnt)
        tl.store(STATS + seq * 3 + 1, mean)
        tl.store(STATS + seq * 3 + 2, m2)


@triton.jit
def _whiten_tile(ADV, MASK, offs, inb, mean, rstd, FULL: tl.constexpr, HAS_MASK: tl.constexpr):
    if FULL:
        out = (tl.load(ADV + offs) - mean) * rstd
        if HAS_MASK:
            out = tl.where(tl.load(MASK + offs) != 0, out, 0.0)
        tl.store(ADV + offs, out)
    else:
        out = (tl.load(ADV + offs, mask=inb, other=0.0) - mean) * rstd
        if HAS_MASK:
            out = tl.where(tl.load(MASK + offs, mask=inb, other=0) != 0, out, 0.0)
        tl.store(ADV + offs, out, mask=inb)


@triton.jit
def _whiten_kernel(ADV, MASK, MOMENTS, N, HAS_MASK: tl.constexpr, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    inb = offs < N
    mean = tl.load(MOMENTS)
    rstd = tl.load(MOMENTS + 1)
    if start + BLOCK <= N:  # every block but the last: unmasked (vectorized) whatever N is
        _whiten_tile(ADV, MASK, offs, inb, mean, rstd, True, HAS_MASK)
    else:
        _whiten_tile(ADV, MASK, offs, inb, mean, rstd, False, HAS_MASK)


def merge_moments(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence (count, mean, M2) [S, 3] -> fp32 [mean, rstd] and fp32 [count, mean, var] of the whole
    batch (Chan's formula, float64, on the device)."""
    s = stats.double()
    n_i, mean_i, m2_i = s[:, 0], s[:, 1], s[:, 2]
    n = n_i.sum()
    mean = (n_i * mean_i).sum() / n
    m2 = m2_i.sum() + (n_i * (mean_i - mean).square()).sum()
    var = m2 / (n - 1)
    return torch.stack([mean, torch.rsqrt(var + WHITEN_EPS)]).float(), torch.stack([n, mean, var]).float()


# GPUs whose float64 units run at 1/2 - 1/3 of fp32 (data-centre parts); elsewhere (1/32 - 1/64) a float64 scan
# would cost ~0.3 ms a 4M-token batch on an RTX 3090-class GPU (estimated: ~90 float64 operations per thread and
# block) against ~0.1 ms for the whole kernel, so those scan in fp32 (the ~1e-5 of the spec of before)
FAST_FP64_CUDA = {(6, 0), (7, 0), (8, 0), (9, 0), (10, 0)}  # P100, V100, A100 / A30, H100 / H200, B200
FAST_FP64_HIP = ("gfx90a", "gfx940", "gfx941", "gfx942", "gfx950")  # MI200, MI300, MI350


@functools.cache
def _fast_fp64(index: int) -> bool:
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        return getattr(props, "gcnArchName", "").split(":")[0] in FAST_FP64_HIP
    return (props.major, props.minor) in FAST_FP64_CUDA


def accumulate_fp64(device: torch.device) -> bool:
    """Whether the scans run in float64 on `device` (always under the CPU interpreter)."""
    return device.type != "cuda" or _fast_fp64(cuda_index(device))


def _block(n: int, nseq: int, uniform_len: int) -> tuple[int, int]:
    """Block size from the (typical) sequence length, known on the host without a sync; and num_warps."""
    typical = uniform_len if uniform_len > 0 else max(1, n // max(nseq, 1))
    block = min(MAX_BLOCK, max(16, next_power_of_2(typical)))
    return block, 8 if block >= 1024 else 4


def gae_forward(rewards, values, mask, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len):
    n = rewards.numel()
    nseq = cu_seqlens.numel() - 1
    dev = rewards.device
    f32 = torch.float32
    # padded rows cover every token; packed ones do too once cu_seqlens is checked (zeros: in case it was not)
    alloc = torch.empty if uniform_len > 0 else torch.zeros
    adv = alloc(n, dtype=f32, device=dev)
    ret = alloc(n, dtype=f32, device=dev)
    if n == 0:
        stats = torch.tensor([0.0, float("nan"), float("nan")] if whiten else [], dtype=f32, device=dev)
        return adv, ret, stats
    lam, critic_lam = wide_lambdas(lam, critic_lam)
    two = critic_lam.data_ptr() != lam.data_ptr()
    seq_stats = torch.empty((nseq, 3) if whiten else (1, 3), dtype=torch.float64, device=dev)
    mask_arg = mask.view(torch.uint8) if mask is not None else rewards
    block, warps = _block(n, nseq, uniform_len)
    _gae_fwd_kernel[(nseq,)](
        rewards, values, mask_arg, cu_seqlens, lam, critic_lam, adv, ret, seq_stats, n, *split_double(gamma),
        HAS_MASK=mask is not None, TWO=two, WHITEN=bool(whiten), BLOCK=block, ALIGN=ALIGN,
        FP64=accumulate_fp64(dev), num_warps=warps,
    )
    if not whiten:
        return adv, ret, torch.zeros(0, dtype=f32, device=dev)
    moments, stats = merge_moments(seq_stats)
    wblock = 1024
    _whiten_kernel[(cdiv(n, wblock),)](adv, mask_arg, moments, n, HAS_MASK=mask is not None,
                                       BLOCK=wblock, num_warps=4)
    return adv, ret, stats
