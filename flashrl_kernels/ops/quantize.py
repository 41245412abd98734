"""torch.library ops for per-row INT8 / FP8 quantization and the scaled linear, and the public functions.

flashrl::quantize_rows_  (w [R, K], q_out [R, K] int8|fp8 (mutated), scale_out [R] fp32 (mutated)) -> ()
flashrl::dequantize_rows (q [R, K], scale [R], dtype) -> [R, K] in dtype
flashrl::scaled_linear   (x [M, K], q [N, K], scale [N], bias [N]?, activation_quant) -> [M, N] in x.dtype

The math is in reference/quantize.py (the spec). All three dispatch at run
time to the selected backend (see _backend.py). The quantizer has only an
out= form as an op: the allocating `quantize_rows` allocates and calls it,
and the in-place `quantize_rows_` writes into storage the caller owns (a
rollout engine's weight parameters), which is what makes a weight sync
allocation-free. These ops are for inference: they have no autograd formula.
"""
from __future__ import annotations

import torch
from torch import Tensor

from .._backend import BackendUnavailableError, implementation, selected_backend
from .._checks import (
    FLOAT_DTYPES,
    check_same_device,
    check_tensor,
    first_true,
    nonfinite_tensors,
    tracing,
    value_checks_enabled,
)
from ..reference.quantize import QUANT_DTYPES


@torch.library.custom_op("flashrl::quantize_rows_", mutates_args=("q_out", "scale_out"))
def _quantize_rows_op(w: Tensor, q_out: Tensor, scale_out: Tensor) -> None:
    implementation("quantize_rows_forward", w.device)(w, q_out, scale_out)


@_quantize_rows_op.register_fake
def _(w, q_out, scale_out):
    return None


@torch.library.custom_op("flashrl::dequantize_rows", mutates_args=())
def _dequantize_rows_op(q: Tensor, scale: Tensor, dtype: torch.dtype) -> Tensor:
    return implementation("dequantize_rows_forward", q.device)(q, scale, dtype)


@_dequantize_rows_op.register_fake
def _(q, scale, dtype):
    return q.new_empty(q.shape, dtype=dtype)


@torch.library.custom_op("flashrl::scaled_linear", mutates_args=())
def _scaled_linear_op(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, activation_quant: bool) -> Tensor:
    return implementation("scaled_linear_forward", x.device)(x, q, scale, bias, activation_quant)


@_scaled_linear_op.register_fake
def _(x, q, scale, bias, activation_quant):
    return x.new_empty((x.shape[0], q.shape[0]))


# ---- checks ----

def _check_qdtype(name: str, dtype) -> None:
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"{name} must be a torch.dtype (torch.int8 or torch.float8_e4m3fn), got {type(dtype).__name__}")
    if dtype not in QUANT_DTYPES:
        raise ValueError(f"{name} must be torch.int8 or torch.float8_e4m3fn, got {dtype}")


def _rows_view(t: Tensor, name: str) -> Tensor:
    """View t[..., K] as [R, K] without a copy (rows may be strided, K must be contiguous), or raise."""
    k = t.shape[-1]
    if t.stride(-1) != 1 and k > 1:
        raise ValueError(f"{name} must have unit stride in its last dimension, got strides {tuple(t.stride())}")
    if t.dim() == 1:
        return t.view(1, k)
    if t.dim() == 2:
        return t
    try:
        return t.view(-1, k)
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(t.shape)} and strides {tuple(t.stride())} cannot be viewed as [rows, K] "
            "without a copy"
        ) from None


def _scale_view(t: Tensor, rows: int, name: str) -> Tensor:
    try:
        v = t.view(rows) if t.dim() != 1 else t
    except RuntimeError:
        raise ValueError(f"{name} with shape {tuple(t.shape)} cannot be viewed as [{rows}] without a copy") from None
    return v


