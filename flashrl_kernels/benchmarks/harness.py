"""Benchmark harness behind `flashrl-kernels bench`.

Each module in flashrl_kernels/benchmarks/ (other than this one) defines
`cases(quick, device) -> list[Case]`. The harness times each case (median
of repeats after warm-up, device-synchronised), measures its peak extra
memory, and prints one table per op with ratios against the case marked
`baseline`.

Peak memory on CPU: PyTorch has no CPU allocator statistics, so each case
runs once more in a fresh subprocess with glibc's mmap threshold fixed at
64 KiB (freed buffers go back to the OS instead of staying resident), the
peak-RSS counter reset through /proc/self/clear_refs after the inputs are
built, and the peak read from VmHWM. On CUDA: torch.cuda.max_memory_allocated.
"""
from __future__ import annotations

import dataclasses
import importlib
import json
import os
import pkgutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch


@dataclasses.dataclass
class Case:
    op: str
    impl: str
    mode: str  # "fwd" or "fwd+bwd"
    size: str
    make: Callable[[], Callable[[], object]]
    bytes: int | None = None
    flops: int | None = None
    baseline: bool = False


@dataclasses.dataclass
class Result:
    op: str
    impl: str
    mode: str
    size: str
    median_ms: float | None
    spread_ms: float | None  # max - min over the timed repeats
    gbps: float | None
    tflops: float | None
    peak_mb: float | None
    baseline: bool
    error: str | None = None
    speedup: float | None = None  # baseline median / this median
    mem_ratio: float | None = None  # this peak / baseline peak


def flashrl_backends(device: torch.device, op: str) -> list[str]:
    """The non-reference backends worth timing for `op` (a backend function name) on `device`.

    Triton on a CPU (the interpreter) is a correctness tool, not a timing.
    """
    from flashrl_kernels import _backend

    out = []
    for b in ("torch", "native", "triton"):
        if _backend.availability(b, device) is not None or (b == "triton" and device.type != "cuda"):
            continue
        if hasattr(importlib.import_module(_backend._PACKAGES[b]), op):
            out.append(b)
    return out


def op_modules(include_optional: bool = True) -> list[str]:
    """Names of the benchmark modules shipped in this package.

    A module that sets `IN_DEFAULT_RUN = False` (a whole-trainer step taking minutes on a CPU) runs only
    when asked for by name; `include_optional=False` leaves those out.
    """
    pkg = importlib.import_module("flashrl_kernels.benchmarks")
    names = sorted(m.name for m in pkgutil.iter_modules(pkg.__path__) if m.name != "harness" and not m.name.startswith("_"))
    if include_optional:
        return names
    return [n for n in names if getattr(importlib.import_module(f"{pkg.__name__}.{n}"), "IN_DEFAULT_RUN", True)]


def load_cases(module: str, quick: bool, device: torch.device) -> list[Case]:
    mod = importlib.import_module(f"flashrl_kernels.benchmarks.{module}")
    return mod.cases(quick, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], object], device: torch.device, repeats: int, warmup: int = 1) -> list[float]:
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


# ---- peak memory ----

