"""GAE on the native CPU kernel (csrc/cpu/gae.cpp): one backward pass per sequence.

The kernel takes the canonical form of ops/gae.py (rewards / values in their
own dtype, bool mask, int64 cu_seqlens, float64 lam and critic_lam [S]; other
float lambdas are widened here); uniform_len is not needed (every sequence is
walked through cu_seqlens).
"""
from __future__ import annotations

import torch

from ..torch_impl.gae import wide_lambdas


def gae_forward(rewards, values, mask, cu_seqlens, lam, critic_lam, gamma, whiten, uniform_len):
    lam, critic_lam = wide_lambdas(lam, critic_lam)
    return torch.ops.flashrl_native.gae_forward(rewards, values, mask, cu_seqlens, lam, critic_lam, float(gamma),
                                                bool(whiten))
