"""Build, cache and load the native CPU kernels (csrc/cpu/*.cpp).

The C++ sources register the ops `torch.ops.flashrl_native.*` through
TORCH_LIBRARY (no pybind11, no Python headers), so they compile into a plain
shared library that `torch.ops.load_library` loads. The library is compiled
on first use, with the C++ compiler found here, against the torch that is
running (so its ABI always matches), and cached:

    $FLASHRL_CACHE_DIR, else $TORCH_EXTENSIONS_DIR/flashrl_kernels,
    else $XDG_CACHE_HOME/flashrl_kernels (~/.cache/flashrl_kernels),
    else a per-user folder in the temp dir if none of those is writable.

The cache key hashes the sources and the headers next to them, the torch
version, the compiler and its flags (including the CPU capability torch
dispatches to), so a change in any of them builds a new library next to the
old one. Concurrent first uses
(several ranks, pytest-xdist) serialise on a file lock and compile once.

Nothing here runs at `import flashrl_kernels`: `load()` is called when the
CPU auto-selection or an explicit native request first needs the backend.
When the build cannot run (no compiler, compile error, FLASHRL_NATIVE=0),
`load()` returns False, the torch backend is used, and one warning says why
(none when disabled on purpose). `native_status()` reports what happened.
"""
from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from flashrl_kernels import _cpu

log = logging.getLogger("flashrl_kernels.native")

LIB_NAME = "flashrl_native"
_PKG_DIR = Path(__file__).resolve().parent


class NativeBuildWarning(RuntimeWarning):
    """The native CPU kernels could not be built or loaded; the torch backend is used instead."""


@dataclass
class NativeStatus:
    loaded: bool = False
    attempted: bool = False
    reason: str | None = None  # why it is not loaded
    library: str | None = None  # path of the loaded shared library
    cached: bool | None = None  # True: found in the cache, False: compiled by this process
    build_seconds: float | None = None
    compiler: str | None = None
    capability: str | None = None
    threads: bool | None = None  # built with OpenMP (at::parallel_for uses torch's threads)
    sources: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.attempted:
            return "native CPU kernels: not loaded yet (built on first CPU use)"
        if not self.loaded:
            return f"native CPU kernels: unavailable ({self.reason}); CPU ops use the torch backend"
        if self.cached:
            how = "from cache"
        elif self.build_seconds is not None:
            how = f"compiled in {self.build_seconds:.1f} s"
        else:
            how = "loaded"
        par = "" if self.threads else ", single-threaded (no OpenMP)"
        return f"native CPU kernels: active ({self.capability}{par}, {how}: {self.library})"


_status = NativeStatus()
_lock = threading.Lock()


def native_status(load: bool = False) -> NativeStatus:
    """The state of the native backend; with load=True, try to build/load it first."""
    if load:
        globals()["load"]()
    return _status


# ---------------------------------------------------------------- sources

def source_dir() -> Path | None:
    """csrc/ shipped inside the package (wheel) or at the repository root (source checkout, editable install)."""
    for d in (_PKG_DIR / "native" / "csrc", _PKG_DIR.parent / "csrc"):
        if (d / "cpu").is_dir() and any((d / "cpu").glob("*.cpp")):
            return d
    return None


def sources() -> list[Path]:
    d = source_dir()
    return sorted((d / "cpu").glob("*.cpp")) if d is not None else []


def headers(srcs: list[Path]) -> list[Path]:
    """The headers next to the sources (csrc/cpu/*.h, included as "name.h"): part of the build key."""
    dirs = sorted({s.parent for s in srcs})
    return sorted(h for d in dirs for ext in ("*.h", "*.hpp") for h in d.glob(ext))


# ---------------------------------------------------------------- cache

def _writable(d: Path) -> bool:
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=d):
            pass
        return True
    except OSError:
        return False


def cache_root() -> Path:
    candidates = []
    if os.environ.get("FLASHRL_CACHE_DIR"):
        candidates.append(Path(os.environ["FLASHRL_CACHE_DIR"]))
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        candidates.append(Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "flashrl_kernels")
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    candidates.append(Path(xdg) / "flashrl_kernels")
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    candidates.append(Path(tempfile.gettempdir()) / f"flashrl_kernels-{uid}")
    for c in candidates:
        if _writable(c):
            return c
    raise OSError(f"no writable cache directory among {', '.join(map(str, candidates))}")


