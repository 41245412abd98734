"""The native CPU backend: build/fallback behaviour, selection, thread counts, and
row shapes specific to its chunked one-pass kernel (max growing across chunks,
-inf prefixes, NaN late in a row)."""
import io
import os
import subprocess
import sys
import threading
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


# compiled once into a fresh cache, then loaded from it: test_native_capabilities.py (the portable build)


def _tiny_sources(d, n=3):
    """Sources that compile in well under a second (no torch headers) and link into a library with no ops."""
    d.mkdir()
    for i in range(n):
        (d / f"tiny{i}.cpp").write_text(f'extern "C" int flashrl_tiny_{i}() {{ return {i}; }}\n')
    return sorted(d.glob("*.cpp"))


def _record_compiles(monkeypatch):
    cmds, popen = [], subprocess.Popen

    def recording(cmd, *a, **k):
        if "-o" in cmd:  # the compiles, not `c++ --version` (subprocess.run goes through Popen too)
            cmds.append(list(cmd))
        return popen(cmd, *a, **k)

    monkeypatch.setattr(_native.subprocess, "Popen", recording)
    return cmds


@pytest.mark.parametrize("pch_builds", [True, False])
def test_sources_started_after_the_precompiled_header_include_it(pch_builds, tmp_path, monkeypatch):
    """On fewer cores than sources, GCC precompiles the common headers first; a header that fails only costs time."""
    cxx = _native._compiler()
    if cxx is None or "Free Software Foundation" not in _native._compiler_id(cxx):
        pytest.skip("the precompiled header is built with GCC only")
    headers = ("vector", "string") if pch_builds else ("vector", "flashrl_no_such_header.h")
    monkeypatch.setattr(_native, "PCH_HEADERS", headers)
    monkeypatch.setattr(_native._cpu, "usable_cpus", lambda: [0])
    monkeypatch.delenv("FLASHRL_NATIVE_PCH", raising=False)
    srcs = []
    for i in range(3):  # the missing header is included where it exists only: the plain compile still works
        srcs.append(tmp_path / f"src{i}.cpp")
        srcs[-1].write_text(f"#include <{headers[0]}>\n#if __has_include(<{headers[1]}>)\n#include <{headers[1]}>\n"
                            f"#endif\nint f{i}() {{ return std::{headers[0]}<int>{{{i}}}[0]; }}\n")
    (tmp_path / "other.cpp").write_text("int g() { return 7; }\n")  # includes neither: always plain
    srcs.append(tmp_path / "other.cpp")
    objs = [tmp_path / f"{s.stem}.o" for s in srcs]
    cmds = _record_compiles(monkeypatch)
    _native._compile_objects(cxx, srcs, objs, ["-O0"])
    assert cmds[0][-5:-3] == ["-x", "c++-header"]  # one core: the header first
    assert all(o.exists() for o in objs)
    with_pch = [c[-3] for c in cmds[1:] if "-include" in c]
    assert with_pch == ([str(s) for s in srcs[:3]] if pch_builds else [])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([s.name for s in srcs] + [o.name for o in objs])
    monkeypatch.setenv("FLASHRL_NATIVE_PCH", "0")
    cmds.clear()
    _native._compile_objects(cxx, srcs, objs, ["-O0"])
    assert len(cmds) == len(srcs) and not any("-include" in c for c in cmds)


def test_first_build_says_so_on_stderr_and_a_cache_hit_is_silent(fresh_status, monkeypatch, capsys):
    """The first use compiles for a minute or two inside the user's first CPU op call: it must not look like a hang."""
    srcs = _tiny_sources(fresh_status / "cpu")
    monkeypatch.setattr(_native, "sources", lambda: srcs)
    monkeypatch.delenv("FLASHRL_NATIVE_PROGRESS", raising=False)
    assert _native.load()
    st = fk.native_status()
    assert st.loaded and not st.cached and st.build_seconds > 0
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err  # not a terminal here: no bar, a line when it starts and one when it ends
    assert err[0].startswith(f"flashrl_kernels: compiling the native CPU kernels for {st.capability}")
    assert err[0].endswith(str(Path(st.library).parent))
    assert err[1] == f"flashrl_kernels: native CPU kernels compiled in {st.build_seconds:.1f} s"
    monkeypatch.setattr(_native, "_status", _native.NativeStatus())
    assert _native.load() and fk.native_status().cached
    assert capsys.readouterr().err == ""