def _raise_nonfinite(name: str, scale2d: Tensor) -> None:
    bad = ~torch.isfinite(scale2d)
    if bool(bad.any()):  # the one host sync
        i = first_true(bad)
        raise ValueError(f"{name} row {i} (flat) contains NaN or +-inf: it has no defined quantization scale")


def _check_weight(w: Tensor, name: str = "w") -> None:
    check_tensor(name, w, dtypes=FLOAT_DTYPES, ndim_min=1)
    if w.shape[-1] == 0:
        raise ValueError(f"{name} has an empty last dimension (K = 0): a row needs at least one element")


# ---- public functions ----

def quantize_rows(w: Tensor, dtype: torch.dtype = torch.int8):
    """Symmetric per-row quantization of w[..., K] (a weight [out, in]: per output channel).

    Returns (q, scale): q with w's shape in `dtype` (torch.int8: scale = amax/127,
    round half to even, clamp to [-128, 127]; torch.float8_e4m3fn: scale = amax/448,
    saturating), scale fp32 with shape w.shape[:-1], so that w ~= q * scale[..., None].
    Rows whose max |w| is 0 (or below 2^-100) get scale 1 and exact zeros. A row
    holding NaN or +-inf raises ValueError (with value checks on, the default).
    """
    _check_weight(w)
    _check_qdtype("dtype", dtype)
    k = w.shape[-1]
    w2d = w.reshape(-1, k)
    if w2d.stride(-1) != 1 and k > 1:
        w2d = w2d.contiguous()
    rows = w2d.shape[0]
    q = torch.empty((rows, k), dtype=dtype, device=w.device)
    scale = torch.empty(rows, dtype=torch.float32, device=w.device)
    if rows:
        torch.ops.flashrl.quantize_rows_(w2d, q, scale)
        if value_checks_enabled():
            _raise_nonfinite("w", scale)
    return q.view(w.shape), scale.view(w.shape[:-1])


def quantize_rows_(w: Tensor, q_out: Tensor, scale_out: Tensor):
    """In-place quantize_rows: write q and scale of w into existing storage; returns (q_out, scale_out).

    q_out (torch.int8 or torch.float8_e4m3fn, the target dtype) has w's shape and
    may be a row-strided view (e.g. a slice of a larger parameter), scale_out is
    fp32 with w.shape[:-1] elements. Nothing weight-sized is allocated (the
    torch backend uses bounded fp32 chunks). With value checks on, w is checked
    for NaN/inf first (one extra read and one host sync) and nothing is written
    if it has any; with value checks off, a non-finite row writes scale NaN.
    """
    _check_weight(w)
    check_tensor("q_out", q_out)
    check_tensor("scale_out", scale_out, dtypes=(torch.float32,))
    _check_qdtype("q_out.dtype", q_out.dtype)
    check_same_device(w=w, q_out=q_out, scale_out=scale_out)
    if tuple(q_out.shape) != tuple(w.shape):
        raise ValueError(f"q_out must have w's shape {tuple(w.shape)}, got {tuple(q_out.shape)}")
    rows = w.numel() // w.shape[-1]
    if scale_out.numel() != rows:
        raise ValueError(f"scale_out must have {rows} elements (one per row of w), got shape {tuple(scale_out.shape)}")
    w2d = _rows_view(w, "w") if w.stride(-1) == 1 else w.reshape(-1, w.shape[-1]).contiguous()
    q2d = _rows_view(q_out, "q_out")
    s1d = _scale_view(scale_out, rows, "scale_out")
    if rows == 0:
        return q_out, scale_out
    if value_checks_enabled() and nonfinite_tensors([w2d]):
        # finite min and max prove all elements finite (one read, no temporary); else find the row exactly
        bad = ~torch.isfinite(w2d).all(dim=-1)
        if bool(bad.any()):
            raise ValueError(f"w row {first_true(bad)} (flat) contains NaN or +-inf; nothing was written")
    torch.ops.flashrl.quantize_rows_(w2d, q2d, s1d)
    return q_out, scale_out


