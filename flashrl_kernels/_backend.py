"""Backend selection: which implementation of an op runs for a given tensor.

Every op family exists under the same function names in each backend package
(`reference`, `torch_impl`, `triton_impl`, and `native` once built), so the op
layer asks `implementation(op_name, device)` and calls what it gets.

Choice, highest priority first:
  1. `use_backend(name)` (process-wide, nestable; read when the op runs, so a
     backward that runs after the `with` block uses the backend in force then),
  2. the environment variable FLASHRL_BACKEND (read at every call),
  3. automatic: CUDA -> triton, CPU -> native if built else torch, other
     devices -> torch.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from collections.abc import Iterator

import torch

BACKENDS = ("reference", "torch", "triton", "native")

_PACKAGES = {
    "reference": "flashrl_kernels.reference",
    "torch": "flashrl_kernels.torch_impl",
    "triton": "flashrl_kernels.triton_impl",
    "native": "flashrl_kernels.native",
}

_override: list[str] = []


class BackendUnavailableError(RuntimeError):
    """The requested backend cannot run here (not installed, not built, wrong device)."""


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    return name


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Force every flashrl op to run on backend `name` inside the block."""
    _override.append(_check_name(name))
    try:
        yield
    finally:
        _override.pop()


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0", "false", "False")


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def native_built() -> bool:
    try:
        importlib.import_module(_PACKAGES["native"])
    except ImportError:
        return False
    return True


def availability(name: str, device: torch.device) -> str | None:
    """None if backend `name` can run on `device`, else the reason it cannot."""
    if name in ("reference", "torch"):
        return None
    if name == "triton":
        if not triton_installed():
            return "the triton package is not installed (pip install triton)"
        if device.type == "cuda":
            return None
        if device.type == "cpu" and triton_interpret():
            return None
        return (
            f"Triton kernels need a CUDA tensor, got a {device.type} tensor; on a CPU set "
            "TRITON_INTERPRET=1 before the first flashrl triton call to run them in the interpreter"
        )
    if name == "native":
        if device.type != "cpu":
            return f"the native backend runs on CPU tensors only, got a {device.type} tensor"
        if not native_built():
            return "the native C++ extension is not built (see README: native CPU kernels)"
        return None
    raise ValueError(f"unknown backend {name!r}")


def selected_backend(device: torch.device) -> str:
    """The backend an op on `device` will run with right now."""
    if _override:
        name = _override[-1]
    elif os.environ.get("FLASHRL_BACKEND"):
        name = _check_name(os.environ["FLASHRL_BACKEND"].strip().lower())
    elif device.type == "cuda" and availability("triton", device) is None:
        name = "triton"
    elif device.type == "cpu" and native_built():
        name = "native"
    else:
        name = "torch"
    reason = availability(name, device)
    if reason is not None:
        raise BackendUnavailableError(f"flashrl backend {name!r} is not available: {reason}")
    return name


def implementation(op: str, device: torch.device):
    """The function implementing `op` on the selected backend for `device`.

    When the backend was chosen automatically and is the native one, ops it does not (yet) implement
    run on the torch backend; a backend forced by use_backend() or FLASHRL_BACKEND never falls back.
    """
    name = selected_backend(device)
    module = importlib.import_module(_PACKAGES[name])
    fn = getattr(module, op, None)
    if fn is None and name == "native" and not _override and not os.environ.get("FLASHRL_BACKEND"):
        fn = getattr(importlib.import_module(_PACKAGES["torch"]), op, None)
    if fn is None:
        raise BackendUnavailableError(f"flashrl backend {name!r} has no implementation of {op}")
    return fn
