"""torch.library op for Generalized Advantage Estimation, and the public function `gae`.

flashrl::gae (rewards, values, mask?, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len)
             -> (advantages [N], returns [N], whiten_stats)

The op works on one canonical form, built by the public wrapper from either
input layout: flat token tensors rewards [N] and values [N] (fp32 / bf16 /
fp16, each in its own dtype), an optional bool mask [N], int64 cu_seqlens
[S+1], and the per-sequence lambdas lam [S] (advantages) and critic_lam [S]
(returns), both float64 (float32 on MPS, which has no float64): gamma and
the lambdas enter the kernels' float64 carries unrounded (an fp32 0.999 is
1.3e-8 off, and a^k over a 1000-token horizon turns that into ~1e-5 of the
returns; docs/gae.md). Padded [B, T] inputs become N = B*T with cu_seqlens =
T * arange(B + 1) and uniform_len = T (a hint: the torch backend scans [B, T]
rows instead of one flat row); packed inputs keep their cu_seqlens and
uniform_len = 0. whiten_stats is fp32 [3] (count of valid tokens, mean, unbiased
variance of the advantages before whitening) with whiten=True, empty [0]
otherwise: the kernels count the valid tokens anyway, so the wrapper's
"at least 2 valid tokens" check reads it after the op instead of reducing
the mask again.

The per-sequence lambda vectors are made once, here in the wrapper, from the
float / [S] tensor / lam_alpha arguments (VAPO's length-adaptive lambda needs
the number of valid tokens of each sequence, a small torch reduction), so
every backend sees the same lam [S] and critic_lam [S] and none of them
re-implements that rule. When critic_lam is not given the wrapper passes the
same tensor twice; backends may notice (same storage) and run one recurrence.

No autograd: advantages and returns are regression / policy-gradient targets,
not functions to differentiate. The wrapper detaches its inputs, the outputs
never require grad. See docs/gae.md for the math and reference/gae.py for the
executable spec.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .._backend import implementation
from .._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_same_device,
    check_tensor,
    first_true,
    sequence_layout,
    value_checks_enabled,
)
from ..torch_impl.gae import wide_dtype


class GAEOutput(NamedTuple):
    advantages: Tensor  # fp32, the input's shape; 0 at masked positions
    returns: Tensor     # fp32, the input's shape; 0 at masked positions


@torch.library.custom_op("flashrl::gae", mutates_args=())
def _gae_op(
    rewards: Tensor, values: Tensor, mask: Tensor | None, cu_seqlens: Tensor, lam: Tensor, critic_lam: Tensor,
    gamma: float, whiten: bool, uniform_len: int,
) -> tuple[Tensor, Tensor, Tensor]:
    fwd = implementation("gae_forward", rewards.device)
    return fwd(rewards, values, mask, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len)


@_gae_op.register_fake
def _(rewards, values, mask, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len):
    n = rewards.shape[0]
    f32 = torch.float32
    return (rewards.new_empty((n,), dtype=f32), rewards.new_empty((n,), dtype=f32),
            rewards.new_empty((3 if whiten else 0,), dtype=f32))


# ---- public wrapper ----

def _unit_float(name: str, x) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise TypeError(f"{name} must be a Python float in [0, 1], got {type(x).__name__}")
    f = float(x)
    if not 0.0 <= f <= 1.0:  # NaN fails too
        raise ValueError(f"{name} must lie in [0, 1], got {x}")
    return f


def _lam_arg(name: str, x, nseq: int, device) -> Tensor | float | None:
    """A float in [0, 1] (checked here) or a [S] float tensor (range checked with the value checks)."""
    if x is None or not isinstance(x, torch.Tensor):
        return None if x is None else _unit_float(name, x)
    check_tensor(name, x, dtypes=FLOAT_DTYPES + (torch.float64,))
    if tuple(x.shape) != (nseq,):
        raise ValueError(f"{name} must be a float or a per-sequence tensor of shape [S] = ({nseq},), "
                         f"got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but rewards is on {device}")
    return x.detach().to(wide_dtype(device)).contiguous()


def _canonical(rewards, values, mask, cu_seqlens):
    """Checks the layout; returns (rewards [N], values [N], mask [N] bool or None, cu int64 [S+1], uniform_len)."""
    check_tensor("rewards", rewards, dtypes=FLOAT_DTYPES)
    check_tensor("values", values, dtypes=FLOAT_DTYPES)
    if mask is not None:
        check_tensor("mask", mask)
    if cu_seqlens is not None:
        check_tensor("cu_seqlens", cu_seqlens, dtypes=INDEX_DTYPES)
    check_same_device(rewards=rewards, values=values, mask=mask, cu_seqlens=cu_seqlens)
    shape = tuple(rewards.shape)
    for name, t in (("values", values), ("mask", mask)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have the shape of rewards {shape}, got {tuple(t.shape)}")
    cu, uniform_len = sequence_layout("rewards", rewards, cu_seqlens)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask != 0
    flat = lambda x: None if x is None else x.detach().reshape(-1).contiguous()
    return flat(rewards), flat(values), flat(mask), cu, uniform_len


def valid_lengths(mask: Tensor | None, cu: Tensor, uniform_len: int) -> Tensor:
    """Number of valid tokens of each sequence [S], on the device (no host sync).

    Sums over the mask's bytes as uint8 into int32: a bool sum (through int64) was 10x slower on CPU."""
    nseq = cu.numel() - 1
    if mask is None:
        return cu[1:] - cu[:-1]
    idx = torch.int32 if mask.numel() < 2**31 else torch.int64
    m8 = mask.view(torch.uint8)
    if uniform_len > 0:
        return m8.view(nseq, uniform_len).sum(1, dtype=idx)
    csum = torch.cat([m8.new_zeros(1, dtype=idx), m8.cumsum(0, dtype=idx)])
    return csum[cu[1:]] - csum[cu[:-1]]


