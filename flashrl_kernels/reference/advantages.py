"""float64 reference of the group advantages: one group at a time, plain Python loops. The spec."""
from __future__ import annotations

import math

import torch


def group_advantages_spec(rewards, group_size, *, mode="grpo", std_eps=1e-6, unbiased_std=True, keep=None):
    """Advantages [N] float64 given an optional keep mask [N] (GFPO's kept set)."""
    r = [float(x) for x in rewards.double()]
    kp = [True] * len(r) if keep is None else [bool(x) for x in keep]
    out = [0.0] * len(r)
    for g0 in range(0, len(r), group_size):
        idx = [i for i in range(g0, g0 + group_size) if kp[i]]
        k = len(idx)
        if k == 0:
            continue
        if min(r[i] for i in idx) == max(r[i] for i in idx):
            continue  # equal rewards: 0 in every mode (sum / k can be 1 ulp off the reward; over a std of the
            # same size that gave +-1 advantages with std_eps = 0)
        mean = sum(r[i] for i in idx) / k
        for i in idx:
            if mode == "grpo":
                if k == 1:
                    std = 0.0
                else:
                    ss = sum((r[j] - mean) ** 2 for j in idx)
                    std = math.sqrt(ss / (k - 1 if unbiased_std else k))
                out[i] = (r[i] - mean) / (std + std_eps) if std + std_eps > 0 else 0.0
            elif mode == "dr_grpo":
                out[i] = r[i] - mean
            elif mode == "rloo":
                out[i] = 0.0 if k == 1 else r[i] - sum(r[j] for j in idx if j != i) / (k - 1)
            else:
                raise ValueError(mode)
    return torch.tensor(out, dtype=torch.float64)


def gfpo_keep_spec(rewards, lengths, group_size, metric, k_of_group):
    """Keep mask: in each group the k best by metric (shortest, or highest reward/length), ties to the earlier."""
    keep = [False] * rewards.numel()
    for gi, g0 in enumerate(range(0, rewards.numel(), group_size)):
        items = list(range(g0, g0 + group_size))
        if metric == "length":
            items.sort(key=lambda i: float(lengths[i]))
        else:
            items.sort(key=lambda i: -float(rewards[i]) / max(float(lengths[i]), 1.0))
        for i in items[: k_of_group(gi, [float(rewards[j]) for j in range(g0, g0 + group_size)])]:
            keep[i] = True
    return torch.tensor(keep)


def overlong_penalty_spec(lengths, max_len, cache_len, factor=1.0):
    out = []
    for ln in lengths.tolist():
        if ln <= max_len - cache_len:
            out.append(0.0)
        elif ln <= max_len:
            out.append(factor * ((max_len - cache_len) - ln) / cache_len)
        else:
            out.append(-factor)
    return torch.tensor(out, dtype=torch.float64)