@contextlib.contextmanager
def _file_lock(path: Path, waiting: Callable[[], None] | None = None):
    """An exclusive lock on `path`; `waiting()` is called once when another process holds it."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock, the atomic rename still keeps the cache consistent
        yield
        return
    with open(path, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if waiting is not None:
                waiting()
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


# ---------------------------------------------------------------- compiler

def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _capability_flags(cap: str | None = None) -> tuple[str, list[str]]:
    """The CPU capability torch dispatches to here (or `cap`), and the flags that build ATen's Vectorized for it."""
    cap = (cap or torch.backends.cpu.get_cpu_capability()).upper()
    if platform.machine() in ("x86_64", "AMD64"):
        if cap.startswith("AVX512"):
            return "AVX512", ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw",
                              "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c"]
        if cap.startswith("AVX2"):
            return "AVX2", ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return "DEFAULT", ["-DCPU_CAPABILITY=DEFAULT"]


_openmp_failed = False  # set when a compiler rejected -fopenmp; the build is retried without it


def _openmp_flags() -> list[str]:
    # at::parallel_for is a header template: without OpenMP it runs on one thread
    if (sys.platform.startswith("linux") and not _openmp_failed
            and os.environ.get("FLASHRL_NATIVE_OPENMP", "1") != "0"):
        return ["-fopenmp"]
    return []


def _compile_flags(cap: str | None = None) -> list[str]:
    from torch.utils import cpp_extension

    _, cap_flags = _capability_flags(cap)
    flags = ["-O3", "-std=c++20", "-fPIC", "-DNDEBUG", "-w",
             f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}", *cap_flags, *_openmp_flags()]
    return flags + [f"-I{cpp_extension.include_paths()[0]}"]


def _link_flags() -> list[str]:
    from torch.utils import cpp_extension

    lib_dirs = cpp_extension.library_paths()
    # -z now: every symbol is resolved when the library loads, so one this torch does not export
    # fails the load (and the CPU ops fall back to torch) instead of aborting on first call.
    # No rpath: the library is only ever loaded by torch.ops.load_library, after `import torch` has loaded
    # libc10 / libtorch_cpu, which the loader then finds by their sonames; so one build serves every virtual
    # environment with this torch (the build key leaves paths out)
    now = ["-Wl,-z,now"] if sys.platform.startswith("linux") else []
    return ["-shared", *_openmp_flags(), *now, *(f"-L{p}" for p in lib_dirs), "-lc10", "-ltorch_cpu"]


def _compiler_id(cxx: str) -> str:
    try:
        return subprocess.run([cxx, "--version"], check=False, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cxx}: {e}"


def _build_key(cxx: str, srcs: list[Path]) -> str:
    h = hashlib.sha256()
    h.update(torch.__version__.encode())
    h.update(str(getattr(torch.version, "git_version", "")).encode())
    h.update(_compiler_id(cxx).encode())
    # the flags without the install paths of this environment's torch (its version and build identify the headers
    # and libraries): virtual environments with the same torch share one build
    h.update(" ".join(f for f in _compile_flags() + _link_flags() if not f.startswith(("-I", "-L"))).encode())
    for s in [*srcs, *headers(srcs)]:
        h.update(s.name.encode())
        h.update(s.read_bytes())
    return h.hexdigest()[:16]


# Every source includes these first (the torch headers are most of a source's compile time): GCC parses them once
# into a precompiled header. Only sources that include all of them use it, so it cannot hide a missing include.
PCH_HEADERS = ("ATen/Parallel.h", "ATen/core/Tensor.h", "c10/util/BFloat16.h", "c10/util/Half.h", "torch/library.h")


def _pch_sources(cxx: str, srcs: list[Path], jobs: int) -> set[Path]:
    """The sources to compile with the precompiled header: none where it cannot pay (a compiler per source anyway,
    not GCC, FLASHRL_NATIVE_PCH=0), else those that include every PCH_HEADERS file."""
    if jobs >= len(srcs) or _switched_off("FLASHRL_NATIVE_PCH"):
        return set()
    if "Free Software Foundation" not in _compiler_id(cxx):  # clang finds no .gch beside an -include'd header
        return set()
    return {s for s in srcs if all(f"#include <{h}>" in s.read_text(errors="replace") for h in PCH_HEADERS)}


