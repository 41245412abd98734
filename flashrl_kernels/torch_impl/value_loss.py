"""Vectorised PyTorch value loss: the fallback on any device (the CPU default is the native kernel).

Works on the canonical form built by ops/value_loss.py: flat token tensors [N], an optional
bool mask [N], cu_seqlens [S+1] (int64). No Python loop over sequences: per-sequence valid
counts (for seq-mean-token-mean and the number of non-empty sequences) come from
policy_loss's `_seq_sums` (a reshape + sum when every sequence has the padded length
`uniform_len`, else one `segment_reduce`); per-sequence factors reach the tokens by a
broadcast (uniform) or policy_loss's `_per_token` gather (packed).

The statistics are one float64 vector of STAT_NAMES; `finalize` (shared with the native and
Triton backends) turns it into the loss, the metrics and the scale 1/D. Partial statistics
(Triton's per-program rows) are merged by `combine_stats`: plain sums, except the two
centred second moments (of R and of R - v), which are merged with Chan et al.'s pairwise
formula so explained_variance never suffers the cancellation of E[x^2] - E[x]^2.

On CPU the token math is compiled once per (clip on/off, seq-mean) with torch.compile
(dynamic shapes), as torch_impl/policy_loss.py does; FLASHRL_TORCH_COMPILE=0 runs eager, and
a failed compile warns once and falls back to eager.
"""
from __future__ import annotations

import os
import warnings

import torch

from .policy_loss import _per_token, _seq_sums

STAT_NAMES = ("n_tok", "n_seq", "q", "n_clip", "sum_v", "sum_err2", "sum_r", "m2_r", "sum_e", "m2_e")
N_STATS = len(STAT_NAMES)
# combine_stats merges the centred second moments as (sum, m2) column pairs 6..9
assert STAT_NAMES[6:10] == ("sum_r", "m2_r", "sum_e", "m2_e")


def combine_stats(rows: torch.Tensor, group: int | None = None) -> torch.Tensor:
    """Merge partial statistics rows [R, N_STATS] into one float64 vector.

    Columns are summed except m2_r / m2_e (each row's second moment about its own mean),
    merged as M2 = sum_b M2_b + sum_b n_b (mean_b - mean)^2. With `group`, rows come in runs
    of `group` per sequence and n_seq is recounted as the sequences with a valid token.
    """
    r = rows.double()
    out = r.sum(0)
    n = r[:, :1]
    # both moments at once: columns 6..9 are (sum_r, m2_r, sum_e, m2_e), viewed as [R, 2, (sum, m2)] (slices, not
    # index lists, which would copy an index tensor to the device at every call)
    pairs = r[:, 6:10].reshape(-1, 2, 2)
    mean_b = pairs[:, :, 0] / n.clamp(min=1.0)
    mean = out[6:10].reshape(2, 2)[:, 0] / out[0].clamp(min=1.0)
    out[6:10].view(2, 2)[:, 1] = pairs[:, :, 1].sum(0) + (n * (mean_b - mean) ** 2).sum(0)
    if group is not None:
        out[1] = (n.reshape(-1, group).sum(1) > 0).sum()
    return out


def _clamp1(x: float) -> float:
    return max(x, 1.0)  # NaN stays NaN (max returns its first argument when no comparison holds), as clamp(min=1)


