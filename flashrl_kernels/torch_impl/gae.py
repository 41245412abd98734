"""GAE in vectorised torch, on any device: the recurrence as reverse linear scans.

Over the flat tokens j (a [B, T] row per sequence when padded, one [N] row
when packed), the two things GAE carries backwards are reverse linear
recurrences x_j = a_j * x_{j+1} + b_j:

  next value  x_j = V_j at a valid token, x_{j+1} at a masked one
              (a = 0 / 1, b = V / 0); V_{t_{k+1}} is x shifted by one;
  advantage   A_j = delta_j + gamma * lam * A_{j+1} at a valid token,
              A_{j+1} at a masked one (a = gamma * lam / 1, b = delta / 0);
              returns are the same scan with critic_lam (stacked with it:
              one scan of [2, ...] unless critic_lam is lam);

with a = 0 at the last token of every sequence, so nothing crosses a
sequence boundary and the value after it is 0 (terminal).

The scan (`reverse_scan`) is chunked: the row is cut into chunks of CHUNK
tokens laid out [rows, CHUNK, chunks] (one transposing copy, then solved in place), a loop over the CHUNK
positions (not over T) solves every chunk at once from its end (the local
solution and the product of the a's), a Hillis-Steele doubling scan over the
chunk starts carries the values across chunks (log2(T / CHUNK) steps on a
CHUNK-times smaller tensor), and one multiply-add applies the carries. At
B=64, T=4096 ([2, 64, 4096] fp32, the advantage + returns scan) on this
project's 2-core CPU it took 3.3-3.7 ms against 11 ms for Hillis-Steele
over the whole row (12 doubling steps on the full tensor); flat packed rows
([2, 262144], 18 steps) 3.7-4.7 ms against 11-15 ms.

Products of a underflow (gamma * lam = 0.95 reaches 2^-126 after ~1700
tokens); CPU arithmetic on subnormal floats is 10-80x slower (measured: the
doubling scan of a flat row went from 4 to 340 ms), so products below 2^-62
are flushed to 0 (their contribution is below 2^-62 of a carried value,
far under fp32 resolution).

Accumulation: the next-value scan in fp32 (exact: a is 0 or 1), delta and
the advantage / returns scans in float64 (`wide_dtype`; fp32 on MPS), with
gamma and the float64 lambdas unrounded. fp32 was fine at gamma = lam = 1
(2e-7 of max |A| at T = 32768), but an fp32 gamma * lam = 0.999 is 1.3e-8
off and its powers over a 1000-token horizon put the returns ~1e-5 (relative)
off the spec; in float64 they are within fp32 rounding of it (about 2x the
fp32 time on a CPU: docs/gae.md). Whitening statistics are summed in float64
(float32 on MPS, which has none). Large temporaries are few and reused in
place: on CPU each fresh 16 MB buffer costs page faults (docs/gae.md).
"""
from __future__ import annotations

import torch

CHUNK = 32
TINY = 2.0 ** -62  # products of a below this become 0: no subnormal arithmetic
WHITEN_EPS = 1e-8


def wide_dtype(device) -> torch.dtype:
    """float64, float32 on MPS (no float64 there): the canonical lam / critic_lam [S] (ops/gae.py), and delta and
    the advantage / returns scans here."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


def wide_lambdas(lam: torch.Tensor, critic_lam: torch.Tensor, dtype: torch.dtype = torch.float64):
    """lam and critic_lam [S] as contiguous `dtype`, still one tensor when critic_lam is lam (the wrapper passes
    lam twice when critic_lam is None: backends then run one recurrence)."""
    same = critic_lam.data_ptr() == lam.data_ptr()
    lam_w = lam.to(dtype).contiguous()
    return lam_w, lam_w if same else critic_lam.to(dtype).contiguous()


def _flush_(a: torch.Tensor) -> torch.Tensor:
    return a.masked_fill_(a < TINY, 0.0)  # a >= 0 everywhere


def scan_doubling(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x_j = a_j x_{j+1} + b_j along the last dimension (x after the end = 0), Hillis-Steele: ceil(log2 L) steps.
    Always a new tensor (b may be an expanded view)."""
    length = a.shape[-1]
    if length <= 1:
        return b.clone(memory_format=torch.contiguous_format)
    d = 1
    while d < length:
        nb = torch.empty_like(b)
        torch.addcmul(b[..., :-d], a[..., :-d], b[..., d:], out=nb[..., :-d])
        nb[..., -d:] = b[..., -d:]
        if 2 * d < length:
            na = torch.empty_like(a)
            torch.mul(a[..., :-d], a[..., d:], out=na[..., :-d])
            na[..., -d:] = a[..., -d:]
            a = _flush_(na)
        b = nb
        d *= 2
    return b


