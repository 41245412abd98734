"""The quantized linear on a GPU (flashrl_kernels/triton_impl/qlinear.py): which kernel runs where, and the Triton
kernels it can pick, against the float64 spec in Triton's interpreter.

None of this ran on a GPU (docs/gpu.md). The selection is a pure function of (compute capability / ROCm, weight
dtype, M, shapes, what vLLM exposes), tested here as a table. The kernels run under TRITON_INTERPRET=1 at small
sizes with their dots in fp32 (the interpreter multiplies bf16 tiles as raw integers), so what is checked is the
code widening, the masks, split-K and the fused epilogues; the vLLM call is checked against vLLM's documented
contract with a stand-in, and torch._int_mm (+ our epilogue) runs on the CPU.
"""
import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels.reference.quantize import dequantize_rows_spec, scaled_linear_spec

pytestmark = pytest.mark.skipif(
    "triton" not in available_backends(DEVICE, op="scaled_linear_forward"),
    reason="needs CUDA or TRITON_INTERPRET=1 for the triton backend")

I8, FP8 = torch.int8, torch.float8_e4m3fn
A100, A6000, L40, H100, B200 = (8, 0), (8, 6), (8, 9), (9, 0), (10, 0)


def ql():
    from flashrl_kernels.triton_impl import qlinear

    return qlinear


# ---- selection: a table ----

def _select(cap, qdtype, m, aq, *, hip=False, vllm=None, torch_ok=True, n=4096, k=4096, out=torch.bfloat16):
    q = ql()
    return q.select_scaled_linear(cap, hip, qdtype, m, n, k, aq, out, vllm or q.VllmScaledMM(), torch_ok).kernel


def test_selection_without_vllm():
    q = ql()
    for cap in (A100, A6000, L40, H100, B200):
        for dt in (I8, FP8):
            for m in (1, 16, 4096):
                assert _select(cap, dt, m, False) == q.TRITON_W8A16  # weight-only: never a dequantized copy
    # W8A8 INT8: Triton up to SMALL_M rows (no padding to 32), cuBLASLt + one fused epilogue pass above, except
    # on sm_90, where the Triton kernel was measured faster at every M (H200, docs/gpu.md)
    for cap in (A100, A6000, L40, H100, B200):
        assert _select(cap, I8, 1, True) == q.TRITON_W8A8_INT8
        assert _select(cap, I8, q.SMALL_M, True) == q.TRITON_W8A8_INT8
        big = q.TRITON_W8A8_INT8 if cap == H100 else q.TORCH_INT_MM
        assert _select(cap, I8, q.SMALL_M + 1, True) == big
        assert _select(cap, I8, 4096, True) == big
        assert _select(cap, I8, 4096, True, torch_ok=False) == q.TRITON_W8A8_INT8
    assert _select(A100, I8, 4096, True, n=4100) == q.TRITON_W8A8_INT8  # N not a multiple of 8: no _int_mm
    # W8A8 FP8: FP8 tensor cores from sm_89 (torch._scaled_mm when it runs here), codes widened below
    for cap in (L40, H100, B200):
        assert _select(cap, FP8, 1, True) == q.TORCH_SCALED_MM
        assert _select(cap, FP8, 4096, True, torch_ok=False) == q.TRITON_W8A8_FP8_WIDEN
    for cap in (A100, A6000):
        assert _select(cap, FP8, 1, True) == q.TRITON_W8A8_FP8_WIDEN
        assert _select(cap, FP8, 4096, True) == q.TRITON_W8A8_FP8_WIDEN
    assert _select(H100, FP8, 1, True, n=4104) == q.TRITON_W8A8_FP8_WIDEN  # N % 16: no scaled-mm


