"""Input checks shared by the public functions.

Two kinds:
- metadata checks (shape, dtype, device, strides): always on, free.
- value checks (token ids in range, finite rows): need one host sync, so they
  run outside the custom ops, in the public wrappers, once per call, and are
  skipped under torch.compile tracing. Turn them off with
  `flashrl_kernels.set_value_checks(False)` or FLASHRL_VALUE_CHECKS=0 when the
  sync matters more than the message; the kernels then still never read out of
  bounds and give NaN where the result is undefined.
"""
from __future__ import annotations

import functools
import math
import os

import torch

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)

_value_checks: bool | None = None


def set_value_checks(enabled: bool) -> None:
    """Enable or disable the host-syncing value checks of the public ops."""
    global _value_checks
    _value_checks = bool(enabled)


def tracing() -> bool:
    """torch.compile / export is tracing, or a torch dispatch mode is active (FakeTensorMode, meta tracing, the
    flop counter): tensors may hold no values, and cached real tensors must not leak into the trace."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def value_checks_enabled() -> bool:
    if tracing():  # the checks read values on the host
        return False
    if _value_checks is not None:
        return _value_checks
    return os.environ.get("FLASHRL_VALUE_CHECKS", "1") not in ("0", "false", "False", "off")


def check_tensor(name: str, t, *, dtypes=None, ndim_min: int | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {str(t.dtype).replace('torch.', '')}")
    if ndim_min is not None and t.dim() < ndim_min:
        raise ValueError(f"{name} must have at least {ndim_min} dimension(s), got shape {tuple(t.shape)}")


def check_same_device(**tensors) -> None:
    items = [(k, v) for k, v in tensors.items() if v is not None]
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_temperature(temperature) -> float:
    if isinstance(temperature, torch.Tensor) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a Python float, got {type(temperature).__name__}")
    t = float(temperature)
    if not (t > 0.0 and t < float("inf")):
        raise ValueError(f"temperature must be a finite positive number, got {temperature}")
    return t


def check_ignore_index(ignore_index) -> int | None:
    if ignore_index is None:
        return None
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int or None, got {type(ignore_index).__name__}")
    return int(ignore_index)


def nonfinite_tensors(tensors: list[torch.Tensor]) -> list[int]:
    """Indices of the floating tensors holding a NaN or +-inf; one host sync per device.

    torch.aminmax reads the tensor once in its own dtype and propagates NaN, so a tensor is finite exactly when
    its min and max are: no temporary, no false alarm. (A float32 sum of a bf16 tensor, the check this
    replaces, first converts the whole tensor on a CPU: on a 0.5B model's weights half a GB of fresh pages per
    call, 0.25-0.35 s of page faults, and 2-5 s right after a vLLM engine started.)
    """
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        if t.numel() and t.is_floating_point():
            by_device.setdefault(t.device, []).append(i)
    bad: list[int] = []
    for idx in by_device.values():
        ext = torch.stack([torch.stack(torch.aminmax(tensors[i].detach())).to(torch.float64) for i in idx])
        fin = torch.isfinite(ext).all(dim=1).cpu().tolist()
        bad += [i for i, ok in zip(idx, fin) if not ok]
    return sorted(bad)


def first_true(mask: torch.Tensor) -> int | None:
    """Index of the first True in a flat bool tensor, or None. One host sync."""
    idx = torch.nonzero(mask.reshape(-1))
    return int(idx[0, 0]) if idx.numel() else None


def check_logprob_values(targets, lse, vocab: int, ignore_index, undefined_row: str) -> None:
    """Value checks shared by the log-prob ops, after the op ran: token ids in range, every
    counted row's log-sum-exp finite. One host sync. `undefined_row` says, for the error, what
    makes a row's log-softmax undefined in this op ("{i}" is replaced by the flat row index)."""
    counted = targets != ignore_index if ignore_index is not None else torch.ones_like(targets, dtype=torch.bool)
    bad_target = counted & ((targets < 0) | (targets >= vocab))
    bad_row = counted & ~torch.isfinite(lse)
    flags = torch.stack([bad_target.any(), bad_row.any()]).tolist()  # the one host sync
    if flags[0]:
        i = first_true(bad_target)
        also = " or equal ignore_index" if ignore_index is not None else ""
        raise ValueError(
            f"targets must lie in [0, {vocab}) (vocabulary size){also}; "
            f"flat position {i} holds {int(targets.reshape(-1)[i])}"
        )
    if flags[1]:
        raise ValueError(undefined_row.format(i=first_true(bad_row)))


