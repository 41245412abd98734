"""Chunked PyTorch fused linear log-probabilities (any device).

The [N, V] logits are never held: they are computed one tile [rows, cols]
at a time (`tile_shape`), reduced into per-row running statistics (forward)
or turned into the tile's dZ and multiplied back (backward), then dropped.

Forward, per tile, with u = (h W^T + b) / T in fp32 and the running per-row
(m, s, w) of the slice seen so far (online log-sum-exp):
    m' = max(m, max_k u_k),  s' = s e^(m - m') + sum_k e^(u_k - m'),
    w' = e^(m - m') (w + s (m - m')) + sum_k e^(u_k - m') (u_k - m')
so that lse = m + log s and entropy = log s - w / s at the end, and the
target's u is picked from the tile that holds it.

Backward, per tile, from the saved lse and entropy (fp32 [N]):
    dZ = ( g_lp (1[k = y] - p_k) - g_h p_k (log p_k + H) ) / T,  p_k = e^(u_k - lse)
    grad_hidden += dZ @ W[cols],  grad_weight[cols] += dZ^T @ h[rows],  grad_bias[cols] += sum_rows dZ.
Loop order: the gradient whose accumulation spans the inner loop lives in a
small fp32 buffer of one tile's extent; the other spans the outer loop and
gets a full fp32 buffer. We put the *smaller* of the two outside: vocab
outer (full fp32 buffer = grad_hidden, N x H) when N <= V, rows outer (full
fp32 buffer = grad_weight, V x H) otherwise, so that the extra memory is
min(N, V) * H * 4 bytes plus the tiles, bounded independently of N.
With fp32_accumulate=False the full buffer is the gradient itself, in the
parameter dtype (rounded once per outer step).

Logits precision: each tile is one GEMM in the input dtype. fp32 inputs give
fp32 logits. For bf16/fp16 inputs the GEMM accumulates in fp32; on CUDA the
tile is written in fp32 (`out_dtype=torch.float32`) where the installed torch
supports it; on CPU torch has no bf16 x bf16 -> fp32 GEMM, so the tile is
rounded to the input dtype, exactly as the unfused `hidden @ weight.T` is,
unless FLASHRL_LINEAR_FP32_LOGITS=1 (then the tile GEMM runs in fp32, about
3.5x slower on AVX512-BF16 CPUs). See docs/linear_logprobs.md.

CPUs without fast bf16/fp16 GEMMs (AVX2-only x86: torch's bf16 GEMM runs at
~1-3 GFLOP/s there; decided once per process by flashrl_kernels._cpu_gemm,
FLASHRL_CPU_GEMM_DTYPE=auto|input|fp32): every tile GEMM, forward and
backward, runs on fp32 copies of its operands instead. The hidden rows are
widened once per call when one row block holds them all (else per tile), a
vocab block of W once per block (its fp32 copy capped at
max(tile bytes, 32 MiB) by narrowing the vocab block), the whole W once in
the rows-outer backward (N > V, so no larger than the fp32 grad_weight
buffer); dZ stays fp32 (no rounding to the input dtype). Logits, dZ and the
GEMM products are then fp32; outputs and gradients keep their dtypes.
"""
from __future__ import annotations

import os

import torch

from .._cpu_gemm import widen_cpu_gemm

_F32_MIN = torch.finfo(torch.float32).min

# ---- tiles ----

_DEFAULT_TILE_BYTES = {"cpu": 8 << 20, "cuda": 1 << 30}


def tile_bytes(device: torch.device) -> int:
    env = os.environ.get("FLASHRL_LINEAR_TILE_BYTES")
    if env:
        return int(env)
    return _DEFAULT_TILE_BYTES.get(device.type, 256 << 20)