def test_selection_prefers_vllm_where_it_has_kernels():
    q = ql()
    both = q.VllmScaledMM(cutlass=True, cutlass_fp8=True)
    int8_only = q.VllmScaledMM(cutlass=True, cutlass_fp8=False)
    for cap in (A100, A6000, L40, H100):
        for m in (1, 64, 4096):
            assert _select(cap, I8, m, True, vllm=int8_only) == q.VLLM_CUTLASS
    # vLLM's CUTLASS INT8 has no kernel for compute capability >= 10.0: ours / cuBLASLt there
    assert _select(B200, I8, 1, True, vllm=both) == q.TRITON_W8A8_INT8
    assert _select(B200, I8, 4096, True, vllm=both) == q.TORCH_INT_MM
    # FP8: only where vLLM's FP8 path supports the GPU (sm_89+)
    for cap in (L40, H100, B200):
        assert _select(cap, FP8, 1, True, vllm=both) == q.VLLM_CUTLASS
        assert _select(cap, FP8, 1, True, vllm=int8_only) == q.TORCH_SCALED_MM
    for cap in (A100, A6000):
        assert _select(cap, FP8, 1, True, vllm=both) == q.TRITON_W8A8_FP8_WIDEN
    # vLLM's kernel needs N, K multiples of 16 and a bf16 / fp16 output
    assert _select(A100, I8, 4096, True, vllm=both, k=4104) == q.TORCH_INT_MM  # K % 16 = 8
    assert _select(A100, I8, 1, True, vllm=both, out=torch.float32) == q.TRITON_W8A8_INT8
    # weight-only never goes to vLLM (Marlin would need its own weight layout; see the module docstring)
    assert _select(A100, FP8, 1, False, vllm=both) == q.TRITON_W8A16


def test_selection_on_rocm():
    q = ql()
    both = q.VllmScaledMM(cutlass=True, cutlass_fp8=True)  # ignored on ROCm
    assert _select(None, I8, 1, True, hip=True, vllm=both) == q.TRITON_W8A8_INT8
    assert _select(None, I8, 4096, True, hip=True, vllm=both) == q.TORCH_INT_MM
    # MI300's fp8 is e4m3fnuz; our stored codes are e4m3fn: widened in registers, never hardware fp8
    assert _select(None, FP8, 1, True, hip=True, vllm=both) == q.TRITON_W8A8_FP8_WIDEN
    assert _select(None, FP8, 4096, False, hip=True) == q.TRITON_W8A16
    assert q.fp8_decode_mode(None, True) == 1
    assert q.fp8_decode_mode(A100, False) == 1 and q.fp8_decode_mode(A6000, False) == 1
    assert q.fp8_decode_mode(L40, False) == 3 and q.fp8_decode_mode(B200, False) == 3


def test_selection_rejects_other_dtypes():
    with pytest.raises(ValueError, match="qdtype must be"):
        _select(A100, torch.bfloat16, 1, True)


def test_every_choice_has_a_reason():
    q = ql()
    for cap, hip in ((A100, False), (L40, False), (B200, False), (None, True)):
        for dt in (I8, FP8):
            for aq in (False, True):
                c = q.select_scaled_linear(cap, hip, dt, 8, 4096, 4096, aq)
                assert c.kernel in (q.VLLM_CUTLASS, q.TORCH_SCALED_MM, q.TORCH_INT_MM, q.TRITON_W8A8_INT8,
                                    q.TRITON_W8A8_FP8_WIDEN, q.TRITON_W8A16)
                assert len(c.reason) > 10


# ---- tile plans ----

@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (1, 896, 896), (8, 18944, 4096), (64, 4096, 18944),
                                   (65, 4096, 4096), (4096, 4096, 4096), (3, 896, 1000)])
