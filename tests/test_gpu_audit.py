"""The Triton kernels compiled (not run) for GPUs that are not here: sm_90 and gfx942, no compile
failure and no spill at the specializations the launch wrappers pick (flashrl_kernels/gpu_audit.py;
docs/gpu.md). Plus the pieces of the audit and of the fixes it led to that can be checked on a CPU."""
import importlib.util

import pytest
import torch

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed: the GPU audit compiles Triton kernels")

EXPECTED_KERNELS = {
    "quantize_rows", "token_logprobs_fwd", "token_logprobs_bwd", "linear_logprobs_fwd_tile",
    "linear_logprobs_bwd_tile", "policy_loss_fwd", "policy_loss_bwd", "value_loss_fwd", "value_loss_bwd",
    "gae_fwd", "gae_whiten",
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

    rows = gpu_audit.run_audit(["80", "86"], quick=True, only="float8")
    assert {r.arch for r in rows} == {"80", "86"} and all("float8" in r.spec for r in rows)
    assert all(r.ok and not r.spill_bytes for r in rows), gpu_audit.format_table(rows, detail=True)


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
