"""float64 reference for per-row (per-output-channel / per-token) quantization: the spec.

For one row w (a weight's output row, or one token's activation vector) and a
target dtype with largest finite value QMAX (int8: 127, float8_e4m3fn: 448):

    amax  = max_j |w_j|
    scale = 1                     if amax <= ZERO_ROW_AMAX (zero rows, and rows so
                                  tiny that amax / QMAX would leave fp32's normal
                                  range), else fp32(amax / QMAX)
    y_j   = fp32(w_j / scale)     (an IEEE fp32 division, correctly rounded)
    int8: q_j = clamp(round_half_even(y_j), -128, 127)
    fp8:  q_j = float8_e4m3fn(clamp(y_j, -448, 448)), round to nearest even
    zero rows: q_j = +0 exactly
    dequantized: w'_j = q_j * scale

The fp32 rounding steps are part of the spec, so that every backend gives
bit-identical q and scale: the reference evaluates each quotient in float64
and rounds it once to fp32, which for a division of fp32 operands equals the
correctly rounded fp32 quotient (53 >= 2 * 24 + 2 bits, so double rounding is
innocuous for division). `scale` is stored in fp32. A row holding NaN or
+-inf has no defined scale: the backends write scale = NaN for it and the
public functions raise.

Scaled linear (what the rollout engine's linear layers compute):

    weight-only (W8A16):  y = x @ (q * scale[:, None]).T + bias
    dynamic W8A8:         (xq, xs) = quantize_rows(x) per token, then
                          y = (xq * xs[:, None]) @ (q * scale[:, None]).T + bias
"""
from __future__ import annotations

import torch

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
QUANT_DTYPES = tuple(QMAX)
ZERO_ROW_AMAX = 2.0**-100  # rows with max|w| at or below this count as zero rows


def quantize_rows_spec(w: torch.Tensor, dtype: torch.dtype):
    """(q, scale) for the rows of w[..., K] (float64 arithmetic, fp32 rounding points of the spec)."""
    if dtype not in QMAX:
        raise ValueError(f"dtype must be torch.int8 or torch.float8_e4m3fn, got {dtype}")
    qmax = QMAX[dtype]
    w64 = w.double()
    amax = w64.abs().amax(dim=-1)  # NaN propagates; +-inf gives inf
    zero = amax <= ZERO_ROW_AMAX
    scale = torch.where(zero, torch.ones_like(amax), (amax / qmax).float().double())
    finite = torch.isfinite(w64).all(dim=-1)
    scale = torch.where(finite, scale, torch.full_like(scale, float("nan")))
    y = (w64 / scale.unsqueeze(-1)).float().double()  # the fp32 quotient
    if dtype == torch.int8:
        q = torch.round(y).clamp(-128, 127)  # torch.round: half to even
        q = torch.where(torch.isnan(q), torch.zeros_like(q), q)
        q = q.to(torch.int8)
    else:
        q = y.clamp(-qmax, qmax).to(torch.float8_e4m3fn)
    q = torch.where(zero.unsqueeze(-1), torch.zeros_like(q), q)
    return q, scale.float()


def dequantize_rows_spec(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float64 q * scale[..., None]."""
    return q.double() * scale.double().unsqueeze(-1)


def scaled_linear_spec(x, q, scale, bias=None, activation_quant: bool = False) -> torch.Tensor:
    """float64 x @ dequant(q, scale).T + bias, with x fake-quantized per token when activation_quant."""
    w = dequantize_rows_spec(q, scale)
    if activation_quant:
        xq, xs = quantize_rows_spec(x, q.dtype)
        x64 = dequantize_rows_spec(xq, xs)
    else:
        x64 = x.double()
    y = x64 @ w.T
    if bias is not None:
        y = y + bias.double()
    return y


# ---- backend interface (same names in every backend package) ----

def quantize_rows_forward(w2d, q_out, scale_out) -> None:
    q, s = quantize_rows_spec(w2d, q_out.dtype)
    q_out.copy_(q)
    scale_out.copy_(s)


def dequantize_rows_forward(q2d, scale, out_dtype):
    return dequantize_rows_spec(q2d, scale).to(out_dtype)


def scaled_linear_forward(x2d, q, scale, bias, activation_quant):
    return scaled_linear_spec(x2d, q, scale, bias, activation_quant).to(x2d.dtype)