def _finalize_on_host(stats: torch.Tensor, normalizer, divisor: float, agg: str):
    """`finalize` in Python float64 arithmetic (the same operations in the same order, so the same bits): on a CPU
    reading 10 numbers costs nothing, while ~25 tensor ops on 0-d float64 tensors cost ~0.1 ms per call."""
    n_tok, n_seq, q, n_clip, sum_v, sum_err2, sum_r, m2_r, _sum_e, m2_e = stats.double().tolist()
    if normalizer is not None:
        d = float(normalizer.reshape(()))
    elif divisor > 0:
        d = float(divisor)
    elif agg == "token-mean":
        d = _clamp1(n_tok)
    elif agg == "token-sum":
        d = 1.0
    else:
        d = _clamp1(n_seq)
    scale = 1.0 / d
    inv = 1.0 / _clamp1(n_tok)
    var_r, var_e = m2_r * inv, m2_e * inv
    ev = 1.0 - var_e / var_r if var_r > 0 else 0.0
    f32 = torch.float32
    return (torch.tensor(0.5 * q * scale, dtype=f32),
            torch.tensor([n_clip * inv, ev, sum_v * inv, sum_r * inv, sum_err2 * inv, n_tok], dtype=f32),
            torch.tensor(scale, dtype=f32))


def finalize(stats: torch.Tensor, normalizer, divisor: float, agg: str):
    """(loss, metrics vector, scale = 1 / D) from the combined statistics (no host sync).

    D: the tensor normalizer, else a positive `divisor` (a float normalizer, or T for
    seq-mean-token-sum-norm), else the mode's default: valid tokens (token-mean), 1
    (token-sum), non-empty sequences (seq-mean-*).
    """
    if stats.device.type == "cpu":
        try:
            return _finalize_on_host(stats, normalizer, divisor, agg)
        except ZeroDivisionError:  # a zero normalizer: the tensor path gives torch's inf / NaN
            pass
    return _finalize_tensors(stats, normalizer, divisor, agg)


def _finalize_tensors(stats: torch.Tensor, normalizer, divisor: float, agg: str):
    st = stats.double()
    dev = st.device
    n_tok, n_seq = st[0], st[1]
    if normalizer is not None:
        d = normalizer.reshape(()).double()
    elif divisor > 0:
        d = torch.full((), float(divisor), dtype=torch.float64, device=dev)
    elif agg == "token-mean":
        d = n_tok.clamp(min=1.0)
    elif agg == "token-sum":
        d = torch.ones((), dtype=torch.float64, device=dev)
    else:
        d = n_seq.clamp(min=1.0)
    scale = 1.0 / d
    loss = 0.5 * st[2] * scale
    # [vf_clip_frac, value_mean, value_error_mean, return_mean, Var(R), Var(R - v)] in one gather and one product
    per_tok = st[3:10] * (1.0 / n_tok.clamp(min=1.0))  # n_clip, sum_v, sum_err2, sum_r, m2_r, sum_e, m2_e
    var_r, var_e = per_tok[4], per_tok[6]
    ev = torch.where(var_r > 0, 1.0 - var_e / var_r, 0.0)  # (var_r = 0: the division's inf / NaN is not taken)
    metrics = torch.cat([per_tok[0:1], ev.reshape(1), per_tok[1:2], per_tok[3:4], per_tok[2:3], n_tok.reshape(1)])
    return loss.float(), metrics.float(), scale.float()


