"""The quantized linear on a GPU: which kernel runs, and the Triton kernels it can pick.

y = x @ (q * scale[:, None]).T + bias for a per-row (per output channel) int8 or fp8 e4m3fn weight q [N, K].

Selection (`select_scaled_linear`) is a pure function of the GPU's compute capability (or ROCm), the weight dtype,
the number of rows M, the shapes, and what vLLM exposes in this process (`VllmScaledMM`), so that it can be unit
tested without a GPU. What runs (docs/gpu.md has the per-GPU table):

- W8A8 (activation_quant=True), activations quantized per token by our quantizer (spec rounding):
  - vLLM's `cutlass_scaled_mm` when vLLM is loaded and provides it: INT8 below compute capability 10.0 (vLLM's
    CUTLASS INT8 has no sm_100 kernel), FP8 where `cutlass_scaled_mm_supports_fp8` says so (sm_89+). One GEMM
    with the row / column scales and the bias fused. Our part: the weight storage and its in-place sync.
  - otherwise INT8, M <= SMALL_M, and at every M on sm_90 (measured on an H200): the Triton int8 x int8 -> int32
    kernel below, scales and bias fused into its epilogue (no padding of M to 32, no extra passes); larger M
    elsewhere: torch._int_mm (cuBLASLt) and one fused Triton epilogue pass over its int32 output.
  - otherwise FP8 on sm_89+ CUDA: torch._scaled_mm with row-wise scales when it runs here (probed once).
  - otherwise FP8 (A100 / A6000, MI300 whose fp8 hardware format is e4m3fnuz, not the e4m3fn bytes we store):
    the Triton kernel with both operands' fp8 codes widened to bf16 in registers (exact) and a bf16 tensor-core
    dot; the same math as W8A8, no fp8 hardware needed.
- W8A16 (weight-only): the Triton kernel, codes widened to x's dtype in registers (int8: exact; fp8: decoded
  from the e4m3fn bytes by integer arithmetic below sm_89 and on ROCm, by the hardware e4m3 -> f16 conversion
  plus integer ops to bf16 on sm_89+, `_e4m3x4_to_bf16`), fp32 accumulation, scale and bias in the epilogue;
  on sm_90 from M = 256 the tile is computed transposed (`TilePlan.swap_ab`: the widened weight is the wgmma's
  register operand). Never a dequantized bf16 copy of the weight. (vLLM runs
  FP8 weight-only through Marlin on sm_80, which needs the weight repacked into Marlin's tile layout when it is
  loaded; our weight is the row-major storage the sync writes in place, read as it is.)

The kernels split K over several programs when the (M, N) tiles alone would leave the GPU's SMs idle
(`plan_tiles`), and sum the fp32 / int32 partials in the epilogue kernel.
Measured on one GPU so far, an H200 (bench/gpu_check.sh and bench/gpu_sweep_qlinear.py, numbers in docs/gpu.md
and bench/RESULTS.md); compiled for sm_80 / 86 / 90 / 100 and gfx942 by `flashrl-kernels gpu-audit` and checked
against the float64 spec in Triton's interpreter.
"""
from __future__ import annotations

import dataclasses
import functools
import os
import sys

import torch
import triton
import triton.language as tl

from ._host import cdiv, cuda_index, sm_count

FP8 = torch.float8_e4m3fn
SMALL_M = 64  # rows up to which the Triton W8A8 INT8 kernel beats padding M for torch._int_mm (memory bound)

# kernel names (what select_scaled_linear returns)
VLLM_CUTLASS = "vllm_cutlass_scaled_mm"
TORCH_SCALED_MM = "torch_scaled_mm"
TORCH_INT_MM = "torch_int_mm+triton_epilogue"
TRITON_W8A8_INT8 = "triton_w8a8_int8"
TRITON_W8A8_FP8_WIDEN = "triton_w8a8_fp8_widened"
TRITON_W8A16 = "triton_w8a16"


@dataclasses.dataclass(frozen=True)
class VllmScaledMM:
    """What vLLM's compiled GPU ops offer in this process (see `vllm_scaled_mm`)."""

    cutlass: bool = False  # vllm._custom_ops.cutlass_scaled_mm with a CUDA kernel behind it (checked by a probe)
    cutlass_fp8: bool = False  # its FP8 path supports this GPU (vllm's cutlass_scaled_mm_supports_fp8)


@dataclasses.dataclass(frozen=True)
class Choice:
    kernel: str
    reason: str


