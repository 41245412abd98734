"""The AVX2 and portable (DEFAULT) builds of the native library, against the float64 spec.

This machine's torch may dispatch to AVX-512, so the other code paths of every native kernel
(policy_loss, token_logprobs, quantize_rows) would otherwise never run here: each test builds the
library for another ATEN_CPU_CAPABILITY into a fresh cache and checks it in a subprocess (the portable build
also checks the build cache: compiled once, then loaded)."""
import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

from flashrl_kernels import _backend


def _has_avx2():
    try:
        with open("/proc/cpuinfo") as f:
            return " avx2" in f.read()
    except OSError:
        return torch.backends.cpu.get_cpu_capability() != "DEFAULT"


_CAPABILITY_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, {tests!r})
    import flashrl_kernels as fk
    from flashrl_kernels import _native
    from flashrl_kernels.reference import token_logprobs_spec
    from flashrl_kernels.reference.quantize import quantize_rows_spec
    from _policy_loss_util import make_inputs, run, spec, assert_close_masked
    st = _native.native_status(load=True)
    assert st.loaded, st.reason
    out = {{"capability": st.capability, "cached": st.cached, "build_seconds": st.build_seconds,
            "library": str(st.library)}}
    torch.manual_seed(0)
    inp = make_inputs(b=7, t=600)
    for cfg in (fk.LossConfig(tis_mode="token_truncate", beta=0.04, entropy_coef=0.01),
                fk.LossConfig(importance_sampling_level="sequence", tis_mode="sequence_truncate",
                              loss_agg_mode="seq-mean-token-mean")):
        loss, metrics, gl, ge = run(inp, cfg, "native")
        e_loss, e_metrics, e_gl, e_ge = spec(inp, cfg)
        torch.testing.assert_close(loss.double(), e_loss, atol=2e-5, rtol=2e-5)
        assert_close_masked(gl, e_gl, inp["mask"], atol=2e-6)
    logits = torch.randn(6, 3001) * 4
    targets = torch.randint(0, 3001, (6,))
    with fk.use_backend("native"):
        lp, ent = fk.token_logprobs(logits, targets, return_entropy=True)
    rlp, rent = token_logprobs_spec(logits.double(), targets, 1.0, None)
    torch.testing.assert_close(lp.double(), rlp, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent.double(), rent, atol=1e-5, rtol=0)
    from test_native_quantize import _fp8_midpoints
    ties8 = torch.cat([torch.tensor([127.0]), torch.arange(-127, 127) + 0.5])  # scale 1: every int8 tie
    ties_fp8 = torch.cat([torch.tensor([448.0]), _fp8_midpoints()])  # scale 1: every e4m3fn tie
    for qd, w in ((torch.int8, torch.randn(5, 1000).bfloat16()), (torch.float8_e4m3fn, torch.randn(5, 1000)),
                  (torch.int8, ties8[None]), (torch.float8_e4m3fn, ties_fp8[None])):
        with fk.use_backend("native"):
            q, s = fk.quantize_rows(w, qd)
        rq, rs = quantize_rows_spec(w, qd)
        assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8)), qd
    from flashrl_kernels.reference.quantize import scaled_linear_spec
    for qd in (torch.int8, torch.float8_e4m3fn):  # the quantized linear's kernels of this build, called directly
        for xd, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
            w = torch.randn(7, 37)
            q, s = fk.quantize_rows(w, qd)
            x = torch.randn(6, 37).to(xd)
            b = torch.randn(7)
            y = torch.ops.flashrl_native.qlinear(x, q, s, b, False)
            ref = scaled_linear_spec(x, q, s, b, False)
            assert (y.double() - ref).abs().max() <= tol * ref.abs().max(), (qd, xd)
    w, x, b = torch.randn(9, 37).bfloat16(), torch.randn(5, 37).bfloat16(), torch.randn(9)
    if torch.ops.flashrl_native.qlinear_caps()[2]:  # the plain bf16 head kernel: fp32 FMAs on AVX2
        ref = x.double() @ w.double().T + b.double()
        y = torch.ops.flashrl_native.bf16_linear(x, w, b)
        assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
    else:
        try:
            torch.ops.flashrl_native.bf16_linear(x, w, b)
            raise AssertionError("bf16_linear ran on a portable build")
        except RuntimeError as e:
            assert "AVX2 or AVX-512" in str(e)
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, quantize_rows_packed_, unpack_rows
    packed = packed_w8a8_capabilities()
    out["packed_kernel"] = packed["kernel"]
    if packed["available"]:  # the packed W8A8 linear of this build (AVX2: vpmaddwd, or AVX-VNNI where the CPU has it)
        n, k = 3 * packed["pack_rows"], 100
        q = torch.empty(n, k, dtype=torch.int8); s = torch.empty(n); c = torch.empty(n, dtype=torch.int32)
        quantize_rows_packed_(torch.randn(n, k), q, s, c, 0)
        for m in (1, 3, 6, 37):
            x, b = torch.randn(m, k).bfloat16(), torch.randn(n)
            y = torch.ops.flashrl_native.qlinear_packed(x, q, s, c, b)
            assert torch.equal(y, torch.ops.flashrl_native.qlinear(x, unpack_rows(q), s, b, True)), m
            ref = scaled_linear_spec(x, unpack_rows(q), s, b, True)
            assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max(), m
    print(json.dumps(out))