def tile_shape(n: int, v: int, device: torch.device) -> tuple[int, int]:
    """(rows, cols) of one fp32 logits tile. FLASHRL_LINEAR_TILE=RxC forces it (tests)."""
    env = os.environ.get("FLASHRL_LINEAR_TILE")
    if env:
        r, c = (int(x) for x in env.lower().split("x"))
        return max(1, min(r, n)), max(1, min(c, v))
    budget = max(1, tile_bytes(device) // 4)  # fp32 elements
    if device.type == "cpu":
        # all rows when they fit (hidden stays in cache, W streams once), else row blocks
        rows = min(n, 2048)
        cols = max(256, budget // rows)
    else:
        # GPU: as many rows as possible (GEMM efficiency), vocab in blocks of >= 4096
        cols = min(v, max(4096, budget // max(n, 1)))
        rows = max(1, budget // cols)
    return max(1, min(rows, n)), max(1, min(cols, v))


_WIDE_W_BYTES = 32 << 20  # cap of one widened (fp32) vocab block of W


def gemm_plan(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, bool]:
    """(rows, cols, widen): the tile shape and whether the tile GEMMs widen bf16/fp16 operands to fp32."""
    n, hdim = hidden.shape
    v = weight.shape[0]
    rows, cols = tile_shape(n, v, hidden.device)
    widen = widen_cpu_gemm(hidden.dtype, hidden.device)
    if widen and not os.environ.get("FLASHRL_LINEAR_TILE"):
        cap = max(tile_bytes(hidden.device), _WIDE_W_BYTES) // (4 * max(hdim, 1))
        cols = max(1, min(cols, max(256, cap)))
    return rows, cols, widen


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float32 else x.float()


def _ranges(total: int, step: int):
    for a in range(0, total, step):
        yield a, min(a + step, total)


# ---- GEMMs with fp32 results ----

_out_dtype_ok: dict[str, bool] = {}


def _mm_f32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as fp32; fp32 accumulation in every case, fp32 output where the device allows."""
    if a.dtype == torch.float32:
        return a @ b
    dev = a.device.type
    if dev == "cuda" and _out_dtype_ok.get(dev, True):
        try:
            return torch.mm(a, b, out_dtype=torch.float32)
        except (RuntimeError, TypeError):
            _out_dtype_ok[dev] = False
    if os.environ.get("FLASHRL_LINEAR_FP32_LOGITS", "0") not in ("0", "", "false", "False"):
        return a.float() @ b.float()
    return (a @ b).float()


def _add_mm(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b (acc fp32, or the operands' dtype)."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif a.dtype == torch.float32:
        acc.add_(a @ b)
    elif a.device.type == "cuda" and _out_dtype_ok.get("cuda", True):
        acc.add_(_mm_f32(a, b))
    else:
        acc.add_(a @ b)  # CPU: product rounded to the operand dtype, summed in fp32


def logits_tile(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 [rows, cols] = h @ w.T (no bias, no temperature)."""
    return _mm_f32(h, w.T)


# ---- forward ----

def _fwd_epilogue_torch(z, bias_c, tgt_c, temperature, return_entropy, m, s, w, zt):
    """Merge tile z (fp32, owned by the caller) into the running rows (m, s, w, zt) views."""
    if bias_c is not None:
        z.add_(bias_c.float())
    if temperature != 1.0:
        z.div_(temperature)
    owned = (tgt_c >= 0) & (tgt_c < z.shape[1])
    safe = torch.where(owned, tgt_c, torch.zeros_like(tgt_c))
    zt.copy_(torch.where(owned, z.gather(1, safe[:, None])[:, 0], zt))
    m_new = torch.maximum(m, z.amax(1))
    m_ref = torch.where(torch.isneginf(m_new), torch.zeros_like(m_new), m_new)
    alpha = torch.exp(m - m_ref)
    z.sub_(m_ref[:, None])
    e = torch.exp(z)
    if return_entropy:
        z.clamp_(min=_F32_MIN)  # e = 0 where z = -inf; keep 0 * z finite
        shift = torch.where(s > 0, s * (m - m_ref), torch.zeros_like(s))
        w.copy_(alpha * (w + shift) + (e * z).sum(1))
    s.copy_(alpha * s + e.sum(1))
    m.copy_(m_new)


def stats_loop(hidden, weight, bias, target_local, temperature, return_entropy, epilogue=None):
    """Running (m, s, w, zt) over all tiles; `epilogue` replaces the torch tile epilogue (Triton)."""
    n, v = hidden.shape[0], weight.shape[0]
    f32 = {"dtype": torch.float32, "device": hidden.device}
    m = torch.full((n,), float("-inf"), **f32)
    s = torch.zeros(n, **f32)
    w = torch.zeros(n, **f32)
    zt = torch.zeros(n, **f32)
    rows, cols, widen = gemm_plan(hidden, weight)
    hid = _f32(hidden) if widen and rows >= n else hidden
    tgt = target_local.long()
    for v0, v1 in _ranges(v, cols):  # vocab outer: each W block is read once
        w_c = _f32(weight[v0:v1]) if widen else weight[v0:v1]
        b_c = bias[v0:v1] if bias is not None else None
        for n0, n1 in _ranges(n, rows):
            h_t = _f32(hid[n0:n1]) if widen else hid[n0:n1]
            z = logits_tile(h_t, w_c)
            args = (z, b_c, tgt[n0:n1] - v0, temperature, return_entropy, m[n0:n1], s[n0:n1], w[n0:n1], zt[n0:n1])
            (epilogue or _fwd_epilogue_torch)(*args)
    return m, s, w, zt


def linear_logprobs_stats(hidden, weight, bias, target_local, temperature, return_entropy):
    return stats_loop(hidden, weight, bias, target_local, temperature, return_entropy)


def merge_over_group(m, s, w, zt, group):
    """Row statistics (m, s, w, zt) of the whole vocabulary from each rank's slice (vocab-parallel)."""
    import torch.distributed as dist

    m_glob = m.clone()
    dist.all_reduce(m_glob, op=dist.ReduceOp.MAX, group=group)
    m_ref = torch.where(torch.isneginf(m_glob), torch.zeros_like(m_glob), m_glob)
    scale = torch.exp(m - m_ref)
    shift = torch.where(s > 0, s * (m - m_ref), torch.zeros_like(s))
    packed = torch.stack([s * scale, (w + shift) * scale, zt])
    dist.all_reduce(packed, group=group)
    return m_glob, packed[0], packed[1], packed[2]


# ---- backward ----

def _bwd_epilogue_torch(z, bias_c, tgt_c, temperature, lse, ent, g_lp, g_h, out_dtype):
    """dZ tile (out_dtype) from the fp32 logits tile z (owned by the caller, overwritten)."""
    if bias_c is not None:
        z.add_(bias_c.float())
    if temperature != 1.0:
        z.div_(temperature)
    logp_all = z.sub_(lse[:, None])
    p = torch.exp(logp_all)
    if g_h is not None:
        term = logp_all.clamp_(min=_F32_MIN).add_(ent[:, None]).mul_(p).mul_(-g_h[:, None])
        term.addcmul_(p, g_lp[:, None], value=-1.0)
    else:
        term = p.mul_(-g_lp[:, None])
    owned = (tgt_c >= 0) & (tgt_c < z.shape[1])
    safe = torch.where(owned, tgt_c, torch.zeros_like(tgt_c))
    term.scatter_add_(1, safe[:, None], torch.where(owned, g_lp, torch.zeros_like(g_lp))[:, None])
    if temperature != 1.0:
        term.mul_(1.0 / temperature)
    return term if out_dtype == torch.float32 else term.to(out_dtype)


def backward_loop(
    grad_logp, grad_ent, hidden, weight, bias, target_local, lse, ent, temperature,
    need_hidden, need_weight, need_bias, fp32_accumulate, epilogue=None,
):
    n, hdim = hidden.shape
    v = weight.shape[0]
    dtype, dev = hidden.dtype, hidden.device
    need_bias = need_bias and bias is not None
    rows, cols, widen = gemm_plan(hidden, weight)
    # widened: GEMM operands (hidden rows, W blocks, dZ) in fp32; dZ is never rounded to `dtype`
    dz_dtype = torch.float32 if widen else dtype
    tgt = target_local.long()
    g_lp = grad_logp.float()
    g_h = grad_ent.float() if grad_ent is not None else None
    acc_dtype = torch.float32 if fp32_accumulate else dtype
    gb = torch.zeros(v, dtype=torch.float32, device=dev) if need_bias else None
    epi = epilogue or _bwd_epilogue_torch

    def tile(h_t, w_t, n0, n1, v0, v1):
        z = logits_tile(h_t, w_t)
        b_c = bias[v0:v1] if bias is not None else None
        dz = epi(z, b_c, tgt[n0:n1] - v0, temperature, lse[n0:n1], ent[n0:n1], g_lp[n0:n1],
                 None if g_h is None else g_h[n0:n1], dz_dtype)
        if need_bias:
            gb[v0:v1] += dz.float().sum(0)
        return dz

    if n <= v:  # vocab outer: grad_hidden spans the outer loop
        gh_acc = torch.zeros((n, hdim), dtype=acc_dtype, device=dev) if need_hidden else None
        gw = torch.empty_like(weight) if need_weight else hidden.new_empty(0)
        hid = _f32(hidden) if widen and rows >= n else hidden
        for v0, v1 in _ranges(v, cols):
            w_c = _f32(weight[v0:v1]) if widen else weight[v0:v1]
            single = rows >= n
            gw_acc = None
            if need_weight and not single:
                gw_acc = torch.zeros((v1 - v0, hdim), dtype=torch.float32, device=dev)
            for n0, n1 in _ranges(n, rows):
                h_t = _f32(hid[n0:n1]) if widen else hid[n0:n1]
                dz = tile(h_t, w_c, n0, n1, v0, v1)
                if need_hidden:
                    _add_mm(gh_acc[n0:n1], dz, w_c)
                if need_weight:
                    if single and widen:  # fp32 GEMM, one rounding to the weight dtype
                        gw[v0:v1] = torch.mm(dz.T, h_t)
                    elif single:  # one GEMM over all rows: fp32 accumulation inside, one rounding
                        torch.mm(dz.T, h_t, out=gw[v0:v1])
                    else:
                        _add_mm(gw_acc, dz.T, h_t)
            if gw_acc is not None:
                gw[v0:v1] = gw_acc
        gh = (gh_acc if gh_acc.dtype == dtype else gh_acc.to(dtype)) if need_hidden else hidden.new_empty(0)
    else:  # rows outer: grad_weight spans the outer loop
        gw_acc = torch.zeros((v, hdim), dtype=acc_dtype, device=dev) if need_weight else None
        gh = torch.empty_like(hidden) if need_hidden else hidden.new_empty(0)
        wgt = _f32(weight) if widen else weight  # V < N: no larger than the fp32 grad_weight buffer
        for n0, n1 in _ranges(n, rows):
            h_c = _f32(hidden[n0:n1]) if widen else hidden[n0:n1]
            gh_part = torch.zeros((n1 - n0, hdim), dtype=torch.float32, device=dev) if need_hidden else None
            for v0, v1 in _ranges(v, cols):
                dz = tile(h_c, wgt[v0:v1], n0, n1, v0, v1)
                if need_hidden:
                    _add_mm(gh_part, dz, wgt[v0:v1])
                if need_weight:
                    _add_mm(gw_acc[v0:v1], dz.T, h_c)
            if need_hidden:
                gh[n0:n1] = gh_part
        gw = (gw_acc if gw_acc.dtype == dtype else gw_acc.to(dtype)) if need_weight else hidden.new_empty(0)
    gbo = gb.to(bias.dtype) if need_bias else hidden.new_empty(0)
    return gh, gw, gbo


def linear_logprobs_backward(
    grad_logp, grad_ent, hidden, weight, bias, target_local, lse, ent, temperature,
    need_hidden, need_weight, need_bias, fp32_accumulate,
):
    return backward_loop(
        grad_logp, grad_ent, hidden, weight, bias, target_local, lse, ent, temperature,
        need_hidden, need_weight, need_bias, fp32_accumulate,
    )
