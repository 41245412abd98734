"""The fused policy head with the Triton tile epilogues of triton_impl/linear_logprobs.py.

The chunk loop is torch_impl's (`fused_policy_loss`): on a GPU each chunk's
logits come from one cuBLAS GEMM (fp32 output), the forward kernel reads the
[C, V] chunk once without modifying it, and the backward kernel writes dZ in
the operand dtype (or over z in fp32) for the two gradient GEMMs.
"""
from __future__ import annotations

from ..torch_impl.linear_policy_loss import ChunkKernels, forward_with
from .linear_logprobs import _bwd_epilogue, _fwd_epilogue


def _stats(z, bias, tgt, temperature, m, s, w, zt):
    _fwd_epilogue(z, bias, tgt, temperature, True, m, s, w, zt)


def _dz(z, bias, tgt, temperature, lse, ent, g_lp, g_h, out, _m):
    _bwd_epilogue(z, bias, tgt, temperature, lse, ent, g_lp, g_h, out.dtype, out=out)


TRITON_KERNELS = ChunkKernels(_stats, _dz)


linear_policy_loss_forward = forward_with(TRITON_KERNELS)
