"""Per-row INT8 / FP8 quantization and the quantized linear on the native CPU kernels.

- quantize_rows (csrc/cpu/quantize.cpp) writes straight into the caller's q / scale
  storage, bit-identical to the spec. Rows must have unit stride (a weight or its row
  slice); any other layout goes through the torch backend's chunked path.
- scaled_linear (csrc/cpu/qlinear.cpp) reads the int8 / fp8 weight in its plain [N, K]
  layout and widens it in registers (nothing is prepacked, so in-place weight syncs are
  seen by the next call):
  * activation_quant with int8 weights on an AVX-512 VNNI or AVX2 build: dynamic per-token
    W8A8 with integer dot products (vpdpbusd; vpmaddwd on AVX2);
  * otherwise weight-only: bf16 dot products (AVX-512 BF16) or fp32 FMAs (AVX-512 / AVX2);
    bf16 tokens from qlinear_capabilities()['bf16_brgemm_min_m'] on (AMX-BF16 CPUs) go through
    oneDNN's bf16 brgemm on the same rows, widened per block (also the bf16 head's bf16_linear);
    activation_quant elsewhere is the exact emulation (quantize, dequantize to fp32, then
    the weight-only kernel).
  Portable (DEFAULT) builds and unusual layouts use ATen's dequantize-and-GEMM, shared with
  the torch backend.
- The packed W8A8 linear (csrc/cpu/qlinear_packed.cpp), for weights that a quantized
  layer owns (the vLLM plugin's W8A8 INT8 layers on AVX-512 VNNI and AVX2 CPUs): the codes
  live in the layout the kernel reads (lanes along the output rows, blocks of 64 rows on
  AVX-512, 8 on AVX2), written there directly by quantize_rows_packed_ at every load and
  sync, with each row's code sum beside them; oneDNN's brgemm runs the same bytes on
  AMX-INT8 tiles. See docs/native.md.
"""
from __future__ import annotations

import functools

import torch

from ..torch_impl import quantize as _torch_quantize
from ..torch_impl.quantize import dequantize_rows_forward, scaled_linear_with

__all__ = ["dequantize_rows_forward", "packed_w8a8_capabilities", "packed_w8a8_fits", "qlinear_capabilities",
           "quantize_rows_forward", "quantize_rows_packed_", "scaled_linear_forward", "unpack_rows"]

# int32 sums of the W8A8 kernel stay exact up to this reduction length (csrc/cpu/qlinear.cpp)
_W8A8_MAX_K = 65536


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


@functools.cache
def qlinear_capabilities() -> dict:
    """What the native quantized linear does on this CPU: {'w8a8', 'bf16_dot', 'vector', 'amx_bf16', 'fp8_byte_tables'} -> bool
    ('w8a8': dynamic W8A8 as integer dot products, AVX-512 VNNI's vpdpbusd or AVX2's vpmaddwd),
    'bf16_brgemm_min_m': tokens from which bf16-activation calls (weight-only int8 / fp8, the bf16 head) run
    oneDNN's brgemm with the weight rows as its A operand (0: never; FLASHRL_NATIVE_BF16_BRGEMM_MIN_M),
    'fp8_byte_tables': fp8 rows widen to bf16 64 weights at a time by AVX-512 VBMI byte permutes (else 32 at a time
    by word permutes), 'amx_bf16_min_m': tokens from which those calls (K % 32 == 0) run AMX-BF16 tiles driven by
    the library itself (0: never; FLASHRL_NATIVE_AMX_BF16_MIN_M; on AMX CPUs brgemm then runs only the shapes they
    refuse), 'amx_head_min_m': the same for bf16 weights, the LM head (FLASHRL_NATIVE_AMX_HEAD_MIN_M),
    'amx_wb_min_m': tokens from which int8 / fp8 rows take those tiles with the widened rows re-laid as the B
    operand instead (prefill; FLASHRL_NATIVE_AMX_WB_MIN_M, 0: never),
    'amx_emulated': those tiles emulated in scalar code, for tests on CPUs without AMX (FLASHRL_NATIVE_EMULATE=amx)."""
    (w8a8, bf16, vec, amx_bf16, min_m, fp8_bytes, amx_min_m, amx_emulated,
     amx_head_min_m, amx_wb_min_m) = torch.ops.flashrl_native.qlinear_caps()
    return {"w8a8": bool(w8a8), "bf16_dot": bool(bf16), "vector": bool(vec), "amx_bf16": bool(amx_bf16),
            "bf16_brgemm_min_m": int(min_m), "fp8_byte_tables": bool(fp8_bytes), "amx_bf16_min_m": int(amx_min_m),
            "amx_emulated": bool(amx_emulated), "amx_head_min_m": int(amx_head_min_m),
            "amx_wb_min_m": int(amx_wb_min_m)}