def _forward_terms(values, old_values, returns, mask, cu_seqlens, uniform_len, clip_range, seq_mean, need_grad=True):
    """(statistics [N_STATS] float64, g_tok [N] fp32, empty without need_grad). Plain torch; the body that gets compiled."""
    n = values.numel()
    nseq = cu_seqlens.numel() - 1
    f32, f64 = torch.float32, torch.float64
    if uniform_len > 0 and nseq * uniform_len != n:
        uniform_len = 0
    inv = None if mask is None else ~mask

    def clean(x):  # fp32, masked positions zeroed (their values may be anything, NaN included)
        y = x.to(f32)
        return y if inv is None else y.masked_fill(inv, 0.0)

    v, r = clean(values), clean(returns)
    d = v - r                                   # 0 at masked positions
    l1 = d * d
    zero = torch.zeros((), dtype=f64, device=values.device)
    if clip_range > 0:
        o = clean(old_values)
        vc = torch.minimum(torch.maximum(v, o - clip_range), o + clip_range)  # masked: clamp(0, -c, c) = 0
        dc = vc - r
        l2 = dc * dc
        use2 = ~(l2 <= l1)                      # strictly larger, or NaN (kept, so the loss shows it)
        per_tok = torch.where(use2, l2, l1)
        g = torch.where(use2, 0.0, d)
        n_clip = (l2 > l1).sum().to(f64)
    else:
        per_tok, g, n_clip = l1, d, zero

    if mask is not None:
        n_i = _seq_sums(mask.to(f32), cu_seqlens, uniform_len)
    else:
        n_i = (cu_seqlens[1:] - cu_seqlens[:-1]).to(f32)
    n_tok = n_i.sum(dtype=f64)
    if seq_mean:
        alpha = 1.0 / n_i.clamp(min=1.0)
        q = (_seq_sums(per_tok.to(f64), cu_seqlens, uniform_len) * alpha).sum()  # f64: long packed sequences
        if need_grad and uniform_len > 0:
            g = (g.reshape(-1, uniform_len) * alpha[:, None]).reshape(n)
        elif need_grad:
            g = g * _per_token(alpha, cu_seqlens, n, 0)
    else:
        q = per_tok.sum(dtype=f64)

    # centred second moments for explained_variance (two passes: exact enough at any offset)
    e = r - v
    sum_r, sum_e = r.sum(dtype=f64), e.sum(dtype=f64)
    cnt = n_tok.clamp(min=1.0)
    cr = r - (sum_r / cnt).to(f32)
    ce = e - (sum_e / cnt).to(f32)
    if inv is not None:
        cr = cr.masked_fill(inv, 0.0)
        ce = ce.masked_fill(inv, 0.0)
    stats = torch.stack([
        n_tok, (n_i > 0).sum().to(f64), q, n_clip, v.sum(dtype=f64), l1.sum(dtype=f64),
        sum_r, (cr * cr).sum(dtype=f64), sum_e, (ce * ce).sum(dtype=f64),
    ])
    return stats, (g if need_grad else g.new_zeros(0))


_compiled: dict = {}
_compile_broken: list = []


def _compile_enabled(device) -> bool:
    if device.type != "cpu" or _compile_broken:
        return False
    return os.environ.get("FLASHRL_TORCH_COMPILE", "1") not in ("0", "false", "False", "off")


def _compiled_terms(clip_range: float, seq_mean: bool, need_grad: bool):
    key = (clip_range, seq_mean, need_grad)
    fn = _compiled.get(key)
    if fn is None:
        def terms(values, old_values, returns, mask, cu_seqlens, uniform_len):
            return _forward_terms(values, old_values, returns, mask, cu_seqlens, uniform_len, clip_range, seq_mean,
                                  need_grad)

        fn = _compiled[key] = torch.compile(terms, dynamic=True)
    return fn


def value_loss_forward(values, old_values, returns, mask, cu_seqlens, normalizer, clip_range, agg, divisor,
                       uniform_len, need_grad=True):
    seq_mean = agg == "seq-mean-token-mean"  # the other modes differ only in finalize's divisor
    tensors = (values, old_values, returns, mask, cu_seqlens, uniform_len)
    out = None
    if _compile_enabled(values.device):
        try:
            out = _compiled_terms(float(clip_range), seq_mean, bool(need_grad))(*tensors)
        except Exception as exc:
            _compile_broken.append(exc)
            warnings.warn(f"flashrl torch backend: torch.compile of value_loss failed ({exc!r}); using eager torch",
                          RuntimeWarning, stacklevel=2)
    if out is None:
        out = _forward_terms(*tensors, float(clip_range), seq_mean, bool(need_grad))
    stats, g_tok = out
    loss, metrics, scale = finalize(stats, normalizer, divisor, agg)
    return loss, metrics, g_tok, scale


def value_loss_backward(grad_loss, g_tok, scale, dtype):
    g = (grad_loss.float() * scale).reshape(())
    return (g_tok * g).to(dtype)
