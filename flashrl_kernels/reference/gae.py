"""float64 reference of Generalized Advantage Estimation: readable, slow. The spec.

`gae_spec` takes the public inputs (padded [B, T] + mask, or packed [total] +
cu_seqlens, optionally with a mask too), picks out the valid tokens of each
sequence, and runs the GAE recurrence over them in plain Python floats
(float64), one sequence at a time:

    for the valid tokens t_1 < ... < t_l of a sequence (V_{t_{l+1}} = 0, A_{l+1} = 0):
        delta_k = r_{t_k} + gamma * V_{t_{k+1}} - V_{t_k}
        A_k     = delta_k + gamma * lam * A_{k+1}
    returns_k = (the same recurrence with critic_lam) + V_{t_k}

which is verl's `compute_gae_advantage_return` at the valid positions (its
reverse loop carries `nextvalues` and `lastgaelam` through masked positions).
Masked positions get 0. It computes the per-sequence lambdas itself (float,
[S] tensor, or VAPO's 1 - 1 / (lam_alpha * l) clamped to [0, 1]), independently
of the wrapper in ops/gae.py. Whitening: mean and unbiased variance over all
valid tokens of the batch, (A - mean) / sqrt(var + 1e-8).

`gae_forward` adapts the same loop to the backend interface (flat tensors,
int64 cu_seqlens, lam [S] and critic_lam [S] made by the wrapper) and returns
fp32 like every backend (plus the whitening statistics, see ops/gae.py).
"""
from __future__ import annotations

import itertools
import math

import torch

WHITEN_EPS = 1e-8


def gae_sequence(r: list[float], v: list[float], gamma: float, lam: float) -> list[float]:
    """GAE advantages of one sequence's valid tokens (lists of floats), terminal value 0."""
    out = [0.0] * len(r)
    next_value = 0.0
    next_adv = 0.0
    for k in reversed(range(len(r))):
        delta = r[k] + gamma * next_value - v[k]
        next_adv = delta + gamma * lam * next_adv
        out[k] = next_adv
        next_value = v[k]
    return out


def _whiten(adv: list[float], valid: list[int]) -> list[float]:
    """In place: (A - mean) / sqrt(var + eps) at the valid indices, unbiased variance over them.
    Returns [count, mean, var]."""
    xs = [adv[j] for j in valid]
    n = len(xs)
    mean = math.fsum(xs) / n if n else float("nan")
    var = math.fsum((x - mean) ** 2 for x in xs) / (n - 1) if n > 1 else float("nan")
    scale = 1.0 / math.sqrt(var + WHITEN_EPS)
    for j in valid:
        adv[j] = (adv[j] - mean) * scale
    return [float(n), mean, var]


def _run(r, v, seqs, gamma, lams, critic_lams, whiten):
    """r, v: flat lists; seqs: per sequence, the flat indices of its valid tokens.
    Returns flat lists (adv, ret) and the whitening statistics [count, mean, var] ([] without)."""
    adv = [0.0] * len(r)
    ret = [0.0] * len(r)
    for idx, lam, clam in zip(seqs, lams, critic_lams):
        rs = [r[j] for j in idx]
        vs = [v[j] for j in idx]
        a = gae_sequence(rs, vs, gamma, lam)
        c = a if clam == lam else gae_sequence(rs, vs, gamma, clam)
        for j, aj, cj, vj in zip(idx, a, c, vs):
            adv[j] = aj
            ret[j] = cj + vj
    stats = _whiten(adv, [j for idx in seqs for j in idx]) if whiten else []
    return adv, ret, stats


def _sequences(n: int, mask, ranges: list[tuple[int, int]]) -> list[list[int]]:
    """Per sequence, the flat indices of its valid tokens; ranges[i] = (start, end) of sequence i."""
    m = [True] * n if mask is None else mask.reshape(-1).bool().tolist()
    return [[j for j in range(a, e) if m[j]] for a, e in ranges]


def _per_seq(x, nseq) -> list[float]:
    if isinstance(x, torch.Tensor):
        return [float(y) for y in x.double().reshape(-1).tolist()]
    return [float(x)] * nseq


def gae_spec(rewards, values, *, mask=None, cu_seqlens=None, gamma=1.0, lam=0.95, critic_lam=None, lam_alpha=None,
             whiten=False):
    """Returns (advantages, returns) as float64 tensors of the input's shape (0 at masked positions)."""
    shape = rewards.shape
    n = rewards.numel()
    if cu_seqlens is None:
        b, t = shape
        cu = [i * t for i in range(b + 1)]
    else:
        cu = [int(c) for c in cu_seqlens.tolist()]
    nseq = len(cu) - 1
    seqs = _sequences(n, mask, list(itertools.pairwise(cu)))
    if lam_alpha is not None:
        lams = [min(1.0, max(0.0, 1.0 - 1.0 / (lam_alpha * len(idx)))) if idx else 0.0 for idx in seqs]
    else:
        lams = _per_seq(lam, nseq)
    critic = lams if critic_lam is None else _per_seq(critic_lam, nseq)
    r = rewards.double().reshape(-1).tolist()
    v = values.double().reshape(-1).tolist()
    adv, ret, _ = _run(r, v, seqs, float(gamma), lams, critic, whiten)
    f64 = torch.float64
    return (torch.tensor(adv, dtype=f64).view(shape).to(rewards.device),
            torch.tensor(ret, dtype=f64).view(shape).to(rewards.device))


def gae_forward(rewards, values, mask, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len):
    """Backend interface (see ops/gae.py): flat [N] inputs, lam / critic_lam [S]; fp32 outputs."""
    n = rewards.numel()
    cu = cu_seqlens.tolist()
    ranges = []
    for i in range(len(cu) - 1):  # clamped like the kernels: never out of bounds, even unchecked
        a = min(max(cu[i], 0), n)
        ranges.append((a, min(max(cu[i + 1], a), n)))
    seqs = _sequences(n, mask, ranges)
    adv, ret, stats = _run(rewards.double().tolist(), values.double().tolist(), seqs, float(gamma),
                           _per_seq(lam, len(seqs)), _per_seq(critic_lam, len(seqs)), whiten)
    dev = rewards.device
    return tuple(torch.tensor(x, dtype=torch.float64).to(torch.float32).to(dev) for x in (adv, ret, stats))