def w8a8_native(q: torch.Tensor) -> bool:
    """Whether dynamic W8A8 runs as integer dot products here (else it is emulated on the weight-only kernel)."""
    return q.dtype == torch.int8 and qlinear_capabilities()["w8a8"]


def scaled_linear_forward(x2d, q, scale, bias, activation_quant):
    if not _unit_rows(x2d) or direct_linear(q, False) is None:
        return scaled_linear_with(_quantize_rows, x2d, q, scale, bias, activation_quant)
    scale = scale.contiguous()
    op = direct_linear(q, activation_quant)
    if op is not None:
        return op(x2d, q, scale, bias, activation_quant)
    # W8A8 without integer dot products here: the exact emulation on the weight-only kernel
    xq, xs = _quantize_rows(x2d, q.dtype)
    x32 = dequantize_rows_forward(xq, xs, torch.float32)
    return torch.ops.flashrl_native.qlinear(x32, q, scale, bias, False).to(x2d.dtype)


# a fake kernel, so that torch.compile (e.g. vLLM's compiled CPU mode) can trace direct calls of the native op
@torch.library.register_fake("flashrl_native::qlinear")
def _qlinear_fake(x, q, scale, bias, act_quant):
    return x.new_empty((x.shape[0], q.shape[0]))


def direct_linear(q: torch.Tensor, activation_quant: bool):
    """`torch.ops.flashrl_native.qlinear` when it alone computes scaled_linear for CPU weight q, else None.

    For callers on the decode hot path (the vLLM plugin's layers): calling the C++ op directly skips the
    Python custom-op dispatch of flashrl::scaled_linear, about 40 us a call, ~4 ms a decode step of a
    24-layer model. Same results as scaled_linear on the native backend.
    """
    if not qlinear_capabilities()["vector"] or q.device.type != "cpu" or not _unit_rows(q):
        return None
    if activation_quant and not (w8a8_native(q) and q.shape[1] <= _W8A8_MAX_K):
        return None
    return torch.ops.flashrl_native.qlinear


@torch.library.register_fake("flashrl_native::bf16_linear")
def _bf16_linear_fake(x, w, bias):
    return x.new_empty((x.shape[0], w.shape[0]))


def direct_bf16_linear(w: torch.Tensor):
    """`torch.ops.flashrl_native.bf16_linear` for a plain bf16 CPU weight on an AVX2 / AVX-512 build, else None.

    A bf16 GEMV/GEMM from the stored [N, K] rows (nothing packed): the model-dtype LM head of a quantized
    engine, which must keep reading its own storage so that in-place syncs show. vdpbf16ps on AVX-512 BF16
    CPUs (torch's bf16 F.linear on such rows is ~2x slower at decode sizes), rows widened to fp32 elsewhere
    (where torch's bf16 GEMM runs at ~1 GFLOP/s).
    """
    if (w.device.type != "cpu" or w.dtype != torch.bfloat16 or w.dim() != 2 or w.stride(1) != 1
            or not qlinear_capabilities()["vector"]):
        return None
    return torch.ops.flashrl_native.bf16_linear


# ---------------------------------------------------------------- the packed W8A8 linear

_PACKED_KERNELS = {0: None, 1: "avx2", 2: "avx512_vnni", 3: "avx_vnni", 4: "avx_vnni_emulated"}


