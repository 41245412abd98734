"""Group advantages for GRPO-family trainers (small tensors: plain torch, no custom op).

group_advantages   GRPO (mean/std in group), Dr. GRPO (mean only), RLOO (leave one out), each
                   optionally over a GFPO-filtered subset of every group.
dynamic_sampling_mask  DAPO: which samples belong to a group whose rewards are all equal (to drop).
overlong_penalty   DAPO soft overlong punishment.

Rewards are laid out group after group: rewards[g * G + j] is sample j of prompt g.
The float64 spec is reference/advantages.py; see docs/policy_loss.md.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from ._checks import FLOAT_DTYPES, check_tensor

ADVANTAGE_MODES = ("grpo", "dr_grpo", "rloo")
GFPO_METRICS = ("length", "token_efficiency")


class GroupAdvantages(NamedTuple):
    advantages: torch.Tensor  # [N] float32 (float64 if rewards are float64); 0 for filtered-out samples
    keep: torch.Tensor        # [N] bool: the sample was kept by the GFPO filter (all True without one)


def default_k_schedule(group_size: int) -> tuple:
    """GFPO adaptive k by group mean reward (rewards in [0, 1]): easy prompts keep fewer samples.

    mean >= 0.75 -> ceil(G/4); >= 0.5 -> ceil(3G/8); otherwise ceil(G/2) (4/6/8 of 16 as in the paper).
    """
    g = group_size
    return ((0.75, math.ceil(g / 4)), (0.5, math.ceil(3 * g / 8)), (-math.inf, math.ceil(g / 2)))


def _check_group(rewards, group_size):
    check_tensor("rewards", rewards, dtypes=FLOAT_DTYPES + (torch.float64,))
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [num_prompts * group_size], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.numel() == 0 or rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a positive multiple of group_size={group_size}"
        )


def _k_per_group(rewards_g, group_size, keep_k, k_schedule):
    """Number of samples to keep in each group, [P] int64."""
    p = rewards_g.shape[0]
    if keep_k == "adaptive":
        schedule = default_k_schedule(group_size) if k_schedule is None else tuple(k_schedule)
        if not schedule:
            raise ValueError("k_schedule must hold at least one (min_mean_reward, k) pair")
        for thr, k in schedule:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"k_schedule entries must be (threshold, k) with int k >= 1, got {(thr, k)!r}")
        mean = rewards_g.mean(1)
        k_out = torch.full((p,), schedule[-1][1], dtype=torch.int64, device=rewards_g.device)
        for thr, k in reversed(schedule):  # the first matching threshold, in schedule order, wins
            k_out = torch.where(mean >= thr, torch.full_like(k_out, k), k_out)
        return k_out.clamp(max=group_size)
    if isinstance(keep_k, bool) or not isinstance(keep_k, int) or keep_k < 1:
        raise ValueError(f"keep_k must be a positive int or 'adaptive', got {keep_k!r}")
    return torch.full((p,), min(keep_k, group_size), dtype=torch.int64, device=rewards_g.device)


def gfpo_keep_mask(rewards, group_size, lengths, *, metric="length", keep_k=None, k_schedule=None):
    """GFPO filter: per group keep the k best samples by `metric` ([N] bool).

    "length": shortest first; "token_efficiency": highest reward / length first. Ties go to the
    earlier sample. keep_k: int, or "adaptive" (k from the group mean reward via k_schedule).
    """
    _check_group(rewards, group_size)
    if metric not in GFPO_METRICS:
        raise ValueError(f"gfpo_metric must be one of {GFPO_METRICS}, got {metric!r}")
    if lengths is None:
        raise ValueError("GFPO filtering needs lengths (the response length of every sample)")
    check_tensor("lengths", lengths)
    if tuple(lengths.shape) != tuple(rewards.shape):
        raise ValueError(f"lengths must have the shape of rewards {tuple(rewards.shape)}, got {tuple(lengths.shape)}")
    rg = rewards.view(-1, group_size)
    ln = lengths.to(torch.float64).view(-1, group_size)
    if metric == "length":
        score = ln  # smaller is better
    else:
        score = -(rg.to(torch.float64) / ln.clamp(min=1.0))  # larger reward per token is better
    order = torch.argsort(score, dim=1, stable=True)
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(group_size, device=rewards.device).expand_as(order))
    k = _k_per_group(rg.to(torch.float64), group_size, keep_k, k_schedule)
    return (rank < k[:, None]).reshape(-1)


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    mode: str = "grpo",
    std_eps: float = 1e-6,
    unbiased_std: bool = True,
    lengths: torch.Tensor | None = None,
    gfpo_metric: str | None = None,
    keep_k=None,
    k_schedule: Sequence[tuple] | None = None,
) -> GroupAdvantages:
    """Advantages of each sample relative to its group.

    mode "grpo":    (r - mean) / (std + std_eps), std sample (unbiased_std=True, TRL/verl) or population.
    mode "dr_grpo": r - mean (Dr. GRPO: no std division).
    mode "rloo":    r - mean of the other samples of the group = k/(k-1) * (r - mean); 0 when k = 1.
    GFPO (gfpo_metric="length" | "token_efficiency" with keep_k=int | "adaptive", lengths=[N]):
    statistics over the kept samples of each group only; filtered-out samples get advantage 0.
    A group of one kept sample gets advantage 0. Returns GroupAdvantages(advantages, keep).
    """
    _check_group(rewards, group_size)
    if mode not in ADVANTAGE_MODES:
        raise ValueError(f"mode must be one of {ADVANTAGE_MODES}, got {mode!r}")
    if isinstance(std_eps, bool) or not isinstance(std_eps, (int, float)) or not std_eps >= 0:
        raise ValueError(f"std_eps must be a float >= 0, got {std_eps!r}")
    if gfpo_metric is None:
        if keep_k is not None or k_schedule is not None:
            raise ValueError("keep_k / k_schedule need gfpo_metric ('length' or 'token_efficiency')")
        keep = torch.ones_like(rewards, dtype=torch.bool)
    else:
        if keep_k is None:
            raise ValueError("gfpo_metric needs keep_k (an int, or 'adaptive')")
        keep = gfpo_keep_mask(rewards, group_size, lengths, metric=gfpo_metric, keep_k=keep_k, k_schedule=k_schedule)
    dtype = torch.float64 if rewards.dtype == torch.float64 else torch.float32
    r = rewards.to(torch.float64).view(-1, group_size)
    kf = keep.view(-1, group_size).to(torch.float64)
    k = kf.sum(1, keepdim=True)
    mean = (r * kf).sum(1, keepdim=True) / k.clamp(min=1.0)
    # equal kept rewards: centred exactly 0 (sum / k can be 1 ulp off the reward, and that over a std of the same
    # size gave +-1 advantages with std_eps = 0)
    big = torch.finfo(torch.float64).max
    flat = r.masked_fill(kf == 0, -big).amax(1, keepdim=True) == r.masked_fill(kf == 0, big).amin(1, keepdim=True)
    centred = torch.where(flat, torch.zeros_like(r), (r - mean) * kf)
    if mode == "grpo":
        dof = (k - 1.0) if unbiased_std else k
        var = (centred * centred).sum(1, keepdim=True) / dof.clamp(min=1.0)
        std = torch.where(k > 1, var.sqrt(), torch.zeros_like(var))
        denom = std + std_eps
        adv = torch.where(denom > 0, centred / denom.clamp(min=1e-300), torch.zeros_like(centred))  # 0/0 -> 0
    elif mode == "dr_grpo":
        adv = centred
    else:
        adv = torch.where(k > 1, centred * k / (k - 1.0).clamp(min=1.0), torch.zeros_like(centred))
    return GroupAdvantages(adv.reshape(-1).to(dtype), keep)


def dynamic_sampling_mask(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """DAPO dynamic sampling: [N] bool, True for every sample of a group whose rewards are all equal.

    Such a group has zero advantage everywhere and carries no gradient; DAPO drops it (and samples
    more prompts): train on `~dynamic_sampling_mask(rewards, G)`.
    """
    _check_group(rewards, group_size)
    rg = rewards.view(-1, group_size)
    flat = rg.amax(1) == rg.amin(1)
    return flat[:, None].expand_as(rg).reshape(-1)


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache_len: int, *, factor: float = 1.0) -> torch.Tensor:
    """DAPO soft overlong punishment, added to the reward ([N] float32).

    0 for length <= max_len - cache_len; linear from 0 down to -factor over the last cache_len
    tokens: factor * ((max_len - cache_len) - length) / cache_len; -factor beyond max_len.
    """
    check_tensor("lengths", lengths)
    for name, v in (("max_len", max_len), ("cache_len", cache_len)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if max_len < 1:
        raise ValueError(f"max_len must be >= 1, got {max_len}")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len must lie in (0, max_len={max_len}], got {cache_len}")
    ln = lengths.to(torch.float64)
    start = max_len - cache_len
    pen = ((start - ln) / cache_len).clamp(max=0.0)
    pen = torch.where(ln > max_len, torch.full_like(pen, -1.0), pen)
    return (pen * factor).to(torch.float32)
