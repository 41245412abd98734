"""Test subprocesses run side by side, their results fetched by key.

Most of a test subprocess's time here is single-threaded: importing torch, vLLM or a framework (verl ~10 s,
AReaL ~12 s on a 2-core VM), and a multi-process vLLM engine imports three times in a row (front end, engine
core, worker). So as many at a time as this process has CPUs take about the time of one each round. Every
subprocess is still a fresh process of its own; only the wall clock is shared. A module fixture that holds a pool
starts all its jobs, also those of tests that -k deselected (close() cancels the ones not started yet).
"""
import subprocess
from concurrent.futures import ThreadPoolExecutor

from flashrl_kernels._cpu import usable_cpus


class SubprocessPool:
    """Starts `jobs` ({key: {"args": [...], "env": {...}, "timeout": s}}) in the order given, `width` at a time
    (default: the CPUs this process may run on); `result(key)` waits for that one's CompletedProcess (a timeout
    raises subprocess.TimeoutExpired there)."""

    def __init__(self, jobs: dict, width: int | None = None):
        width = width or len(usable_cpus())
        self._pool = ThreadPoolExecutor(max_workers=max(1, width))
        self._runs = {key: self._pool.submit(subprocess.run, job["args"], env=job.get("env"), capture_output=True,
                                             text=True, timeout=job.get("timeout", 600), check=False)
                      for key, job in jobs.items()}

    def result(self, key) -> subprocess.CompletedProcess:
        return self._runs[key].result()

    def close(self) -> None:
        for run in self._runs.values():
            run.cancel()  # those not started yet
        self._pool.shutdown(wait=True)