def _read_status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def cpu_peak_extra_mb(fn: Callable[[], object]) -> float:
    """Peak resident memory above the current level during one call of fn (this process)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    base = _read_status_kb("VmRSS")
    fn()
    # the kernel's RSS counters are synced lazily: a call that allocates nothing can read a few hundred KB below
    # the level before it; nothing extra is 0, not a negative peak
    return max(0.0, (_read_status_kb("VmHWM") - base) / 1024.0)


def cuda_peak_extra_mb(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def _memory_in_subprocess(module: str, index: int, quick: bool, device: torch.device, timeout: float) -> float:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    cmd = [sys.executable, "-m", "flashrl_kernels.benchmarks.harness", module, str(index), str(int(quick)), str(device)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return float(out.stdout.strip().splitlines()[-1])


def _memory_child(module: str, index: int, quick: bool, device: str) -> None:
    dev = torch.device(device)
    case = load_cases(module, quick, dev)[index]
    fn = case.make()
    fn()  # warm-up: compilation, lazy initialisation and one-time buffers stay out of the peak
    synchronize(dev)
    import gc

    gc.collect()
    peak = cuda_peak_extra_mb(fn, dev) if dev.type == "cuda" else cpu_peak_extra_mb(fn)
    print(f"{peak:.3f}")


# ---- ceilings ----

def copy_bandwidth_gbps(device: torch.device, mbytes: int = 256, repeats: int = 5) -> float:
    """Measured device copy bandwidth, counting bytes read plus bytes written."""
    n = mbytes * 2**20 // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = time_fn(lambda: dst.copy_(src), device, repeats)
    return 2 * src.numel() * 4 / (statistics.median(times) * 1e-3) / 1e9


# ---- driver ----

def run(
    modules: list[str] | None = None,
    *,
    quick: bool = False,
    device: torch.device | str | None = None,
    repeats: int | None = None,
    memory: bool = True,
    impl_filter: str | None = None,
    progress: bool = True,
) -> list[Result]:
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    repeats = repeats or (3 if quick else 5)
    todo = []
    for module in modules or op_modules(include_optional=False):
        for index, case in enumerate(load_cases(module, quick, device)):
            if impl_filter and impl_filter not in case.impl and not case.baseline:
                continue
            todo.append((module, index, case))
    results: list[Result] = []
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        tqdm = None
    bar = tqdm(todo, desc="bench", unit="case", disable=not progress or tqdm is None, dynamic_ncols=True)
    for module, index, case in bar:
        if hasattr(bar, "set_postfix_str"):
            bar.set_postfix_str(f"{case.op} {case.mode} {case.impl}")
        res = Result(case.op, case.impl, case.mode, case.size, None, None, None, None, None, case.baseline)
        try:
            fn = case.make()
            times = time_fn(fn, device, repeats)
            del fn
            res.median_ms = statistics.median(times)
            res.spread_ms = max(times) - min(times)
            sec = res.median_ms * 1e-3
            res.gbps = case.bytes / sec / 1e9 if case.bytes else None
            res.tflops = case.flops / sec / 1e12 if case.flops else None
            if memory:
                if device.type == "cuda":
                    res.peak_mb = cuda_peak_extra_mb(case.make(), device)
                else:
                    res.peak_mb = _memory_in_subprocess(module, index, quick, device, timeout=900)
        except Exception as exc:  # one broken baseline must not hide the other rows
            res.error = f"{type(exc).__name__}: {exc}"[:200]
        results.append(res)
    _attach_ratios(results)
    return results


# "mem vs base" only against a baseline peak of at least this: the CPU measurement's noise is a few hundred KB
# (page-granular RSS counters), and a ratio of two noise readings (0.12 / -0.01 MB: "-1175%") means nothing
MEM_RATIO_MIN_MB = 1.0


def _attach_ratios(results: list[Result]) -> None:
    for r in results:
        base = next((b for b in results if b.baseline and (b.op, b.mode, b.size) == (r.op, r.mode, r.size)), None)
        if base is None or r.median_ms is None or base.median_ms is None:
            continue
        r.speedup = base.median_ms / r.median_ms
        if r.peak_mb is not None and base.peak_mb is not None and base.peak_mb >= MEM_RATIO_MIN_MB:
            r.mem_ratio = r.peak_mb / base.peak_mb


def _fmt(v, spec):
    return "-" if v is None else format(v, spec)


def format_table(results: list[Result], copy_gbps: float | None = None) -> str:
    headers = ["op", "mode", "size", "impl", "median ms", "spread ms", "GB/s"]
    if copy_gbps:
        headers.append("% copy BW")
    headers += ["TFLOP/s", "peak MB", "speedup", "mem vs base"]
    rows = []
    for r in results:
        row = [r.op, r.mode, r.size, r.impl + (" *" if r.baseline else "")]
        if r.error:
            rows.append(row + [f"error: {r.error}"] + [""] * (len(headers) - 5))
            continue
        row += [_fmt(r.median_ms, ".2f"), _fmt(r.spread_ms, ".2f"), _fmt(r.gbps, ".1f")]
        if copy_gbps:
            row.append(_fmt(None if r.gbps is None else 100 * r.gbps / copy_gbps, ".0f"))
        row += [
            _fmt(r.tflops, ".2f"),
            _fmt(r.peak_mb, ".0f"),
            _fmt(r.speedup, ".2f") + ("x" if r.speedup else ""),
            _fmt(None if r.mem_ratio is None else 100 * r.mem_ratio, ".0f") + ("%" if r.mem_ratio is not None else ""),
        ]
        rows.append(row)
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *rows)]
    line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths))
    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    out.append("* baseline; speedup = baseline time / time; mem vs base = peak extra memory / baseline's")
    return "\n".join(out)


def results_json(results: list[Result], **meta) -> str:
    return json.dumps({"meta": meta, "results": [dataclasses.asdict(r) for r in results]}, indent=1)


if __name__ == "__main__":  # memory-measurement child: module index quick device
    _memory_child(sys.argv[1], int(sys.argv[2]), bool(int(sys.argv[3])), sys.argv[4])
