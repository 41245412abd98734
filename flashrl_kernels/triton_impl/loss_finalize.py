"""The loss ops' last step on a GPU in one launch: merge the per-program statistics rows and finalize them.

policy_loss and value_loss reduce their tokens into one row of statistics per program; merging the rows
(`combine_stats`) and turning the result into (loss, metrics, scale) (`finalize`) were ~15 (policy) and ~35
(value, float64) small torch ops. On a GPU each is a kernel launch of ~5-20 us of host time, while the token
kernels run in ~10-70 us of device time at trainer micro-batch sizes: an H200 spent 0.5 ms (policy) and 1.2 ms
(value) of host time per forward call (bench/gpu_runs/2026-12-04-h200-b/loss_call_profile.log). The kernels
below do the same arithmetic as torch_impl's combine_stats + finalize (policy: fp32, value: float64), in one
program; the sums run in another order than torch's (tree reductions), so results agree to rounding, not bits.
VAPO's NLL term (policy_loss with `positive`) keeps the torch path.
"""
from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from ..torch_impl import policy_loss as _policy
from ..torch_impl import value_loss as _value
from ._host import next_power_of_2, split_double

_AGG = {"token-mean": 0, "token-sum": 1}  # anything else divides by the non-empty sequences
N_VALUE_METRICS = 6  # len(ops.value_loss.VALUE_METRIC_NAMES), in the order the kernel stores them


@triton.jit
def _divisor(NORM, n_tok, n_seq, DIV_HI, DIV_LO, HAS_NORM: tl.constexpr, AGG: tl.constexpr):
    """finalize's divisor: the tensor normalizer, else the float divisor when positive (passed as two fp32
    halves, hi + lo, which Triton's fp32 scalar arguments carry exactly), else the mode's default."""
    if HAS_NORM:
        d = tl.load(NORM).to(n_tok.dtype)
    elif DIV_HI > 0:
        d = (n_tok * 0.0 + DIV_HI) + DIV_LO
    elif AGG == 0:
        d = tl.maximum(n_tok, 1.0)
    elif AGG == 1:
        d = n_tok * 0.0 + 1.0
    else:
        d = tl.maximum(n_seq, 1.0)
    return d


def _split_float(x: float, dtype: torch.dtype) -> tuple[float, float]:
    """x as hi + lo, both fp32-representable: the divisor the torch path makes in `dtype`, exactly (fp32: lo 0)."""
    return (float(np.float32(x)), 0.0) if dtype == torch.float32 else split_double(x)


@triton.jit
def _pick(vec, cols, c):
    """vec[c] of a small register vector."""
    return tl.sum(tl.where(cols == c, vec, 0.0), axis=0)


