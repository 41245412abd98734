"""Per-row INT8 / FP8 quantization on the native CPU kernels (csrc/cpu/quantize.cpp).

The quantizer writes straight into the caller's q / scale storage, bit-identical
to the spec. Rows must have unit stride (a weight or its row slice); any other
layout goes through the torch backend's chunked path. Dequantization and the
scaled linear are one dequantize-and-GEMM in ATen on CPU, shared with the
torch backend, with this quantizer for the activations.
"""
from __future__ import annotations

import torch

from ..torch_impl import quantize as _torch_quantize
from ..torch_impl.quantize import dequantize_rows_forward, scaled_linear_with

__all__ = ["dequantize_rows_forward", "quantize_rows_forward", "scaled_linear_forward"]


def _unit_rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and (t.stride(1) == 1 or t.shape[1] <= 1)


def quantize_rows_forward(w2d, q_out, scale_out) -> None:
    if not (_unit_rows(w2d) and _unit_rows(q_out)):
        _torch_quantize.quantize_rows_forward(w2d, q_out, scale_out)
        return
    torch.ops.flashrl_native.quantize_rows(w2d, q_out, scale_out)


def _quantize_rows(w2d: torch.Tensor, dtype: torch.dtype):
    q = torch.empty(w2d.shape, dtype=dtype, device=w2d.device)
    s = torch.empty(w2d.shape[0], dtype=torch.float32, device=w2d.device)
    quantize_rows_forward(w2d, q, s)
    return q, s


def scaled_linear_forward(x2d, q, scale, bias, activation_quant):
    return scaled_linear_with(_quantize_rows, x2d, q, scale, bias, activation_quant)
