"""The Triton kernels compiled (not run) for GPUs that are not here: sm_90 and gfx942, no compile
failure and no spill at the specializations the launch wrappers pick (flashrl_kernels/gpu_audit.py;
docs/gpu.md). Plus the pieces of the audit and of the fixes it led to that can be checked on a CPU."""
import dataclasses
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the GPU audit compiles Triton kernels")

EXPECTED_KERNELS = {
    "quantize_rows", "token_logprobs_fwd", "token_logprobs_bwd", "linear_logprobs_fwd_tile",
    "linear_logprobs_bwd_tile", "policy_loss_fwd", "policy_loss_bwd", "value_loss_fwd", "value_loss_bwd",
    "gae_fwd", "gae_whiten", "w8_linear", "w8_epilogue", "policy_finalize", "value_finalize",
}


@pytest.fixture(scope="module")
def quick_rows():
    from flashrl_kernels import gpu_audit

    # runs in a subprocess without TRITON_INTERPRET when this process's kernels are interpreted
    return gpu_audit.run_audit(["90", "gfx942"], quick=True)


def test_every_kernel_compiles_for_sm90_and_gfx942_without_spills(quick_rows):
    from flashrl_kernels import gpu_audit

    assert {r.kernel for r in quick_rows} == EXPECTED_KERNELS
    assert {r.arch for r in quick_rows} == {"90", "gfx942"}
    bad = gpu_audit.failures(quick_rows)
    assert not bad, gpu_audit.format_table(bad, detail=True)
    for r in quick_rows:
        assert r.registers > 0 and r.occupancy_warps > 0, r
        assert r.shared <= r.shared_limit, r


def test_fp8_quantizer_compiles_for_sm80_and_sm86():
    # the e4m3fn bytes are assembled in integer arithmetic: no fp8 type reaches the compiler, so sm_80 /
    # sm_86 (no e4m3 conversion) and MI300 (e4m3fnuz hardware) compile it too
    from flashrl_kernels import gpu_audit

    rows = gpu_audit.run_audit(["80", "86"], quick=True, only="float8", jobs=2)
    assert {r.arch for r in rows} == {"80", "86"} and all("float8" in r.spec for r in rows)
    assert all(r.ok and not r.spill_bytes for r in rows), gpu_audit.format_table(rows, detail=True)
    # one process per target (jobs=2) gives the rows, in the order, that one process for both gives
    def same(r):  # all but the compile time
        return dataclasses.replace(r, seconds=0.0)

    assert [same(r) for r in rows] == [same(r) for r in gpu_audit.run_audit(["80", "86"], quick=True, only="float8",
                                                                            jobs=1)]


def test_only_that_matches_nothing_fails(capsys):
    """`gpu-audit --only no_such_kernel` printed an empty table and '0 compiled specializations, 0 with problems'
    with exit 0: a misspelt filter passed as a clean audit."""
    from flashrl_kernels import cli

    assert cli.main(["gpu-audit", "--arch", "90", "--quick", "--only", "no_such_kernel"]) == 2
    assert "no specialization matches --only 'no_such_kernel' for --arch 90" in capsys.readouterr().err


def test_table_and_json_name_every_row(quick_rows):
    from flashrl_kernels import gpu_audit

    table = gpu_audit.format_table(quick_rows)
    for kernel in EXPECTED_KERNELS:
        assert kernel in table
    data = gpu_audit.rows_to_json(quick_rows)
    assert data["failures"] == 0 and len(data["rows"]) == len(quick_rows)


def test_occupancy_estimate():
    from flashrl_kernels.gpu_audit import ARCHS, occupancy_warps

    h100 = ARCHS["90"]
    assert occupancy_warps(h100, 32, 0, 4) == 64          # register file fits the 64-warp maximum
    assert occupancy_warps(h100, 128, 0, 8) == 16         # 128 regs * 32 lanes = 4096 per warp: 16 warps
    assert occupancy_warps(h100, 40, 200 * 1024, 4) == 4  # one block's shared memory fills the SM
    mi300 = ARCHS["gfx942"]
    assert occupancy_warps(mi300, 64, 0, 4) == 32         # 8 waves per SIMD, 4 SIMDs
    assert occupancy_warps(mi300, 256, 0, 4) == 8         # 2 waves per SIMD


def test_parse_archs():
    from flashrl_kernels.gpu_audit import parse_archs

    assert parse_archs("80, sm_90,gfx942") == ["80", "90", "gfx942"]
    with pytest.raises(ValueError, match="unknown arch 75"):
        parse_archs("75")


def test_recorder_captures_the_wrapper_launch_without_running_it():
    from flashrl_kernels import gpu_audit

    spec = next(s for s in gpu_audit._token_logprobs_specs(quick=True) if s.kernel == "token_logprobs_fwd")
    launch = spec.build()
    assert launch.kernel_name == "_token_logprobs_fwd_kernel"
    assert launch.kwargs["BLOCK_V"] == 4096 and launch.kwargs["num_warps"] == 8


def _triton_interpreted():
    from flashrl_kernels import _backend

    return _backend.triton_interpret() or torch.cuda.is_available()


