"""Vectorised PyTorch policy loss: the CPU path and the fallback on any device.

Works on the canonical form built by ops/policy_loss.py: flat token tensors
[N], an optional bool mask [N], cu_seqlens [S+1] (int64) and advantages per
sequence [S] or per token [N]. No Python loop over sequences:

- per-sequence sums (valid-token counts, sum of log-ratios for GSPO, sum of
  old - rollout log-ratios for sequence TIS) come from one `segment_reduce`
  (or a reshape + sum when every sequence has the same padded length,
  `uniform_len`), per-sequence values reach the tokens by broadcasting
  (uniform) or one gather (packed);
- the forward computes the loss and, analytically, the per-token gradient
  coefficient `g_tok` (what autograd would find), so the backward is one
  multiply;
- statistics are accumulated into one vector of STAT_NAMES and turned into the
  loss and metrics by `finalize` (shared with the Triton backend).

On CPU the token math (`_forward_terms`) is compiled once per LossConfig with
torch.compile (dynamic shapes), which fuses its ~40 elementwise passes into a
few C++ loops; this is what makes the CPU path several times faster than eager
torch. The first call per config pays the compile (seconds). Set
FLASHRL_TORCH_COMPILE=0 to run eager; a failed compile (e.g. no C++ compiler)
warns once and falls back to eager.
"""
from __future__ import annotations

import math
import os
import warnings

import numpy as np
import torch

from ..loss_config import METRIC_NAMES

STAT_NAMES = (
    "n_tok", "n_seq", "q", "clip_low", "clip_high", "clip_dual", "sum_r", "max_r", "min_r",
    "sum_w", "min_w", "max_w", "n_tis_out", "sum_mkl", "sum_kl", "sum_ent", "sum_s", "min_s", "max_s",
)
_MAX_COLS = (7, 11, 18)
_MIN_COLS = (8, 10, 17)
N_STATS = len(STAT_NAMES)


_COMBINE_KIND: dict = {}


def combine_stats(rows: torch.Tensor) -> torch.Tensor:
    """Reduce partial statistics rows [R, N_STATS] to one vector: sums, except max/min columns.
    (Three reductions over every column and two selects: 5 kernel launches on a GPU, not 13.)"""
    key = str(rows.device)
    if key not in _COMBINE_KIND:
        kind = torch.zeros(N_STATS, dtype=torch.int8)
        kind[list(_MAX_COLS)] = 1
        kind[list(_MIN_COLS)] = 2
        _COMBINE_KIND[key] = (kind == 1).to(rows.device), (kind == 2).to(rows.device)
    is_max, is_min = _COMBINE_KIND[key]
    return torch.where(is_max, rows.amax(0), torch.where(is_min, rows.amin(0), rows.sum(0)))


def nll_stats(logp, mask, cu_seqlens, uniform_len, positive):
    """VAPO's NLL term: [sum of -logp, count] over the valid tokens of positive sequences (fp32 [2]).

    One read of logp, shared by every fast backend (the token kernels do not see `positive`).
    """
    n = logp.numel()
    nseq = cu_seqlens.numel() - 1
    if uniform_len > 0 and nseq * uniform_len != n:
        uniform_len = 0
    lp = logp.to(torch.float32)
    if mask is not None:
        lp = lp.masked_fill(~mask, 0.0)
        n_i = _seq_sums(mask.to(torch.float32), cu_seqlens, uniform_len)
    else:
        n_i = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.float32)
    pos = positive.to(torch.float32)
    return torch.stack([-(_seq_sums(lp, cu_seqlens, uniform_len) * pos).sum(), (n_i * pos).sum()])


def add_nll(seq_coef, nll, positive, nll_coef, scale):
    """seq_coef plus the NLL term's per-sequence gradient, in units of the backward's grad_loss * scale.

    d(nll_coef * nll_sum / n_pos) / d logp_t = -nll_coef / n_pos on positive valid tokens; the backward
    multiplies seq_coef by scale = 1 / divisor, hence the division by scale here.
    """
    c = positive.to(torch.float32) * (-nll_coef / (nll[1].clamp(min=1.0) * scale))
    return c if seq_coef.numel() == 0 else seq_coef + c