def test_first_build_on_a_terminal_shows_a_bar_over_the_files(fresh_status, monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self):
            return True

    srcs = _tiny_sources(fresh_status / "cpu", n=4)
    monkeypatch.setattr(_native, "sources", lambda: srcs)
    monkeypatch.delenv("FLASHRL_NATIVE_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", Terminal())
    assert _native.load()
    out = sys.stderr.getvalue()
    assert "flashrl_kernels: compiling" in out and "5/5" in out  # four objects and the link
    assert out.rstrip().splitlines()[-1].endswith(f"compiled in {fk.native_status().build_seconds:.1f} s")


def test_build_progress_can_be_turned_off_and_stays_in_the_log(fresh_status, monkeypatch, capsys, caplog):
    srcs = _tiny_sources(fresh_status / "cpu")
    monkeypatch.setattr(_native, "sources", lambda: srcs)
    monkeypatch.setenv("FLASHRL_NATIVE_PROGRESS", "0")
    with caplog.at_level("INFO", logger="flashrl_kernels.native"):
        assert _native.load()
    assert capsys.readouterr().err == ""
    assert any(r.getMessage().startswith("native CPU kernels compiled in") for r in caplog.records)


def test_a_build_waiting_for_another_processes_says_so(tmp_path):
    lock, told, got = tmp_path / "k.lock", threading.Event(), []

    def second():
        with _native._file_lock(lock, waiting=told.set):
            got.append(told.is_set())

    with _native._file_lock(lock):  # flock: a second open file description conflicts, even in one process
        t = threading.Thread(target=second)
        t.start()
        assert told.wait(10) and got == []
    t.join(10)
    assert got == [True]
    calls = []
    with _native._file_lock(lock, waiting=lambda: calls.append(1)):
        pass
    assert calls == []


_FAKE_CXX = """#!/bin/bash
# compiles nothing: sleeps for the seconds written in the source, then writes the object (or fails on 'fail')
while [ $# -gt 0 ]; do case "$1" in *.cpp) src=$1;; -o) shift; out=$1;; esac; shift; done
what=$(cat "$src")
if [ "$what" = fail ]; then echo "$src: error: the fake compiler failed here"; exit 1; fi
sleep "$what"; : > "$out"
"""


def test_compiles_refill_a_free_core_as_soon_as_any_compiler_finishes(tmp_path, monkeypatch):
    """Two compilers at once: while the slow source compiles, the three fast ones go through the other core
    (waiting for the first-started one to finish, as before, left that core idle)."""
    cxx = tmp_path / "fake-c++"
    cxx.write_text(_FAKE_CXX)
    cxx.chmod(0o755)
    monkeypatch.setattr(_native._cpu, "usable_cpus", lambda: [0, 1])
    srcs = []
    for name, secs in (("slow", "1.5"), ("fast1", "0.05"), ("fast2", "0.05"), ("fast3", "0.05")):
        srcs.append(tmp_path / f"{name}.cpp")
        srcs[-1].write_text(secs)
    objs = [tmp_path / f"{s.stem}.o" for s in srcs]
    done = []
    _native._compile_objects(str(cxx), srcs, objs, [], done=lambda s: done.append(s.stem))
    assert done == ["fast1", "fast2", "fast3", "slow"]
    assert all(o.exists() for o in objs) and not list(tmp_path.glob("*.log"))
    srcs[2].write_text("fail")
    with pytest.raises(RuntimeError, match=r"(?s)compiling fast2\.cpp failed.*the fake compiler failed here"):
        _native._compile_objects(str(cxx), srcs, objs, [])
    assert not list(tmp_path.glob("*.log"))


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
def test_native_backend_implements_every_backend_op():
    """Every op function the torch backend implements has a native kernel, so "auto" on a CPU runs every op
    natively (the suite's default backend on CPU tensors is then the native one, and no op quietly drops to torch;
    this replaced a second full suite run under FLASHRL_BACKEND=native)."""
    import importlib

    torch_ops = set(importlib.import_module("flashrl_kernels.torch_impl").__all__)
    native = importlib.import_module("flashrl_kernels.native")
    assert torch_ops <= set(native.__all__), sorted(torch_ops - set(native.__all__))
    cpu = torch.device("cpu")
    for op in sorted(torch_ops):
        assert callable(getattr(native, op)), op
        if os.environ.get("FLASHRL_BACKEND") in (None, "", "native") and not _backend._override:
            assert _backend.selected_backend(cpu, op) == "native", op


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