def select_scaled_linear(capability: tuple[int, int] | None, is_hip: bool, qdtype: torch.dtype, m: int, n: int,
                         k: int, activation_quant: bool, out_dtype: torch.dtype = torch.bfloat16,
                         vllm: VllmScaledMM = VllmScaledMM(), torch_w8a8: bool = False) -> Choice:
    """The kernel `scaled_linear` runs for these inputs on a GPU.

    capability: (major, minor) of a CUDA GPU (None on ROCm); is_hip: an AMD GPU; qdtype: torch.int8 or
    torch.float8_e4m3fn; m, n, k: x is [m, k], q is [n, k]; vllm: what vLLM provides here; torch_w8a8: whether
    torch's W8A8 GEMM for qdtype ran correctly here (torch._int_mm / torch._scaled_mm with row-wise scales,
    probed once per device by torch_impl.quantize.cuda_fast_path).
    """
    if qdtype not in (torch.int8, FP8):
        raise ValueError(f"qdtype must be torch.int8 or torch.float8_e4m3fn, got {qdtype}")
    cap = tuple(capability) if capability is not None else None
    if not activation_quant:
        if qdtype == FP8 and not is_hip and cap is not None and cap < (8, 9):
            why = ("fp8 weight-only below sm_89: e4m3fn codes widened to bf16 by integer arithmetic in registers "
                   "(vLLM uses Marlin here, which needs its own repacked weight layout)")
        else:
            why = "weight-only: codes widened in registers, scale and bias in the epilogue"
        return Choice(TRITON_W8A16, why)
    cutlass_shapes = n % 16 == 0 and k % 16 == 0 and out_dtype in (torch.bfloat16, torch.float16)
    cuda = not is_hip and cap is not None
    if qdtype == torch.int8:
        if cuda and vllm.cutlass and cutlass_shapes and cap < (10, 0):
            return Choice(VLLM_CUTLASS, "vLLM's CUTLASS W8A8 INT8 (compute capability below 10.0)")
        if m <= SMALL_M:
            return Choice(TRITON_W8A8_INT8, f"INT8, M <= {SMALL_M}: int8 tensor-core dot, scales fused, no padding")
        if cuda and cap[0] == 9:
            return Choice(TRITON_W8A8_INT8, "INT8 on sm_90: the Triton int8 dot, scales fused (measured on an H200, "
                                            "1.1-1.4x faster than cuBLASLt int8 + epilogue at M = 128 ... 4096)")
        if torch_w8a8 and n % 8 == 0 and k % 8 == 0:
            why = "INT8, large M: cuBLASLt int8 GEMM, then one fused epilogue pass"
            if cuda and cap >= (10, 0):
                why += " (vLLM's CUTLASS INT8 has no kernel for compute capability >= 10.0)"
            return Choice(TORCH_INT_MM, why)
        return Choice(TRITON_W8A8_INT8, "INT8: int8 tensor-core dot, scales fused (no usable torch._int_mm)")
    # FP8 W8A8
    if cuda and cap >= (8, 9):
        if vllm.cutlass and vllm.cutlass_fp8 and cutlass_shapes:
            return Choice(VLLM_CUTLASS, "vLLM's CUTLASS W8A8 FP8 (sm_89+)")
        if torch_w8a8 and cutlass_shapes:
            return Choice(TORCH_SCALED_MM, "FP8 tensor cores through torch._scaled_mm (row-wise scales)")
        return Choice(TRITON_W8A8_FP8_WIDEN, "FP8 without a usable scaled-mm: codes widened to bf16 in registers")
    where = "ROCm (MI300's fp8 is e4m3fnuz, not the e4m3fn codes stored)" if is_hip else "below sm_89 (no FP8 tensor cores)"
    return Choice(TRITON_W8A8_FP8_WIDEN, f"FP8 {where}: both operands' codes widened to bf16 in registers (exact)")


def fp8_decode_mode(capability: tuple[int, int] | None, is_hip: bool) -> int:
    """How the kernels widen e4m3fn bytes: 3 = the hardware e4m3 -> f16 conversion and, for bf16, integer ops and one
    bf16x2 multiply (CUDA sm_89+, `_e4m3x4_to_bf16`), 1 = integer arithmetic (sm_80 / sm_86, where Triton has no
    e4m3 type, and ROCm, whose native fp8 is another encoding). (2, Triton's own conversion, is what mode 3 runs
    in the interpreter, which has no inline assembly.)"""
    return 3 if (not is_hip and capability is not None and tuple(capability) >= (8, 9)) else 1


@dataclasses.dataclass(frozen=True)
class TilePlan:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_split: int  # K elements per split (a multiple of block_k)
    num_warps: int
    num_stages: int
    swap_ab: bool = False  # compute y.T tiles: the widened weight is the dot's first operand (W8A16 only)