def rows_as_3d(x: torch.Tensor, name: str) -> torch.Tensor:
    """View `x[..., V]` as [B, T, V] without copying, or raise.

    The vocabulary dimension must have unit stride. Rows may be strided, as in
    `logits[:, :-1, :]` sliced from a model output: kernels index rows through
    (stride_b, stride_t), so such a slice is never copied.
    """
    v = x.shape[-1]
    if x.stride(-1) != 1 and v > 1:
        raise ValueError(
            f"{name} must have unit stride in its last (vocabulary) dimension, got strides {tuple(x.stride())}; "
            f"pass {name}.contiguous()"
        )
    if x.dim() == 1:
        return x.view(1, 1, v)
    if x.dim() == 2:
        return x.unsqueeze(0)
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, x.shape[-2], v)
    except RuntimeError:
        raise ValueError(
            f"{name} with shape {tuple(x.shape)} and strides {tuple(x.stride())} cannot be viewed as "
            f"[rows, vocab] without a copy; pass {name}.contiguous()"
        ) from None


def iter_row_chunks(x3: torch.Tensor, rows_per_chunk: int):
    """Yield (row_start, row_stop, 2-D view) over the rows of a [B, T, V] view."""
    b, t, v = x3.shape
    if b == 1 or x3.stride(0) == t * x3.stride(1):
        flat = x3.as_strided((b * t, v), (x3.stride(1), x3.stride(2)))
        for r0 in range(0, b * t, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, b * t)
            yield r0, r1, flat[r0:r1]
        return
    for bi in range(b):
        for t0 in range(0, t, rows_per_chunk):
            t1 = min(t0 + rows_per_chunk, t)
            yield bi * t + t0, bi * t + t1, x3[bi, t0:t1]


@functools.lru_cache(maxsize=64)
def _padded_cu_seqlens(b: int, t: int, device: torch.device) -> torch.Tensor:
    """T * arange(B + 1), made once per (B, T, device): the ops only read it (an arange and a multiply per call
    cost ~10-20 us of host time, more than a small loss kernel)."""
    return torch.arange(b + 1, device=device, dtype=torch.int64) * t


def sequence_layout(name: str, x: torch.Tensor, cu_seqlens: torch.Tensor | None):
    """The sequence layout of token tensor `x` (named `name` in errors): (cu_seqlens int64 [S+1], uniform_len).

    Padded [B, T] (no cu_seqlens): cu = T * arange(B + 1), uniform_len = T. Packed [N] with cu_seqlens:
    cu as int64, uniform_len = 0. The values of a packed cu_seqlens are checked by `check_cu_seqlens`.
    """
    shape = tuple(x.shape)
    if cu_seqlens is None:
        if x.dim() != 2:
            raise ValueError(
                f"padded inputs must be [B, T], got {name} of shape {shape}; for packed [total_tokens] inputs pass "
                "cu_seqlens"
            )
        b, t = shape
        if b == 0:
            raise ValueError(f"empty batch: {name} has no sequences (B = 0)")
        if tracing() or x.device.type == "meta":
            return torch.arange(b + 1, device=x.device, dtype=torch.int64) * t, t  # fake / traced: made fresh
        return _padded_cu_seqlens(b, t, x.device), t
    if x.dim() != 1:
        raise ValueError(f"packed inputs (cu_seqlens given) must be 1-D [total_tokens], got {name} of shape {shape}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must be 1-D with at least 2 entries (0 and the total), got shape {tuple(cu_seqlens.shape)}"
        )
    return cu_seqlens.to(torch.int64).contiguous(), 0


def check_cu_seqlens(cu: torch.Tensor, n: int) -> None:
    """Packed layout only, before an op (the kernels index with it): one host sync."""
    flags = torch.stack([cu[0] != 0, cu[-1] != n, (cu[1:] < cu[:-1]).any()]).tolist()
    if flags[0]:
        raise ValueError(f"cu_seqlens must start at 0, got {int(cu[0])}")
    if flags[1]:
        raise ValueError(f"cu_seqlens must end at the number of tokens {n}, got {int(cu[-1])}")
    if flags[2]:
        i = first_true(cu[1:] < cu[:-1])
        raise ValueError(f"cu_seqlens must be non-decreasing; entry {i + 1} ({int(cu[i + 1])}) < entry {i} ({int(cu[i])})")


def parse_normalizer(normalizer, device: torch.device, ref_name: str):
    """(0-d fp32 tensor or None, float divisor or 0.0) from a loss's `normalizer` argument (number or 1-element tensor)."""
    if normalizer is None:
        return None, 0.0
    if isinstance(normalizer, torch.Tensor):
        if normalizer.numel() != 1:
            raise ValueError(f"normalizer must be a number or a one-element tensor, got shape {tuple(normalizer.shape)}")
        if normalizer.device != device:
            raise ValueError(f"normalizer is on {normalizer.device} but {ref_name} is on {device}")
        return normalizer.reshape(()).to(torch.float32), 0.0
    if isinstance(normalizer, bool) or not isinstance(normalizer, (int, float)):
        raise TypeError(f"normalizer must be a float or a tensor, got {type(normalizer).__name__}")
    if not (normalizer > 0 and math.isfinite(normalizer)):
        raise ValueError(f"normalizer must be a finite number > 0, got {normalizer}")
    return None, float(normalizer)
