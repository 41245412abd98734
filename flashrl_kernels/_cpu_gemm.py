"""The CPU GEMM dtype for bf16 / fp16 operands, decided once per process.

On CPUs without native bf16 (fp16) matrix instructions (AVX2-only x86, no
avx512_bf16 / AMX) torch's bf16 GEMM falls back to a scalar-ish path at about
1-3 GFLOP/s, against 60-100 GFLOP/s for fp32: widening the operands to fp32
for the GEMM is then ~30x faster (and at least as accurate). On CPUs with
fast low-precision GEMMs nothing should change.

`cpu_low_precision_gemm_is_fast(dtype)` decides from a tiny timing probe
(a 256^3 GEMM in `dtype` vs fp32, single-threaded, best of a few runs: slow
when `dtype` takes more than `SLOW_RATIO` times fp32's time), cached per dtype
for the process. FLASHRL_CPU_GEMM_DTYPE overrides it (read on every call, so
tests can switch it):

    auto   (default) the probe decides
    input  always GEMM in the input dtype (the fast answer)
    fp32   always widen bf16 / fp16 operands to fp32 (the slow answer)
"""
from __future__ import annotations

import functools
import os
import time

import torch

ENV = "FLASHRL_CPU_GEMM_DTYPE"
SLOW_RATIO = 2.0
_PROBE_N = 256
_LOW = (torch.bfloat16, torch.float16)


def _mode() -> str:
    mode = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if mode not in ("auto", "input", "fp32"):
        raise ValueError(f"{ENV} must be auto, input or fp32, got {mode!r}")
    return mode


def cpu_capability() -> str:
    try:
        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # very old torch
        return "unknown"


def _best_time(a: torch.Tensor, b: torch.Tensor, reps: int = 3) -> float:
    a @ b  # warm-up (kernel selection, oneDNN primitive creation)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return best


@functools.cache
def gemm_slowdown(dtype: torch.dtype) -> float:
    """Time of a 256^3 `dtype` GEMM over the fp32 one on this CPU (probed once per dtype, cached).

    Single-threaded: on a loaded machine multi-threaded timings of such a small
    GEMM are dominated by scheduling noise; the kernel choice does not depend on it.
    """
    if dtype not in _LOW:
        return 1.0
    g = torch.Generator().manual_seed(0)
    a = torch.randn(_PROBE_N, _PROBE_N, generator=g)
    b = torch.randn(_PROBE_N, _PROBE_N, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        t32 = _best_time(a, b)
        tlow = _best_time(a.to(dtype), b.to(dtype))
    finally:
        torch.set_num_threads(threads)
    return tlow / max(t32, 1e-9)


def cpu_low_precision_gemm_is_fast(dtype: torch.dtype) -> bool:
    """True when CPU GEMMs should run in `dtype` itself, False when bf16/fp16 operands should be widened to fp32."""
    if dtype not in _LOW:
        return True
    mode = _mode()
    if mode != "auto":
        return mode == "input"
    return gemm_slowdown(dtype) <= SLOW_RATIO


def widen_cpu_gemm(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether CPU tile GEMMs on `dtype` operands should be run in fp32."""
    return device.type == "cpu" and dtype in _LOW and not cpu_low_precision_gemm_is_fast(dtype)


def describe(dtype: torch.dtype) -> str:
    """One line for `flashrl-kernels info`."""
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, str(dtype))
    mode = _mode()
    if mode != "auto":
        how = "native" if mode == "input" else "widened to fp32"
        return f"CPU {name} GEMM: {how} ({ENV}={mode})"
    ratio = gemm_slowdown(dtype)
    if ratio <= SLOW_RATIO:
        return f"CPU {name} GEMM: native (fast: {ratio:.2f}x fp32's time; capability {cpu_capability()})"
    return f"CPU {name} GEMM: widened to fp32 ({name} matmul {ratio:.0f}x slower here; capability {cpu_capability()})"