def plan_tiles(m: int, n: int, k: int, sms: int, is_hip: bool = False, x_bytes: int = 2, int8_dot: bool = False,
               capability: tuple[int, int] | None = None, weight_only: bool = False) -> TilePlan:
    """Tile shape and split-K for the Triton kernels: small M is bound by the weight's bytes, so N is cut in 64
    columns; larger M takes 128 x 128 tiles. At any M, K is split while the (M, N) tiles alone would give fewer
    than two programs per SM (at most 8 splits, at least 4 K steps each). fp32 activations (x_bytes 4) take an
    IEEE fp32 dot, which holds its tiles in registers: 32-wide K and N tiles. On sm_90, int8_dot (W8A8 INT8) and
    weight_only (W8A16) take the tiles measured best there (bench/gpu_sweep_qlinear.py on an H200, 2026-12-04;
    docs/gpu.md)."""
    stages = 2 if (is_hip or x_bytes == 4) else 3  # fp32: a third stage made ptxas spill 8 bytes (sm_90)
    if m <= SMALL_M:
        bm = 16 if m <= 16 else (32 if m <= 32 else 64)
        bn, bk, warps = 64, 128, 4
        if x_bytes == 4:
            bn, bk = 32, 32
    else:
        bm, bn, bk, warps = 128, 128, 64, 8
        if x_bytes == 4:
            bm, bn, bk, warps = 64, 64, 32, 4
        elif int8_dot and not is_hip and capability is not None and capability[0] == 9:
            # H200: 64 x 128 x 128 up to M = 512 and 128 x 128 x 64 with 4 warps and 4 stages from M = 1024 were
            # within 1-9 % of the best of 40 plans per case; the 8-warp, 3-stage tile was 16-27 % slower there
            bm, bn, bk, warps, stages = (64, 128, 128, 4, 3) if m < 1024 else (128, 128, 64, 4, 4)
    swap = False
    if weight_only and x_bytes == 2 and m >= 256 and not is_hip and capability is not None and capability[0] == 9:
        # sm_90 W8A16 from M = 256: the tile computed transposed (the weight widened in registers is the wgmma's
        # register operand, not written back to shared memory first), 256 x-rows wide; on the H200 3-10 % faster
        # than the best plain tile at M = 256 ... 4096, slower below (bench/gpu_sweep_qlinear.py, 2026-12-04)
        swap = True
        bm, bn, bk, warps, stages = 256, 128, 64, 8, 3
    tiles = cdiv(m, bm) * cdiv(n, bn)
    split = 1
    steps = cdiv(k, bk)
    want = sms if swap else 2 * sms  # programs: the wide transposed tiles were fastest near one per SM
    if tiles < want:
        # (M = 128 ... 512 without it left most SMs idle: W8A16 on the H200 was 2-3.3x slower than with it);
        # decode splits in 2 where the rule gives 1: 172 column tiles of an 11008-row layer on 132 SMs ran 15 %
        # faster split in 2 than unsplit (H200)
        per = want // tiles
        if m <= 16 and per == 1:
            per = 2
        split = max(1, min(8, per, steps // 4))  # at least 4 K steps per program
    k_split = cdiv(steps, split) * bk
    split = cdiv(k, k_split)
    return TilePlan(bm, bn, bk, split, k_split, warps, stages, swap)


# ---- kernels ----


@triton.jit
def _e4m3x4_to_bf16(codes):
    """e4m3fn bytes -> bf16, four per asm block: the hardware e4m3x2 -> f16x2 conversion (sm_89+), then fp16 bits
    -> bf16 bits by integer ops on both halves at once (sign kept, exponent and mantissa shifted right by 3: the
    value times 2^-112, a normal bf16 for every finite e4m3 code) and one bf16x2 multiply by 2^112 (exact).
    Triton's own fp8 -> bf16 path converts every element again f16 -> bf16 on the slow conversion unit (1/4 rate
    on sm_90): that made FP8 decode ~30 % slower than INT8 on an H200. NaN codes (never written by the quantizer)
    come out finite."""
    return tl.inline_asm_elementwise(
        """
        {
        .reg .b16 lo, hi;
        .reg .b32 h0, h1, s0, s1, k, z;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 h0, lo;
        cvt.rn.f16x2.e4m3x2 h1, hi;
        shr.b32 s0, h0, 3;
        shr.b32 s1, h1, 3;
        and.b32 s0, s0, 0x0FFF0FFF;
        and.b32 s1, s1, 0x0FFF0FFF;
        and.b32 h0, h0, 0x80008000;
        and.b32 h1, h1, 0x80008000;
        or.b32 s0, s0, h0;
        or.b32 s1, s1, h1;
        mov.b32 k, 0x77807780;
        mov.b32 z, 0x80008000;
        fma.rn.bf16x2 $0, s0, k, z;
        fma.rn.bf16x2 $1, s1, k, z;
        }
        """,
        "=r,=r,r", [codes], dtype=tl.bfloat16, is_pure=True, pack=4)


@triton.jit
def widen_codes(codes, DECODE: tl.constexpr, DTYPE: tl.constexpr):
    """int8 codes (DECODE 0) or e4m3fn bytes (uint8; DECODE 1: integer arithmetic, any GPU; 2: the hardware
    conversion, sm_89+; 3: as 2, but to bf16 by `_e4m3x4_to_bf16`) as DTYPE. Exact: every code is representable
    in bf16 / fp16 / fp32."""
    if DECODE == 0:
        w = codes.to(tl.float32).to(DTYPE)  # (the interpreter cannot convert int8 to bf16 directly)
    elif DECODE == 1:
        # e4m3fn -> fp16 bits: exponent and mantissa shifted in place (bias 7 -> 15 is the factor 2^-8, undone by
        # the product below); e4m3 subnormals land on fp16 subnormals, which the conversion to fp32 keeps exactly
        b = codes.to(tl.int16)
        h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
        w = (h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(DTYPE)
    elif DECODE == 3 and DTYPE == tl.bfloat16:
        w = _e4m3x4_to_bf16(codes)
    else:
        w = codes.to(tl.float8e4nv, bitcast=True).to(DTYPE)
    return w


@triton.jit
def _scale_epilogue(acc, rm, rn, XS, S, BIAS, M, N, X_CODES: tl.constexpr, HAS_BIAS: tl.constexpr):
    """fp32 (acc * xs[m] * s[n] + bias[n]); xs only for quantized activations."""
    y = acc.to(tl.float32)
    if X_CODES != 0:
        y = y * tl.load(XS + rm, mask=rm < M, other=0.0)[:, None]
    y = y * tl.load(S + rn, mask=rn < N, other=0.0)[None, :]
    if HAS_BIAS:
        y = y + tl.load(BIAS + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    return y


@triton.jit
def _dot_step(a, b, acc, X_CODES: tl.constexpr, W_DECODE: tl.constexpr, CDTYPE: tl.constexpr,
              PRECISION: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc += a @ widen(b) for an x tile a [BM, BK] and a weight tile b [BK, BN]; SWAP_AB: acc += widen(b) @ a for
    a weight tile b [BN, BK] and an x tile a [BK, BM] (the accumulator is the transposed output tile)."""
    if X_CODES == 1:
        if SWAP_AB:
            acc = tl.dot(b, a, acc, out_dtype=tl.int32)
        else:
            acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    else:
        if X_CODES == 2:
            a = widen_codes(a, W_DECODE, CDTYPE)
        else:
            a = a.to(CDTYPE)
        if SWAP_AB:
            acc = tl.dot(widen_codes(b, W_DECODE, CDTYPE), a, acc, input_precision=PRECISION)
        else:
            acc = tl.dot(a, widen_codes(b, W_DECODE, CDTYPE), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _w8_linear_kernel(
    X, XS, Q, S, BIAS, Y, P, M, N, K, stride_xm, stride_qn, stride_ym, K_SPLIT,
    X_CODES: tl.constexpr, W_DECODE: tl.constexpr, CDTYPE: tl.constexpr, PRECISION: tl.constexpr,
    HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile of x @ q.T over K[pid_k * K_SPLIT : (pid_k + 1) * K_SPLIT].

    X_CODES 0: x is float (W8A16): q widened to CDTYPE (x's dtype; fp32 under the interpreter), fp32 accumulation.
    X_CODES 1: x holds int8 codes (W8A8 INT8): int8 x int8 -> int32 dot.
    X_CODES 2: x holds e4m3fn bytes (W8A8 FP8): both widened to bf16 (CDTYPE), fp32 accumulation.
    SWAP_AB: the tile is computed transposed, widen(q) @ x.T, so the widened weight is the dot's first operand:
    on sm_90 that operand of a wgmma may come from registers, while a second operand widened in registers is
    written back to shared memory first (and the weight's N, not M, fills the MMA's 64-row side at small M).
    The K loop runs over whole BLOCK_K steps without a mask along K (vector loads, software pipelined); a K
    that is not a multiple of BLOCK_K (EVEN_K False) ends with one masked step.
    SPLIT: write the raw partial sums to P[pid_k] (the epilogue kernel adds them up); else the scaled output.
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    k0 = pid_k.to(tl.int64) * K_SPLIT
    if SWAP_AB:
        x_ptrs = X + rm.to(tl.int64)[None, :] * stride_xm + (k0 + rk)[:, None]  # x.T tile [BK, BM]
        q_ptrs = Q + rn.to(tl.int64)[:, None] * stride_qn + (k0 + rk)[None, :]  # q tile [BN, BK]
        x_in = (rm < M)[None, :]
        q_in = (rn < N)[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.int32 if X_CODES == 1 else tl.float32)
    else:
        x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + (k0 + rk)[None, :]
        q_ptrs = Q + rn.to(tl.int64)[None, :] * stride_qn + (k0 + rk)[:, None]
        x_in = (rm < M)[:, None]
        q_in = (rn < N)[None, :]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if X_CODES == 1 else tl.float32)
    if EVEN_K:
        k_full = K_SPLIT
    else:
        k_len = tl.minimum(K_SPLIT, K - k0).to(tl.int32)
        k_full = (k_len // BLOCK_K) * BLOCK_K
    for kk in range(0, k_full, BLOCK_K):
        a = tl.load(x_ptrs, mask=x_in, other=0)
        b = tl.load(q_ptrs, mask=q_in, other=0)
        acc = _dot_step(a, b, acc, X_CODES, W_DECODE, CDTYPE, PRECISION, SWAP_AB)
        x_ptrs += BLOCK_K
        q_ptrs += BLOCK_K
    if not EVEN_K:  # noqa: SIM102 (compile-time branch: k_len exists only here)
        if k_full < k_len:
            k_in = (k_full + rk) < k_len
            if SWAP_AB:
                a = tl.load(x_ptrs, mask=x_in & k_in[:, None], other=0)
                b = tl.load(q_ptrs, mask=q_in & k_in[None, :], other=0)
            else:
                a = tl.load(x_ptrs, mask=x_in & k_in[None, :], other=0)
                b = tl.load(q_ptrs, mask=q_in & k_in[:, None], other=0)
            acc = _dot_step(a, b, acc, X_CODES, W_DECODE, CDTYPE, PRECISION, SWAP_AB)
    if SWAP_AB:
        acc = tl.trans(acc)
    m_in = (rm < M)[:, None]
    n_in = (rn < N)[None, :]
    if SPLIT:
        p_ptrs = P + pid_k.to(tl.int64) * M * N + rm.to(tl.int64)[:, None] * N + rn[None, :]
        tl.store(p_ptrs, acc, mask=m_in & n_in)
    else:
        y = _scale_epilogue(acc, rm, rn, XS, S, BIAS, M, N, X_CODES, HAS_BIAS)
        tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=m_in & n_in)


@triton.jit
def _w8_epilogue_kernel(
    P, XS, S, BIAS, Y, M, N, stride_pm, stride_ym, SPLIT,
    X_CODES: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """y = (sum over SPLIT partials of P) * xs[m] * s[n] + bias[n], in Y's dtype: the split-K reduction, and the
    one pass after torch._int_mm (SPLIT = 1, P its int32 output). Integer partials are summed as integers."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rm < M)[:, None] & (rn < N)[None, :]
    ptrs = P + rm.to(tl.int64)[:, None] * stride_pm + rn[None, :]
    acc = tl.load(ptrs, mask=inside, other=0)
    for s in range(1, SPLIT):
        acc += tl.load(ptrs + s * M * N, mask=inside, other=0)
    y = _scale_epilogue(acc, rm, rn, XS, S, BIAS, M, N, X_CODES, HAS_BIAS)
    tl.store(Y + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], y.to(Y.dtype.element_ty), mask=inside)


# ---- launches ----

_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _epilogue(part, xs, scale, bias, y, split, x_codes):
    m, n = y.shape
    bm, bn = 32, 128
    _w8_epilogue_kernel[(cdiv(m, bm), cdiv(n, bn))](
        part, xs if xs is not None else scale, scale, bias if bias is not None else scale, y, m, n,
        part.stride(-2), y.stride(0), split,
        X_CODES=x_codes, HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=4,
    )


def w8_linear(x, xs, q, scale, bias, out_dtype, x_codes: int, w_decode: int, plan: TilePlan,
              for_gpu: bool | None = None):
    """Launch the Triton kernel: x [M, K] float (x_codes 0) or int8 / e4m3fn codes with per-row scales xs.
    for_gpu: compile for a GPU (default: x is a CUDA tensor; the audit sets it for its CPU stand-ins)."""
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty((m, n), dtype=out_dtype, device=x.device)
    if m == 0 or n == 0:
        return y
    if k == 0:
        return y.copy_((bias.to(out_dtype) if bias is not None else torch.zeros(n, dtype=out_dtype,
                                                                                device=x.device)).expand(m, n))
    codes = q.view(torch.uint8) if q.dtype == FP8 else q
    xa = x.view(torch.uint8) if x.dtype == FP8 else x
    if not (x.device.type == "cuda" if for_gpu is None else for_gpu):
        # Triton's interpreter multiplies bf16 / fp16 tiles as raw integers: its dots run in fp32 (exact for the
        # widened codes), so there the widening, masking and epilogues are what is checked, not the dot's dtype
        cdtype, precision = tl.float32, "ieee"
        w_decode = 2 if w_decode == 3 else w_decode  # (no inline assembly in the interpreter)
    elif x_codes == 0:
        cdtype, precision = _TL[x.dtype], ("ieee" if x.dtype == torch.float32 else "tf32")
    else:
        cdtype, precision = tl.bfloat16, "tf32"  # fp8 codes: exact in bf16; int8 dots ignore both
    split = plan.split_k > 1
    part = torch.empty((plan.split_k, m, n), dtype=torch.int32 if x_codes == 1 else torch.float32,
                       device=x.device) if split else y
    grid = (cdiv(m, plan.block_m), cdiv(n, plan.block_n), plan.split_k)
    _w8_linear_kernel[grid](
        xa, xs if xs is not None else scale, codes, scale, bias if bias is not None else scale, y, part,
        m, n, k, xa.stride(0), codes.stride(0), y.stride(0), plan.k_split,
        X_CODES=x_codes, W_DECODE=w_decode, CDTYPE=cdtype, PRECISION=precision, HAS_BIAS=bias is not None,
        SPLIT=split, EVEN_K=(k % plan.k_split == 0 and plan.k_split % plan.block_k == 0), SWAP_AB=plan.swap_ab,
        BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
        num_warps=plan.num_warps, num_stages=plan.num_stages,
    )
    if split:
        _epilogue(part, xs, scale, bias, y, plan.split_k, x_codes)
    return y


def int_mm_scaled(xq, xs, q, scale, bias, out_dtype):
    """torch._int_mm (cuBLASLt int8 GEMM, int32 out) and one fused Triton epilogue pass. torch._int_mm on CUDA
    wants M > 16: smaller M is padded to 32 rows (the selection never picks this kernel there)."""
    m = xq.shape[0]
    if m <= 16:
        xq = torch.nn.functional.pad(xq, (0, 0, 0, 32 - m))
    acc = torch._int_mm(xq, q.t())[:m]
    y = torch.empty(acc.shape, dtype=out_dtype, device=acc.device)
    _epilogue(acc, xs, scale, bias, y, 1, 1)
    return y


def vllm_scaled_mm(ops, xq, xs, q, scale, bias, out_dtype):
    """vLLM's fused scaled GEMM: a [M, K] row-major codes, b = q.t() [K, N] column-major (q's rows are
    contiguous), per-token scale_a [M, 1], per-channel scale_b [1, N] (fp32), bias [N] in out_dtype."""
    return ops.cutlass_scaled_mm(xq, q.t(), scale_a=xs.reshape(-1, 1), scale_b=scale.reshape(1, -1),
                                 out_dtype=out_dtype, bias=None if bias is None else bias.to(out_dtype))


# ---- what this process offers (GPU only: probed once per device, then cached) ----


def _vllm_wanted() -> bool:
    """FLASHRL_VLLM_KERNELS=0 never uses vLLM's kernels, =1 imports vLLM to look for them; unset (default): use
    them when vLLM is already imported (a rollout engine), never importing it into a trainer process."""
    env = os.environ.get("FLASHRL_VLLM_KERNELS", "").strip()
    if env == "0":
        return False
    return env == "1" or "vllm" in sys.modules


def _vllm_ops():
    try:
        import vllm._custom_ops as ops

        return ops if hasattr(torch.ops._C, "cutlass_scaled_mm") else None
    except Exception:  # not installed, a CPU build, or an import error: vLLM has nothing for us here
        return None


@functools.cache
def _vllm_probe(device_index: int) -> VllmScaledMM:
    if torch.version.hip is not None:
        return VllmScaledMM()  # vLLM's ROCm path for these is its Triton kernel; ours is audited for gfx942
    ops = _vllm_ops()
    if ops is None:
        return VllmScaledMM()
    major, minor = torch.cuda.get_device_capability(device_index)
    try:
        fp8 = bool(ops.cutlass_scaled_mm_supports_fp8(major * 10 + minor))
    except Exception:
        fp8 = False
    dev = torch.device("cuda", device_index)

    def works(dtype) -> bool:
        try:
            a = torch.ones(32, 32, device=dev).to(dtype)
            y = vllm_scaled_mm(ops, a, torch.full((32,), 0.5, device=dev), a, torch.full((32,), 2.0, device=dev),
                               None, torch.bfloat16)
            return bool(torch.equal(y.float(), torch.full((32, 32), 32.0, device=dev)))
        except Exception:  # a kernel this build or GPU lacks (e.g. INT8 on sm_100), or an ABI mismatch
            return False

    int8_ok = (major, minor) < (10, 0) and works(torch.int8)
    fp8_ok = fp8 and works(FP8)
    return VllmScaledMM(cutlass=int8_ok or fp8_ok, cutlass_fp8=fp8_ok)


def available_vllm(device: torch.device) -> VllmScaledMM:
    if device.type != "cuda" or not _vllm_wanted():
        return VllmScaledMM()
    return _vllm_probe(cuda_index(device))


INTERPRETER_CAPABILITY = (8, 0)  # the GPU the interpreter stands in for (tests may change it)


def device_facts(device: torch.device) -> tuple[tuple[int, int] | None, bool, int]:
    """(capability, is_hip, SM count); on the CPU (Triton's interpreter) an A100 stands in, with few SMs."""
    if device.type != "cuda":
        return INTERPRETER_CAPABILITY, False, 4
    index = cuda_index(device)
    if torch.version.hip is not None:
        return None, True, sm_count(index)
    return torch.cuda.get_device_capability(index), False, sm_count(index)


def scaled_linear(quantize, x2d, q, scale, bias, activation_quant):
    """The quantized linear on a GPU (or in the interpreter); `quantize(x, dtype) -> (codes, scales)` is the
    activation quantizer (our Triton quantize_rows: the spec's rounding)."""
    m, k = x2d.shape
    n = q.shape[0]
    dev = x2d.device
    if dev.type == "cuda":
        index = cuda_index(dev)
        kernel, cap, is_hip, sms, plan = cuda_choice(index, q.dtype, m, n, k, bool(activation_quant), x2d.dtype,
                                                     _vllm_wanted())
        return run_choice(kernel, quantize, x2d, q, scale, bias, cap, is_hip, sms, plan)
    cap, is_hip, sms = device_facts(dev)  # the interpreter: not cached (tests change INTERPRETER_CAPABILITY)
    choice = select_scaled_linear(cap, is_hip, q.dtype, m, n, k, activation_quant, x2d.dtype, VllmScaledMM(), False)
    return run_choice(choice.kernel, quantize, x2d, q, scale, bias, cap, is_hip, sms)


@functools.lru_cache(maxsize=4096)
def cuda_choice(index: int, qdtype: torch.dtype, m: int, n: int, k: int, activation_quant: bool,
                x_dtype: torch.dtype, vllm_wanted: bool):
    """(kernel, capability, is_hip, SM count, tile plan or None) for one call shape on CUDA device `index`: what
    select_scaled_linear and plan_tiles pick, computed once per shape (a vLLM engine calls every layer with the
    same few shapes; recomputing it cost ~20-40 us of host time per call)."""
    from ..torch_impl.quantize import cuda_fast_path

    dev = torch.device("cuda", index)
    cap, is_hip, sms = device_facts(dev)
    vllm = available_vllm(dev) if vllm_wanted else VllmScaledMM()
    torch_ok = activation_quant and n % 16 == 0 and k % 16 == 0 and cuda_fast_path(index, qdtype)
    kernel = select_scaled_linear(cap, is_hip, qdtype, m, n, k, activation_quant, x_dtype, vllm, torch_ok).kernel
    return kernel, cap, is_hip, sms, _plan_for(kernel, m, n, k, sms, is_hip, cap, x_dtype.itemsize)


def _plan_for(kernel: str, m: int, n: int, k: int, sms: int, is_hip: bool, cap, x_bytes: int) -> TilePlan | None:
    """The Triton kernels' tile plan for `kernel` (None for the library GEMMs)."""
    if kernel == TRITON_W8A16:
        return plan_tiles(m, n, k, sms, is_hip, x_bytes, capability=cap, weight_only=True)
    if kernel == TRITON_W8A8_INT8:
        return plan_tiles(m, n, k, sms, is_hip, int8_dot=True, capability=cap)
    if kernel == TRITON_W8A8_FP8_WIDEN:
        return plan_tiles(m, n, k, sms, is_hip)
    return None


def run_choice(kernel: str, quantize, x2d, q, scale, bias, cap, is_hip, sms, plan: TilePlan | None = None):
    """Run `kernel` (a name select_scaled_linear returns); `plan`: its tile plan when already known."""
    m, k = x2d.shape
    n = q.shape[0]
    out_dtype = x2d.dtype
    x = x2d if x2d.stride(-1) == 1 or k <= 1 else x2d.contiguous()
    if q.stride(-1) != 1 and k > 1:
        q = q.contiguous()
    if plan is None:
        plan = _plan_for(kernel, m, n, k, sms, is_hip, cap, x.element_size())
    decode = fp8_decode_mode(cap, is_hip)
    if kernel == TRITON_W8A16:
        return w8_linear(x, None, q, scale, bias, out_dtype, 0, 0 if q.dtype == torch.int8 else decode, plan)
    xq, xs = quantize(x, q.dtype)
    if kernel == VLLM_CUTLASS:
        return vllm_scaled_mm(_vllm_ops(), xq, xs, q, scale, bias, out_dtype)
    if kernel == TORCH_SCALED_MM:
        return torch._scaled_mm(xq, q.t(), scale_a=xs.unsqueeze(1), scale_b=scale.unsqueeze(0),
                                bias=None if bias is None else bias.to(out_dtype), out_dtype=out_dtype)
    if kernel == TORCH_INT_MM:
        return int_mm_scaled(xq, xs, q, scale, bias, out_dtype)
    if kernel == TRITON_W8A8_INT8:
        return w8_linear(xq, xs, q, scale, bias, out_dtype, 1, 0, plan)
    if kernel == TRITON_W8A8_FP8_WIDEN:
        return w8_linear(xq, xs, q, scale, bias, out_dtype, 2, decode, plan)
    raise ValueError(f"unknown scaled-linear kernel {kernel!r}")


# ---- the per-GPU table of docs/gpu.md, generated from the selection above ----

GPU_GENERATIONS = (
    ("A100 / A800 (sm_80)", (8, 0), False),
    ("A6000 (sm_86)", (8, 6), False),
    ("L40 / RTX 4090 (sm_89)", (8, 9), False),
    ("H100 / H200 (sm_90)", (9, 0), False),
    ("B200 (sm_100)", (10, 0), False),
    ("MI300X (gfx942)", None, True),
)
_SHORT = {VLLM_CUTLASS: "vLLM CUTLASS", TORCH_SCALED_MM: "torch._scaled_mm", TORCH_INT_MM: "torch._int_mm + epilogue",
          TRITON_W8A8_INT8: "Triton int8 dot", TRITON_W8A8_FP8_WIDEN: "Triton fp8 widened",
          TRITON_W8A16: "Triton W8A16"}


def selection_markdown() -> str:
    """Which kernel scaled_linear runs per GPU generation: without vLLM / with vLLM loaded (where it differs).
    Assumes torch's W8A8 GEMMs run where the hardware has them (int8: all; fp8: sm_89+; the probe decides)."""
    cols = [("INT8 W8A16", torch.int8, False, 1), ("FP8 W8A16", FP8, False, 1),
            (f"INT8 W8A8, M <= {SMALL_M}", torch.int8, True, 1), (f"INT8 W8A8, M > {SMALL_M}", torch.int8, True, 4096),
            ("FP8 W8A8", FP8, True, 16)]
    lines = ["| GPU | " + " | ".join(c[0] for c in cols) + " |", "|" + "---|" * (len(cols) + 1)]
    for name, cap, hip in GPU_GENERATIONS:
        cells = []
        for _, dt, aq, m in cols:
            fp8_hw = not hip and cap >= (8, 9)
            torch_ok = dt == torch.int8 or fp8_hw
            plain = select_scaled_linear(cap, hip, dt, m, 4096, 4096, aq, torch.bfloat16, VllmScaledMM(), torch_ok)
            vllm = VllmScaledMM(cutlass=not hip, cutlass_fp8=fp8_hw)
            with_v = select_scaled_linear(cap, hip, dt, m, 4096, 4096, aq, torch.bfloat16, vllm, torch_ok)
            cell = _SHORT[plain.kernel]
            if with_v.kernel != plain.kernel:
                cell += f" / {_SHORT[with_v.kernel]}"
            cells.append(cell)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