def quantize_per_token(x: Tensor, dtype: torch.dtype = torch.int8):
    """Dynamic per-token activation quantization for W8A8: quantize_rows of x[..., K], one scale per token."""
    return quantize_rows(x, dtype)


def dequantize_rows(q: Tensor, scale: Tensor, dtype: torch.dtype = torch.bfloat16) -> Tensor:
    """q * scale[..., None] in `dtype` (bf16, fp16 or fp32)."""
    check_tensor("q", q, ndim_min=1)
    _check_qdtype("q.dtype", q.dtype)
    check_tensor("scale", scale, dtypes=(torch.float32,))
    check_same_device(q=q, scale=scale)
    if not isinstance(dtype, torch.dtype) or dtype not in FLOAT_DTYPES:
        raise TypeError(f"dtype must be one of torch.float32, torch.bfloat16, torch.float16, got {dtype}")
    if tuple(scale.shape) != tuple(q.shape[:-1]):
        raise ValueError(f"scale must have shape q.shape[:-1] = {tuple(q.shape[:-1])}, got {tuple(scale.shape)}")
    k = q.shape[-1]
    q2d = q.reshape(-1, k)
    out = torch.ops.flashrl.dequantize_rows(q2d, scale.reshape(-1), dtype)
    return out.view(q.shape)


def scaled_linear(
    x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None = None, *, activation_quant: bool = False
) -> Tensor:
    """x @ (q * scale[:, None]).T + bias for a per-row quantized weight q [N, K].

    activation_quant=False: weight-only (W8A16), the activations stay in x.dtype.
    activation_quant=True: dynamic W8A8, the activations are quantized per token
    to q.dtype first. On a GPU the kernel is chosen per GPU generation, dtype
    and M (triton_impl/qlinear.select_scaled_linear: vLLM's CUTLASS scaled-mm
    when vLLM provides it, Triton kernels with the codes widened in registers
    and the scales fused, torch._int_mm / torch._scaled_mm); on the CPU the
    native C++ kernel; elsewhere it is emulated exactly. Returns [..., N] in
    x.dtype.
    """
    check_tensor("x", x, dtypes=FLOAT_DTYPES, ndim_min=1)
    check_tensor("q", q)
    _check_qdtype("q.dtype", q.dtype)
    check_tensor("scale", scale, dtypes=(torch.float32,))
    check_same_device(x=x, q=q, scale=scale, bias=bias)
    if q.dim() != 2:
        raise ValueError(f"q must be 2-D [N, K], got shape {tuple(q.shape)}")
    n, k = q.shape
    if x.shape[-1] != k:
        raise ValueError(f"x must have last dimension K = {k} (q is [N, K] = {tuple(q.shape)}), got {x.shape[-1]}")
    if tuple(scale.shape) != (n,):
        raise ValueError(f"scale must have shape ({n},), got {tuple(scale.shape)}")
    if bias is not None:
        check_tensor("bias", bias, dtypes=FLOAT_DTYPES)
        if tuple(bias.shape) != (n,):
            raise ValueError(f"bias must have shape ({n},), got {tuple(bias.shape)}")
        bias = bias.to(x.dtype)
    x2d = x.reshape(-1, k)
    y = torch.ops.flashrl.scaled_linear(x2d, q, scale, bias, bool(activation_quant))
    return y.view(*x.shape[:-1], n)