# finalize's metric table: for each name of METRIC_NAMES, (statistic, count it is divided by, count gating it to 0
# when empty). Indices into [stats[:N_STATS], nll_sum, n_pos, 1.0]: 0 = n_tok, 1 = n_seq, _POS = n_pos, _ONE = 1.
_NLL_SUM, _POS, _ONE = N_STATS, N_STATS + 1, N_STATS + 2
_METRIC_TABLE = (
    (3, 0, _ONE), (4, 0, _ONE), (5, 0, _ONE),          # clip fractions (per valid token)
    (6, 0, _ONE), (8, _ONE, 0), (7, _ONE, 0),          # ratio mean / min / max
    (16, 1, _ONE), (17, _ONE, 1), (18, _ONE, 1),       # GSPO sequence ratio mean / min / max
    (9, 0, _ONE), (10, _ONE, 0), (11, _ONE, 0),        # TIS weight mean / min / max
    (12, 0, _ONE), (13, 0, _ONE), (14, 0, _ONE), (15, 0, _ONE),  # tis_frac_clipped, mismatch_kl, kl, entropy
    (0, _ONE, _ONE), (1, _ONE, _ONE),                  # num_tokens, num_seqs
    (_NLL_SUM, _POS, _ONE), (_POS, _ONE, _ONE),        # nll_mean, num_positive_tokens
)
_NLL_MEAN = METRIC_NAMES.index("nll_mean")
_METRIC_INDEX_NP = np.array([row[j] for j in range(3) for row in _METRIC_TABLE])
_FINALIZE_INDEX: dict = {}


def _finalize_index(device):
    """(gather index [3 * metrics], the constant 1.0 [1]) on device, made once per device."""
    key = str(device)
    if key not in _FINALIZE_INDEX:
        _FINALIZE_INDEX[key] = (torch.from_numpy(_METRIC_INDEX_NP).to(device=device, dtype=torch.long),
                                torch.ones(1, dtype=torch.float32, device=device))
    return _FINALIZE_INDEX[key]


def finalize(stats: torch.Tensor, normalizer, divisor: float, agg: str, nll=None, nll_coef: float = 0.0):
    """(loss, metrics vector, scale = 1 / divisor) from the combined statistics (no host sync).

    The divisor: the tensor normalizer, else a positive `divisor` (config normalizer, or T for
    seq-mean-token-sum-norm), else the mode's default: valid tokens (token-mean), 1 (token-sum),
    non-empty sequences (seq-mean-*). `nll` ([2] from `nll_stats`, or None) adds VAPO's NLL term,
    weighted by nll_coef, outside the divisor. On a CPU the same float32 arithmetic runs in numpy
    (`_finalize_on_host`: identical bits, a tenth of the host time of ~10 tensor ops on 0-d tensors).
    """
    if stats.device.type == "cpu":
        return _finalize_on_host(stats, normalizer, divisor, agg, nll, nll_coef)
    return _finalize_tensors(stats, normalizer, divisor, agg, nll, nll_coef)


def _finalize_on_host(stats, normalizer, divisor, agg, nll, nll_coef):
    f = np.float32
    with np.errstate(all="ignore"):  # a zero normalizer gives inf / NaN, as the tensor path does
        st = stats.detach().float().numpy()
        if normalizer is not None:
            d = normalizer.detach().reshape(()).float().numpy()[()]
        elif divisor > 0:
            d = f(divisor)
        elif agg == "token-mean":
            d = np.maximum(st[0], f(1.0))
        elif agg == "token-sum":
            d = f(1.0)
        else:
            d = np.maximum(st[1], f(1.0))
        scale = f(1.0) / d
        loss = st[2] * scale
        nll_np = nll.detach().float().numpy() if nll is not None else np.zeros(2, dtype=f)
        ext = np.concatenate([st[:N_STATS], nll_np, np.ones(1, dtype=f)])
        val, den, gate = ext[_METRIC_INDEX_NP].reshape(3, -1)
        metrics = np.where(gate > 0, val * (f(1.0) / np.maximum(den, f(1.0))), f(0.0)).astype(f)
        if nll is not None and nll_coef != 0.0:
            loss = loss + f(nll_coef) * metrics[_NLL_MEAN]
    return (torch.from_numpy(np.asarray(loss, dtype=f).reshape(())), torch.from_numpy(metrics),
            torch.from_numpy(np.asarray(scale, dtype=f).reshape(())))


