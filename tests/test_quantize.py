"""quantize_rows / quantize_rows_ / dequantize_rows / scaled_linear: every backend vs the spec.

q and scale must be bit-identical to reference.quantize_rows_spec (the spec
fixes every fp32 rounding point), so the kernel tests compare bytes. Triton
runs under TRITON_INTERPRET=1 on a CPU (conftest), at small sizes.
"""
import pytest
import torch
from conftest import DEVICE, available_backends

import flashrl_kernels as fk
from flashrl_kernels.reference import quantize_rows_spec
from flashrl_kernels.reference.quantize import ZERO_ROW_AMAX, dequantize_rows_spec, scaled_linear_spec

BACKENDS = available_backends(DEVICE, op="quantize_rows_forward")
QDTYPES = [torch.int8, torch.float8_e4m3fn]
QNAME = {torch.int8: "int8", torch.float8_e4m3fn: "fp8"}


def bits(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def assert_same_as_spec(w, q, s, dtype):
    rq, rs = quantize_rows_spec(w, dtype)
    assert q.dtype == dtype and s.dtype == torch.float32
    assert q.shape == w.shape and s.shape == w.shape[:-1]
    assert torch.equal(s.cpu(), rs), (s, rs)
    neq = bits(q.cpu()) != bits(rq)
    assert not neq.any(), f"{int(neq.sum())} of {q.numel()} values differ, first at {neq.nonzero()[0].tolist()}"


def rand_weight(shape, dtype, scale=1.0):
    # rows with very different magnitudes, like a real layer; never all zeros
    w = torch.randn(shape) * scale
    if len(shape) >= 2:
        w = w * torch.logspace(-3, 2, shape[-2]).unsqueeze(-1)
    return w.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (5, 129), (17, 1000), (2, 3, 64)])
def test_matches_spec(backend, qdtype, wdtype, shape):
    w = rand_weight(shape, wdtype)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, qdtype)
    assert_same_as_spec(w, q, s, qdtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
def test_wide_rows_two_pass_path(backend, qdtype):
    # K > 16384: the Triton kernel loops over the row twice instead of holding it in registers
    w = rand_weight((2, 20011), torch.bfloat16)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, qdtype)
    assert_same_as_spec(w, q, s, qdtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_torch_chunking_is_invisible(backend, monkeypatch):
    monkeypatch.setenv("FLASHRL_CHUNK_BYTES", "256")  # one row per chunk
    w = rand_weight((9, 33), torch.bfloat16)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, torch.int8)
    assert_same_as_spec(w, q, s, torch.int8)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
def test_zero_and_tiny_rows(backend, qdtype):
    w = rand_weight((4, 37), torch.float32)
    w[1] = 0.0
    w[2] = -0.0
    w[3] = ZERO_ROW_AMAX / 2 * torch.sign(torch.randn(37))  # below the zero-row threshold
    w[0, :5] = ZERO_ROW_AMAX * 4  # a normal row that contains tiny values: they quantize to 0
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, qdtype)
    assert_same_as_spec(w, q, s, qdtype)
    assert s[1:].tolist() == [1.0, 1.0, 1.0]
    assert (bits(q[1:]) == 0).all()  # +0 exactly, not -0
    assert torch.equal(fk.dequantize_rows(q, s, torch.float32)[1:], torch.zeros(3, 37, device=DEVICE))


@pytest.mark.parametrize("backend", BACKENDS)
def test_int8_rounds_half_to_even(backend):
    # amax 127 -> scale exactly 1, so w / scale is w itself
    w = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, 126.5, -127.0]], device=DEVICE)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, torch.int8)
    assert s.item() == 1.0
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -2, 3, 126, -127]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp8_rounds_to_nearest_even_with_subnormals(backend):
    # amax 448 -> scale exactly 1; 100 is halfway between 96 and 104 (-> 96), 108 between 104 and 112 (-> 112)
    w = torch.tensor([[448.0, 100.0, 108.0, -100.0, 0.0013, 0.00293, 3e-4, 17.0]], device=DEVICE)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, torch.float8_e4m3fn)
    assert s.item() == 1.0
    assert q.float().tolist() == [[448.0, 96.0, 112.0, -96.0, 2.0**-9, 2.0**-9 * 2, 0.0, 16.0]]
    assert_same_as_spec(w, q, s, torch.float8_e4m3fn)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
def test_saturation_never_overflows(backend, qdtype):
    # amax values whose fp32 scale rounds down, so amax / scale lands just above qmax: it must clamp
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    amax = torch.rand(4096, dtype=torch.float64) * 10 + 0.1
    over = (amax / (amax / qmax).float().double()) > qmax
    amax = amax[over][:64].float()
    assert amax.numel() > 8
    w = torch.stack([amax, -amax * 0.5, amax * 0.3], dim=1).to(DEVICE)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, qdtype)
    assert_same_as_spec(w, q, s, qdtype)
    assert q.float().max().item() == qmax and not torch.isnan(q.float()).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