def _compile_objects(cxx: str, srcs: list[Path], objs: list[Path], flags: list[str],
                     done: Callable[[Path], None] | None = None) -> None:
    """One object per source, as many compilers at once as this machine has cores, each free core refilled as soon
    as any compiler finishes (`done(source)` then); the first failure raises with that compiler's output.

    With fewer cores than sources, one core first precompiles PCH_HEADERS (GCC) while the others compile plainly,
    and the sources started after it include the precompiled header: on 2 cores the build takes ~0.8x the time.
    A precompiled header that fails to build only costs its time: the sources then compile without it."""
    jobs = max(1, min(len(srcs), len(_cpu.usable_cpus())))
    pending = list(zip(srcs, objs))
    running: list[tuple[Path, Path, subprocess.Popen]] = []
    use_pch = _pch_sources(cxx, srcs, jobs)
    pch, pch_ready = None, False
    if use_pch:
        header = objs[0].parent / "flashrl_pch.h"
        pch_log = header.with_suffix(".log")
        header.write_text("".join(f"#include <{h}>\n" for h in PCH_HEADERS))
        with open(pch_log, "w") as f:
            pch = subprocess.Popen([cxx, *flags, "-x", "c++-header", str(header), "-o", f"{header}.gch"],
                                   stdout=f, stderr=subprocess.STDOUT)
    try:
        while pending or running:
            if pch is not None and pch.poll() is not None:
                pch_ready = pch.returncode == 0
                if not pch_ready:
                    log.info("the precompiled header failed; compiling without it:\n%s", _tail(pch_log.read_text()))
                pch = None
            while pending and len(running) + (pch is not None) < jobs:
                s, o = pending.pop(0)
                extra = ["-include", str(header)] if pch_ready and s in use_pch else []
                out = o.with_suffix(".log")  # a file, not a pipe: a long error would fill a pipe nobody reads yet
                with open(out, "w") as f:
                    p = subprocess.Popen([cxx, "-c", *flags, *extra, str(s), "-o", str(o)], stdout=f,
                                         stderr=subprocess.STDOUT)
                running.append((s, out, p))
            finished = [r for r in running if r[2].poll() is not None]
            if not finished:
                time.sleep(0.05)
                continue
            for s, out, p in finished:
                running.remove((s, out, p))
                text = out.read_text(errors="replace")
                out.unlink()
                if p.returncode != 0:
                    raise RuntimeError(f"compiling {s.name} failed:\n{_tail(text)}")
                if done is not None:
                    done(s)
    finally:
        for _, out, p in running:
            p.kill()
            p.wait()
            out.unlink(missing_ok=True)
        if use_pch:
            if pch is not None:
                pch.kill()
                pch.wait()
            for f in (header, pch_log, Path(f"{header}.gch")):
                f.unlink(missing_ok=True)  # the .gch is ~270 MB


def _compile(cxx: str, srcs: list[Path], target: Path, progress: Callable[[str], None] | None = None) -> None:
    """Compile the sources into `target`: one object per source, in parallel, then one link."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        objs = [Path(tmp) / f"{i}_{s.stem}.o" for i, s in enumerate(srcs)]
        _compile_objects(cxx, srcs, objs, _compile_flags(), None if progress is None else lambda s: progress(s.name))
        lib = Path(tmp) / f"{LIB_NAME}.so"
        r = subprocess.run([cxx, *map(str, objs), *_link_flags(), "-o", str(lib)],
                           check=False, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"linking {LIB_NAME} failed:\n{_tail(r.stdout + r.stderr)}")
        os.replace(lib, target)  # atomic: a reader sees no library or a whole one
        if progress is not None:
            progress("link")


def compile_check(capability: str, workdir: str | os.PathLike) -> float:
    """Compile every native source for another CPU capability ("AVX512", "AVX2", "DEFAULT") into objects under
    `workdir`, without linking or loading them; returns the seconds it took, raises RuntimeError with the
    compiler's output on the first failure.

    Each machine builds only its own capability, so code for the others (the AVX-512 VNNI, AVX-512 BF16 and AMX
    kernels on an AVX2 machine) would first be compiled on a user's machine of that class. This finds an error there
    before it ships. -O0 keeps it fast; templates are instantiated and always_inline intrinsics inlined (where a
    missing target attribute is an error) at every optimization level."""
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    srcs = sources()
    objs = [Path(workdir) / f"{s.stem}.o" for s in srcs]
    flags = [f for f in _compile_flags(capability) if f != "-O3"] + ["-O0"]
    start = time.perf_counter()
    _compile_objects(cxx, srcs, objs, flags)
    return time.perf_counter() - start


def _tail(text: str, lines: int = 25) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# ---------------------------------------------------------------- load

def _switched_off(variable: str) -> bool:
    """An on-by-default switch set to 0 / false / off / no."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "false", "off", "no")