def _finalize_tensors(stats, normalizer, divisor, agg, nll, nll_coef):
    st = stats.float()
    n_tok, n_seq = st[0], st[1]
    if normalizer is not None:
        d = normalizer.reshape(()).float()
    elif divisor > 0:
        d = torch.full((), float(divisor), dtype=torch.float32, device=st.device)
    elif agg == "token-mean":
        d = n_tok.clamp(min=1.0)
    elif agg == "token-sum":
        d = torch.ones((), dtype=torch.float32, device=st.device)
    else:
        d = n_seq.clamp(min=1.0)
    scale = 1.0 / d
    loss = st[2] * scale
    # every metric is one statistic, times 1 / max(count, 1) or gated on count > 0, in one gather and one where:
    # ~10 small ops instead of ~45 (each a kernel launch on a GPU, ~5-20 us of host time)
    idx, one = _finalize_index(st.device)
    ext = torch.cat([st[:N_STATS], nll.float() if nll is not None else torch.zeros_like(one).expand(2), one])
    val, den, gate = ext.index_select(0, idx).view(3, -1)
    metrics = torch.where(gate > 0, val * (1.0 / den.clamp(min=1.0)), 0.0)
    if nll is not None and nll_coef != 0.0:
        loss = loss + nll_coef * metrics[_NLL_MEAN]
    assert metrics.numel() == len(METRIC_NAMES)
    return loss, metrics, scale


def _seq_sums(x, cu_seqlens, uniform_len):
    """Per-sequence sums of the token tensor x [N] or [N, k]."""
    if uniform_len > 0:
        return x.reshape(-1, uniform_len, *x.shape[1:]).sum(1)
    return torch.segment_reduce(x, "sum", offsets=cu_seqlens, axis=0)


def _per_token(v, cu_seqlens, n, uniform_len):
    """Per-sequence values v [S] as per-token values [N] (a view when uniform)."""
    if uniform_len > 0:
        return v[:, None].expand(-1, uniform_len).reshape(n) if v.numel() * uniform_len == n else v
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return torch.repeat_interleave(v, lengths, output_size=n)


def _tis(rho, tis_mode, tis_min, tis_max):
    """(applied weight, outside the bounds) for raw ratios rho (not modified)."""
    outside = (rho < tis_min) | (rho > tis_max)
    if tis_mode.endswith("truncate"):
        w = rho.clamp(tis_min, tis_max)
    else:
        w = rho.masked_fill(outside, 0.0)
    return w, outside


