"""Test set-up: on a machine without a GPU the Triton kernels run in the
interpreter. TRITON_INTERPRET must be set before any @triton.jit is applied,
so it is set here, before flashrl_kernels.triton_impl is imported."""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashrl_kernels import _backend

if os.environ.get("FLASHRL_BACKEND", "").strip().lower() == "native" and not _backend.native_built():
    # CI runs the suite a second time under FLASHRL_BACKEND=native: a native build that broke
    # must fail that run, not quietly drop "native" from the parametrised backends
    from flashrl_kernels import _native

    raise RuntimeError(f"FLASHRL_BACKEND=native but the native CPU kernels are unavailable: "
                       f"{_native.native_status().reason}")


def available_backends(device="cpu", op="token_logprobs_forward"):
    """Backends that can run `op` (a backend function name) on `device` here."""
    dev = torch.device(device)
    out = []
    for b in _backend.BACKENDS:
        if _backend.availability(b, dev) is not None:
            continue
        if b == "native" and not _backend._native_has(op):
            continue
        out.append(b)
    return out


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # a different, reproducible seed per test: fresh inputs, never shared zeros
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))  # not hash(): that changes per process
    yield


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