# ---- linear_token_logprobs epilogues (csrc/cpu/linear_logprobs.cpp) ----

def _linear_tiles(rows, cols_list, bias_dtype, scale=5.0):
    """Logits tiles of one row block (fp32, as the tile GEMM returns them), their biases, and odd rows:
    row 0 -inf over most of the first tile (a -inf prefix), row 1 -inf everywhere, row 2 growing by tile."""
    tiles, biases = [], []
    for i, cols in enumerate(cols_list):
        z = torch.randn(rows, cols) * scale
        z[0, : (cols * 3) // 4 if i == 0 else 0] = float("-inf")
        z[1] = float("-inf")
        z[2] += 10.0 * i
        tiles.append(z)
        biases.append(torch.randn(cols).to(bias_dtype) if bias_dtype is not None else None)
    return tiles, biases


def _run_fwd_epilogue(epi, tiles, biases, targets, temperature, entropy):
    rows = tiles[0].shape[0]
    m = torch.full((rows,), float("-inf"))
    s, w, zt = torch.zeros(rows), torch.zeros(rows), torch.zeros(rows)
    v0 = 0
    for z, b in zip(tiles, biases):
        epi(z.clone(), b, targets - v0, temperature, entropy, m, s, w, zt)
        v0 += z.shape[1]
    return m, s, w, zt


@needs_native
@pytest.mark.parametrize("bias_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols_list", [[1, 37], [1041, 3001, 16]], ids=["narrow", "chunks-and-tails"])
def test_linear_fwd_epilogue_matches_float64(bias_dtype, cols_list):
    """Several tiles merged into running (m, s, w, zt): odd widths (1, not a multiple of the vector width,
    several 1024-wide chunks), -inf prefixes and an all -inf row, bias in every dtype, T != 1."""
    from flashrl_kernels.native.linear_logprobs import _fwd_epilogue
    from flashrl_kernels.torch_impl.linear_logprobs import _fwd_epilogue_torch

    rows, temperature = 6, 0.7
    tiles, biases = _linear_tiles(rows, cols_list, bias_dtype)
    v = sum(cols_list)
    targets = torch.randint(0, v, (rows,))
    targets[0] = v - 1
    targets[3] = -100  # in no tile: zt keeps its initial 0
    u = torch.cat([z.double() + (b.double() if b is not None else 0.0) for z, b in zip(tiles, biases)], 1) / temperature
    m, s, w, zt = _run_fwd_epilogue(_fwd_epilogue, tiles, biases, targets, temperature, True)
    m_t, s_t, w_t, _ = _run_fwd_epilogue(_fwd_epilogue_torch, tiles, biases, targets, temperature, True)

    # the all -inf row: exactly the torch epilogue's state, no NaN
    assert m[1] == float("-inf") and s[1] == 0 and w[1] == 0
    assert (m_t[1], s_t[1], w_t[1]) == (m[1], s[1], w[1])
    keep = torch.ones(rows, dtype=torch.bool)
    keep[1] = False
    lse = (m.double() + s.double().log())[keep]
    ent = (s.double().log() - w.double() / s.double())[keep]
    ref_lse = torch.logsumexp(u, 1)[keep]
    p = torch.softmax(u[keep], 1)
    ref_ent = -(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)
    tol = 1e-5 + 8 * torch.finfo(torch.float32).eps * float(u[torch.isfinite(u)].abs().max())
    torch.testing.assert_close(lse, ref_lse, atol=tol, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=tol, rtol=0)
    ref_zt = u.gather(1, targets.clamp(min=0)[:, None])[:, 0]
    ref_zt[3] = 0.0
    torch.testing.assert_close(zt.double(), ref_zt, atol=tol, rtol=0)
    # without entropy: same m and s, w untouched
    m2, s2, w2, zt2 = _run_fwd_epilogue(_fwd_epilogue, tiles, biases, targets, temperature, False)
    assert torch.equal(m2, m) and torch.equal(s2, s) and torch.equal(zt2, zt) and (w2 == 0).all()


def _dz_float64(z, bias, targets, temperature, lse, ent, g_lp, g_h):
    u = (z.double() + (bias.double() if bias is not None else 0.0)) / temperature
    logp = u - lse.double()[:, None]
    p = logp.exp()
    onehot = torch.zeros_like(u)
    owned = (targets >= 0) & (targets < z.shape[1])
    onehot[owned, targets[owned]] = 1.0
    dz = g_lp.double()[:, None] * (onehot - p)
    if g_h is not None:
        dz -= g_h.double()[:, None] * p * torch.where(p > 0, logp + ent.double()[:, None], torch.zeros_like(p))
    return dz / temperature


@needs_native
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias_dtype", [None, torch.bfloat16])
@pytest.mark.parametrize("entropy", [True, False])
def test_linear_bwd_epilogue_matches_float64(out_dtype, bias_dtype, entropy):
    """dZ in the operand dtype straight from the kernel (fp32: over z in place), vs float64 from the same
    fp32 tile and statistics; -inf logits give exact zeros, as do rows with no upstream gradient."""
    from flashrl_kernels.native.linear_logprobs import _bwd_epilogue

    rows, cols, temperature = 7, 2077, 1.3  # a ragged tail after whole vector pairs
    z = torch.randn(rows, cols) * 4
    z[0, :1500] = float("-inf")
    bias = torch.randn(cols).to(bias_dtype) if bias_dtype is not None else None
    targets = torch.randint(0, cols, (rows,))
    targets[0] = 1600  # past the -inf prefix
    targets[2] = -5  # the target lives in another tile: no one-hot term here
    targets[4] = cols - 1
    u = (z.double() + (bias.double() if bias is not None else 0.0)) / temperature
    lse = torch.logsumexp(u, 1).float()
    p = torch.softmax(u, 1)
    ent = (-(p * torch.where(p > 0, p.log(), torch.zeros_like(p))).sum(1)).float()
    g_lp = torch.randn(rows)
    g_h = torch.randn(rows) if entropy else None
    g_lp[5] = 0.0  # an ignored row
    if g_h is not None:
        g_h[5] = 0.0
    zz = z.clone()
    dz = _bwd_epilogue(zz, bias, targets, temperature, lse, ent, g_lp, g_h, out_dtype)
    assert dz.dtype == out_dtype and dz.shape == z.shape
    assert (dz.data_ptr() == zz.data_ptr()) == (out_dtype == torch.float32)
    ref = _dz_float64(z, bias, targets, temperature, lse, ent, g_lp, g_h)
    rnd = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}[out_dtype]
    err = (dz.double() - ref).abs()
    bound = rnd * ref.abs() + 1e-5 * float(ref.abs().max())
    assert (err <= bound).all(), f"max excess {float((err - bound).max())}"
    assert (dz[0, :1500] == 0).all() and (dz[5] == 0).all()


