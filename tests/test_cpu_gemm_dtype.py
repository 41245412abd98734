"""The CPU GEMM dtype choice for bf16/fp16 (flashrl_kernels/_cpu_gemm.py) and linear_token_logprobs in both modes.

FLASHRL_CPU_GEMM_DTYPE=input keeps the tile GEMMs in the input dtype (today's
path on fast-bf16 CPUs), =fp32 widens the bf16/fp16 operands to fp32 (the path
taken on AVX2-only CPUs); both must meet test_linear_logprobs' float64-spec
tolerances (the widened path is at least as accurate) on every CPU backend.
"""
import pytest
import torch
from conftest import available_backends
from test_linear_logprobs import assert_close_to_spec, make_inputs, run_case

from flashrl_kernels import _cpu_gemm
from flashrl_kernels.cli import main as cli_main
from flashrl_kernels.torch_impl import linear_logprobs as tl

# the backends whose CPU tile GEMMs are torch_impl's loops (Triton's CPU interpreter and the reference are not)
CPU_BACKENDS = [b for b in available_backends("cpu", op="linear_logprobs_stats") if b in ("torch", "native")]
MODES = ["input", "fp32"]


def test_decision_env_override_and_bool(monkeypatch):
    for dtype in (torch.bfloat16, torch.float16):
        monkeypatch.setenv(_cpu_gemm.ENV, "input")
        assert _cpu_gemm.cpu_low_precision_gemm_is_fast(dtype) is True
        assert not _cpu_gemm.widen_cpu_gemm(dtype, torch.device("cpu"))
        monkeypatch.setenv(_cpu_gemm.ENV, "fp32")
        assert _cpu_gemm.cpu_low_precision_gemm_is_fast(dtype) is False
        assert _cpu_gemm.widen_cpu_gemm(dtype, torch.device("cpu"))
        assert not _cpu_gemm.widen_cpu_gemm(dtype, torch.device("meta"))  # never off the CPU
    # fp32 operands are never widened, whatever the mode
    assert _cpu_gemm.cpu_low_precision_gemm_is_fast(torch.float32) is True
    monkeypatch.setenv(_cpu_gemm.ENV, "bogus")
    with pytest.raises(ValueError, match="FLASHRL_CPU_GEMM_DTYPE"):
        _cpu_gemm.cpu_low_precision_gemm_is_fast(torch.bfloat16)


def test_decision_auto_is_cached_bool(monkeypatch):
    monkeypatch.setenv(_cpu_gemm.ENV, "auto")
    first = _cpu_gemm.cpu_low_precision_gemm_is_fast(torch.bfloat16)
    assert isinstance(first, bool)
    calls = []
    monkeypatch.setattr(_cpu_gemm, "_best_time", lambda *a, **k: calls.append(1) or 1.0)
    for _ in range(3):  # the probe ran once per process: no new timing, same answer
        assert _cpu_gemm.cpu_low_precision_gemm_is_fast(torch.bfloat16) is first
    assert calls == []
    assert _cpu_gemm.gemm_slowdown.cache_info().currsize >= 1
    assert first == (_cpu_gemm.gemm_slowdown(torch.bfloat16) <= _cpu_gemm.SLOW_RATIO)


def test_info_prints_the_choice(monkeypatch, capsys):
    monkeypatch.setenv(_cpu_gemm.ENV, "fp32")
    assert cli_main(["info"]) == 0
    assert "CPU bf16 GEMM: widened to fp32" in capsys.readouterr().out


@pytest.mark.parametrize("mode", MODES)
def test_widened_plan_only_in_fp32_mode(mode, monkeypatch):
    monkeypatch.setenv(_cpu_gemm.ENV, mode)
    h, w, _ = make_inputs(4, 16, 10, torch.bfloat16)
    assert tl.gemm_plan(h, w)[2] == (mode == "fp32")
    assert tl.gemm_plan(h.float(), w.float())[2] is False


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile", ["auto", "3x16"])
def test_matches_reference_in_each_mode(backend, mode, dtype, tile, monkeypatch):
    monkeypatch.setenv(_cpu_gemm.ENV, mode)
    if tile != "auto":
        monkeypatch.setenv("FLASHRL_LINEAR_TILE", tile)
    torch.manual_seed(0)
    hidden, weight, bias = make_inputs(11, 64, 50, dtype, bias=True)
    hidden, weight, bias = hidden.cpu(), weight.cpu(), bias.cpu()
    targets = torch.randint(0, 50, (11,))
    targets[3] = -100
    got, ref = run_case(backend, hidden, weight, targets, bias=bias, temperature=0.7, ignore_index=-100)
    assert_close_to_spec(got, ref, hidden, weight, bias, 0.7)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("fp32_acc", [True, False])
@pytest.mark.parametrize("n, v", [(8, 50), (40, 21)])  # N <= V: vocab outer; N > V: rows outer
def test_loop_orders_in_each_mode(backend, mode, fp32_acc, n, v, monkeypatch):
    monkeypatch.setenv(_cpu_gemm.ENV, mode)
    monkeypatch.setenv("FLASHRL_LINEAR_TILE", "7x8")
    torch.manual_seed(1)
    hidden, weight, bias = (x.cpu() for x in make_inputs(n, 24, v, torch.bfloat16, bias=True))
    targets = torch.randint(0, v, (n,))
    got, ref = run_case(backend, hidden, weight, targets, bias=bias, fp32_grad_accumulation=fp32_acc)
    assert_close_to_spec(got, ref, hidden, weight, bias, 1.0)


def test_widened_vocab_block_is_capped(monkeypatch):
    monkeypatch.setenv(_cpu_gemm.ENV, "fp32")
    monkeypatch.delenv("FLASHRL_LINEAR_TILE", raising=False)
    h = torch.zeros(4, 4096, dtype=torch.bfloat16)
    w = torch.empty((), dtype=torch.bfloat16).expand(100_000, 4096)  # only its shape matters to the plan
    _rows, cols, widen = tl.gemm_plan(h, w)
    assert widen and cols * 4096 * 4 <= max(tl.tile_bytes(h.device), tl._WIDE_W_BYTES)
    monkeypatch.setenv(_cpu_gemm.ENV, "input")
    assert tl.gemm_plan(h, w)[1] > cols  # the fast path keeps today's tile shape


def test_gemm_dtype_bench_runs_every_variant():
    """bench/cpu_gemm_dtype.py (what widening buys on a CPU whose bf16 GEMM is slow): a tiny real run prints a
    timed row for every variant of both parts."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != _cpu_gemm.ENV}
    r = subprocess.run([sys.executable, str(root / "bench" / "cpu_gemm_dtype.py"), "--repeats", "1", "--rows", "16",
                        "--vocab", "300", "--policy-vocab", "300", "--policy-repeats", "1"],
                       capture_output=True, text=True, timeout=600, check=False, env={**env, "PYTHONPATH": str(root)})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line.split() for line in r.stdout.splitlines() if " median " in line]
    for backend in ("torch", "native"):
        for dtype, mode in (("torch.float32", "auto"), ("torch.bfloat16", "auto"), ("torch.bfloat16", "input")):
            assert any(row[:3] == [backend, dtype, mode] and float(row[4]) > 0 for row in rows), r.stdout
    for impl in ("fused[native] bf16", "fused[torch] bf16", "composed[native] bf16", "unfused eager fp32",
                 "unfused torch.compile fp32", "unfused eager bf16"):
        assert sum(impl in line for line in r.stdout.splitlines()) == 1, r.stdout