def adaptive_lambda(lengths: Tensor, lam_alpha: float) -> Tensor:
    """VAPO's length-adaptive lambda 1 - 1 / (lam_alpha * l), clamped to [0, 1] (l = 0 gives 0), [S] in
    `wide_dtype`."""
    wide = wide_dtype(lengths.device)
    lam = 1.0 - 1.0 / (lam_alpha * lengths.to(wide))
    return lam.clamp(0.0, 1.0)


def _value_checks(cu, n, uniform_len, lam_t, critic_t):
    """Everything that needs a look at values, with one host sync; the message is built only on failure."""
    checks = []  # (bool tensor: something is wrong, function making the message)
    if uniform_len == 0:
        dec = lambda: cu[1:] < cu[:-1]

        def decreasing():
            i = first_true(dec())
            return f"cu_seqlens must be non-decreasing; entry {i + 1} ({int(cu[i + 1])}) < entry {i} ({int(cu[i])})"

        checks += [(cu[0] != 0, lambda: f"cu_seqlens must start at 0, got {int(cu[0])}"),
                   (cu[-1] != n, lambda: f"cu_seqlens must end at the number of tokens {n}, got {int(cu[-1])}"),
                   (dec().any(), decreasing)]
    for name, t in (("lam", lam_t), ("critic_lam", critic_t)):
        if t is not None:
            bad = ~((t >= 0) & (t <= 1))  # NaN is bad too

            def outside(name=name, t=t, bad=bad):
                j = first_true(bad)
                return f"{name} must lie in [0, 1] for every sequence; sequence {j} has {float(t[j])}"

            checks.append((bad.any(), outside))
    if not checks:
        return
    hits = torch.stack([c for c, _ in checks]).tolist()  # the one host sync
    for hit, (_, message) in zip(hits, checks):
        if hit:
            raise ValueError(message())