def scan_chunked(a: torch.Tensor, b: torch.Tensor, chunk: int = CHUNK) -> torch.Tensor:
    """The same scan, CHUNK positions at a time over all chunks at once, then carries across chunks."""
    length = a.shape[-1]
    lead = a.shape[:-1]
    nchunks = -(-length // chunk)
    pad = nchunks * chunk - length
    if pad:  # x after the end is 0: padding with b = 0 changes nothing before it
        a = torch.nn.functional.pad(a, (0, pad))
        b = torch.nn.functional.pad(b, (0, pad))
    # [..., chunk, nchunks] copies, then solved in place: bt becomes the local solution x (0 after the
    # chunk's end), at the product p of a from each position to the chunk's end
    p = a.reshape(*lead, nchunks, chunk).transpose(-1, -2).contiguous()
    x = b.reshape(*lead, nchunks, chunk).transpose(-1, -2).contiguous()
    for k in range(chunk - 2, -1, -1):
        x[..., k, :].addcmul_(p[..., k, :], x[..., k + 1, :])
        _flush_(p[..., k, :].mul_(p[..., k + 1, :]))
    starts = scan_doubling(p[..., 0, :], x[..., 0, :])  # the full solution at each chunk's first position
    carry = torch.zeros_like(starts)
    carry[..., :-1] = starts[..., 1:]  # what enters each chunk from its right
    x.addcmul_(p, carry.unsqueeze(-2))
    return x.transpose(-1, -2).reshape(*lead, nchunks * chunk)[..., :length]


def reverse_scan(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.shape[-1] <= 2 * CHUNK:
        return scan_doubling(a, b)
    return scan_chunked(a, b)


def _layout(n, nseq, cu, uniform_len, dev):
    """(rows, length, is_last [rows, length] bool or None for padded rows, seq index per token or None)."""
    if uniform_len > 0 and nseq * uniform_len == n:
        return nseq, uniform_len, None, None
    tok = torch.arange(n, device=dev)
    # sequence of each token (robust to malformed cu_seqlens: always a valid index)
    seq = torch.searchsorted(cu[1:].contiguous(), tok, right=True).clamp_(max=nseq - 1)
    last = torch.ones(n, dtype=torch.bool, device=dev)
    last[:-1] = seq[1:] != seq[:-1]
    return 1, n, last.view(1, n), seq


def whiten_(adv: torch.Tensor, valid: torch.Tensor | None) -> torch.Tensor:
    """verl masked_whiten in place over the valid tokens (masked positions stay 0); returns fp32
    [count, mean, var] (before whitening). Sums in float64, one fp32 temporary."""
    acc = torch.float32 if adv.device.type == "mps" else torch.float64
    cnt = adv.new_tensor(adv.numel(), dtype=acc) if valid is None else torch.count_nonzero(valid).to(acc)
    mean = adv.sum(dtype=acc) / cnt  # masked positions hold 0
    centered = adv - mean.to(adv.dtype)
    if valid is not None:
        centered.masked_fill_(~valid, 0.0)
    var = centered.square_().sum(dtype=acc) / (cnt - 1)
    adv.sub_(mean.to(adv.dtype)).mul_(torch.rsqrt(var + WHITEN_EPS).to(adv.dtype))
    if valid is not None:
        adv.masked_fill_(~valid, 0.0)
    return torch.stack([cnt, mean, var]).to(torch.float32)


def gae_forward(rewards, values, mask, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len):
    n = rewards.numel()
    nseq = cu_seqlens.numel() - 1
    dev = rewards.device
    f32 = torch.float32
    acc = wide_dtype(dev)
    if n == 0:
        stats = torch.tensor([0.0, float("nan"), float("nan")] if whiten else [], dtype=f32, device=dev)
        return torch.zeros(0, dtype=f32, device=dev), torch.zeros(0, dtype=f32, device=dev), stats
    lam, critic_lam = wide_lambdas(lam, critic_lam, acc)
    rows, length, last, seq = _layout(n, nseq, cu_seqlens, uniform_len, dev)
    r = rewards.to(f32).view(rows, length)
    v = values.to(f32).view(rows, length)
    valid = None if mask is None else mask.view(rows, length)
    invalid = None if mask is None else ~valid
    if seq is None:
        lam_t, crit_t = lam.view(nseq, 1), critic_lam.view(nseq, 1)
    else:
        lam_t, crit_t = lam[seq].view(1, n), critic_lam[seq].view(1, n)

    # next value: V of the next valid token of the same sequence, 0 after the last
    nv = torch.zeros_like(v)
    if valid is None:
        nv[:, :-1] = v[:, 1:]
    else:
        a = invalid.to(f32)
        a[:, -1] = 0.0
        if last is not None:
            a.masked_fill_(last, 0.0)
        x = reverse_scan(a, v.masked_fill(invalid, 0.0))
        nv[:, :-1] = x[:, 1:]
        del a, x
    if last is not None:
        nv.masked_fill_(last, 0.0)
    delta = nv.to(acc).mul_(gamma).add_(r).sub_(v)  # r + gamma * V_next - V
    del nv
    if valid is not None:
        delta.masked_fill_(invalid, 0.0)

    def coef(lam_rows):
        a = (gamma * lam_rows).expand(rows, length)
        a = a.masked_fill(invalid, 1.0) if valid is not None else a.contiguous()
        a[:, -1] = 0.0
        if last is not None:
            a.masked_fill_(last, 0.0)
        return a

    if critic_lam.data_ptr() == lam.data_ptr():  # the wrapper passes lam twice when critic_lam is None
        adv64 = reverse_scan(coef(lam_t), delta)
        adv, ret = adv64.to(f32), (adv64 + v).to(f32)
    else:
        both = reverse_scan(torch.stack([coef(lam_t), coef(crit_t)]), delta.expand(2, rows, length))
        adv, ret = both[0].to(f32), (both[1] + v).to(f32)
    if valid is not None:
        adv.masked_fill_(invalid, 0.0)
        ret.masked_fill_(invalid, 0.0)
    adv = adv.reshape(n)
    ret = ret.reshape(n)
    stats = whiten_(adv, mask) if whiten else torch.zeros(0, dtype=f32, device=dev)
    return adv, ret, stats
