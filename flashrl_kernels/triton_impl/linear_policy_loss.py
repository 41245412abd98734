"""The fused policy head with the Triton tile epilogues of triton_impl/linear_logprobs.py.

The chunk loop is torch_impl's (`fused_policy_loss`): on a GPU each chunk's
logits come from one cuBLAS GEMM (fp32 output), the forward kernel reads the
[C, V] chunk once without modifying it, and the backward kernel writes dZ in
the operand dtype (or over z in fp32) for the two gradient GEMMs.
"""
from __future__ import annotations

from ..torch_impl.linear_policy_loss import ChunkKernels, fused_policy_loss
from .linear_logprobs import _fwd_epilogue, _linear_bwd_tile_kernel
from .logprobs import block_v


def _stats(z, bias, tgt, temperature, m, s, w, zt):
    _fwd_epilogue(z, bias, tgt, temperature, True, m, s, w, zt)


def _dz(z, bias, tgt, temperature, lse, ent, g_lp, g_h, out, _m):
    rows, cols = z.shape
    has_gh = g_h is not None
    _linear_bwd_tile_kernel[(rows,)](
        z, z.stride(0), bias if bias is not None else z, tgt, lse, ent if has_gh else lse,
        g_lp, g_h if has_gh else g_lp, out, out.stride(0), cols,
        HAS_BIAS=bias is not None, TEMPERATURE=float(temperature), HAS_GH=has_gh,
        BLOCK=block_v(cols), num_warps=8,
    )


TRITON_KERNELS = ChunkKernels(_stats, _dz)


def linear_policy_loss_forward(hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp,
                               ref_logp, normalizer, positive, scalars, nll_coef, divisor, uniform_len, temperature,
                               need_hidden, need_weight, need_bias, fp32_accumulate, **group_args):
    return fused_policy_loss(
        TRITON_KERNELS, hidden, weight, bias, targets, old_logp, advantages, mask, cu_seqlens, rollout_logp, ref_logp,
        normalizer, positive, scalars, nll_coef, divisor, uniform_len, temperature, need_hidden, need_weight,
        need_bias, fp32_accumulate, **group_args,
    )