@triton.jit
def _policy_finalize_kernel(
    ROWS, R, NORM, INDEX, LOSS, METRICS, SCALE, DIV_HI, DIV_LO,
    HAS_NORM: tl.constexpr, AGG: tl.constexpr, NSTATS: tl.constexpr, NMET: tl.constexpr, COLS: tl.constexpr,
    MET: tl.constexpr, BLOCK: tl.constexpr,
):
    cols = tl.arange(0, COLS)
    in_cols = cols < NSTATS
    is_max = (cols == 7) | (cols == 11) | (cols == 18)  # max_r, max_w, max_s (torch_impl.policy_loss._MAX_COLS)
    is_min = (cols == 8) | (cols == 10) | (cols == 17)  # min_r, min_w, min_s (_MIN_COLS)
    s = tl.zeros((COLS,), dtype=tl.float32)
    mx = tl.full((COLS,), float("-inf"), dtype=tl.float32)
    mn = tl.full((COLS,), float("inf"), dtype=tl.float32)
    nans = tl.zeros((COLS,), dtype=tl.int32)
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        ok = (r < R)[:, None] & in_cols[None, :]
        x = tl.load(ROWS + r.to(tl.int64)[:, None] * NSTATS + cols[None, :], mask=ok, other=0.0)
        s += tl.sum(x, axis=0)
        mx = tl.maximum(mx, tl.max(tl.where(ok, x, float("-inf")), axis=0))
        mn = tl.minimum(mn, tl.min(tl.where(ok, x, float("inf")), axis=0))
        nans += tl.sum((ok & (x != x)).to(tl.int32), axis=0)  # noqa: PLR0124 (x != x: NaN)
    # a NaN row makes the max / min NaN, as torch's amax / amin (the GPU's max instruction would skip it)
    st = tl.where(is_max, mx, tl.where(is_min, mn, s))
    st = tl.where((is_max | is_min) & (nans > 0), float("nan"), st)
    n_tok = _pick(st, cols, 0)
    d = _divisor(NORM, n_tok, _pick(st, cols, 1), DIV_HI, DIV_LO, HAS_NORM, AGG)
    scale = 1.0 / d
    tl.store(LOSS, _pick(st, cols, 2) * scale)
    tl.store(SCALE, scale)
    # metrics from the table: ext = [stats, nll_sum = 0, n_pos = 0, 1.0] (no NLL term on this path)
    ext = tl.where(in_cols, st, tl.where(cols == NSTATS + 2, 1.0, 0.0))
    m = tl.arange(0, MET)
    m_ok = m < NMET
    vi = tl.load(INDEX + m, mask=m_ok, other=0)
    di = tl.load(INDEX + NMET + m, mask=m_ok, other=0)
    gi = tl.load(INDEX + 2 * NMET + m, mask=m_ok, other=0)
    val = tl.sum(tl.where(cols[None, :] == vi[:, None], ext[None, :], 0.0), axis=1)
    den = tl.sum(tl.where(cols[None, :] == di[:, None], ext[None, :], 0.0), axis=1)
    gate = tl.sum(tl.where(cols[None, :] == gi[:, None], ext[None, :], 0.0), axis=1)
    metrics = tl.where(gate > 0, val * (1.0 / tl.maximum(den, 1.0)), 0.0)
    tl.store(METRICS + m, metrics, mask=m_ok)


def _outputs(dev, nmet: int, normalizer):
    """(loss, metrics, scale) fp32 outputs, and the normalizer argument (the loss as a dummy pointer without one)."""
    loss = torch.empty((), dtype=torch.float32, device=dev)
    metrics = torch.empty(nmet, dtype=torch.float32, device=dev)
    scale = torch.empty((), dtype=torch.float32, device=dev)
    return loss, metrics, scale, (normalizer.reshape(()) if normalizer is not None else loss)


def policy_finalize(rows: torch.Tensor, normalizer, divisor: float, agg: str):
    """(loss, metrics, scale) of policy_loss from its statistics rows [R, N_STATS] (fp32), one launch; the same
    as torch_impl.policy_loss.finalize(combine_stats(rows), ...) without the NLL term."""
    idx, _ = _policy._finalize_index(rows.device)
    nmet = len(_policy.METRIC_NAMES)
    loss, metrics, scale, norm = _outputs(rows.device, nmet, normalizer)
    _policy_finalize_kernel[(1,)](
        rows, rows.shape[0], norm, idx, loss, metrics, scale, *_split_float(divisor, torch.float32),
        HAS_NORM=normalizer is not None, AGG=_AGG.get(agg, 2), NSTATS=_policy.N_STATS, NMET=nmet,
        COLS=next_power_of_2(_policy.N_STATS + 3), MET=next_power_of_2(nmet), BLOCK=64, num_warps=4,
    )
    return loss, metrics, scale