def gae(
    rewards: Tensor,
    values: Tensor,
    *,
    mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    gamma: float = 1.0,
    lam: float | Tensor = 0.95,
    critic_lam: float | Tensor | None = None,
    lam_alpha: float | None = None,
    whiten: bool = False,
) -> GAEOutput:
    """Generalized Advantage Estimation (verl's `compute_gae_advantage_return`); see docs/gae.md.

    Inputs are padded [B, T] (with an optional mask, True/nonzero = valid token) or packed
    [total_tokens] with cu_seqlens [S + 1] (int32/int64, starting at 0, non-decreasing; a mask
    [total_tokens] may be given too). rewards and values: fp32 / bf16 / fp16 (they may differ).
    The recurrence runs over the valid tokens of each sequence only (masked tokens are passed
    through, their rewards and values are ignored, NaN included); the value after a sequence's
    last valid token is 0 (terminal).

    gamma: discount in [0, 1]. lam: GAE lambda in [0, 1], a float or a per-sequence tensor [S]
    (S = B when padded). critic_lam: the lambda of the returns (VC-PPO's decoupled GAE), a float
    or [S] tensor; None uses the advantages' per-sequence lambda. lam_alpha (VAPO, > 0; not with a
    tensor lam; a float lam is then ignored): the advantages use lam_i = 1 - 1 / (lam_alpha * l_i),
    l_i the number of valid tokens of sequence i, clamped to [0, 1] (so short sequences, l_i <=
    1 / lam_alpha, get 0). whiten: whiten the advantages over all valid tokens of the batch as
    verl's masked_whiten does (unbiased variance, rsqrt(var + 1e-8)); returns are never whitened.

    Returns GAEOutput(advantages, returns): fp32 tensors of the input's shape, 0 at masked
    positions, without gradient (targets, not differentiable functions of the inputs).
    """
    r, v, m, cu, uniform_len = _canonical(rewards, values, mask, cu_seqlens)
    dev = r.device
    nseq = cu.numel() - 1
    g = _unit_float("gamma", gamma)
    if not isinstance(whiten, bool):
        raise TypeError(f"whiten must be a bool, got {type(whiten).__name__}")
    lam_v = _lam_arg("lam", lam, nseq, dev)
    if lam_v is None:
        raise TypeError("lam must be a Python float in [0, 1] or a per-sequence tensor [S], got None")
    critic_v = _lam_arg("critic_lam", critic_lam, nseq, dev)
    if lam_alpha is not None:
        if isinstance(lam_alpha, bool) or not isinstance(lam_alpha, (int, float)):
            raise TypeError(f"lam_alpha must be a Python float > 0 or None, got {type(lam_alpha).__name__}")
        if not (lam_alpha > 0 and math.isfinite(lam_alpha)):
            raise ValueError(f"lam_alpha must be a finite number > 0, got {lam_alpha}")
        if isinstance(lam_v, Tensor):
            raise ValueError("lam_alpha (length-adaptive lambda) and a per-sequence lam tensor are exclusive: "
                             "pass one of them")
    checks = value_checks_enabled()
    if checks:
        _value_checks(cu, r.numel(), uniform_len, lam_v if isinstance(lam_v, Tensor) else None,
                      critic_v if isinstance(critic_v, Tensor) else None)
    if lam_alpha is not None:
        lam_t = adaptive_lambda(valid_lengths(m, cu, uniform_len), float(lam_alpha))
    elif isinstance(lam_v, Tensor):
        lam_t = lam_v
    else:
        lam_t = torch.full((nseq,), lam_v, dtype=wide_dtype(dev), device=dev)
    if critic_v is None:
        critic_t = lam_t  # the same tensor: backends may run one recurrence
    elif isinstance(critic_v, Tensor):
        critic_t = critic_v
    else:
        critic_t = torch.full((nseq,), critic_v, dtype=wide_dtype(dev), device=dev)
    adv, ret, stats = torch.ops.flashrl.gae(r, v, m, cu, lam_t, critic_t, g, whiten, int(uniform_len))
    if checks and whiten:
        count = float(stats[0])  # one host sync, after the op
        if count < 2:
            raise ValueError(f"whiten=True needs at least 2 valid tokens in the batch (unbiased variance), "
                             f"got {int(count)}")
    shape = rewards.shape
    return GAEOutput(adv.view(shape), ret.view(shape))
