"""Integer helpers for the launch wrappers' host code.

`triton.cdiv` / `triton.next_power_of_2` are constexpr functions in Triton 3.9: ~3 us per call from Python, and
a quantized linear's launch made about ten such calls (a vLLM decode step in eager mode calls it ~200 times).
These plain versions return the same values (next_power_of_2(0) is 0, as Triton's). `sm_count` caches the
SM count (torch.cuda.get_device_properties is a Python call too). `split_double` passes a float64 scalar.
"""
from __future__ import annotations

import functools

import numpy as np
import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def split_double(x: float) -> tuple[float, float]:
    """x as hi + lo, both fp32 numbers (hi = fp32(x)): a float64 scalar through Triton's fp32 scalar arguments,
    rebuilt in the kernel as float64(hi) + float64(lo) (48 of the 53 bits)."""
    hi = float(np.float32(x))
    return hi, float(np.float32(float(x) - hi))


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device (the current one for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count