""")


_LOAD_SCRIPT = (
    "import json, torch, flashrl_kernels as fk; st = fk.native_status(load=True); assert st.loaded, st.reason; "
    "lp = fk.token_logprobs(torch.tensor([[0.0, 1.0]]), torch.tensor([1])); "
    "print(json.dumps({'cached': st.cached, 'library': str(st.library), 'lp': float(lp[0])}))"
)


def _run_script(script, env):
    r = subprocess.run([sys.executable, "-c", script], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("capability", ["avx2", "default"])
def test_other_cpu_capability_builds_vs_spec(capability, tmp_path):
    """The AVX2 and portable code paths (this machine may run AVX-512 by default) are built and checked too.

    The portable build goes into a fresh cache: the first process compiles it, a second one loads it from the cache
    (the build cache's own test, folded in here to compile the library once, not twice). The AVX2 build on a CPU whose
    native build is AVX2 is the library the suite already built: it is loaded from the suite's cache and checked,
    not compiled a second time (~1 min on a 2-core machine)."""
    if not _backend.native_built():
        pytest.skip("native CPU kernels not built here")
    if capability == "avx2" and (platform.machine() not in ("x86_64", "AMD64") or not _has_avx2()):
        pytest.skip("this CPU has no AVX2")
    from flashrl_kernels import _native

    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    env.pop("FLASHRL_BACKEND", None)
    reuse = capability == "avx2" and _native.native_status().capability == "AVX2"
    if not reuse:
        env["FLASHRL_CACHE_DIR"] = str(tmp_path)
    out = _run_script(_CAPABILITY_SCRIPT.format(tests=os.path.dirname(__file__)), env)
    assert out["capability"] == {"avx2": "AVX2", "default": "DEFAULT"}[capability]
    from flashrl_kernels._cpu import cpu_flags

    avx_vnni = "avx_vnni" in cpu_flags() and "avxvnni" not in os.environ.get("FLASHRL_NATIVE_CPU_DISABLE", "")
    assert out["packed_kernel"] == {"avx2": "avx_vnni" if avx_vnni else "avx2", "default": None}[capability], out
    if reuse:
        assert out["cached"] and out["library"] == str(_native.native_status().library), out
        return
    assert out["cached"] is False and out["build_seconds"] > 0 and out["library"].startswith(str(tmp_path)), out
    again = _run_script(_LOAD_SCRIPT, env)
    assert again["cached"] is True and again["library"] == out["library"], again
    assert abs(again["lp"] - (-0.31326168751822286)) < 1e-6


def _disassembly(obj):
    r = subprocess.run(["objdump", "-d", str(obj)], check=True, capture_output=True, text=True, timeout=300)
    return r.stdout


def test_avx512_and_amx_kernels_compile_on_a_cpu_without_them(tmp_path):
    """Every machine builds only its own capability, so a change made on an AVX2 machine could break the AVX-512
    VNNI / BF16 and AMX kernels unseen until a user of such a CPU fails to build (and falls back to torch). Here the
    AVX-512 build is compiled (not run) and its objects must hold those kernels' instructions."""
    from flashrl_kernels import _native

    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX-512 build is x86-64 only")
    if _native._compiler() is None:
        pytest.skip("no C++ compiler here")
    if _native.native_status(load=True).capability == "AVX512":
        pytest.skip("this machine's own build is the AVX-512 one: the suite built and ran it")
    _native.compile_check("AVX512", tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.o")) == sorted(f"{s.stem}.o" for s in _native.sources())
    if shutil.which("objdump") is None:
        return
    packed, rows = _disassembly(tmp_path / "qlinear_packed.o"), _disassembly(tmp_path / "qlinear.o")
    assert "vpdpbusd" in packed and "tdpbusd" in packed  # AVX-512 VNNI tiles, AMX-INT8 tiles
    assert "vdpbf16ps" in rows and "tdpbf16ps" in rows  # AVX-512 BF16 tiles, AMX-BF16 tiles


def test_compile_check_reports_the_compilers_error(tmp_path, monkeypatch):
    from flashrl_kernels import _native

    if _native._compiler() is None:
        pytest.skip("no C++ compiler here")
    bad = tmp_path / "broken_kernel.cpp"
    bad.write_text("int f() { return undeclared_name; }\n")
    monkeypatch.setattr(_native, "sources", lambda: [bad])
    with pytest.raises(RuntimeError, match=r"(?s)compiling broken_kernel\.cpp failed.*undeclared_name"):
        _native.compile_check("DEFAULT", tmp_path)