@needs_native
def test_linear_epilogues_thread_count_does_not_change_results():
    from flashrl_kernels.native.linear_logprobs import _bwd_epilogue, _fwd_epilogue

    rows, cols = 64, 1500  # enough rows for at::parallel_for to split them
    tiles, biases = _linear_tiles(rows, [cols, 999], torch.bfloat16)
    targets = torch.randint(0, cols + 999, (rows,))
    g_lp, g_h = torch.randn(rows), torch.randn(rows)
    old = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            m, s, w, zt = _run_fwd_epilogue(_fwd_epilogue, tiles, biases, targets, 0.9, True)
            lse, ent = m + s.log(), s.log() - w / s
            lse[1], ent[1] = 0.0, 0.0  # the all -inf row
            dz = _bwd_epilogue(tiles[0].clone(), biases[0], targets, 0.9, lse, ent, g_lp, g_h, torch.bfloat16)
            results.append((m, s, w, zt, dz))
    finally:
        torch.set_num_threads(old)
    for a, b in zip(*results):
        assert torch.equal(a, b)


@needs_native
@pytest.mark.parametrize(
    "change, match",
    [
        ({"z": torch.zeros(3, 5, dtype=torch.float64)}, "z must be float32, bfloat16 or float16"),
        ({"z": torch.zeros(3, 5)[:, ::2]}, "unit stride"),
        ({"bias": torch.zeros(4)}, "bias must be a contiguous 1-D tensor of the tile's 5 columns"),
        ({"bias": torch.zeros(5, dtype=torch.float64)}, "bias must be float32, bfloat16 or float16"),
        ({"target": torch.zeros(3, dtype=torch.int32)}, "target must be int64"),
        ({"m": torch.zeros(4)}, "m must be a contiguous float32 tensor with one entry per row"),
        ({"temperature": 0.0}, "temperature must be finite and positive"),
    ],
)
def test_linear_fwd_epilogue_bad_inputs(change, match):
    args = {
        "z": torch.zeros(3, 5),
        "bias": None,
        "target": torch.zeros(3, dtype=torch.long),
        "temperature": 1.0,
        "return_entropy": True,
        "m": torch.zeros(3),
        "s": torch.zeros(3),
        "w": torch.zeros(3),
        "zt": torch.zeros(3),
    }
    args.update(change)
    with pytest.raises(RuntimeError, match=match):
        torch.ops.flashrl_native.linear_fwd_epilogue(*args.values())


