"""The native CPU backend: build/fallback behaviour, selection, thread counts, and
row shapes specific to its chunked one-pass kernel (max growing across chunks,
-inf prefixes, NaN late in a row)."""
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import flashrl_kernels as fk
from flashrl_kernels import _backend, _native
from flashrl_kernels.reference import token_logprobs_spec

ROOT = Path(__file__).resolve().parents[1]
NATIVE = _backend.native_built()
_LOADED_LIBRARY = _native.native_status().library
needs_native = pytest.mark.skipif(not NATIVE, reason=f"native backend not built here: {_native.native_status().reason}")


@pytest.fixture
def fresh_status(monkeypatch, tmp_path):
    """A process state in which the native library was never tried, with a private cache dir."""
    monkeypatch.setattr(_native, "_status", _native.NativeStatus())
    monkeypatch.setenv("FLASHRL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FLASHRL_NATIVE", raising=False)
    monkeypatch.delenv("FLASHRL_BACKEND", raising=False)  # these tests are about the automatic choice
    return tmp_path


def _run(code, env_extra, timeout=300):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **env_extra}
    r = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=timeout)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


# ---- build and fallback ----

def test_compile_failure_falls_back_with_one_warning(fresh_status):
    bad = fresh_status / "cpu"
    bad.mkdir()
    (bad / "broken.cpp").write_text("this is not C++;\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_native, "sources", lambda: [bad / "broken.cpp"])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert _backend.selected_backend(torch.device("cpu")) == "torch"
            assert _backend.selected_backend(torch.device("cpu")) == "torch"  # no second attempt, no second warning
            out = fk.token_logprobs(torch.randn(3, 7), torch.tensor([0, 3, 6]))
        msgs = [str(w.message) for w in caught if issubclass(w.category, _native.NativeBuildWarning)]
        assert len(msgs) == 1 and "compiling broken.cpp failed" in msgs[0], msgs
        st = fk.native_status()
        assert not st.loaded and st.attempted and "broken.cpp" in st.reason and "error" in st.reason
        assert "unavailable" in st.summary()
        assert torch.isfinite(out).all()
        with fk.use_backend("native"), pytest.raises(fk.BackendUnavailableError, match="broken.cpp"):
            fk.token_logprobs(torch.randn(3, 7), torch.tensor([0, 3, 6]))


def test_no_compiler_falls_back(fresh_status, monkeypatch):
    monkeypatch.setattr(_native, "_compiler", lambda: None)
    with pytest.warns(_native.NativeBuildWarning, match="no C\\+\\+ compiler"):
        assert not _native.load()
    assert _backend.availability("native", torch.device("cpu")).startswith("the native C++ extension is not built")


def test_sources_missing_falls_back(fresh_status, monkeypatch):
    monkeypatch.setattr(_native, "sources", list)
    with pytest.warns(_native.NativeBuildWarning, match="not shipped"):
        assert not _native.load()


@needs_native
def test_compiler_without_openmp_builds_single_threaded(fresh_status, monkeypatch):
    loaded = _native.native_status().library  # the real library of this process (fixture swapped the status)
    monkeypatch.setattr(_native, "_openmp_failed", False)
    calls = []

    def fake_build(cxx, srcs):
        calls.append(_native._openmp_flags())
        if "-fopenmp" in calls[-1]:
            raise RuntimeError("compiling token_logprobs.cpp failed:\nclang: error: unsupported option '-fopenmp'")
        return Path(_LOADED_LIBRARY)

    monkeypatch.setattr(_native, "_build", fake_build)
    assert loaded is None and _native.load()
    assert calls == [["-fopenmp"], []] and fk.native_status().threads is False
    assert "single-threaded" in fk.native_status().summary()


def test_disabled_by_env_is_silent(fresh_status, monkeypatch):
    monkeypatch.setenv("FLASHRL_NATIVE", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.selected_backend(torch.device("cpu")) == "torch"
    assert "FLASHRL_NATIVE=0" in fk.native_status().reason


def test_import_does_not_build():
    out = _run(
        "import sys, flashrl_kernels as fk; "
        "print('flashrl_kernels.native' in sys.modules, fk.native_status().attempted)",
        {"FLASHRL_CACHE_DIR": "/nonexistent-must-not-be-touched"},
    )
    assert out.split() == ["False", "False"]


@needs_native
def test_compiles_once_then_loads_from_cache(tmp_path):
    """A fresh cache dir: the first process compiles (timed), the second loads the cached library."""
    code = (
        "import torch, flashrl_kernels as fk; st = fk.native_status(load=True); assert st.loaded, st.reason; "
        "print(st.cached, st.build_seconds, st.library); "
        "print(float(fk.token_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([1]))[0]))"
    )
    env = {"FLASHRL_CACHE_DIR": str(tmp_path)}
    first = _run(code, env).split()
    second = _run(code, env).split()
    assert first[0] == "False" and float(first[1]) > 0 and first[2].startswith(str(tmp_path))
    assert second[0] == "True" and second[2] == first[2]
    assert abs(float(first[3]) - (-0.31326168751822286)) < 1e-6


# ---- selection ----

@needs_native
def test_auto_selects_native_on_cpu_and_torch_for_ops_native_lacks(monkeypatch):
    monkeypatch.delenv("FLASHRL_BACKEND", raising=False)
    cpu = torch.device("cpu")
    assert _backend.selected_backend(cpu) == "native"
    assert _backend.selected_backend(cpu, "token_logprobs_forward") == "native"
    assert _backend.selected_backend(cpu, "an_op_without_native_kernel") == "torch"
    with fk.use_backend("native"), pytest.raises(fk.BackendUnavailableError, match="no implementation of an_op"):
        _backend.implementation("an_op_without_native_kernel", cpu)


@needs_native
def test_status_reports_active():
    st = fk.native_status()
    assert st.loaded and st.library and Path(st.library).exists()
    assert "active" in st.summary() and "token_logprobs.cpp" in st.sources


# ---- kernel behaviour ----

def _native_vs_spec(logits, targets, temperature=1.0, ignore_index=None):
    x = logits.clone().requires_grad_(True)
    with fk.use_backend("native"):
        lp, ent = fk.token_logprobs(x, targets, temperature=temperature, return_entropy=True, ignore_index=ignore_index)
    g1, g2 = torch.randn_like(lp), torch.randn_like(ent)
    ((lp * g1).sum() + (ent * g2).sum()).backward()
    xr = logits.double().requires_grad_(True)
    rlp, rent = token_logprobs_spec(xr, targets, temperature, ignore_index)
    ((rlp * g1.double()).sum() + (rent * g2.double()).sum()).backward()
    return (lp, ent, x.grad), (rlp, rent, xr.grad)


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_max_growing_across_chunks_and_neg_inf_prefix(dtype):
    v = 5000  # several 1024-wide chunks and a ragged tail
    ramp = torch.linspace(-20, 20, v)  # the max grows in every chunk: every rescale path runs
    logits = torch.stack([ramp + torch.randn(v), ramp.flip(0) + torch.randn(v), torch.randn(v) * 4, torch.randn(v)])
    logits[3, :3000] = float("-inf")  # whole chunks of -inf before the first finite value
    logits = logits.to(dtype)
    targets = torch.tensor([v - 1, 0, 1234, 4000])
    (lp, ent, g), (rlp, rent, rg) = _native_vs_spec(logits, targets, temperature=0.8)
    tol = 1e-5 + 4 * torch.finfo(torch.float32).eps * 25 / 0.8
    torch.testing.assert_close(lp.double(), rlp, atol=tol, rtol=0)
    torch.testing.assert_close(ent.double(), rent, atol=tol, rtol=0)
    round_ = 2.0**-8 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(g.double(), rg, atol=(round_ + tol) * float(rg.abs().max()), rtol=0)
    assert (g[3, :3000] == 0).all()


@needs_native
def test_nan_late_in_a_long_row_is_reported():
    logits = torch.randn(3, 6000)
    logits[1, 5999] = float("nan")  # last entry, in the padded tail
    logits[2, 3000] = float("nan")
    with fk.use_backend("native"), pytest.raises(ValueError, match="row 1"):
        fk.token_logprobs(logits, torch.tensor([0, 1, 2]))
    with fk.use_backend("native"):
        _, _, lse = torch.ops.flashrl.token_logprobs(logits, torch.tensor([0, 1, 2]), 1.0, None, False)
    assert torch.isfinite(lse[0]) and torch.isnan(lse[1]) and torch.isnan(lse[2])


@needs_native
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_thread_count_does_not_change_results(dtype):
    n, v = 48, 3001  # enough rows for at::parallel_for to split them
    logits = (torch.randn(n, v) * 3).to(dtype)
    targets = torch.randint(0, v, (n,))
    targets[::7] = -100
    g_lp, g_h = torch.randn(n), torch.randn(n)
    old = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            x = logits.clone().requires_grad_(True)
            with fk.use_backend("native"):
                lp, ent = fk.token_logprobs(x, targets, temperature=1.1, return_entropy=True, ignore_index=-100)
            ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
            results.append((lp.detach(), ent.detach(), x.grad))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_native
def test_matches_torch_backend_on_an_rl_shaped_batch():
    """Padded batch sliced from a model output (strided rows), prompt tokens ignored, T != 1."""
    full = (torch.randn(3, 17, 2053) * 5).bfloat16()
    logits = full[:, :-1, :]
    targets = torch.randint(0, 2053, (3, 16))
    targets[:, :5] = -100
    outs = {}
    for b in ("native", "torch"):
        x = logits.detach().clone().requires_grad_(True)
        with fk.use_backend(b):
            lp, ent = fk.token_logprobs(x, targets, temperature=0.6, return_entropy=True, ignore_index=-100)
        (lp.sum() - 0.1 * ent.sum()).backward()
        outs[b] = (lp, ent, x.grad)
    torch.testing.assert_close(outs["native"][0], outs["torch"][0], atol=5e-5, rtol=0)
    torch.testing.assert_close(outs["native"][1], outs["torch"][1], atol=5e-5, rtol=0)
    torch.testing.assert_close(outs["native"][2].float(), outs["torch"][2].float(), atol=2e-3, rtol=2e-2)


@needs_native
def test_side_by_side_bench_script_runs_at_tiny_size(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_logprobs_bench", ROOT / "bench" / "native_logprobs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    results, acc = bench.main(["--rows", "8", "--vocab", "301", "--repeats", "2", "--no-compile", "--copy-mib", "16"])
    assert set(results) == {"fwd", "fwd+bwd"}
    assert all(set(r) == {"eager", "flashrl native"} and min(r.values()) > 0 for r in results.values())
    assert acc["flashrl native"] < 1e-4 and acc["eager"] < 1e-4
    assert "of copy bw" in capsys.readouterr().out
