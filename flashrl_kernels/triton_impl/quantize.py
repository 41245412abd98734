"""Triton per-row quantization: one program per row, one pass over the weight.

A row that fits in one tile (K <= 16384, e.g. every row of a 7B model's
linear layers) is loaded once into registers: amax, scale and the quantized
row come from that one load, so the weight is read exactly once. Wider rows
take two loops over the row (amax, then quantize); the second one reads from
L2. Rounding is done in fp32 arithmetic that is bit-exact on the GPU and in
the interpreter alike:
- the quotient w / scale is an IEEE division (tl.math.div_rn; plain `/`
  compiles to an approximate division on NVIDIA GPUs);
- int8: round-half-even through the 1.5 * 2^23 magic constant (exact for
  |y| < 2^22, and |y| <= 127 here);
- fp8 e4m3: the value is rounded to its e4m3 grid (3 mantissa bits, step
  2^-9 below 2^-6) with the same trick on y / ulp, and only then converted:
  the conversion of a representable value is exact whatever rounding the
  hardware (or the interpreter, which rounds ties away and flushes
  subnormals) would apply. The sign of zero is kept, as an IEEE cast does.
  The e4m3fn byte is then assembled from the fp32 bits by integer arithmetic
  and stored through a uint8 view of q: no fp8 type reaches the compiler,
  because sm_80 / sm_86 have no e4m3 conversion (Triton refuses fp8e4nv
  there) and MI300's native fp8 is e4m3fnuz, a different encoding. The same
  bytes on every target and in the interpreter.
Rows holding NaN or +-inf get scale NaN (tl.max may drop NaNs, so a
separate flag is reduced), which the public function turns into a ValueError.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..reference.quantize import QMAX, ZERO_ROW_AMAX
from ..torch_impl.quantize import dequantize_rows_forward as _torch_dequantize
from . import qlinear
from ._host import next_power_of_2

_MAX_ONE_TILE = 16384
_LOOP_BLOCK = 4096


@triton.jit
def _round_half_even(y):
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _quantize_values(x, scale, zero, QMAX: tl.constexpr, IS_FP8: tl.constexpr):
    y = tl.math.div_rn(x, scale)
    y = tl.minimum(tl.maximum(y, -QMAX), QMAX)
    if IS_FP8:
        # ulp of e4m3 at y: 2^(max(e, -6) - 3), e = unbiased fp32 exponent of y
        bits = y.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        ulp_bits = ((tl.maximum(e, -6) - 3 + 127) << 23).to(tl.int32)
        ulp = ulp_bits.to(tl.float32, bitcast=True)
        r = _round_half_even(y / ulp) * ulp  # divisions / products by powers of two are exact
        # keep the sign of zero (-0.0003 -> -0, like the IEEE cast): OR y's sign bit back in
        y = (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)
    else:
        y = _round_half_even(y)
    return tl.where(zero, 0.0, y)


@triton.jit
def _e4m3fn_bits(y):
    """The e4m3fn byte (as int32) of y, which must already lie on the e4m3 grid with |y| <= 448 (or be NaN)."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    mag = bits & 0x7FFFFFFF
    e = (mag >> 23) - 127
    normal = ((e + 7) << 3) | ((mag >> 20) & 7)
    subnormal = (tl.abs(y) * 512.0).to(tl.int32)  # k * 2^-9 -> k, exact; also 0 for +-0
    code = tl.where(e >= -6, normal, subnormal)
    code = tl.where(mag > 0x7F800000, 0x7F, code)  # NaN -> the e4m3fn NaN
    return code | sign