@pytest.mark.parametrize("sms", [108, 132])
def test_plan_tiles(m, n, k, sms):
    p = ql().plan_tiles(m, n, k, sms)
    assert p.k_split % p.block_k == 0 and p.split_k * p.k_split >= k > (p.split_k - 1) * p.k_split
    assert p.block_m >= min(m, 16) and (p.block_m == 128) == (m > ql().SMALL_M)
    tiles = -(-m // p.block_m) * -(-n // p.block_n)
    if m <= ql().SMALL_M and tiles < sms and k >= 8 * p.block_k:
        assert p.split_k > 1  # decode: K split so that the grid covers the SMs
    assert p.split_k <= 8 and p.num_stages == 3
    assert ql().plan_tiles(m, n, k, sms, x_bytes=4).num_stages == 2
    assert ql().plan_tiles(m, n, k, sms, is_hip=True).num_stages == 2


@pytest.mark.parametrize("m", [65, 128, 256, 512])
def test_medium_m_plan_splits_k_to_fill_the_gpu(m):
    # M = 128 ... 512 used to run 128 x 128 tiles unsplit: 64 programs on 132 SMs (W8A16 2-3.3x slower on an H200)
    p = ql().plan_tiles(m, 4096, 4096, 132)
    programs = -(-m // p.block_m) * -(-4096 // p.block_n) * p.split_k
    assert programs >= 132 and p.split_k > 1


def test_sm90_int8_tiles():
    q = ql()
    p = q.plan_tiles(256, 4096, 4096, 132, int8_dot=True, capability=(9, 0))
    assert (p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages) == (64, 128, 128, 4, 3)
    p = q.plan_tiles(4096, 4096, 4096, 132, int8_dot=True, capability=(9, 0))
    assert (p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages, p.split_k) == (128, 128, 64, 4, 4, 1)
    # elsewhere (not measured) the generic tiles stay
    p = q.plan_tiles(4096, 4096, 4096, 108, int8_dot=True, capability=(8, 0))
    assert (p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages) == (128, 128, 64, 8, 3)
    assert q.plan_tiles(16, 4096, 4096, 132, int8_dot=True, capability=(9, 0)) == q.plan_tiles(16, 4096, 4096, 132)


def test_sm90_weight_only_plans_compute_the_tile_transposed():
    q = ql()
    for m in (256, 512, 4096):
        p = q.plan_tiles(m, 4096, 4096, 132, capability=(9, 0), weight_only=True)
        assert p.swap_ab and (p.block_m, p.block_n, p.block_k, p.num_warps, p.num_stages) == (256, 128, 64, 8, 3)
        programs = -(-m // p.block_m) * -(-4096 // p.block_n) * p.split_k
        assert programs <= 132 or p.split_k == 1  # near one wide program per SM (measured best)
    # below M = 256 (decode and small batches) the plain tiles were faster: unchanged
    for m in (1, 16, 64, 128):
        assert q.plan_tiles(m, 4096, 4096, 132, capability=(9, 0), weight_only=True) == q.plan_tiles(m, 4096, 4096, 132)
    # elsewhere (wgmma is sm_90's) and for W8A8 / fp32 activations nothing changes
    for cap in ((8, 0), (8, 9), (10, 0)):
        assert not q.plan_tiles(4096, 4096, 4096, 132, capability=cap, weight_only=True).swap_ab
    assert not q.plan_tiles(4096, 4096, 4096, 132, int8_dot=True, capability=(9, 0)).swap_ab
    assert not q.plan_tiles(4096, 4096, 4096, 132, x_bytes=4, capability=(9, 0), weight_only=True).swap_ab


def test_decode_split_never_leaves_the_weight_unsplit_when_tiles_fall_short():
    # 172 column tiles (N = 11008) on 132 SMs: split in 2 (measured 15 % faster than unsplit on an H200); 64 tiles
    # keep the floor of 264 / 64 = 4 (the sweep's best there)
    assert ql().plan_tiles(1, 11008, 4096, 132).split_k == 2
    assert ql().plan_tiles(1, 4096, 4096, 132).split_k == 4


def test_decode_plan_fills_an_h100():
    p = ql().plan_tiles(1, 4096, 4096, 132)
    assert (p.block_m, p.block_n, p.block_k) == (16, 64, 128)
    assert 64 * p.split_k >= 2 * 132 - 64  # 64 column tiles x split ~ two programs per SM


# ---- the kernels in the interpreter, against the spec ----

def _weights(n, k, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 0, n).unsqueeze(1)
    return fk.quantize_rows(w.to(DEVICE), dtype)


def _check(y, x, q, s, bias, aq, tol=None):
    """y against the float64 spec, relative to the size of the terms: fp32 accumulation order only (fp32 out), one
    output rounding (bf16 / fp16 out; the interpreter truncates instead of rounding: 2^-7)."""
    ref = scaled_linear_spec(x, q, s, bias, aq)
    mag = x.double().abs() @ dequantize_rows_spec(q, s).abs().T + (bias.double().abs() if bias is not None else 0)
    tol = tol if tol is not None else (1e-5 if y.dtype == torch.float32 else 2.0**-7)
    err = (y.double() - ref).abs()
    assert (err <= tol * mag + 1e-6).all(), float((err / mag).max())


PLANS = {  # (block_m, block_n, block_k, split_k, k_split, warps, stages[, swap_ab]) for K = 300: split / not, even
    # K / not, the tile computed transposed or not
    "split3": (16, 64, 32, 3, 128, 4, 1),
    "split2-evenK": (16, 32, 32, 2, 160, 4, 1),
    "one": (32, 32, 64, 1, 320, 4, 1),
    "swap-split3": (16, 64, 32, 3, 128, 4, 1, True),
    "swap-split2-evenK": (16, 32, 32, 2, 160, 4, 1, True),
    "swap-one": (32, 32, 64, 1, 320, 4, 1, True),
}


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
# int8 codes widen one way; fp8 by integer arithmetic (sm_80/86, ROCm) or by the hardware conversion (sm_89+)
@pytest.mark.parametrize("qdtype,decode", [(I8, 0), (FP8, 1), (FP8, 2)], ids=["int8", "fp8-int-decode", "fp8-hw-cvt"])
def test_w8a16_kernel(plan, qdtype, xdtype, decode):
    q_ = ql()
    k = 320 if plan.endswith("split2-evenK") else 300
    q, s = _weights(40, k, qdtype)
    x = torch.randn(7, k, device=DEVICE).to(xdtype)
    bias = torch.randn(40, device=DEVICE).to(xdtype)
    p = q_.TilePlan(*PLANS[plan])
    y = q_.w8_linear(x, None, q, s, bias, xdtype, 0, decode, p)
    assert y.shape == (7, 40) and y.dtype == xdtype
    _check(y, x, q, s, bias, False)


@pytest.mark.parametrize("plan", list(PLANS))
@pytest.mark.parametrize("qdtype", [I8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("bias", [False, True])
def test_w8a8_kernels(plan, qdtype, bias):
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    q_ = ql()
    k = 320 if plan.endswith("split2-evenK") else 300
    q, s = _weights(40, k, qdtype, seed=1)
    x = torch.randn(19, k, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(40, device=DEVICE).to(torch.bfloat16) if bias else None
    xq, xs = quantize_rows(x, qdtype)
    x_codes = 1 if qdtype == I8 else 2
    y = q_.w8_linear(xq, xs, q, s, b, torch.bfloat16, x_codes, 0 if qdtype == I8 else 1, q_.TilePlan(*PLANS[plan]))
    _check(y, x, q, s, b, True)


def test_int8_split_partials_are_summed_exactly():
    # int32 partials stay integers until the epilogue: the result equals the unsplit kernel's bit for bit
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    q_ = ql()
    q, s = _weights(32, 512, I8, seed=2)
    xq, xs = quantize_rows(torch.randn(5, 512, device=DEVICE) * 50, I8)
    y1 = q_.w8_linear(xq, xs, q, s, None, torch.float32, 1, 0, q_.TilePlan(16, 32, 64, 1, 512, 4, 1))
    y4 = q_.w8_linear(xq, xs, q, s, None, torch.float32, 1, 0, q_.TilePlan(16, 32, 64, 4, 128, 4, 1))
    assert torch.equal(y1, y4)


def test_e4m3_to_bf16_bit_recipe_is_exact():
    # the integer recipe of _e4m3x4_to_bf16 (sm_89+, inline assembly: compiled by the audit, not run here), replayed
    # on the fp16 bits torch gives for every finite e4m3fn code: sign kept, the rest shifted right by 3 (the value
    # times 2^-112 as bf16 bits), then one bf16 multiply by 2^112 must give the code's value exactly
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8)
    codes = codes[torch.isfinite(codes.float())]
    h = codes.to(torch.float16).view(torch.int16).to(torch.int32) & 0xFFFF  # cvt.rn.f16x2.e4m3x2
    b = (h & 0x8000) | ((h >> 3) & 0x0FFF)
    scaled = b.to(torch.int16).view(torch.bfloat16)
    assert bool((scaled.float().abs()[codes.float() != 0] >= 2.0 ** -126).all())  # normal bf16: no subnormal input
    two112 = torch.tensor(0x7780, dtype=torch.int16).view(torch.bfloat16)
    assert float(two112) == 2.0 ** 112
    out = scaled * two112
    assert torch.equal(out.float(), codes.float())
    assert torch.equal(torch.signbit(out), torch.signbit(codes.float()))  # -0 stays -0


@pytest.mark.parametrize("decode", [1, 2, 3], ids=["int-decode", "hw-cvt", "hw-cvt-bf16-ops"])
def test_every_e4m3fn_code_widens_exactly(decode):
    # x = identity: y[i, j] = code[j, i] * 1. Every finite e4m3fn byte (subnormals, +-0, +-448)
    q_ = ql()
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes = codes[torch.isfinite(codes.view(FP8).float())]
    n = codes.numel()
    q = codes.view(FP8).reshape(n, 1).repeat(1, 16).to(DEVICE)  # N = 254 codes, K = 16
    x = torch.zeros(16, 16, device=DEVICE)
    x[0, 0] = 1.0
    y = q_.w8_linear(x, None, q, torch.ones(n, device=DEVICE), None, torch.float32, 0, decode,
                     q_.TilePlan(16, 64, 16, 1, 16, 4, 1))
    assert torch.equal(y[0].cpu(), codes.view(FP8).float())


def test_int_mm_path_with_the_fused_epilogue():
    # torch._int_mm runs on the CPU too: our epilogue pass over its int32 output, against the spec
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    q_ = ql()
    q, s = _weights(48, 64, I8, seed=3)
    x = torch.randn(33, 64, device=DEVICE)
    b = torch.randn(48, device=DEVICE).to(torch.bfloat16)
    xq, xs = quantize_rows(x.bfloat16(), I8)
    y = q_.int_mm_scaled(xq, xs, q, s, b, torch.bfloat16)
    _check(y, x.bfloat16(), q, s, b, True)


class _FakeVllmOps:
    """vLLM's documented cutlass_scaled_mm contract: out = (scale_a * a) @ (scale_b * b) + bias, a [M, K],
    b [K, N] column-major, scale_a [M, 1], scale_b [1, N] fp32, bias [N] in out_dtype (bf16 / fp16)."""

    def __init__(self):
        self.calls = []

    def cutlass_scaled_mm(self, a, b, scale_a, scale_b, out_dtype, bias=None):
        assert out_dtype in (torch.bfloat16, torch.float16)
        assert a.dim() == 2 and b.dim() == 2 and a.shape[1] == b.shape[0] and a.stride(1) == 1
        assert b.stride(0) == 1, "b must be column-major: q.t() of the row-major weight"
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        assert scale_a.dtype == scale_b.dtype == torch.float32
        assert bias is None or (bias.shape == (b.shape[1],) and bias.dtype == out_dtype)
        self.calls.append((a.dtype, tuple(a.shape), tuple(b.shape)))
        y = (a.double() * scale_a.double()) @ (b.double() * scale_b.double())
        return (y + (bias.double() if bias is not None else 0)).to(out_dtype)


@pytest.mark.parametrize("qdtype", [I8, FP8], ids=["int8", "fp8"])
def test_vllm_call_follows_its_contract(monkeypatch, qdtype):
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    q_ = ql()
    fake = _FakeVllmOps()
    monkeypatch.setattr(q_, "_vllm_ops", lambda: fake)
    q, s = _weights(32, 48, qdtype, seed=4)
    x = torch.randn(5, 48, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(32, device=DEVICE).to(torch.bfloat16)
    y = q_.run_choice(q_.VLLM_CUTLASS, quantize_rows, x, q, s, b, H100, False, 132)
    assert fake.calls == [(qdtype, (5, 48), (48, 32))]
    _check(y, x, q, s, b, True)


@pytest.mark.parametrize("kernel", ["triton_w8a16", "triton_w8a8_int8", "triton_w8a8_fp8_widened",
                                    "torch_int_mm+triton_epilogue", "torch_scaled_mm"])
def test_run_choice(kernel):
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    q_ = ql()
    qdtype = I8 if "int" in kernel else FP8
    aq = kernel != "triton_w8a16"
    if kernel == "triton_w8a16":
        qdtype = FP8
    q, s = _weights(32, 48, qdtype, seed=5)
    x = torch.randn(20, 48, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(32, device=DEVICE).to(torch.bfloat16)
    y = q_.run_choice(kernel, quantize_rows, x, q, s, b, A100, False, 4)
    _check(y, x, q, s, b, aq)


@pytest.mark.parametrize("qdtype", [I8, FP8], ids=["int8", "fp8"])
@pytest.mark.parametrize("aq", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("m", [1, 17, 70])
def test_scaled_linear_through_the_op(qdtype, aq, m):
    # the public op on the triton backend: the interpreter stands in for an A100 (qlinear.INTERPRETER_CAPABILITY)
    q, s = _weights(40, 96, qdtype, seed=6)
    x = torch.randn(m, 96, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(40, device=DEVICE).to(torch.bfloat16)
    with fk.use_backend("triton"):
        y = fk.scaled_linear(x, q, s, b, activation_quant=aq)
    _check(y, x, q, s, b, aq)


def test_no_vllm_probe_off_the_gpu(monkeypatch):
    q_ = ql()
    monkeypatch.setenv("FLASHRL_VLLM_KERNELS", "1")
    assert q_.available_vllm(torch.device("cpu")) == q_.VllmScaledMM()
    monkeypatch.setenv("FLASHRL_VLLM_KERNELS", "0")
    assert not q_._vllm_wanted()
    monkeypatch.delenv("FLASHRL_VLLM_KERNELS")
    monkeypatch.delitem(__import__("sys").modules, "vllm", raising=False)
    assert not q_._vllm_wanted()  # a trainer process that never imported vLLM does not import it for us


# ---- the per-call host path on CUDA (selection and plan cached per shape) and the direct callable ----

def test_cuda_choice_is_the_selection_and_plan_cached(monkeypatch):
    q = ql()
    calls = []

    def facts(device):
        calls.append(device)
        return H100, False, 132

    monkeypatch.setattr(q, "device_facts", facts)
    monkeypatch.setattr(q, "available_vllm", lambda device: q.VllmScaledMM())
    import flashrl_kernels.torch_impl.quantize as tq

    monkeypatch.setattr(tq, "cuda_fast_path", lambda index, dtype: True)
    q.cuda_choice.cache_clear()
    try:
        for qdtype, aq, m in ((I8, False, 1), (I8, False, 4096), (I8, True, 256), (FP8, True, 16), (FP8, False, 512)):
            kernel, cap, hip, sms, plan = q.cuda_choice(0, qdtype, m, 11008, 4096, aq, torch.bfloat16, False)
            want = q.select_scaled_linear(H100, False, qdtype, m, 11008, 4096, aq, torch.bfloat16, q.VllmScaledMM(),
                                          aq)
            assert kernel == want.kernel and (cap, hip, sms) == (H100, False, 132)
            if kernel == q.TRITON_W8A16:
                assert plan == q.plan_tiles(m, 11008, 4096, 132, capability=H100, weight_only=True)
            elif kernel == q.TRITON_W8A8_INT8:
                assert plan == q.plan_tiles(m, 11008, 4096, 132, int8_dot=True, capability=H100)
            else:
                assert plan is None  # library GEMMs (torch._scaled_mm here)
        n = len(calls)
        q.cuda_choice(0, I8, 1, 11008, 4096, False, torch.bfloat16, False)
        assert len(calls) == n  # cached: the same shape does not select again
    finally:
        q.cuda_choice.cache_clear()


def test_direct_scaled_linear_on_cuda_weights_is_the_triton_path(monkeypatch):
    import types

    import flashrl_kernels.ops.quantize as oq

    monkeypatch.setattr(oq, "selected_backend", lambda device, op=None: "triton")
    fake_cuda_weight = types.SimpleNamespace(is_cuda=True, device=torch.device("cuda", 0))
    assert oq.direct_scaled_linear(fake_cuda_weight, True) is oq._triton_direct
    monkeypatch.setattr(oq, "selected_backend", lambda device, op=None: "torch")
    assert oq.direct_scaled_linear(fake_cuda_weight, True) is None


@pytest.mark.parametrize("aq", [False, True])
def test_triton_direct_equals_the_op(aq):
    import flashrl_kernels.ops.quantize as oq

    q, s = _weights(40, 300, I8, seed=5)
    x = torch.randn(9, 300, device=DEVICE).to(torch.bfloat16)
    b = torch.randn(40, device=DEVICE).to(torch.bfloat16)
    with fk.use_backend("triton"):
        want = torch.ops.flashrl.scaled_linear(x, q, s, b, aq)
        got = oq._triton_direct(x, q, s, b, aq)
    assert torch.equal(got, want)
    # under a dispatch mode (as in torch.compile's tracing) the registered op runs: fake tensors in, fake out
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode, fk.use_backend("triton"):
        fx, fq, fs = mode.from_tensor(x), mode.from_tensor(q), mode.from_tensor(s)
        y = oq._triton_direct(fx, fq, fs, None, aq)
    assert tuple(y.shape) == (9, 40) and y.dtype == torch.bfloat16