def _disabled() -> bool:
    return _switched_off("FLASHRL_NATIVE")


def load() -> bool:
    """Build (first time) and load the native library; True when its ops are registered. Cached per process."""
    if _status.attempted:
        return _status.loaded
    with _lock:
        if _status.attempted:
            return _status.loaded
        try:
            _load()
            _status.loaded = True
        except Exception as e:  # any failure means: use the torch path, say why
            _status.reason = str(e) if str(e) else type(e).__name__
            if not _disabled():
                first = _status.reason.splitlines()[0]
                warnings.warn(
                    f"flashrl_kernels: native CPU kernels unavailable ({first}); using the torch backend on CPU. "
                    "flashrl_kernels.native_status() has the details; set FLASHRL_NATIVE=0 to silence this.",
                    NativeBuildWarning,
                    stacklevel=3,
                )
        finally:
            _status.attempted = True
    return _status.loaded


def _load() -> None:
    global _openmp_failed
    if _disabled():
        raise RuntimeError("disabled by FLASHRL_NATIVE=0")
    srcs = sources()
    if not srcs:
        raise RuntimeError("the C++ sources (csrc/cpu/*.cpp) are not shipped with this installation")
    _status.sources = [s.name for s in srcs]
    cap, _ = _capability_flags()
    _status.capability = cap
    cxx = _compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler found (set CXX, or install g++ / clang++)")
    _status.compiler = cxx
    try:
        target = _build(cxx, srcs)
    except RuntimeError as e:
        msg = str(e).lower()
        if not _openmp_flags() or not any(k in msg for k in ("openmp", "omp.h", "gomp", "-lomp")):
            raise
        _openmp_failed = True  # e.g. clang without libomp: build single-threaded rather than not at all
        log.warning("the C++ compiler rejected -fopenmp; building the native kernels single-threaded")
        target = _build(cxx, srcs)
    _status.threads = bool(_openmp_flags())
    torch.ops.load_library(str(target))
    _status.library = str(target)


def _build(cxx: str, srcs: list[Path]) -> Path:
    """The cached library for these sources and flags, compiled first if missing."""
    key = _build_key(cxx, srcs)
    root = cache_root()
    target = root / f"{LIB_NAME}-{key}" / f"{LIB_NAME}.so"
    _status.cached = target.exists()
    if not _status.cached:
        report = _BuildReport(len(srcs) + 1, target.parent)
        with _file_lock(root / f"{LIB_NAME}-{key}.lock", waiting=report.waiting):
            if target.exists():  # another process built it while we waited
                _status.cached = True
            else:
                report.start()
                t0 = time.perf_counter()
                try:
                    _compile(cxx, srcs, target, progress=report.step)
                finally:
                    report.close()
                _status.build_seconds = time.perf_counter() - t0
                report.finished(_status.build_seconds)
    return target


def _progress_enabled() -> bool:
    return not _switched_off("FLASHRL_NATIVE_PROGRESS")


class _BuildReport:
    """What a first-use build shows on stderr. It takes one to two minutes on a 2-core machine, inside the user's
    first CPU op call: silent, that pause looks like a hang. One line when it starts and one when it ends, and a
    progress bar over the files between them on a terminal; FLASHRL_NATIVE_PROGRESS=0 leaves only the INFO log."""

    def __init__(self, steps: int, where: Path):
        self.steps, self.where, self.bar = steps, where, None
        self.show = _progress_enabled()

    def _say(self, text: str) -> None:
        log.info(text)
        if self.show:
            print(f"flashrl_kernels: {text}", file=sys.stderr, flush=True)

    def waiting(self) -> None:
        self._say(f"waiting for another process that is compiling the native CPU kernels into {self.where}")

    def start(self) -> None:
        self._say(f"compiling the native CPU kernels for {_status.capability or _capability_flags()[0]} "
                  f"(once for this torch, compiler and source; cached after) into {self.where}")
        if self.show and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.steps, desc="flashrl_kernels: compiling", unit="file", file=sys.stderr,
                            leave=False, dynamic_ncols=True, mininterval=0)  # ~10 updates: show each

    def step(self, name: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(name, refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def finished(self, seconds: float) -> None:
        self._say(f"native CPU kernels compiled in {seconds:.1f} s")