@pytest.mark.parametrize("wdtype", [torch.bfloat16, torch.float16, torch.float32])
def test_huge_values(backend, qdtype, wdtype):
    big = torch.finfo(wdtype).max
    w = torch.randn(3, 40, dtype=torch.float64) * 0.3
    w[0, 3] = big
    w[1] = big * torch.sign(w[1])  # a whole row at the largest finite value
    w = w.clamp(-big, big).to(device=DEVICE, dtype=wdtype)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, qdtype)
    assert torch.isfinite(s).all()
    assert_same_as_spec(w, q, s, qdtype)


@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
def test_error_bound(qdtype):
    w = rand_weight((64, 300), torch.float32)
    q, s = fk.quantize_rows(w, qdtype)
    err = (fk.dequantize_rows(q, s, torch.float32) - w).abs()
    if qdtype == torch.int8:
        bound = s.unsqueeze(1) * (0.5 + 1e-3)  # half a step
    else:
        bound = torch.maximum(w.abs() * 2.0**-4, s.unsqueeze(1) * 2.0**-10) * (1 + 1e-3)  # half an e4m3 ulp
    assert (err <= bound).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nonfinite_raises(backend, bad):
    w = rand_weight((5, 20), torch.bfloat16)
    w[3, 7] = bad
    with fk.use_backend(backend), pytest.raises(ValueError, match=r"w row 3 .*NaN or \+-inf"):
        fk.quantize_rows(w, torch.int8)


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_with_checks_off_gives_nan_scale(backend):
    w = rand_weight((3, 20), torch.float32)
    w[1, 0] = float("nan")
    fk.set_value_checks(False)
    try:
        with fk.use_backend(backend):
            _q, s = fk.quantize_rows(w, torch.int8)
    finally:
        fk.set_value_checks(True)
    assert torch.isnan(s[1]) and torch.isfinite(s[[0, 2]]).all()


# ---- in place ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
def test_inplace_into_a_slice_of_existing_storage(backend, qdtype):
    # like a weight loader writing the k shard of a fused qkv parameter
    big_q = torch.zeros(12, 48, dtype=torch.int8, device=DEVICE).to(qdtype)
    big_s = torch.full((12,), -1.0, device=DEVICE)
    q_ptr, s_ptr = big_q.data_ptr(), big_s.data_ptr()
    before_q, before_s = big_q.clone(), big_s.clone()
    w = rand_weight((5, 48), torch.bfloat16)
    with fk.use_backend(backend):
        q, _s = fk.quantize_rows_(w, big_q.narrow(0, 4, 5), big_s.narrow(0, 4, 5))
    assert big_q.data_ptr() == q_ptr and big_s.data_ptr() == s_ptr
    assert q.data_ptr() == big_q[4].data_ptr()
    assert_same_as_spec(w, big_q[4:9], big_s[4:9], qdtype)
    keep = torch.ones(12, dtype=torch.bool)
    keep[4:9] = False
    assert torch.equal(bits(big_q[keep]), bits(before_q[keep])) and torch.equal(big_s[keep], before_s[keep])


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_nonfinite_writes_nothing(backend):
    q_out = torch.full((4, 16), 7, dtype=torch.int8, device=DEVICE)
    s_out = torch.full((4,), 0.5, device=DEVICE)
    w = rand_weight((4, 16), torch.float32)
    w[2, 2] = float("nan")
    with fk.use_backend(backend), pytest.raises(ValueError, match="nothing was written"):
        fk.quantize_rows_(w, q_out, s_out)
    assert (q_out == 7).all() and (s_out == 0.5).all()


