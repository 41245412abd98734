"""The fused policy head on the native CPU epilogues (csrc/cpu/linear_logprobs.cpp).

The chunk loop, GEMMs and policy-loss coefficients are torch_impl's
(`fused_policy_loss`); the two epilogues over each [C, V] logits chunk are the
native ones. They read the chunk in the GEMM's own dtype (bf16 logits are
not copied to fp32): the forward reads z once without modifying it, the
backward writes dZ over z for the gradient GEMMs.
"""
from __future__ import annotations

import torch

from ..torch_impl.linear_policy_loss import ChunkKernels, forward_with


def _stats(z, bias, tgt, temperature, m, s, w, zt):
    torch.ops.flashrl_native.linear_fwd_epilogue(z, bias, tgt, float(temperature), True, m, s, w, zt)


def _dz(z, bias, tgt, temperature, lse, ent, g_lp, g_h, out, _m):
    torch.ops.flashrl_native.linear_bwd_epilogue(z, bias, tgt, float(temperature), lse, ent, g_lp, g_h, out)


NATIVE_KERNELS = ChunkKernels(_stats, _dz, low_precision_tile=True)


linear_policy_loss_forward = forward_with(NATIVE_KERNELS)
