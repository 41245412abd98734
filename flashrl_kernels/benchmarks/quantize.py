"""quantize_rows (per-row INT8 / FP8 weight quantization) vs the naive torch expression.

Baseline: what a weight sync writes without a kernel,
    s = w.abs().amax(1, keepdim=True) / 127;  q = (w / s).round().clamp(-128, 127).to(int8)
in eager torch (several full passes and fp32 temporaries the size of the
weight). Then each flashrl backend that can run on the device, allocating
(`quantize_rows`) and in place into preallocated storage (`quantize_rows_`,
what the vLLM plugin's loaders do). Sizes: a 7B MLP weight (11008 x 4096,
bf16) on a GPU; 4096 x 4096 on a CPU (quick: a quarter of each). Bytes: the
bf16 weight read once, the 1-byte q and the fp32 scales written once.
"""
from __future__ import annotations

import torch

import flashrl_kernels as fk

from .harness import Case, flashrl_backends

QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}


def naive(w, dtype):
    qmax = QMAX[dtype]
    s = w.float().abs().amax(dim=1, keepdim=True) / qmax
    s = torch.where(s == 0, torch.ones_like(s), s)
    y = w.float() / s
    if dtype == torch.int8:
        return y.round().clamp(-128, 127).to(torch.int8), s
    return y.clamp(-qmax, qmax).to(dtype), s


def sizes(quick: bool, device: torch.device):
    if device.type == "cuda":
        return (2752, 4096) if quick else (11008, 4096)
    return (1024, 4096) if quick else (4096, 4096)


def _flashrl(backend, inplace):
    def f(w, dtype, q, s):
        with fk.use_backend(backend):
            if inplace:  # the op the plugin's loaders call (the sync validated the tensors up front)
                return torch.ops.flashrl.quantize_rows_(w, q, s)
            return fk.quantize_rows(w, dtype)  # its value check reads only the scales

    return f


def _maker(fn, n, k, dtype, device):
    def make():
        g = torch.Generator(device="cpu").manual_seed(0)
        w = (torch.randn(n, k, generator=g) * 0.02).to(device=device, dtype=torch.bfloat16)
        q = torch.empty(n, k, dtype=dtype, device=device)
        s = torch.empty(n, dtype=torch.float32, device=device)
        return lambda: fn(w, dtype, q, s)

    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    n, k = sizes(quick, device)
    nbytes = n * k * 2 + n * k + n * 4
    out = []
    for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
        size = f"{n}x{k} bf16->{tag}"
        impls = [("eager torch expression", lambda w, dt, q, s: naive(w, dt), True)]
        for b in flashrl_backends(device, "quantize_rows_forward"):
            impls.append((f"flashrl[{b}]", _flashrl(b, False), False))
            impls.append((f"flashrl[{b}] in place", _flashrl(b, True), False))
        for name, fn, base in impls:
            out.append(Case("quantize_rows", name, "fwd", size, _maker(fn, n, k, dtype, device), nbytes, None, base))
    return out