def test_inplace_bad_arguments():
    w = torch.randn(4, 16)
    with pytest.raises(ValueError, match="q_out must have w's shape"):
        fk.quantize_rows_(w, torch.empty(4, 15, dtype=torch.int8), torch.empty(4))
    with pytest.raises(ValueError, match="scale_out must have 4 elements"):
        fk.quantize_rows_(w, torch.empty(4, 16, dtype=torch.int8), torch.empty(3))
    with pytest.raises(TypeError, match="scale_out must have dtype"):
        fk.quantize_rows_(w, torch.empty(4, 16, dtype=torch.int8), torch.empty(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="q_out.dtype must be torch.int8 or torch.float8_e4m3fn"):
        fk.quantize_rows_(w, torch.empty(4, 16, dtype=torch.int16), torch.empty(4))


def test_bad_arguments():
    with pytest.raises(TypeError, match="w must have dtype"):
        fk.quantize_rows(torch.ones(3, 4, dtype=torch.int32))
    with pytest.raises(TypeError, match="w must be a torch.Tensor"):
        fk.quantize_rows([[1.0, 2.0]])
    with pytest.raises(ValueError, match="dtype must be torch.int8 or torch.float8_e4m3fn"):
        fk.quantize_rows(torch.ones(3, 4), torch.float16)
    with pytest.raises(TypeError, match="dtype must be a torch.dtype"):
        fk.quantize_rows(torch.ones(3, 4), "int8")
    with pytest.raises(ValueError, match="empty last dimension"):
        fk.quantize_rows(torch.ones(3, 0))
    q, s = fk.quantize_rows(torch.ones(0, 5))  # no rows: empty result, no error
    assert q.shape == (0, 5) and s.shape == (0,)


# ---- dequantize, per-token, scaled linear ----

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_dequantize(backend, qdtype, out_dtype):
    w = rand_weight((6, 45), torch.float32)
    q, s = quantize_rows_spec(w, qdtype)
    q, s = q.to(DEVICE), s.to(DEVICE)
    with fk.use_backend(backend):
        d = fk.dequantize_rows(q, s, out_dtype)
    assert d.dtype == out_dtype
    torch.testing.assert_close(d.double(), dequantize_rows_spec(q, s).to(out_dtype).double(), rtol=0, atol=0)
    with pytest.raises(ValueError, match="scale must have shape"):
        fk.dequantize_rows(q, s[:-1])
    with pytest.raises(TypeError, match="dtype must be one of"):
        fk.dequantize_rows(q, s, torch.int8)


def test_quantize_per_token_shapes():
    x = rand_weight((2, 3, 64), torch.bfloat16)
    q, s = fk.quantize_per_token(x, torch.float8_e4m3fn)
    assert q.shape == (2, 3, 64) and s.shape == (2, 3)
    assert_same_as_spec(x, q, s, torch.float8_e4m3fn)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
@pytest.mark.parametrize("activation_quant", [False, True], ids=["w8a16", "w8a8"])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_scaled_linear(backend, qdtype, activation_quant, xdtype):
    n, k = 24, 40
    w = rand_weight((n, k), torch.float32, scale=0.1)
    q, s = fk.quantize_rows(w, qdtype)
    x = torch.randn(3, 5, k, device=DEVICE).to(xdtype)
    bias = torch.randn(n, device=DEVICE).to(xdtype)
    with fk.use_backend(backend):
        y = fk.scaled_linear(x, q, s, bias, activation_quant=activation_quant)
    assert y.shape == (3, 5, n) and y.dtype == xdtype
    ref = scaled_linear_spec(x.reshape(-1, k), q, s, bias, activation_quant).reshape(3, 5, n)
    # fp32: accumulation order only; bf16: the dequantized weight, x and y are rounded to bf16
    scale_y = (x.double().abs() @ dequantize_rows_spec(q, s).abs().T).reshape(3, 5, n) + bias.double().abs()
    tol = 1e-5 if xdtype == torch.float32 else 3 * 2.0**-8
    err = (y.double() - ref).abs()
    assert (err <= tol * scale_y + 1e-6).all(), float((err / scale_y).max())


def test_scaled_linear_bad_arguments():
    q, s = fk.quantize_rows(torch.randn(8, 16))
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="x must have last dimension K = 16"):
        fk.scaled_linear(torch.randn(2, 15), q, s)
    with pytest.raises(ValueError, match=r"scale must have shape \(8,\)"):
        fk.scaled_linear(x, q, s[:4])
    with pytest.raises(ValueError, match=r"bias must have shape \(8,\)"):
        fk.scaled_linear(x, q, s, torch.zeros(7))
    with pytest.raises(ValueError, match="q.dtype must be"):
        fk.scaled_linear(x, q.float(), s)


# ---- op plumbing ----

@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    w = torch.randn(5, 24, device=DEVICE)
    x = torch.randn(3, 24, device=DEVICE)
    with fk.use_backend(backend):
        q, s = fk.quantize_rows(w, torch.int8)
        torch.library.opcheck(
            torch.ops.flashrl.quantize_rows_.default,
            (w, torch.empty(5, 24, dtype=torch.int8, device=DEVICE), torch.empty(5, device=DEVICE)),
        )
        torch.library.opcheck(torch.ops.flashrl.dequantize_rows.default, (q, s, torch.bfloat16))
        torch.library.opcheck(torch.ops.flashrl.scaled_linear.default, (x, q, s, None, True))