def _forward_terms(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, uniform_len,
                   eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta,
                   entropy_coef):
    """Statistics vector, g_tok, g_ent, seq_coef. Plain torch; also the body that gets compiled."""
    n = logp.numel()
    nseq = cu_seqlens.numel() - 1
    dev = logp.device
    f32 = torch.float32
    if uniform_len > 0 and nseq * uniform_len != n:
        uniform_len = 0
    valid = mask
    inv = None if valid is None else ~valid

    def clean(x):  # fp32 copy with masked positions zeroed (their values may be anything, NaN included)
        y = x.to(f32, copy=True)
        return y if inv is None else y.masked_fill_(inv, 0.0)

    # ---- per-sequence pass: counts, sum of log-ratios, sum of rollout log-ratios ----
    log_ratio = logp.to(f32) - old_logp.to(f32)
    if inv is not None:
        log_ratio.masked_fill_(inv, 0.0)
    seq_tis = tis_mode.startswith("sequence")
    tis_lr = None
    if rollout_logp is not None:
        tis_lr = old_logp.to(f32) - rollout_logp.to(f32)
        if inv is not None:
            tis_lr.masked_fill_(inv, 0.0)
    if valid is not None:
        n_i = _seq_sums(valid.to(f32), cu_seqlens, uniform_len)
    else:
        n_i = (cu_seqlens[1:] - cu_seqlens[:-1]).to(f32)
    n_i1 = n_i.clamp(min=1.0)
    s_i = torch.exp(_seq_sums(log_ratio, cu_seqlens, uniform_len) / n_i1)
    nonempty = n_i > 0
    seq_w = seq_out = None
    if seq_tis:
        d = _seq_sums(tis_lr, cu_seqlens, uniform_len)
        if tis_reduce == "mean":
            d = d / n_i1
        seq_w, seq_out = _tis(torch.exp(d), tis_mode, tis_min, tis_max)
    alpha = (1.0 / n_i1) if agg == "seq-mean-token-mean" else None

    adv_per_seq = advantages.numel() != n
    adv = advantages.to(f32)
    if not adv_per_seq and inv is not None:
        adv = adv.masked_fill(inv, 0.0)

    # ---- token pass ----
    lo, hi = 1.0 - eps_low, 1.0 + eps_high
    c = dual_clip if dual_clip > 0 else math.inf
    vf = None if valid is None else valid.to(f32)

    def tok(v):
        return None if v is None else _per_token(v, cu_seqlens, n, uniform_len)

    a_t = tok(adv) if adv_per_seq else adv
    if vf is not None and adv_per_seq:
        a_t = a_t * vf
    alpha_t = tok(alpha)
    if level == "token":
        r = torch.exp(log_ratio)
    else:
        r = tok(s_i).to(f32)
    rho_t = torch.exp(tis_lr) if tis_lr is not None else None  # rollout -> old ratio, one exp for TIS and mismatch KL
    pos = a_t > 0
    neg = a_t < 0
    rc = torch.where(pos, r.clamp(max=hi), r.clamp(lo, c))
    unclipped = rc == r
    # The loss sum is three separate reductions (clipped term, KL, entropy), each out of place: with all three
    # terms in one in-place chain Inductor's dynamic-shape graph under no_grad returned a wrong sum (the
    # gradients were right); separate, fused reductions cost the same.
    loss_t = -(rc * a_t)                              # -A * min/max(...): the clipped PPO term
    g_pg = -(torch.where(unclipped, a_t, 0.0) * r)    # d loss_t / d logp through r (token / seq_token)
    if tis_mode != "none":
        if seq_tis:
            w_t = tok(seq_w)
            out_t = tok(seq_out)
        else:
            w_t, out_t = _tis(rho_t, tis_mode, tis_min, tis_max)
        loss_t = loss_t * w_t
        g_pg = g_pg * w_t
    else:
        w_t = out_t = None
    if level == "sequence":
        # all tokens of a sequence share s_i: the gradient is per sequence, spread over its tokens in backward
        g_tok = torch.zeros(n, dtype=f32, device=dev)
        gsum = _seq_sums(g_pg, cu_seqlens, uniform_len)
        seq_coef = gsum / n_i1
        if alpha is not None:
            seq_coef = seq_coef * alpha
    else:
        g_tok = g_pg
        seq_coef = logp.new_zeros(0, dtype=f32)
    sum_kl = torch.zeros((), dtype=f32, device=dev)
    q_kl = q_ent = None
    if ref_logp is not None:
        y = ref_logp.to(f32) - logp.to(f32)
        if inv is not None:
            y.masked_fill_(inv, 0.0)
        e = torch.exp(y)
        kl = e - y - 1.0
        sum_kl = kl.sum()
        if beta != 0.0:
            q_kl = beta * (kl if alpha_t is None else kl * alpha_t).sum()
            g_tok = g_tok + (1.0 - e) * beta
    sum_ent = torch.zeros((), dtype=f32, device=dev)
    g_ent = logp.new_zeros(0, dtype=f32)
    if entropy is not None:
        h = clean(entropy)
        sum_ent = h.sum()
        if entropy_coef != 0.0:
            q_ent = -entropy_coef * (h if alpha_t is None else h * alpha_t).sum()
        g_ent = torch.full((n,), -entropy_coef, dtype=f32, device=dev)
        if vf is not None:
            g_ent.mul_(vf)
        if alpha_t is not None:
            g_ent.mul_(alpha_t)
    # masked positions already contribute 0: their log-ratios, KL inputs and advantages were zeroed above
    if alpha_t is not None:
        loss_t = loss_t * alpha_t
        if level != "sequence" or ref_logp is not None:
            g_tok = g_tok * alpha_t

    q = loss_t.sum()
    for extra in (q_kl, q_ent):
        if extra is not None:
            q = q + extra

    # ---- statistics ----
    n_tok = n_i.sum()
    zero = torch.zeros((), dtype=f32, device=dev)

    def count(b):
        return (b if valid is None else b & valid).sum().to(f32)

    r_tok = r if level == "token" else torch.exp(log_ratio)
    big = torch.tensor(math.inf, dtype=f32, device=dev)

    def vmax(x, keep):  # max over the kept entries; -inf when there are none (also for an empty batch)
        x = x if keep is None else torch.where(keep, x, -big)
        return x.amax(0) if x.numel() else -big

    def vmin(x, keep):
        x = x if keep is None else torch.where(keep, x, big)
        return x.amin(0) if x.numel() else big

    max_r, min_r = vmax(r_tok, valid), vmin(r_tok, valid)
    sum_r = r_tok.sum() if valid is None else r_tok.sum() - (n - n_tok)  # masked positions hold exp(0) = 1
    if w_t is None:
        sum_w, min_w, max_w, n_out = n_tok, torch.ones_like(zero), torch.ones_like(zero), zero
    elif seq_tis:
        sum_w = (seq_w * n_i).sum()
        min_w, max_w = vmin(seq_w, nonempty), vmax(seq_w, nonempty)
        n_out = (seq_out.to(f32) * n_i).sum()
    else:
        sum_w = w_t.sum() if vf is None else (w_t * vf).sum()
        min_w, max_w = vmin(w_t, valid), vmax(w_t, valid)
        n_out = count(out_t)
    sum_mkl = zero
    if tis_lr is not None:
        sum_mkl = (rho_t - 1.0 - tis_lr).sum()  # masked positions give exp(0) - 1 - 0 = 0
    stats = torch.stack([
        n_tok, nonempty.sum().to(f32), q,
        count(neg & (r < lo)), count(pos & (r > hi)), count(neg & (r > c)) if dual_clip > 0 else zero,
        sum_r, max_r, min_r, sum_w, min_w, max_w, n_out, sum_mkl, sum_kl, sum_ent,
        torch.where(nonempty, s_i, 0.0).sum(), torch.where(nonempty, s_i, big).min(),
        torch.where(nonempty, s_i, -big).max(),
    ])
    return stats, g_tok, g_ent, seq_coef.to(f32)


