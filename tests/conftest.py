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


def _native_expected() -> bool:
    """The native CPU kernels must build here: a C++ compiler is present and FLASHRL_NATIVE=0 did not turn them off
    (or FLASHRL_BACKEND=native asks for them)."""
    from flashrl_kernels import _native

    if os.environ.get("FLASHRL_BACKEND", "").strip().lower() == "native":
        return True
    return _native._compiler() is not None and not _native._disabled()


if _native_expected() and not _backend.native_built():
    # a native build that broke must fail the run, not quietly drop "native" from the parametrised tests and
    # leave every CPU op on the torch backend (where no compiler exists, that fallback is the documented behaviour)
    from flashrl_kernels import _native

    raise RuntimeError(f"the native CPU kernels should build here (a C++ compiler is present) but are unavailable: "
                       f"{_native.native_status().reason}; FLASHRL_NATIVE=0 runs the suite without them")


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