def test_compile_fullgraph():
    torch._dynamo.reset()

    def f(x, w):
        q, s = fk.quantize_rows(w, torch.float8_e4m3fn)
        return fk.scaled_linear(x * 2.0, q, s, activation_quant=True)

    x, w = torch.randn(4, 32, device=DEVICE), torch.randn(16, 32, device=DEVICE)
    fk.set_value_checks(False)  # value checks are skipped under tracing anyway; keep eager and compiled alike
    try:
        out = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w)
    finally:
        fk.set_value_checks(True)
    torch.testing.assert_close(out, f(x, w))


def _nonfinite(tensors):
    """Indices of the tensors whose max |x|, as sync_weights' check reads it, is not finite (NaN or inf)."""
    from flashrl_kernels.integrations.vllm.sync import abs_max_tensors

    return [i for i, a in enumerate(abs_max_tensors(tensors)) if not a < float("inf")]


def test_sync_finiteness_check_handles_overflowing_sums():
    from flashrl_kernels.integrations.vllm.sync import abs_max_tensors

    big = torch.full((4, 8), 3e38)  # finite, but its fp32 sum overflows to inf
    nan = torch.randn(3, 5).bfloat16()
    nan[1, 2] = float("nan")
    inf = torch.randn(7, dtype=torch.float64)
    inf[0] = -float("inf")
    ok = torch.randn(6, 6).bfloat16()
    assert _nonfinite([ok, big, nan, ok, inf, -big]) == [2, 4]
    # max |x| exactly, in fp64: what the sync compares with the range of the dtype each tensor is stored in
    assert abs_max_tensors([big, -big, ok, torch.tensor([-1e300, 2.0], dtype=torch.float64)]) == [
        float(big[0, 0]), float(big[0, 0]), float(ok.abs().max()), 1e300]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_sync_finiteness_check_finds_every_bad_value_anywhere(dtype):
    """One NaN, +inf or -inf at a random position (vector body or tail) of tensors of odd sizes, beside finite
    tensors that reach the dtype's largest and smallest values, empty ones and non-contiguous views."""
    g = torch.Generator().manual_seed(5)
    fin = torch.finfo(dtype)
    tensors, expect = [], []
    for i in range(60):
        n = int(torch.randint(1, 5000, (1,), generator=g))
        t = torch.randn(n, generator=g, dtype=torch.float64).to(dtype)
        kind = i % 4
        if kind < 3:
            t[int(torch.randint(0, n, (1,), generator=g))] = (float("nan"), float("inf"), -float("inf"))[kind]
            expect.append(len(tensors))
        else:
            t[0], t[-1] = fin.max, fin.min  # finite extremes: no false alarm
        tensors.append(t)
    bad_view = torch.randn(64, 48, dtype=torch.float64).to(dtype)
    bad_view[5, 7] = float("nan")
    tensors += [torch.empty(0, dtype=dtype), bad_view.t(), bad_view[2:9, 5:9:2]]
    expect += [len(tensors) - 2, len(tensors) - 1]
    assert _nonfinite(tensors) == expect


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qdtype", QDTYPES, ids=QNAME.get)
@pytest.mark.parametrize("shape", [(2, 64), (7, 129), (300, 1000)])
def test_counted_requantize_counts_the_changed_codes(backend, qdtype, shape):
    """quantize_rows_counted_ (what a weight sync runs) writes what quantize_rows_ writes and returns exactly how
    many codes differ from the ones it overwrote: a small update (some codes cross a rounding boundary, most do
    not), a zero row written over a nonzero one, and a strided row slice of a larger parameter."""
    from flashrl_kernels.ops.quantize import quantize_rows_counted_

    w0 = rand_weight(shape, torch.bfloat16)
    w1 = (w0.float() + 0.01 * w0.float().std(dim=-1, keepdim=True) * torch.randn(shape, device=DEVICE))
    if shape[0] > 1:
        w1[0] = 0.0  # a row that becomes zero: every nonzero old code changes to +0
    w1 = w1.to(torch.bfloat16)
    store_q = torch.zeros(shape[0], shape[1] + 9, dtype=qdtype, device=DEVICE)
    store_s = torch.ones(shape[0], device=DEVICE)
    q, s = store_q[:, 3:3 + shape[1]], store_s  # a row-strided view, as a loader's shard
    with fk.use_backend(backend):
        fk.quantize_rows_(w0, q, s)
        old = bits(q.clone()).cpu()
        changed = quantize_rows_counted_(w1, q, s)
    assert_same_as_spec(w1, q, s, qdtype)
    expect = int((bits(q).cpu() != old).sum())
    assert changed == expect
    assert 0 < changed < q.numel()  # the update moved some codes, not all: the count is not vacuous
    # the columns outside the view are untouched
    assert not bits(store_q[:, :3]).any() and not bits(store_q[:, 3 + shape[1]:]).any()
    with fk.use_backend(backend):
        assert quantize_rows_counted_(w1, q, s) == 0  # the same weights again change nothing
