"""Adapters for the frameworks flashrl_kernels plugs into (vLLM, TRL, ...).

Each adapter lives in its own module and imports its framework only when
used, so `import flashrl_kernels` never imports vLLM, TRL or verl (unless
FLASHRL_PATCH asks for a patch at import, see `patch_from_env`).

`patch(name)` / `unpatch(name)` dispatch to the adapters that patch a
framework in place ("trl", "verl", "openrlhf", "areal"). vLLM needs no patch: it finds the
quantization configs through its plugin entry point.
"""
from __future__ import annotations

import importlib
import os
import warnings

_PATCHABLE = {
    "trl": "flashrl_kernels.integrations.trl",
    "verl": "flashrl_kernels.integrations.verl",
    "openrlhf": "flashrl_kernels.integrations.openrlhf",
    "areal": "flashrl_kernels.integrations.areal",
}


def _adapter(name: str):
    if not isinstance(name, str) or name.lower() not in _PATCHABLE:
        raise ValueError(f"framework must be one of {', '.join(repr(k) for k in _PATCHABLE)}, got {name!r}")
    return importlib.import_module(_PATCHABLE[name.lower()])


def patch(framework: str) -> None:
    """Patch `framework` ("trl", "verl", "openrlhf" or "areal") to run on flashrl_kernels; idempotent, undone by `unpatch`."""
    _adapter(framework).patch()


def unpatch(framework: str) -> None:
    """Undo `patch(framework)`; idempotent."""
    _adapter(framework).unpatch()


def patch_from_env() -> None:
    """Apply the patches named in FLASHRL_PATCH (comma separated, e.g. "trl"). Called at `import flashrl_kernels`.

    A failure (unknown name, framework missing or of an unsupported version) warns and leaves the framework
    unpatched: it never breaks the import."""
    names = [n.strip() for n in os.environ.get("FLASHRL_PATCH", "").split(",") if n.strip()]
    for name in names:
        try:
            patch(name)
        except Exception as exc:
            warnings.warn(f"FLASHRL_PATCH={name}: not patched ({type(exc).__name__}: {exc})", RuntimeWarning,
                          stacklevel=2)
