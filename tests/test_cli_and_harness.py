"""The command line and the benchmark harness (timing, memory, tables)."""
import subprocess
import sys

import pytest
import torch

from flashrl_kernels import cli
from flashrl_kernels.benchmarks import harness


def test_info_lists_every_backend(capsys):
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    for b in ("reference", "torch", "triton", "native"):
        assert b in out
    assert "token_logprobs         runs on" in out and "policy_loss            runs on" in out
    assert "native CPU kernels:" in out


def test_bench_rejects_unknown_op(capsys):
    assert cli.main(["bench", "--op", "no_such_op", "--no-memory"]) == 2
    assert "no_such_op" in capsys.readouterr().err


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc peak-RSS accounting is Linux-only")
def test_cpu_peak_memory_sees_a_known_allocation():
    code = (
        "from flashrl_kernels.benchmarks.harness import cpu_peak_extra_mb\n"
        "import torch\n"
        "def f():\n"
        "    x = torch.ones(200 * 2**20 // 4)\n"  # 200 MiB, touched
        "    return float(x[-1])\n"
        "print(cpu_peak_extra_mb(f))\n"
    )
    env = {"MALLOC_MMAP_THRESHOLD_": "65536", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    peak = float(out.stdout.strip())
    assert 195 <= peak <= 260, peak


def test_harness_runs_a_case_and_takes_ratios():
    calls = []

    def make(delay):
        x = torch.randn(1000)

        def fn():
            calls.append(1)
            for _ in range(delay):
                x.exp()

        return lambda: fn

    cases = [
        harness.Case("toy", "slow", "fwd", "n=1000", make(40), bytes=8000, baseline=True),
        harness.Case("toy", "fast", "fwd", "n=1000", make(1), bytes=8000),
    ]
    results = []
    for c in cases:
        times = harness.time_fn(c.make(), torch.device("cpu"), repeats=3)
        results.append(harness.Result(c.op, c.impl, c.mode, c.size, sorted(times)[1], 0.0, None, None, None, c.baseline))
    harness._attach_ratios(results)
    assert results[0].speedup == 1.0
    assert results[1].speedup > 1.0
    table = harness.format_table(results)
    assert "slow *" in table and "fast" in table
    assert len(calls) == 2 * (3 + 1)  # warm-up plus repeats, per case


def test_token_logprobs_bench_cases_run_at_tiny_size(monkeypatch):
    from flashrl_kernels.benchmarks import token_logprobs as tb

    monkeypatch.setattr(tb, "sizes", lambda quick, device: (4, 333))
    cases = [c for c in tb.cases(True, torch.device("cpu")) if c.impl != "torch.compile"]
    assert any(c.baseline for c in cases) and any(c.impl.startswith("flashrl") for c in cases)
    for c in cases:
        c.make()()