@triton.jit
def _store_codes(ptr, y, mask, IS_FP8: tl.constexpr):
    if IS_FP8:
        tl.store(ptr, _e4m3fn_bits(y).to(tl.uint8), mask=mask)
    else:
        tl.store(ptr, y.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _quantize_rows_kernel(
    W, stride_w, Q, stride_q, S, K, TINY,
    QMAX: tl.constexpr, IS_FP8: tl.constexpr, ONE_TILE: tl.constexpr, BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    w_row = W + row * stride_w
    q_row = Q + row * stride_q
    if ONE_TILE:
        offs = tl.arange(0, BLOCK_K)
        mask = offs < K
        x = tl.load(w_row + offs, mask=mask, other=0.0).to(tl.float32)
        ax = tl.abs(x)
        amax = tl.max(ax, axis=0)
        bad = tl.max(tl.where(ax < float("inf"), 0, 1), axis=0)  # NaN < inf is False
    else:
        amax = tl.zeros((), tl.float32)
        bad = tl.zeros((), tl.int32)
        for start in range(0, K, BLOCK_K):
            offs = start + tl.arange(0, BLOCK_K)
            ax = tl.abs(tl.load(w_row + offs, mask=offs < K, other=0.0).to(tl.float32))
            amax = tl.maximum(amax, tl.max(ax, axis=0))
            bad = tl.maximum(bad, tl.max(tl.where(ax < float("inf"), 0, 1), axis=0))
    zero = amax <= TINY
    scale = tl.where(zero, 1.0, tl.math.div_rn(amax, QMAX))
    scale = tl.where(bad > 0, float("nan"), scale)
    tl.store(S + row, scale)
    if ONE_TILE:
        y = _quantize_values(x, scale, zero, QMAX, IS_FP8)
        _store_codes(q_row + offs, y, mask, IS_FP8)
    else:
        for start in range(0, K, BLOCK_K):
            offs = start + tl.arange(0, BLOCK_K)
            mask = offs < K
            x = tl.load(w_row + offs, mask=mask, other=0.0).to(tl.float32)
            y = _quantize_values(x, scale, zero, QMAX, IS_FP8)
            _store_codes(q_row + offs, y, mask, IS_FP8)


def _launch(w2d, q_out, scale_out):
    n, k = w2d.shape
    if n == 0:
        return
    one_tile = k <= _MAX_ONE_TILE
    block = next_power_of_2(k) if one_tile else _LOOP_BLOCK
    num_warps = 4 if block <= 2048 else (8 if block <= 8192 else 16)
    is_fp8 = q_out.dtype == torch.float8_e4m3fn
    codes = q_out.view(torch.uint8) if is_fp8 else q_out  # fp8: bytes assembled in the kernel (see above)
    _quantize_rows_kernel[(n,)](
        w2d, w2d.stride(0), codes, codes.stride(0), scale_out, k, ZERO_ROW_AMAX,
        QMAX=QMAX[q_out.dtype], IS_FP8=is_fp8, ONE_TILE=one_tile, BLOCK_K=block,
        num_warps=num_warps,
    )


def quantize_rows_forward(w2d, q_out, scale_out) -> None:
    _launch(w2d, q_out, scale_out)


def quantize_rows(w2d, dtype):
    q = torch.empty(w2d.shape, dtype=dtype, device=w2d.device)
    s = torch.empty(w2d.shape[0], dtype=torch.float32, device=w2d.device)
    _launch(w2d, q, s)
    return q, s


def dequantize_rows_forward(q2d, scale, out_dtype):
    # one fused elementwise pass either way; torch's is as fast as a hand-written kernel
    return _torch_dequantize(q2d, scale, out_dtype)


def scaled_linear_forward(x2d, q, scale, bias, activation_quant):
    """The kernel qlinear.select_scaled_linear picks for this GPU, dtype and M: vLLM's CUTLASS scaled-mm when
    vLLM provides it, the Triton W8A16 / W8A8 kernels (codes widened in registers, scales fused), or cuBLAS
    (torch._int_mm + one fused epilogue, torch._scaled_mm). Triton quantizes the activations."""
    return qlinear.scaled_linear(quantize_rows, x2d, q, scale, bias, activation_quant)
