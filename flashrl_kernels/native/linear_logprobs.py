"""Fused linear log-probabilities on the native CPU epilogues (csrc/cpu/linear_logprobs.cpp).

The tile loops are torch_impl's (`stats_loop` / `backward_loop`): one ATen
GEMM per [rows, cols] logits tile, in fp32 (never the full [N, V] logits);
only the per-tile epilogue is native, as for the Triton backend:

- forward: one pass per tile row folds (z + b) / T into the row's running
  online log-sum-exp statistics (m, s, w) and picks the target's logit, in
  place (`torch.ops.flashrl_native.linear_fwd_epilogue`);
- backward: one pass per tile row writes dZ in the operand dtype for the two
  gradient GEMMs; an fp32 dZ overwrites the logits tile itself
  (`torch.ops.flashrl_native.linear_bwd_epilogue`).
"""

from __future__ import annotations

import torch

from ..torch_impl.linear_logprobs import backward_loop, stats_loop


def _fwd_epilogue(z, bias_c, tgt_c, temperature, return_entropy, m, s, w, zt):
    torch.ops.flashrl_native.linear_fwd_epilogue(
        z, bias_c, tgt_c, float(temperature), bool(return_entropy), m, s, w, zt
    )


def _bwd_epilogue(z, bias_c, tgt_c, temperature, lse, ent, g_lp, g_h, out_dtype):
    dz = z if out_dtype == torch.float32 else torch.empty(z.shape, dtype=out_dtype, device=z.device)
    torch.ops.flashrl_native.linear_bwd_epilogue(z, bias_c, tgt_c, float(temperature), lse, ent, g_lp, g_h, dz)
    return dz


def linear_logprobs_stats(hidden, weight, bias, target_local, temperature, return_entropy):
    return stats_loop(hidden, weight, bias, target_local, temperature, return_entropy, epilogue=_fwd_epilogue)


def linear_logprobs_backward(
    grad_logp,
    grad_ent,
    hidden,
    weight,
    bias,
    target_local,
    lse,
    ent,
    temperature,
    need_hidden,
    need_weight,
    need_bias,
    fp32_accumulate,
):
    return backward_loop(
        grad_logp.float().contiguous(),
        None if grad_ent is None else grad_ent.float().contiguous(),
        hidden,
        weight,
        bias,
        target_local,
        lse.contiguous(),
        ent.contiguous(),
        temperature,
        need_hidden,
        need_weight,
        need_bias,
        fp32_accumulate,
        epilogue=_bwd_epilogue,
    )