@pytest.mark.skipif(not _triton_interpreted(), reason="needs CUDA or TRITON_INTERPRET=1 for the triton backend")
def test_e4m3fn_bytes_match_torch_for_every_finite_value():
    # every finite e4m3fn value (subnormals, +-0, +-448) quantized with scale 1 must come back as the same byte
    import flashrl_kernels as fk
    from flashrl_kernels._backend import use_backend

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    values = values[torch.isfinite(values)].to(dev)
    assert values.abs().max() == 448
    with use_backend("triton"):
        q, s = fk.quantize_rows(values.reshape(1, -1), torch.float8_e4m3fn)
    assert s.item() == 1.0
    assert torch.equal(q.view(torch.uint8).reshape(-1), values.to(torch.float8_e4m3fn).view(torch.uint8))


STREAMING_ROW_KERNELS = {"token_logprobs_fwd", "token_logprobs_bwd", "linear_logprobs_fwd_tile",
                         "linear_logprobs_bwd_tile", "policy_loss_fwd", "policy_loss_bwd", "value_loss_fwd",
                         "value_loss_bwd", "gae_fwd", "gae_whiten"}


def _elements_per_thread(row, arch):
    import re

    m = re.search(r"\bBLOCK(?:_V)?=(\d+)", row.constexprs)
    return int(m.group(1)) // (row.num_warps * arch.warp_size) if m else 0


def test_streaming_loops_use_vector_loads(quick_rows):
    # the streaming loops load 64 or 128 bits per thread wherever the tile gives a thread 2+ elements, also for
    # rows of 32003 elements, sequences at runtime cu_seqlens offsets and N not a multiple of 16 (before the
    # aligned loops none of policy_loss / value_loss / gae and no 32003-wide row did; docs/gpu.md)
    from flashrl_kernels.gpu_audit import ARCHS

    checked = 0
    for r in quick_rows:
        per_thread = _elements_per_thread(r, ARCHS[r.arch])
        if r.kernel not in STREAMING_ROW_KERNELS or per_thread < 2:
            continue
        checked += 1
        if r.arch == "gfx942":  # (scalar cu_seqlens loads are s_load there: every global_load_dwordx2/x4 counts)
            assert r.global_loads_128 + r.global_loads_64 > 0, (r.arch, r.kernel, r.spec, r.constexprs)
        elif per_thread >= 8:  # 16+ bytes per thread even in bf16
            assert r.global_loads_128 > 0, (r.arch, r.kernel, r.spec, r.constexprs)
        else:  # more 64/128-bit loads than the two int64 cu_seqlens loads (LDG.E.64 as well)
            assert r.global_loads_128 + r.global_loads_64 > 2, (r.arch, r.kernel, r.spec, r.constexprs)
    assert checked >= 40
    v32003 = [r for r in quick_rows if r.kernel == "token_logprobs_fwd" and "V=32003" in r.spec and r.arch == "90"]
    assert v32003 and all(r.global_loads_128 >= 2 for r in v32003)


def test_load_width_parsing():
    from flashrl_kernels.gpu_audit import _width

    assert _width("LDG.E.128") == 128
    assert _width("LDG.E.128.CONSTANT") == 128
    assert _width("LDGSTS.E.BYPASS.LTC128B.128") == 128  # cp.async of 16 bytes
    assert _width("LDGSTS.E.LTC128B") == 32  # an L2 hint, not the width
    assert _width("LDG.E.64") == 64
    assert _width("LDG.E.U16") == 32 and _width("LDG.E") == 32


def test_hip_launches_drop_cuda_only_options():
    from flashrl_kernels import gpu_audit

    launch = gpu_audit.Launch("k", None, (), {"num_warps": 8, "maxnreg": 128})
    assert gpu_audit.for_backend(launch, gpu_audit.ARCHS["gfx942"]).kwargs == {"num_warps": 8}
    assert gpu_audit.for_backend(launch, gpu_audit.ARCHS["80"]).kwargs["maxnreg"] == 128


def test_policy_forward_register_cap_only_on_cuda():
    from flashrl_kernels.triton_impl.policy_loss import register_cap

    assert register_cap(torch.device("cpu")) == {}


def test_roofline_arithmetic():
    from flashrl_kernels.gpu_audit import ROOFLINE_GPUS, Work, roofline_work

    h100 = next(g for g in ROOFLINE_GPUS if g.name.startswith("H100"))
    tok = next(w for w in roofline_work() if w.op == "token_logprobs fwd (+entropy)")
    assert tok.stream_bytes == 16384 * 151936 * 2 + 16384 * 20
    assert abs(tok.seconds(h100) - tok.stream_bytes / (0.9 * 3350e9)) < 1e-12
    gemm = Work("x", "", 0.0, gemm_flops=2 * 4096**3, gemm_bytes=1.0, math="int8")
    assert abs(gemm.seconds(h100) - 2 * 4096**3 / (0.75 * 1979e12)) < 1e-12
    a100 = ROOFLINE_GPUS[0]
    fp8 = Work("x", "", 0.0, gemm_flops=1e12, math="fp8")
    assert fp8.seconds(a100) == Work("x", "", 0.0, gemm_flops=1e12, math="bf16").seconds(a100)  # no FP8 cores


def test_docs_tables_are_generated_from_the_code():
    # docs/gpu.md carries the per-GPU scaled_linear table and the roofline exactly as the code produces them
    import pathlib

    from flashrl_kernels.gpu_audit import roofline_markdown
    from flashrl_kernels.triton_impl.qlinear import selection_markdown

    doc = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "gpu.md").read_text()
    assert selection_markdown() in doc
    assert roofline_markdown() in doc