@triton.jit
def _value_finalize_kernel(
    ROWS, R, GROUP, NORM, LOSS, METRICS, SCALE, DIV_HI, DIV_LO,
    HAS_NORM: tl.constexpr, AGG: tl.constexpr, NSTATS: tl.constexpr, COLS: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Columns (torch_impl.value_loss.STAT_NAMES): 0 n_tok, 1 n_seq, 2 q, 3 n_clip, 4 sum_v, 5 sum_err2, 6 sum_r,
    7 m2_r, 8 sum_e, 9 m2_e; rows come in runs of GROUP per sequence. float64 throughout, as combine_stats."""
    cols = tl.arange(0, COLS)
    in_cols = cols < NSTATS
    s = tl.zeros((COLS,), dtype=tl.float64)
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        x = tl.load(ROWS + r.to(tl.int64)[:, None] * NSTATS + cols[None, :],
                    mask=(r < R)[:, None] & in_cols[None, :], other=0.0)
        s += tl.sum(x.to(tl.float64), axis=0)
    n_all = _pick(s, cols, 0)
    mean_r = _pick(s, cols, 6) / tl.maximum(n_all, 1.0)
    mean_e = _pick(s, cols, 8) / tl.maximum(n_all, 1.0)
    # the centred second moments: sum_b M2_b + sum_b n_b (mean_b - mean)^2 (Chan et al.), and the sequences that
    # hold a valid token (a run of GROUP rows with n > 0)
    dev_r = tl.zeros((BLOCK,), dtype=tl.float64)
    dev_e = tl.zeros((BLOCK,), dtype=tl.float64)
    for r0 in range(0, R, BLOCK):
        r = r0 + tl.arange(0, BLOCK)
        ok = r < R
        base = ROWS + r.to(tl.int64) * NSTATS
        n = tl.load(base, mask=ok, other=0.0).to(tl.float64)
        nc = tl.maximum(n, 1.0)
        dr = tl.load(base + 6, mask=ok, other=0.0).to(tl.float64) / nc - mean_r
        de = tl.load(base + 8, mask=ok, other=0.0).to(tl.float64) / nc - mean_e
        dev_r += n * dr * dr
        dev_e += n * de * de
    nseq = R // GROUP
    seqs = tl.zeros((BLOCK,), dtype=tl.float64)
    g = tl.arange(0, GROUP_P2)
    for s0 in range(0, nseq, BLOCK):
        sq = s0 + tl.arange(0, BLOCK)
        ok = (sq < nseq)[:, None] & (g < GROUP)[None, :]
        n = tl.load(ROWS + (sq.to(tl.int64)[:, None] * GROUP + g[None, :]) * NSTATS, mask=ok, other=0.0)
        seqs += (tl.sum(n, axis=1) > 0).to(tl.float64)
    m2_r = _pick(s, cols, 7) + tl.sum(dev_r, axis=0)
    m2_e = _pick(s, cols, 9) + tl.sum(dev_e, axis=0)
    d = _divisor(NORM, n_all, tl.sum(seqs, axis=0), DIV_HI, DIV_LO, HAS_NORM, AGG)
    scale = 1.0 / d
    tl.store(LOSS, (0.5 * _pick(s, cols, 2) * scale).to(tl.float32))
    tl.store(SCALE, scale.to(tl.float32))
    inv = 1.0 / tl.maximum(n_all, 1.0)
    var_r = m2_r * inv
    var_e = m2_e * inv
    ev = tl.where(var_r > 0, 1.0 - var_e / tl.where(var_r > 0, var_r, 1.0), 0.0)
    # metrics: [vf_clip_frac, explained_variance, value_mean, return_mean, value_error_mean, num_tokens]
    tl.store(METRICS + 0, (_pick(s, cols, 3) * inv).to(tl.float32))
    tl.store(METRICS + 1, ev.to(tl.float32))
    tl.store(METRICS + 2, (_pick(s, cols, 4) * inv).to(tl.float32))
    tl.store(METRICS + 3, (_pick(s, cols, 6) * inv).to(tl.float32))
    tl.store(METRICS + 4, (_pick(s, cols, 5) * inv).to(tl.float32))
    tl.store(METRICS + 5, n_all.to(tl.float32))


def value_finalize(rows: torch.Tensor, group: int, normalizer, divisor: float, agg: str):
    """(loss, metrics, scale) of value_loss from its statistics rows [S * group, N_STATS] (fp32), one launch; the
    same as torch_impl.value_loss.finalize(combine_stats(rows, group), ...)."""
    loss, metrics, scale, norm = _outputs(rows.device, N_VALUE_METRICS, normalizer)
    _value_finalize_kernel[(1,)](
        rows, rows.shape[0], group, norm, loss, metrics, scale, *_split_float(divisor, torch.float64),
        HAS_NORM=normalizer is not None, AGG=_AGG.get(agg, 2), NSTATS=_value.N_STATS,
        COLS=next_power_of_2(_value.N_STATS), GROUP_P2=next_power_of_2(max(group, 1)), BLOCK=64,
        num_warps=4,
    )
    return loss, metrics, scale