@functools.cache
def packed_w8a8_capabilities() -> dict:
    """{'kernel': the packed W8A8 kernel that runs here ('avx512_vnni': zmm vpdpbusd tiles, 'avx_vnni': ymm vpdpbusd
    tiles of AVX2 builds on CPUs with AVX-VNNI, 'avx2': vpmaddwd tiles, 'avx_vnni_emulated': the AVX-VNNI tiles with
    their dot products done by AVX2 instructions, for tests (FLASHRL_NATIVE_EMULATE=avxvnni), None: none, as on
    AVX-512 without VNNI and portable builds), 'available': kernel is not None,
    'pack_rows': rows per block of its layout (a packed weight's N must be a multiple; K of 4),
    'amx': AMX-INT8 tiles granted to this process, 'brgemm_min_m': tokens from which a call runs oneDNN's brgemm
    where the amx driver is off or refuses the shape (0: never), 'amx_min_m': tokens from which a call (K % 64 == 0) runs the AMX-INT8 tiles driven by the library
    itself (0: never; FLASHRL_NATIVE_AMX_MIN_M), 'amx_emulated': those tiles emulated in scalar code, for tests
    on CPUs without AMX (FLASHRL_NATIVE_EMULATE=amx), 'decode_tiles': the VNNI tiles' shapes at few tokens
    ({'pf_spread': blocks ahead the 4-token tiles of a block prefetch, 'pf_min_tiles': from how many such
    tiles, 'wide_max_m': tokens up to which (from 5) one wide tile reads each block once, 'wide_pf': blocks ahead
    it prefetches}; FLASHRL_NATIVE_PACKED_PF_SPREAD / _PF_MIN_TILES / _WIDE_MAX_M / _WIDE_PF; docs/native.md)}.

    FLASHRL_NATIVE_PACKED=0 reports the kernel as unavailable (quantized layers then keep the plain layout)."""
    import os

    (kernel, amx, min_m, pack_rows, amx_min_m, amx_emulated, pf_spread, pf_min_tiles, wide_max_m,
     wide_pf) = torch.ops.flashrl_native.qlinear_packed_caps()
    name = _PACKED_KERNELS[int(kernel)] if os.environ.get("FLASHRL_NATIVE_PACKED", "1") != "0" else None
    return {"kernel": name, "available": name is not None, "pack_rows": int(pack_rows), "amx": bool(amx),
            "brgemm_min_m": int(min_m), "amx_min_m": int(amx_min_m), "amx_emulated": bool(amx_emulated),
            "decode_tiles": {"pf_spread": int(pf_spread), "pf_min_tiles": int(pf_min_tiles),
                             "wide_max_m": int(wide_max_m), "wide_pf": int(wide_pf)}}


def packed_w8a8_fits(shape) -> bool:
    """Whether an int8 weight of this [N, K] shape can be stored packed for the W8A8 kernel on this CPU."""
    n, k = shape
    caps = packed_w8a8_capabilities()
    return caps["available"] and n % caps["pack_rows"] == 0 and k % 4 == 0 and 0 < k <= _W8A8_MAX_K


def quantize_rows_packed_(w2d: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, comp: torch.Tensor, row0: int,
                          count: bool = False) -> int:
    """Quantize the rows of w2d [R, K] into rows [row0, row0 + R) of the packed weight q [N, K] (int8 codes
    exactly as quantize_rows gives them), their scales into scale[row0:], their code sums into comp[row0:];
    returns how many codes changed when count (else 0)."""
    return torch.ops.flashrl_native.quantize_rows_packed(w2d, q, scale, comp, row0, count)


def unpack_rows(q: torch.Tensor, ids: torch.Tensor | None = None) -> torch.Tensor:
    """The logical [len(ids), K] int8 rows (all N rows when ids is None) of a packed weight."""
    if ids is None:
        ids = torch.arange(q.shape[0], device=q.device)
    return torch.ops.flashrl_native.unpack_rows(q, ids)


@torch.library.register_fake("flashrl_native::qlinear_packed")
def _qlinear_packed_fake(x, q, scale, comp, bias):
    return x.new_empty((x.shape[0], q.shape[0]))


@torch.library.register_fake("flashrl_native::unpack_rows")
def _unpack_rows_fake(q, ids):
    return q.new_empty((ids.shape[0], q.shape[1]))
