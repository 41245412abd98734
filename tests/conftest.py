"""Test set-up: on a machine without a GPU the Triton kernels run in the
interpreter. TRITON_INTERPRET must be set before any @triton.jit is applied,
so it is set here, before flashrl_kernels.triton_impl is imported."""
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from flashrl_kernels import _backend


def available_backends(device="cpu"):
    return [b for b in _backend.BACKENDS if _backend.availability(b, torch.device(device)) is None]


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # a different, reproducible seed per test: fresh inputs, never shared zeros
    torch.manual_seed(abs(hash(request.node.nodeid)) % (2**31))
    yield


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
