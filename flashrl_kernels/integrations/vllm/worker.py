"""sync_weights into engines whose workers live in other processes (vLLM's default multi-process engine,
tensor parallelism > 1): shared-memory staging and a two-phase commit over collective_rpc.

The driver checks every tensor for NaN / inf and takes its max |x| (once: every rank would see the same
values), copies them into one file in /dev/shm (64-byte aligned, CUDA tensors included: they are copied to
the host; the file is kept and reused by the engine's next sync) and sends only a small handle (path,
names, dtypes, shapes, offsets, max |x|) through `collective_rpc`, a message vLLM's serializers carry
without pickling code or data. Every worker maps the file (no copy: its tensors are views of the mapping, kept for the next sync)
and then:

  1. `flashrl_sync_stage(handle)`: validates every tensor against its own model (names, full checkpoint
     shapes, dtypes, each max |x| within the range of the dtype its model stores it in) and keeps the list;
     returns None, or [error type, message];
  2. only when every rank returned None, `flashrl_sync_commit()` writes (each rank quantizes its shard);
     otherwise `flashrl_sync_abort()` drops the staged list and nothing is written anywhere.

The three methods are added to vLLM's WorkerBase by the plugin's `register()`, which vLLM runs in every
worker process (general plugins), so no `worker_extension_cls` is needed; see install_worker_methods.
"""
from __future__ import annotations

import math
import os
import tempfile
import uuid
import weakref

import torch

_ALIGN = 64
_METHODS = ("flashrl_sync_stage", "flashrl_sync_commit", "flashrl_sync_abort")


def _staging_dir(nbytes: int) -> str:
    """FLASHRL_SYNC_STAGING_DIR, else /dev/shm when it has room (containers often cap it at 64 MB), else
    the temporary directory (a page-cache file: mapped the same way, possibly written back to disk)."""
    explicit = os.environ.get("FLASHRL_SYNC_STAGING_DIR")
    if explicit:
        return explicit
    try:
        st = os.statvfs("/dev/shm")
        if st.f_bavail * st.f_frsize > nbytes + (64 << 20):
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


class Staging:
    """A driver-side shared file that holds one sync's tensors; reused by the next sync of the same engine
    while it is large enough (its pages are then already mapped: writing 1 GB into a fresh tmpfs file costs
    about as much again in page faults as the copy itself). Removed by `close()` or when garbage-collected."""

    def __init__(self, size: int):
        self.size = size
        self.path = os.path.join(_staging_dir(size), f"flashrl-sync-{os.getpid()}-{uuid.uuid4().hex}")
        with open(self.path, "wb") as f:
            f.truncate(size)
        self.buf = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)
        self._finalizer = weakref.finalize(self, _unlink, self.path)

    def close(self) -> None:
        self.buf = None
        self._finalizer()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def stage_tensors(tensors: list[tuple[str, torch.Tensor]], staging: Staging | None = None):
    """Copy (name, tensor) pairs into `staging` (a new Staging when it is None or too small); return
    (handle: plain str / int / list, the Staging used)."""
    entries, offset = [], 0
    for name, t in tensors:
        entries.append([name, str(t.dtype).removeprefix("torch."), list(t.shape), offset])
        offset += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
    size = max(offset, _ALIGN)
    if staging is None or staging.buf is None or staging.size < size:
        if staging is not None:
            staging.close()
        staging = Staging(size)
    with torch.no_grad():
        for (_, _, _, off), (_, t) in zip(entries, tensors):
            n = t.numel() * t.element_size()
            staging.buf[off:off + n].view(t.dtype).view(t.shape).copy_(t)
    return {"path": staging.path, "size": staging.size, "tensors": entries}, staging


_mapped: dict[str, torch.Tensor] = {}  # worker side: the staging file mapped by the last sync (by path)


def open_staged(handle: dict) -> list[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a staged file, as views of its shared mapping (nothing copied). The
    mapping is kept for the next sync from the same file (already-faulted pages)."""
    buf = _mapped.get(handle["path"])
    if buf is None or buf.numel() != handle["size"]:
        _mapped.clear()  # a new file: drop the old mapping (its file is gone once the driver unlinked it)
        buf = _mapped[handle["path"]] = torch.from_file(handle["path"], shared=True, size=handle["size"],
                                                        dtype=torch.uint8)
    out = []
    for name, dtype_name, shape, off in handle["tensors"]:
        dtype = getattr(torch, dtype_name)
        n = math.prod(shape) * dtype.itemsize
        out.append((name, buf[off:off + n].view(dtype).view(shape)))
    return out


def flashrl_sync_stage(self, handle: dict):
    """Phase 1 on one rank: map and validate; keep the load list for the commit. Errors are returned."""
    from .sync import prepare

    self._flashrl_staged = None
    try:
        tensors = open_staged(handle)
        nbytes, load = prepare(self.get_model(), tensors, absmax=handle["absmax"])  # the driver read the values
    except (TypeError, ValueError) as e:
        return [type(e).__name__, str(e)]
    self._flashrl_staged = (nbytes, load, len(tensors))
    return None


def flashrl_sync_commit(self):
    """Phase 2 on one rank: write the staged tensors; returns [bytes written, tensors, codes changed, codes
    written, largest relative row-scale change]."""
    from .sync import write_prepared

    staged = getattr(self, "_flashrl_staged", None)
    self._flashrl_staged = None
    if staged is None:
        raise RuntimeError("flashrl_sync_commit without a successful flashrl_sync_stage on this rank")
    nbytes, load, n = staged
    changed, total, scale = write_prepared(self, load)
    return [nbytes, n, changed, total, scale]


def flashrl_sync_abort(self):
    """Drop a staged sync (another rank refused it)."""
    self._flashrl_staged = None


def install_worker_methods() -> None:
    """Add the three sync methods to vLLM's WorkerBase (every worker class inherits them). Idempotent;
    methods of the same name that are not ours are left alone (a clear error at sync time instead)."""
    from vllm.v1.worker.worker_base import WorkerBase

    for name, fn in (("flashrl_sync_stage", flashrl_sync_stage), ("flashrl_sync_commit", flashrl_sync_commit),
                     ("flashrl_sync_abort", flashrl_sync_abort)):
        if getattr(WorkerBase, name, None) in (None, fn):
            setattr(WorkerBase, name, fn)
