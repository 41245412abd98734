"""PyTorch per-row quantization and scaled linear (any device; the CPU path).

quantize_rows_forward works through the rows in chunks whose fp32 temporaries
stay within FLASHRL_CHUNK_BYTES (default 8 MiB), writing each chunk's q and
scale straight into the caller's storage: no weight-sized temporary, whatever
the size of the weight. Same arithmetic as the spec (fp32 division, which is
IEEE correctly rounded on CPU and CUDA; torch.round is half-to-even; the fp8
cast rounds to nearest even), so the results are bit-identical to it.

scaled_linear_forward:
- on CUDA with dynamic activation quantization: FP8 through torch._scaled_mm
  with row-wise scales (sm89+), INT8 through torch._int_mm plus a scale
  epilogue (sm80+), when the shapes suit the kernels (K, N multiples of 16);
  anything else falls back to the emulation below.
- otherwise (the CPU, or weight-only): dequantize the weight to the
  activation dtype and call F.linear; with activation quantization the
  activations are quantized and dequantized first (exact emulation of W8A8).
"""
from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from ..reference.quantize import QMAX, ZERO_ROW_AMAX


def chunk_bytes() -> int:
    return int(os.environ.get("FLASHRL_CHUNK_BYTES", str(8 << 20)))


def _quantize_chunk(w: torch.Tensor, dtype: torch.dtype):
    qmax = QMAX[dtype]
    x = w.float()
    amax = x.abs().amax(dim=-1, keepdim=True)  # NaN propagates, inf stays inf
    zero = amax <= ZERO_ROW_AMAX
    scale = torch.where(zero, torch.ones_like(amax), amax / qmax)
    y = x / scale
    if dtype == torch.int8:
        y = torch.round(y).clamp_(-128, 127).nan_to_num_(0.0)
    else:
        y = y.clamp_(-qmax, qmax)
    y.masked_fill_(zero, 0.0)  # +0 exactly
    return y.to(dtype), scale.squeeze(-1)


def quantize_rows_forward(w2d, q_out, scale_out) -> None:
    n, k = w2d.shape
    if n == 0:
        return
    rows = max(1, chunk_bytes() // (4 * max(k, 1) * 3))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        q, s = _quantize_chunk(w2d[r0:r1], q_out.dtype)
        q_out[r0:r1].copy_(q)
        scale_out[r0:r1].copy_(s)


def quantize_rows(w2d: torch.Tensor, dtype: torch.dtype):
    """Allocating helper used by the scaled linear (activations)."""
    q = torch.empty(w2d.shape, dtype=dtype, device=w2d.device)
    s = torch.empty(w2d.shape[0], dtype=torch.float32, device=w2d.device)
    quantize_rows_forward(w2d, q, s)
    return q, s


def dequantize_rows_forward(q2d, scale, out_dtype):
    return (q2d.float() * scale.float().unsqueeze(-1)).to(out_dtype)


# ---- scaled linear ----

@functools.cache
def cuda_fast_path(device_index: int, dtype: torch.dtype) -> bool:
    """Whether the W8A8 GEMM for `dtype` runs on this GPU (probed once, then cached)."""
    cap = torch.cuda.get_device_capability(device_index)
    if dtype == torch.float8_e4m3fn and cap < (8, 9):
        return False
    if dtype == torch.int8 and cap < (8, 0):
        return False
    dev = torch.device("cuda", device_index)
    try:
        a = torch.ones(32, 32, device=dev)
        b = torch.ones(32, 32, device=dev)
        qa, sa = quantize_rows(a, dtype)
        qb, sb = quantize_rows(b, dtype)
        y = _w8a8_cuda(qa, sa, qb, sb, None, torch.bfloat16)
        return bool(torch.allclose(y.float(), torch.full_like(y.float(), 32.0)))
    except (RuntimeError, NotImplementedError):
        return False


def _w8a8_cuda(xq, xs, q, scale, bias, out_dtype):
    """GEMM of per-token-quantized activations and per-row-quantized weights on CUDA."""
    if q.dtype == torch.float8_e4m3fn:
        return torch._scaled_mm(
            xq, q.t(), scale_a=xs.unsqueeze(1), scale_b=scale.unsqueeze(0),
            bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype,
        )
    m = xq.shape[0]
    a = xq
    if m <= 16:  # torch._int_mm needs more than 16 rows
        a = torch.zeros((32, xq.shape[1]), dtype=xq.dtype, device=xq.device)
        a[:m] = xq
    acc = torch._int_mm(a, q.t())[:m]
    y = acc.float().mul_(xs.unsqueeze(1)).mul_(scale.unsqueeze(0))
    if bias is not None:
        y.add_(bias.float())
    return y.to(out_dtype)


def w8a8_fast_path_ok(x2d, q) -> bool:
    if x2d.device.type != "cuda":
        return False
    k, n = q.shape[1], q.shape[0]
    if k % 16 or n % 16:
        return False
    return cuda_fast_path(x2d.device.index or 0, q.dtype)


def scaled_linear_with(quantize, x2d, q, scale, bias, activation_quant):
    """The scaled linear given an activation quantizer `quantize(x2d, dtype) -> (xq, xs)`."""
    if activation_quant and w8a8_fast_path_ok(x2d, q):
        xq, xs = quantize(x2d, q.dtype)
        return _w8a8_cuda(xq, xs, q, scale, bias, x2d.dtype)
    x = x2d
    if activation_quant:
        xq, xs = quantize(x2d, q.dtype)
        x = dequantize_rows_forward(xq, xs, torch.float32).to(x2d.dtype)
    w = dequantize_rows_forward(q, scale, x2d.dtype)
    return F.linear(x, w, bias)


def scaled_linear_forward(x2d, q, scale, bias, activation_quant):
    return scaled_linear_with(quantize_rows, x2d, q, scale, bias, activation_quant)