def quantize_rows_counted_(w2d: Tensor, q2d: Tensor, s1d: Tensor) -> int:
    """flashrl::quantize_rows_(w2d, q2d, s1d) that also returns how many codes of q2d changed (compared as bytes:
    int8 codes, or e4m3fn bit patterns), what a weight sync reports. The arguments are the already validated
    [R, K] / [R] views a loader writes (no checks here).

    On the CPU with the native backend the kernel counts while it writes (the old codes come from the cache
    lines the stores bring in anyway: within noise of the plain write). Elsewhere rows go in chunks that stay
    in cache (CPU: 256 KiB of codes) or in 64 MiB chunks (GPU): the chunk's old codes are copied, the chunk is
    quantized, and the two are compared.
    """
    rows, k = q2d.shape
    if rows == 0 or k == 0:
        return 0
    if _native_selected(q2d) and w2d.stride(-1) == 1 and q2d.stride(-1) == 1:
        return int(torch.ops.flashrl_native.quantize_rows_counted(w2d, q2d, s1d))
    chunk = max(1, ((64 << 20) if q2d.is_cuda else (256 << 10)) // k)
    changed = torch.zeros((), dtype=torch.int64, device=q2d.device)
    for r0 in range(0, rows, chunk):
        q = q2d[r0:r0 + chunk]
        old = q.clone()
        torch.ops.flashrl.quantize_rows_(w2d[r0:r0 + chunk], q, s1d[r0:r0 + chunk])
        changed += (q.view(torch.uint8) != old.view(torch.uint8)).sum()
    return int(changed)


def direct_scaled_linear(q: Tensor, activation_quant: bool):
    """A callable computing scaled_linear(x, q, ...) for these weights without flashrl::scaled_linear's Python
    dispatch, or None: on a CPU the native C++ op when the backend choice (use_backend / FLASHRL_BACKEND /
    automatic) is native and its kernel covers them; on a CUDA GPU with the triton backend selected, the Triton
    path itself (the registered op while torch.compile traces, so a compiled graph holds the op).

    For per-token hot paths such as the vLLM plugin's layers: the returned callable takes
    (x [M, K], q, scale, bias, activation_quant) like flashrl::scaled_linear.
    """
    if q.is_cuda:
        try:
            triton = selected_backend(q.device, "scaled_linear_forward") == "triton"
        except BackendUnavailableError:  # the op raises its own error at the call
            return None
        return _triton_direct if triton else None
    if not _native_selected(q):
        return None
    from ..native.quantize import direct_linear

    return direct_linear(q, activation_quant)


def _triton_direct(x: Tensor, q: Tensor, scale: Tensor, bias: Tensor | None, activation_quant: bool) -> Tensor:
    if tracing():
        return torch.ops.flashrl.scaled_linear(x, q, scale, bias, activation_quant)
    from ..triton_impl.qlinear import scaled_linear as triton_scaled_linear
    from ..triton_impl.quantize import quantize_rows

    return triton_scaled_linear(quantize_rows, x, q, scale, bias, activation_quant)


def direct_bf16_linear(w: Tensor):
    """The native C++ op computing x @ w.T + bias straight from a plain bf16 CPU weight's rows (AVX2 /
    AVX-512 builds, native backend selected), else None: for a model-dtype layer that must keep reading its own
    storage, e.g. the bf16 LM head of a quantized vLLM engine. Takes (x [M, K] bf16, w, bias)."""
    if not _native_selected(w):
        return None
    from ..native.quantize import direct_bf16_linear as _direct

    return _direct(w)


def direct_packed_w8a8(q: Tensor) -> bool:
    """Whether the native packed W8A8 kernel (torch.ops.flashrl_native.qlinear_packed) can compute a layer
    whose int8 CPU weight has q's shape when the layer stores it packed: the native backend is selected and the
    CPU and shape fit (see flashrl_kernels.native.quantize.packed_w8a8_fits)."""
    if q.dtype != torch.int8 or q.dim() != 2 or not _native_selected(q):
        return False
    from ..native.quantize import packed_w8a8_fits

    return packed_w8a8_fits(tuple(q.shape))


def _native_selected(t: Tensor) -> bool:
    if t.device.type != "cpu":
        return False
    try:
        return selected_backend(t.device, "scaled_linear_forward") == "native"
    except Exception:  # a forced backend that cannot run here: the caller takes the generic path
        return False