@needs_native
def test_linear_bwd_epilogue_bad_out():
    z, t, r = torch.zeros(3, 5), torch.zeros(3, dtype=torch.long), torch.zeros(3)
    with pytest.raises(RuntimeError, match="out must have the tile's shape"):
        torch.ops.flashrl_native.linear_bwd_epilogue(z, None, t, 1.0, r, r, r, None, torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match="out must be float32, bfloat16 or float16"):
        torch.ops.flashrl_native.linear_bwd_epilogue(
            z, None, t, 1.0, r, r, r, None, torch.zeros(3, 5, dtype=torch.int32)
        )
    with pytest.raises(RuntimeError, match="grad_entropy must be a contiguous float32"):
        torch.ops.flashrl_native.linear_bwd_epilogue(z, None, t, 1.0, r, r, r, torch.zeros(2), torch.zeros(3, 5))


@needs_native
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_linear_epilogues_read_low_precision_tiles(dtype):
    """A bf16 / fp16 logits tile (the GEMM's own output, as linear_policy_loss keeps it) gives the statistics and
    dZ of the same values widened to fp32; dZ is written over the tile itself."""
    rows, cols = 5, 1037  # a tail past the 1024-value chunk
    z = (torch.randn(rows, cols) * 3).to(dtype)
    bias = torch.randn(cols).to(dtype)
    tgt = torch.tensor([0, 7, cols - 1, -1, 1030])
    stats = []
    for tile in (z, z.float()):
        m = torch.full((rows,), float("-inf"))
        s, w, zt = torch.zeros(rows), torch.zeros(rows), torch.zeros(rows)
        torch.ops.flashrl_native.linear_fwd_epilogue(tile, bias, tgt, 0.8, True, m, s, w, zt)
        stats.append((m, s, w, zt))
    for a, b in zip(*stats):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    m, s, w, _ = stats[1]
    lse = m + torch.log(s)
    ent = torch.log(s) - w / s
    g_lp, g_h = torch.randn(rows), torch.randn(rows)
    ref = torch.empty(rows, cols, dtype=dtype)
    torch.ops.flashrl_native.linear_bwd_epilogue(z.float(), bias, tgt, 0.8, lse, ent, g_lp, g_h, ref)
    inplace = z.clone()
    torch.ops.flashrl_native.linear_bwd_epilogue(inplace, bias, tgt, 0.8, lse, ent, g_lp, g_h, inplace)
    torch.testing.assert_close(inplace, ref, rtol=0, atol=0)
    with pytest.raises(RuntimeError, match="needs out of the same dtype"):
        torch.ops.flashrl_native.linear_bwd_epilogue(z, bias, tgt, 0.8, lse, ent, g_lp, g_h, torch.empty(rows, cols))


@needs_native
def test_linear_side_by_side_bench_script_runs_at_tiny_size(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("native_linear_bench", ROOT / "bench" / "native_linear_logprobs.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    epi, results = bench.main(["--rows", "8", "--hidden", "16", "--vocab", "301", "--repeats", "2", "--tile", "32x64"])
    assert set(results) == {"fwd", "fwd+bwd"} and all(set(r) == {"torch", "native"} for r in results.values())
    assert all(ms > 0 for r in results.values() for ms in r.values())
    assert {"fwd epilogue torch", "fwd epilogue native", "bwd epilogue torch", "bwd epilogue native"} <= set(epi)
    assert "torch/native" in capsys.readouterr().out
