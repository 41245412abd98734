"""Native CPU quantize_rows beyond the shared suite (tests/test_quantize.py): exact ties and fp8
subnormals inside the vectorised part of a row (the shared suite's tie rows are shorter than one
vector), thread-count independence, and the fallback for rows without unit stride."""
import pytest
import torch
from test_quantize import assert_same_as_spec, bits

import flashrl_kernels as fk
from flashrl_kernels import _backend
from flashrl_kernels.reference import quantize_rows_spec

pytestmark = pytest.mark.skipif(not _backend.native_built(), reason="native CPU kernels not built here")


def _fp8_midpoints():
    """Every midpoint between consecutive finite e4m3fn values in [0, 448], both signs."""
    vals = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    pos = torch.unique(vals[torch.isfinite(vals) & (vals >= 0)])
    mids = (pos[1:] + pos[:-1]) / 2  # exact in fp32
    return torch.cat([mids, -mids])


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_fp8_ties_and_subnormals_in_vector_lanes(wdtype):
    mids = _fp8_midpoints()
    row = torch.cat([torch.tensor([448.0]), mids, mids[:5] * 0.999, mids[:5] * 1.001])  # amax 448: scale 1
    w = torch.stack([row, row.flip(0), row * 0.5]).to(wdtype)
    with fk.use_backend("native"):
        q, s = fk.quantize_rows(w, torch.float8_e4m3fn)
    assert_same_as_spec(w, q, s, torch.float8_e4m3fn)


def test_fp8_every_bf16_value_and_random_fp32_bits():
    """Every finite bf16 value in [-448, 448] and 2^20 random fp32 bit patterns there (subnormal e4m3fn range,
    values below it, near-ties, the top of the range), in rows whose amax is 448 so the scale is exactly 1 and
    the conversion itself is what is compared; plus a row holding NaN with the value checks off (every code
    NaN). Covers the vector conversion of every build (AVX-512, AVX2) against the spec bit for bit."""
    b = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    b = b[torch.isfinite(b) & (b.abs() <= 448)]
    g = torch.Generator().manual_seed(7)
    r = torch.randint(0, 0x43E00001, (2**20,), generator=g, dtype=torch.int32).view(torch.float32)  # |r| <= 448
    r = torch.where(torch.rand(r.shape, generator=g) < 0.5, r, -r)
    vals = torch.cat([b, r])
    cols = 1000
    vals = torch.cat([vals, vals[: (-vals.numel()) % cols]]).view(-1, cols)
    vals[:, 0] = 448.0
    with fk.use_backend("native"):
        q, s = fk.quantize_rows(vals, torch.float8_e4m3fn)
    assert torch.equal(s, torch.ones_like(s))
    assert_same_as_spec(vals, q, s, torch.float8_e4m3fn)
    nan_row = torch.randn(2, 37)
    nan_row[1, 5] = float("nan")
    fk.set_value_checks(False)
    try:
        with fk.use_backend("native"):
            q, s = fk.quantize_rows(nan_row, torch.float8_e4m3fn)
    finally:
        fk.set_value_checks(True)
    assert torch.isnan(q[1].float()).all() and torch.isnan(s[1]) and torch.isfinite(q[0].float()).all()
    rq, rs = quantize_rows_spec(nan_row, torch.float8_e4m3fn)
    assert torch.equal(bits(q), bits(rq)) and torch.isnan(rs[1]) and s[0] == rs[0]


def test_int8_ties_in_vector_lanes():
    halves = torch.arange(-128, 127, dtype=torch.float32) + 0.5  # every x.5 from -127.5 to 126.5, exact
    row = torch.cat([torch.tensor([127.0]), halves, -halves])  # amax 127.5 -> scale 127.5 / 127
    exact = torch.cat([torch.tensor([127.0]), halves[1:]])  # amax 127: scale exactly 1, quotients are the ties
    for w in (row[None], exact[None]):
        with fk.use_backend("native"):
            q, s = fk.quantize_rows(w, torch.int8)
        assert_same_as_spec(w, q, s, torch.int8)
    assert s.item() == 1.0
    assert q[0, 1:5].tolist() == [-126, -126, -124, -124]  # -126.5, -125.5, -124.5, -123.5: half to even
    assert q[0, 128:130].tolist() == [0, 2]  # 0.5, 1.5


@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn])
def test_thread_count_does_not_change_results(qdtype):
    w = torch.randn(300, 777).bfloat16()
    old = torch.get_num_threads()
    out = []
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            with fk.use_backend("native"):
                out.append(fk.quantize_rows(w, qdtype))
    finally:
        torch.set_num_threads(old)
    assert torch.equal(out[0][0].view(torch.uint8), out[1][0].view(torch.uint8))
    assert torch.equal(out[0][1], out[1][1])


def test_rows_without_unit_stride_fall_back_to_the_torch_path():
    w = torch.randn(64, 48).t()  # column-major: rows have stride 64
    with fk.use_backend("native"):
        q, s = fk.quantize_rows(w, torch.int8)
    assert_same_as_spec(w, q, s, torch.int8)