_compiled: dict = {}
_compile_broken: list = []


def _compile_enabled(device) -> bool:
    if device.type != "cpu" or _compile_broken:
        return False
    return os.environ.get("FLASHRL_TORCH_COMPILE", "1") not in ("0", "false", "False", "off")


def _compiled_terms(scalars):
    """_forward_terms with the config scalars baked in as constants, compiled by Inductor (fused C++ loops)."""
    fn = _compiled.get(scalars)
    if fn is None:
        def terms(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, uniform_len):
            return _forward_terms(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy,
                                  uniform_len, *scalars)

        fn = _compiled[scalars] = torch.compile(terms, dynamic=True)
    return fn


def policy_loss_forward(logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, normalizer,
                        eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta,
                        entropy_coef, divisor, uniform_len, positive=None, nll_coef=0.0):
    tensors = (logp, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp, entropy, uniform_len)
    scalars = (eps_low, eps_high, dual_clip, level, tis_mode, tis_min, tis_max, tis_reduce, agg, beta, entropy_coef)
    out = None
    if _compile_enabled(logp.device):
        try:
            out = _compiled_terms(scalars)(*tensors)
        except Exception as exc:
            _compile_broken.append(exc)
            warnings.warn(f"flashrl torch backend: torch.compile of policy_loss failed ({exc!r}); using eager torch",
                          RuntimeWarning, stacklevel=2)
    if out is None:
        out = _forward_terms(*tensors, *scalars)
    stats, g_tok, g_ent, seq_coef = out
    return finish(stats, g_tok, g_ent, seq_coef, logp, mask, cu_seqlens, uniform_len, normalizer, divisor, agg,
                  positive, nll_coef)


def finish(stats, g_tok, g_ent, seq_coef, logp, mask, cu_seqlens, uniform_len, normalizer, divisor, agg, positive,
           nll_coef):
    """The op's outputs from a backend's statistics and coefficients (torch, native and Triton share it)."""
    nll = None if positive is None else nll_stats(logp, mask, cu_seqlens, uniform_len, positive)
    loss, metrics, scale = finalize(stats, normalizer, divisor, agg, nll, nll_coef)
    if nll is not None and nll_coef != 0.0:
        seq_coef = add_nll(seq_coef, nll, positive, nll_coef, scale)
    return loss, metrics, g_tok, g_ent, seq_coef, scale


def policy_loss_backward(grad_loss, g_tok, g_ent, seq_coef, mask, cu_seqlens, scale, uniform_len):
    n = g_tok.numel()
    g = (grad_loss.float() * scale).reshape(())
    grad_logp = g_tok * g
    if seq_coef.numel():
        if uniform_len > 0 and seq_coef.numel() * uniform_len != n:
            uniform_len = 0
        per_tok = _per_token(seq_coef * g, cu_seqlens, n, uniform_len)
        if mask is not None:
            per_tok = per_tok * mask
        grad_logp = grad_logp + per_tok
    grad_ent = g_ent * g if g_ent.numel() else g_ent.new_zeros(0)
    return grad_logp, grad_ent
