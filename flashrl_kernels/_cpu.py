"""What this CPU is and what the process may run on it: the ISA flags, and the AMX tile permission.

AMX (Intel Xeon 4th generation and later) is the one x86 extension Linux does not enable for a process by
default: its tile data is 8 KiB of state per thread, so a process must ask for it once with
`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)` before any AMX instruction runs; until then every
AMX instruction raises SIGILL. The grant covers the whole process (all its threads, present and future) and
is inherited by children. vLLM's CPU attention kernel uses AMX tiles whenever the CPU has them, and relies on
someone in the process having asked first: in vLLM's bf16 engine that is oneDNN, at the first bf16 matmul. In
the flashrl engines no oneDNN matmul runs (every linear and the LM head are flashrl kernels), so without
`request_amx()` a fresh process died with SIGILL at the first attention call (issue 23). The plugin asks in
every vLLM process (`flashrl_kernels.integrations.vllm.register`, which vLLM runs in the engine core and in
every worker).
"""
from __future__ import annotations

import ctypes
import functools
import os
import platform
import threading

ISA_FLAGS = ("avx2", "avx_vnni", "avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")

_SYS_ARCH_PRCTL = 158  # x86_64
_ARCH_GET_XCOMP_PERM = 0x1022
_ARCH_REQ_XCOMP_PERM = 0x1023
_XFEATURE_XTILEDATA = 18

_lock = threading.Lock()


@functools.lru_cache(maxsize=1)
def _cpuinfo() -> tuple[str, frozenset[str]]:
    name, flags = None, frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name is None:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags") and not flags:
                    flags = frozenset(line.split(":", 1)[1].split())
                if name is not None and flags:
                    break
    except OSError:
        pass
    return name or platform.processor() or platform.machine() or "cpu", flags


def usable_cpus() -> list[int]:
    """The CPUs this process may run on, sorted: its affinity mask where the OS has one (a container or a
    `taskset` gives fewer than the machine has), else all of `os.cpu_count()`. Read at every call: the mask
    can change."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    return _cpuinfo()[0]


def cpu_flags() -> frozenset[str]:
    """Every ISA flag /proc/cpuinfo lists for the first CPU (empty where there is no /proc/cpuinfo)."""
    return _cpuinfo()[1]


def isa_flags() -> list[str]:
    """The flags that matter for this package's CPU kernels, in a fixed order: the line to print beside any
    CPU number."""
    flags = cpu_flags()
    return [f for f in ISA_FLAGS if f in flags]


def has_amx() -> bool:
    """The CPU has AMX tiles (amx_tile), whether or not this process may use them yet."""
    return "amx_tile" in cpu_flags()


def _xcomp_perm() -> int | None:
    """The process's permitted extended-state components (ARCH_GET_XCOMP_PERM), None where unknown."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        bits = ctypes.c_uint64(0)
        if libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_GET_XCOMP_PERM), ctypes.byref(bits)) != 0:
            return None
        return bits.value
    except (OSError, AttributeError):
        return None


def amx_permitted() -> bool:
    """Whether this process may run AMX instructions now (the CPU has them and the tile state is granted)."""
    perm = _xcomp_perm()
    return has_amx() and perm is not None and bool(perm & (1 << _XFEATURE_XTILEDATA))


def request_amx() -> bool:
    """Ask Linux for the AMX tile state for this process, once; True when AMX instructions may run.

    Cheap (one or two system calls) and safe everywhere: False without AMX, on another OS or where the
    kernel refuses (Linux < 5.16, or a seccomp filter).
    """
    if not has_amx():
        return False
    with _lock:
        if amx_permitted():
            return True
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.syscall(ctypes.c_long(_SYS_ARCH_PRCTL), ctypes.c_long(_ARCH_REQ_XCOMP_PERM),
                         ctypes.c_long(_XFEATURE_XTILEDATA))
        except (OSError, AttributeError):
            return False
        return amx_permitted()
