"""The native quantized linear (csrc/cpu/qlinear.cpp) against the float64 spec, path by path.

flashrl_native::qlinear(x, q, scale, bias, act_quant) is what `scaled_linear` runs on CPU
tensors under the native backend (and so what the vLLM plugin's linear layers run). Its
AVX-512 paths (VNNI W8A8, bf16 dot products, fp32 FMA) and the AVX2 / portable builds'
paths must all match scaled_linear_spec; the other builds are checked in
test_native_capabilities.py.
"""
import pytest
import torch

import flashrl_kernels as fk
from flashrl_kernels import _backend
from flashrl_kernels.reference.quantize import quantize_rows_spec, scaled_linear_spec

pytestmark = pytest.mark.skipif(not _backend.native_built(), reason="native CPU kernels not built here")

QDTYPES = [torch.int8, torch.float8_e4m3fn]
# relative to the largest |output|: bf16 / fp16 outputs round once; fp32 accumulates in fp32
TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _caps():
    from flashrl_kernels.native.quantize import qlinear_capabilities

    return qlinear_capabilities()


def _check(y, ref, xdtype):
    assert y.dtype == xdtype
    err = (y.double() - ref).abs().max().item()
    assert err <= TOL[xdtype] * max(ref.abs().max().item(), 1e-30), err


def _act_quant_cases(qdtype):
    # act_quant through the op runs natively (VNNI) for int8 where the CPU has it; elsewhere scaled_linear emulates it
    return [False, True] if (qdtype == torch.int8 and _caps()["w8a8"]) else [False]


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (3, 5, 7), (8, 33, 130), (13, 17, 1000), (70, 9, 64), (5, 4, 896),
                                   (2, 6, 95), (9, 3, 31), (4, 8, 33)])
def test_qlinear_vs_spec(qdtype, xdtype, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n * 10 + k)
    q, s = fk.quantize_rows(torch.randn(n, k, generator=g), qdtype)
    x = (torch.randn(m, k, generator=g) * 3).to(xdtype)
    bias = torch.randn(n, generator=g)
    for act_quant in _act_quant_cases(qdtype):
        for b in (None, bias):
            y = torch.ops.flashrl_native.qlinear(x, q, s, b, act_quant)
            _check(y, scaled_linear_spec(x, q, s, b, act_quant), xdtype)


@pytest.mark.parametrize("qdtype", QDTYPES)
@pytest.mark.parametrize("activation_quant", [False, True])
def test_scaled_linear_native_backend(qdtype, activation_quant):
    """The public op on the native backend: native W8A8, or the emulation on the weight-only kernel."""
    g = torch.Generator().manual_seed(3)
    q, s = fk.quantize_rows(torch.randn(50, 200, generator=g), qdtype)
    x = torch.randn(2, 3, 200, generator=g).bfloat16()
    with fk.use_backend("native"):
        y = fk.scaled_linear(x, q, s, activation_quant=activation_quant)
    _check(y.reshape(6, 50), scaled_linear_spec(x.reshape(6, 200), q, s, None, activation_quant), torch.bfloat16)


def test_w8a8_integer_sums_are_exact():
    """Integer-valued activations whose per-token quantization is exact: the W8A8 result is the exact product."""
    if not _caps()["w8a8"]:
        pytest.skip("no AVX-512 VNNI on this CPU")
    g = torch.Generator().manual_seed(0)
    k = 4864
    q = torch.randint(-127, 128, (13, k), generator=g, dtype=torch.int8)
    s = torch.ones(13)
    x = torch.randint(-127, 128, (5, k), generator=g).float()
    x[:, 0] = 127.0  # amax 127: scale exactly 1, so x quantizes to itself
    y = torch.ops.flashrl_native.qlinear(x, q, s, None, True)
    exact = x.double() @ q.double().T
    assert torch.equal(y.double(), exact.float().double())


def test_nonfinite_and_zero_tokens():
    q, s = fk.quantize_rows(torch.randn(6, 40), torch.int8)
    x = torch.randn(4, 40)
    x[1] = 0.0
    x[2, 7] = float("nan")
    x[3, 3] = float("inf")
    for act_quant in _act_quant_cases(torch.int8):
        y = torch.ops.flashrl_native.qlinear(x, q, s, None, act_quant)
        assert torch.isfinite(y[0]).all() and torch.equal(y[1], torch.zeros(6))
        assert torch.isnan(y[2]).all() and not torch.isfinite(y[3]).any()
        _check(y[:2], scaled_linear_spec(x[:2], q, s, None, act_quant), torch.float32)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_strided_rows_and_in_place_updates(qdtype):
    """Row strides of x and q are honoured, and a quantize_rows_ into q's storage is seen by the next call."""
    g = torch.Generator().manual_seed(1)
    big_q = torch.empty(12, 150, dtype=qdtype)
    big_s = torch.empty(12)
    fk.quantize_rows_(torch.randn(12, 150, generator=g), big_q, big_s)
    q, s = big_q[2:9, :100], big_s[2:9].contiguous()  # a row slice with row stride 150
    x = torch.randn(5, 130, generator=g).bfloat16()[:, 10:110]
    _check(torch.ops.flashrl_native.qlinear(x, q, s, None, False), scaled_linear_spec(x, q, s), torch.bfloat16)
    ptr = big_q.data_ptr()
    fk.quantize_rows_(torch.randn(12, 150, generator=g) * 5, big_q, big_s)
    assert big_q.data_ptr() == ptr
    s = big_s[2:9].contiguous()
    _check(torch.ops.flashrl_native.qlinear(x, q, s, None, False), scaled_linear_spec(x, q, s), torch.bfloat16)


@pytest.mark.parametrize("qdtype", QDTYPES)
def test_results_do_not_depend_on_threads(qdtype):
    g = torch.Generator().manual_seed(2)
    q, s = fk.quantize_rows(torch.randn(301, 250, generator=g), qdtype)
    x = torch.randn(67, 250, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append([torch.ops.flashrl_native.qlinear(x, q, s, None, a) for a in _act_quant_cases(qdtype)])
    finally:
        torch.set_num_threads(before)
    for other in outs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(outs[0], other))


def test_fp8_subnormal_and_extreme_weights():
    """Every e4m3fn value (subnormals, +-448, signed zeros) widens exactly."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes = codes[(codes & 0x7F) != 0x7F]  # NaN encodings are never written by the quantizer
    q = codes.view(torch.float8_e4m3fn)[None].repeat(3, 1).contiguous()
    s = torch.tensor([1.0, 0.5, 3.0])
    eye = torch.eye(q.shape[1])
    for xd in (torch.float32, torch.bfloat16):
        y = torch.ops.flashrl_native.qlinear(eye.to(xd), q, s, None, False)
        ref = scaled_linear_spec(eye.to(xd), q, s)
        assert torch.equal(y.double(), ref.to(xd).double()), xd
    # decode sizes (M <= 8 bf16 tokens: rows widened in registers, not through the scratch): one-hot tokens
    # read single weights back exactly, every code at many lane positions, the K tail included
    g = torch.Generator().manual_seed(11)
    q6 = torch.stack([codes[torch.randperm(len(codes), generator=g)] for _ in range(6)]).view(torch.float8_e4m3fn)
    eye = torch.eye(q6.shape[1], dtype=torch.bfloat16)
    for c0, m in [(c, 8) for c in range(0, q6.shape[1] - 8, 8)] + [(0, 1), (3, 4), (q6.shape[1] - 5, 5)]:
        x = eye[c0:c0 + m]
        y = torch.ops.flashrl_native.qlinear(x, q6.contiguous(), torch.ones(6), None, False)
        assert torch.equal(y.double(), scaled_linear_spec(x, q6, torch.ones(6)).bfloat16().double()), (c0, m)


def test_bad_arguments():
    q, s = fk.quantize_rows(torch.randn(4, 8), torch.int8)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        torch.ops.flashrl_native.qlinear(torch.randn(2, 9), q, s, None, False)
    with pytest.raises(RuntimeError, match="scale"):
        torch.ops.flashrl_native.qlinear(torch.randn(2, 8), q, s[:3], None, False)
    with pytest.raises(RuntimeError, match="bias"):
        torch.ops.flashrl_native.qlinear(torch.randn(2, 8), q, s, torch.zeros(5), False)
    with pytest.raises(RuntimeError, match="int8 or float8"):
        torch.ops.flashrl_native.qlinear(torch.randn(2, 8), q.float(), s, None, False)
    q8, s8 = fk.quantize_rows(torch.randn(4, 8), torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="act_quant"):
        torch.ops.flashrl_native.qlinear(torch.randn(2, 8), q8, s8, None, True)


def test_spec_of_quantized_tokens_matches_kernel_scales():
    """The W8A8 kernel quantizes tokens with the spec: a token whose values all sit on its int8 grid is exact."""
    if not _caps()["w8a8"]:
        pytest.skip("no AVX-512 VNNI on this CPU")
    g = torch.Generator().manual_seed(5)
    x = torch.randn(3, 64, generator=g)
    xq, xs = quantize_rows_spec(x, torch.int8)
    x_grid = (xq.double() * xs.double()[:, None]).float()  # dequantized: quantizes back to the same (xq, xs)
    q, s = fk.quantize_rows(torch.randn(5, 64, generator=g), torch.int8)
    y = torch.ops.flashrl_native.qlinear(x_grid, q, s, None, True)
    _check(y, scaled_linear_spec(x_grid, q, s, None, False), torch.float32)


@pytest.mark.parametrize("m,n,k", [(1, 1, 1), (8, 151, 896), (5, 7, 33), (70, 13, 100)])
def test_bf16_linear_vs_float64(m, n, k):
    """The plain bf16 kernel the quantized engine's model-dtype LM head runs (vector builds)."""
    if not _caps()["vector"]:
        pytest.skip("portable build: no bf16_linear")
    g = torch.Generator().manual_seed(m + n + k)
    w = torch.randn(n, k + 3, generator=g).bfloat16()[:, 1:k + 1]  # strided rows
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        y = torch.ops.flashrl_native.bf16_linear(x, w, b)
        ref = x.double() @ w.double().T + (0 if b is None else b.double())
        _check(y, ref, torch.bfloat16)
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.flashrl_native.bf16_linear(x.float(), w, None)


# K % 16 == 0: AVX2 builds run the lane-pair tiles (csrc/cpu/avx2_pair_rows.h): 8 x 1, 4 x 2, 2 x 4 and 1 x 4 tiles
# over 64-row panels, the rows a panel leaves over one at a time
_PAIR_SHAPES = [(m, n, k) for m in (1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 23) for n, k in ((131, 16), (67, 896))] + [
    (70, 200, 64), (33, 64, 4864)]


@pytest.mark.parametrize("m,n,k", _PAIR_SHAPES)
def test_bf16_linear_pair_tiles_vs_float64(m, n, k):
    """Every tile shape and panel remainder of the AVX2 lane-pair driver (other builds: their own bf16 paths), on
    strided rows of x and w, against float64."""
    if not _caps()["vector"]:
        pytest.skip("portable build: no bf16_linear")
    g = torch.Generator().manual_seed(7 * m + n + k)
    w = (torch.randn(n, k + 16, generator=g) * 0.1).bfloat16()[:, 16:]
    x = (torch.randn(m, k + 32, generator=g) * 2).bfloat16()[:, 32:]
    b = torch.randn(n, generator=g)
    y = torch.ops.flashrl_native.bf16_linear(x, w, b)
    _check(y, x.double() @ w.double().T + b.double(), torch.bfloat16)


def test_bf16_linear_fp32_tiles_switch(tmp_path):
    """FLASHRL_NATIVE_AVX2_PAIR_ROWS=0 keeps the fp32 tiles on vpmovzxwd-widened rows (the A/B baseline); both drivers
    match float64, and on AVX2 builds they sum in different orders (so the switch reaches the kernel)."""
    import os
    import subprocess
    import sys

    from flashrl_kernels import _native

    if not _caps()["vector"]:
        pytest.skip("portable build: no bf16_linear")
    script = (  # each variable is read once per process
        "import sys, torch\n"
        "from flashrl_kernels import _native\n"
        "assert _native.load()\n"
        "g = torch.Generator().manual_seed(4)\n"
        "x, w = torch.randn(11, 896, generator=g).bfloat16(), torch.randn(4000, 896, generator=g).bfloat16()\n"
        "torch.save(torch.ops.flashrl_native.bf16_linear(x, w, None), sys.argv[1])\n")
    outs = {}
    for flag in ("0", "1"):
        path = tmp_path / f"flag{flag}.pt"
        r = subprocess.run([sys.executable, "-c", script, path], check=False, capture_output=True, text=True,
                           env={**os.environ, "FLASHRL_NATIVE_AVX2_PAIR_ROWS": flag}, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        outs[flag] = torch.load(path)
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(11, 896, generator=g).bfloat16(), torch.randn(4000, 896, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    for y in outs.values():
        _check(y, ref, torch.bfloat16)
    if _native.native_status().capability == "AVX2":
        assert not torch.equal(outs["0"], outs["1"])


_BRGEMM_ROWS_SCRIPT = r"""
import sys, torch
import flashrl_kernels as fk
from flashrl_kernels.native.quantize import qlinear_capabilities
g = torch.Generator().manual_seed(21)
cases = []
# N off the 64-row blocks, M off the 64-token blocks and the 16-row groups of the epilogue, K off 32; an odd K
# (no VNNI pairs) stays on the tiles; (130, 70, 4100): three 64-token blocks, one per pass over the weight at this
# K (the int8 / fp8 rows widened again for each pass, as in prefill calls)
# (the AMX rows driver takes K % 32 == 0: (16, 64, 64), (63, 200, 96), (1, 70, 256), (17, 129, 896), (130, 65, 4096))
for m, n, k in [(1, 70, 34), (15, 129, 130), (16, 64, 64), (63, 200, 96), (65, 131, 258), (130, 17, 1000), (20, 9, 33),
                (130, 70, 4100), (1, 70, 256), (17, 129, 896), (130, 65, 4096)]:
    x, bias = (torch.randn(m, k, generator=g) * 2).bfloat16(), torch.randn(n, generator=g)
    w = torch.randn(n, k + 3, generator=g).bfloat16()[:, 1:k + 1]  # strided rows: the head's rows are A in place
    for b in (None, bias):
        cases.append(("bf16", x, w, None, b, torch.ops.flashrl_native.bf16_linear(x, w, b)))
        for qd in (torch.int8, torch.float8_e4m3fn):
            q, s = fk.quantize_rows(w.float(), qd)
            cases.append((str(qd), x, q, s, b, torch.ops.flashrl_native.qlinear(x, q, s, b, False)))
# an in-place write into the rows is seen by the next call (nothing of the weight is packed or kept), one pass
# over the weight or several
for m, k in ((40, 128), (130, 4100)):
    q, s = fk.quantize_rows(torch.randn(96, k, generator=g), torch.float8_e4m3fn)
    x = torch.randn(m, k, generator=g).bfloat16()
    before = torch.ops.flashrl_native.qlinear(x, q, s, None, False)
    fk.quantize_rows_(torch.randn(96, k, generator=g) * 3, q, s)
    cases.append(("synced", x, q, s, None, torch.ops.flashrl_native.qlinear(x, q, s, None, False)))
    assert not torch.equal(before, cases[-1][-1])
torch.save({"caps": qlinear_capabilities(), "cases": cases}, sys.argv[1])
"""


def _rows_driver_runs(tmp_path, drivers):
    """{driver: (caps, cases)} of _BRGEMM_ROWS_SCRIPT, each driver in a fresh process with its environment."""
    import os
    import subprocess
    import sys

    runs = {}
    for driver, env_add in drivers.items():
        out = tmp_path / f"{driver}.pt"
        r = subprocess.run([sys.executable, "-c", _BRGEMM_ROWS_SCRIPT, str(out)], check=False,
                           env={**os.environ, **env_add}, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        saved = torch.load(out)
        runs[driver] = (saved["caps"], saved["cases"])
        assert len(saved["cases"]) == 11 * 2 * 3 + 2
    return runs


def _check_rows_drivers(y_cases, tile_cases):
    for (kind, x, w, s, b, y), (*_, tiles) in zip(y_cases, tile_cases):
        if kind == "bf16":
            ref = x.double() @ w.double().T + (0 if b is None else b.double())
        else:
            ref = scaled_linear_spec(x, w, s, b, False)
        _check(y, ref, torch.bfloat16)
        _check(tiles, ref, torch.bfloat16)
        # fp32 sums in another order: the two drivers agree to a bf16 rounding of the output
        assert (y.double() - tiles.double()).abs().max() <= 8e-3 * ref.abs().max(), (kind, x.shape, w.shape)


_TILES_ENV = {"FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "0", "FLASHRL_NATIVE_AMX_BF16_MIN_M": "0",
              "FLASHRL_NATIVE_AMX_HEAD_MIN_M": "0", "FLASHRL_NATIVE_EMULATE": ""}


def test_amx_rows_driver_vs_float64(tmp_path):
    """The AMX-BF16 tiles driven by the library on the weight rows (qlinear.cpp's drive_amx_rows: int8 / fp8 rows
    widened per 64-row block, bf16 rows in place; the tokens VNNI-2 packed as B; and drive_amx_wb: the widened rows
    re-laid VNNI-2 as B, the token rows as A): forced for every M in fresh processes, on real tiles where this CPU
    has AMX-BF16 (and Linux grants it), else emulated in scalar code (FLASHRL_NATIVE_EMULATE=amx, which traps on a
    tile shape the real instruction would refuse); each output against float64 and the tiles, and the two drivers'
    outputs bit for bit without a bias (the same fp32 sums in the same k order; with one, the compiler may fuse the
    epilogue's product and bias addition in one and not the other: one bf16 rounding apart). K % 32 != 0 falls back
    to the other drivers."""
    if not _caps()["bf16_dot"]:
        pytest.skip("no AVX-512 BF16 on this CPU: the bf16 rows drivers are not used here")
    real = _caps()["amx_bf16"]  # AMX-BF16 here and Linux granted the tile state
    amx_env = {"FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "0", "FLASHRL_NATIVE_AMX_BF16_MIN_M": "1",
               "FLASHRL_NATIVE_AMX_HEAD_MIN_M": "1", "FLASHRL_NATIVE_EMULATE": "" if real else "amx"}
    runs = _rows_driver_runs(tmp_path, {
        "amx": {**amx_env, "FLASHRL_NATIVE_AMX_WB_MIN_M": "0"},
        "amx_wb": {**amx_env, "FLASHRL_NATIVE_AMX_WB_MIN_M": "1"},
        "tiles": _TILES_ENV})
    for name, wb in (("amx", 0), ("amx_wb", 1)):
        caps = runs[name][0]
        assert caps["amx_bf16_min_m"] == caps["amx_head_min_m"] == 1 and caps["amx_emulated"] == (not real), caps
        assert caps["amx_wb_min_m"] == wb, caps
        _check_rows_drivers(runs[name][1], runs["tiles"][1])
    assert runs["tiles"][0]["amx_bf16_min_m"] == runs["tiles"][0]["amx_head_min_m"] == 0
    for (kind, x, _, _, b, y), (*_, y_wb) in zip(runs["amx"][1], runs["amx_wb"][1]):
        if b is None:
            assert torch.equal(y, y_wb), (kind, x.shape)
        else:
            # (plus the product's fp32 rounding where the bias cancels it)
            tol = y.float().abs() * 2.0**-7 + 1e-5 * (y.float().abs().max() + b.abs().max())
            assert ((y.float() - y_wb.float()).abs() <= tol).all(), (kind, x.shape)


def test_brgemm_rows_driver_vs_float64(tmp_path):
    """oneDNN's bf16 brgemm with the weight rows as its A operand (AMX-BF16 tiles on AMX CPUs, AVX-512 BF16 code
    here): forced for every M in a fresh process, each output checked against float64 and against the tiles,
    forced in another (on AMX CPUs the default process runs brgemm only where the amx driver refuses the shape)."""
    if not _caps()["bf16_dot"]:
        pytest.skip("no AVX-512 BF16 on this CPU: oneDNN's bf16 brgemm is not used here")
    runs = _rows_driver_runs(tmp_path, {
        "brgemm": {"FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "1", "FLASHRL_NATIVE_AMX_BF16_MIN_M": "0",
                   "FLASHRL_NATIVE_AMX_HEAD_MIN_M": "0"},
        "tiles": _TILES_ENV})
    assert runs["brgemm"][0]["bf16_brgemm_min_m"] == 1 and runs["tiles"][0]["bf16_brgemm_min_m"] == 0
    _check_rows_drivers(runs["brgemm"][1], runs["tiles"][1])


def test_direct_ops_follow_the_backend_choice():
    """direct_scaled_linear / direct_bf16_linear hand out the native op only where the native backend runs it."""
    from flashrl_kernels.ops.quantize import direct_bf16_linear, direct_scaled_linear

    q, _ = fk.quantize_rows(torch.randn(4, 64), torch.int8)
    q8, _ = fk.quantize_rows(torch.randn(4, 64), torch.float8_e4m3fn)
    with fk.use_backend("native"):
        assert direct_scaled_linear(q, False) is torch.ops.flashrl_native.qlinear
        assert (direct_scaled_linear(q, True) is torch.ops.flashrl_native.qlinear) == _caps()["w8a8"]
        assert direct_scaled_linear(q8, True) is None  # fp8 W8A8 is emulated by scaled_linear
        assert (direct_bf16_linear(torch.randn(4, 64).bfloat16()) is not None) == _caps()["vector"]
        assert direct_bf16_linear(torch.randn(4, 64)) is None
    with fk.use_backend("torch"):
        assert direct_scaled_linear(q, False) is None and direct_bf16_linear(torch.randn(4, 64).bfloat16()) is None
    with fk.use_backend("reference"):
        assert direct_scaled_linear(q, False) is None


def test_direct_op_traces_under_torch_compile():
    from flashrl_kernels.ops.quantize import direct_scaled_linear

    q, s = fk.quantize_rows(torch.randn(16, 64), torch.int8)
    with fk.use_backend("native"):
        op = direct_scaled_linear(q, False)
    f = torch.compile(lambda x: op(x, q, s, None, False), fullgraph=True)
    x = torch.randn(3, 64)
    assert torch.equal(f(x), op(x, q, s, None, False))


_FALLBACK_SCRIPT = r"""
import torch
import flashrl_kernels as fk
from flashrl_kernels.native.quantize import qlinear_capabilities
from flashrl_kernels.reference.quantize import scaled_linear_spec
caps = qlinear_capabilities()
assert not caps["w8a8"] and not caps["bf16_dot"], caps
assert caps["bf16_brgemm_min_m"] == 0 or caps["amx_bf16"], caps  # oneDNN's bf16 brgemm needs AVX-512 BF16 or AMX
g = torch.Generator().manual_seed(3)
x, w, b = torch.randn(6, 97, generator=g).bfloat16(), torch.randn(11, 97, generator=g).bfloat16(), torch.randn(11)
ref = x.double() @ w.double().T + b.double()
y = torch.ops.flashrl_native.bf16_linear(x, w, b)
assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max()
for qd in (torch.int8, torch.float8_e4m3fn):
    q, s = fk.quantize_rows(torch.randn(11, 97, generator=g), qd)
    y = torch.ops.flashrl_native.qlinear(x, q, s, b, False)
    ref = scaled_linear_spec(x, q, s, b, False)
    assert (y.double() - ref).abs().max() <= 1e-2 * ref.abs().max(), qd
try:
    torch.ops.flashrl_native.qlinear(x, q, s, b, True)
    raise AssertionError("act_quant ran on an AVX-512 build without VNNI")
except RuntimeError as e:
    assert "VNNI" in str(e)
print("ok")
"""


def test_avx512_fallbacks_without_bf16_and_vnni():
    """On AVX-512 CPUs without BF16 / VNNI (hidden here by FLASHRL_NATIVE_CPU_DISABLE) the fp32 paths run."""
    import os
    import subprocess
    import sys

    from flashrl_kernels import _native

    if _native.native_status().capability != "AVX512" or not (_caps()["bf16_dot"] or _caps()["w8a8"]):
        pytest.skip("no AVX-512 BF16 / VNNI here to hide")
    env = {**os.environ, "FLASHRL_NATIVE_CPU_DISABLE": "avx512bf16,avx512vnni"}
    r = subprocess.run([sys.executable, "-c", _FALLBACK_SCRIPT], check=False, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stdout[-2000:] + r.stderr[-2000:]


_FP8_WIDENING_SCRIPT = """
import sys, torch
import flashrl_kernels as fk
from flashrl_kernels.native.quantize import qlinear_capabilities
g = torch.Generator().manual_seed(5)
outs = []
# decode tiles (M <= 4, 5..8), the widened scratch (9..127), brgemm rows (128+ on AVX-512 BF16 CPUs, every M with AMX);
# K: one 64-weight step, 64-steps plus a 32-step plus a tail, Qwen2.5-0.5B's hidden and down sizes
for m, n, k in [(1, 7, 64), (4, 9, 130), (5, 6, 254), (8, 33, 896), (20, 5, 4864), (130, 9, 896)]:
    q, s = fk.quantize_rows(torch.randn(n, k, generator=g), torch.float8_e4m3fn)
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    outs.append(torch.ops.flashrl_native.qlinear(x, q, s, torch.randn(n, generator=g), False))
torch.save((qlinear_capabilities()["fp8_byte_tables"], outs), sys.argv[1])
"""


def test_fp8_byte_and_word_table_widenings_agree(tmp_path):
    """fp8 rows widen to bf16 by byte tables on AVX-512 VBMI CPUs and by word tables on the other BF16 CPUs (Cooper
    Lake; hidden here by FLASHRL_NATIVE_CPU_DISABLE): both exact, same dot-product order, so bit-identical outputs."""
    import os
    import subprocess
    import sys

    if not _caps()["fp8_byte_tables"]:
        pytest.skip("no AVX-512 VBMI + BF16 here: only the word-table widening runs")
    runs = {}
    for name, hide in (("bytes", ""), ("words", "avx512vbmi")):
        env = {**os.environ, "FLASHRL_NATIVE_CPU_DISABLE": hide}
        path = tmp_path / f"{name}.pt"
        r = subprocess.run([sys.executable, "-c", _FP8_WIDENING_SCRIPT, str(path)], check=False, env=env,
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        runs[name] = torch.load(path)
    assert runs["bytes"][0] is True and runs["words"][0] is False
    for a, b in zip(runs["bytes"][1], runs["words"][1]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("pair", [None, "brgemm,amx"])
def test_dispatch_bench_runs_each_driver_in_its_own_process(tmp_path, pair):
    """bench/cpu_linear_dispatch.py (how a session sets the brgemm thresholds of a CPU class, or compares the AVX2
    build's vpmaddwd and AVX-VNNI tiles; with --drivers brgemm,amx oneDNN's brgemm against the AMX tiles flashrl
    drives, emulated on CPUs without AMX): a tiny real run, and its threshold rule."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    sys.path.insert(0, str(root / "bench"))
    try:
        import cpu_linear_dispatch as bench
    finally:
        sys.path.pop(0)
    assert bench.threshold([1, 8, 32, 256], {1: 1.5, 8: 0.9, 32: 0.8, 256: 0.7}) == 8
    assert bench.threshold([1, 8, 32, 256], {1: 0.5, 8: 1.1, 32: 0.8, 256: 0.7}) == 32  # won at every larger M
    assert bench.threshold([1, 8], {1: 0.9, 8: 1.0}) == 0
    from flashrl_kernels._cpu import cpu_flags
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities

    avx2_build = packed_w8a8_capabilities()["kernel"] in ("avx2", "avx_vnni")
    if avx2_build and pair is None:  # the AVX2 build's two tile sets, int8 only
        drivers, kernels = list(bench.avx2_drivers("avx_vnni" in cpu_flags())), ("int8",)
    elif not avx2_build and _caps()["bf16_dot"] and _caps()["w8a8"]:
        drivers, kernels = (pair or "tiles,brgemm").split(","), ("int8", "fp8", "head")
    else:
        pytest.skip("no such pair of drivers in this build on this CPU")
    out = tmp_path / "dispatch.json"
    r = subprocess.run([sys.executable, str(root / "bench" / "cpu_linear_dispatch.py"), "--layers", "1", "--vocab",
                        "256", "--m", "3,20", "--rounds", "1", "--repeats", "1", "--json", str(out)]
                       + (["--drivers", pair] if pair else []),
                       capture_output=True, text=True, timeout=600, env=dict(os.environ), check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert list(res["raw"]) == drivers
    for driver in drivers:
        (run,) = res["raw"][driver]
        assert set(run["3"]) == set(kernels) and all(run[m][k] > 0 for m in ("3", "20") for k in kernels)
    assert set(res["summary"]) == set(kernels)
    assert f"| {kernels[-1]} | 20 |" in r.stdout


def test_int8_modes_bench_measures_both_modes(tmp_path):
    """bench/cpu_int8_modes.py (the measurement behind activation_quant="auto" per CPU class): a tiny real run."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "modes.json"
    r = subprocess.run([sys.executable, str(root / "bench" / "cpu_int8_modes.py"), "--layers", "1", "--m", "3",
                        "--rounds", "2", "--repeats", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=600, check=False)
    if not _caps()["w8a8"]:
        assert r.returncode != 0 and "no native W8A8 kernel" in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
        return
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {"weight-only", "w8a8"} <= set(res["raw"])
    assert all(len(res["raw"][mode]["3"]) == 2 and min(res["raw"][mode]["3"]) > 0 for mode in res["raw"])
    assert res["weight_only_over_w8a8"]["3"] > 0 and "| 3 |" in r.stdout


_LIVE_SCRIPT = r"""
import os, sys, torch
import flashrl_kernels as fk
from flashrl_kernels import _native
_native.native_status(load=True)
g = torch.Generator().manual_seed(3)
# K = 4096: long enough sums that the two summation orders round some of the 32768 outputs to other bf16 values
q, s = fk.quantize_rows(torch.randn(512, 4096, generator=g), torch.float8_e4m3fn)
x = torch.randn(64, 4096, generator=g).bfloat16()
ys = []
for v in ("0", "1", "0"):
    os.environ["FLASHRL_NATIVE_AMX_BF16_MIN_M"] = v
    ys.append(torch.ops.flashrl_native.qlinear(x, q, s, None, False))
torch.save(ys, sys.argv[1])
"""


@pytest.mark.parametrize("live", ["1", "0"])
def test_live_dispatch_switches_drivers_call_by_call(tmp_path, live):
    """FLASHRL_NATIVE_DISPATCH_LIVE=1 (bench/dispatch_ab.py's mode) reads the thresholds at every call: the AMX rows
    driver (real tiles, or emulated) and the tiles sum in another order, so flipping FLASHRL_NATIVE_AMX_BF16_MIN_M
    between calls of one process changes the output bits and flipping it back restores them; without the mode the
    first value read holds for the process."""
    import os
    import subprocess
    import sys

    if not _caps()["bf16_dot"]:
        pytest.skip("no AVX-512 BF16 on this CPU: no AMX rows driver (real or emulated) to switch to")
    real = _caps()["amx_bf16"]
    out = tmp_path / "ys.pt"
    env = {**os.environ, "FLASHRL_NATIVE_DISPATCH_LIVE": live, "FLASHRL_NATIVE_EMULATE": "" if real else "amx",
           "FLASHRL_NATIVE_BF16_BRGEMM_MIN_M": "0"}
    r = subprocess.run([sys.executable, "-c", _LIVE_SCRIPT, str(out)], env=env, capture_output=True, text=True,
                       timeout=600, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    tiles, amx, tiles_again = torch.load(out)
    assert torch.equal(tiles, tiles_again)
    if live == "1":
        assert not torch.equal(tiles, amx)
        assert (tiles.double() - amx.double()).abs().max() <= 8e-3 * tiles.double().abs().max()
    else:
        assert torch.equal(tiles, amx)


def test_dispatch_ab_bench_runs(tmp_path):
    """bench/dispatch_ab.py: a tiny real run of two variants alternated in one process, its table complete."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    if not _caps()["vector"]:
        pytest.skip("no native quantized linear in this build")
    root = Path(__file__).resolve().parents[1]
    kernels = ["int8", "fp8", "head"] if _caps()["w8a8"] else ["fp8", "head"]
    r = subprocess.run([sys.executable, str(root / "bench" / "dispatch_ab.py"), "--kernels", ",".join(kernels),
                        "--m", "3,20", "--layers", "1", "--vocab", "256", "--rounds", "2", "--variant", "base:",
                        "--variant", "nobrgemm:FLASHRL_NATIVE_BRGEMM_MIN_M=0,FLASHRL_NATIVE_BF16_BRGEMM_MIN_M=0"],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ), check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "ms" not in line]
    assert len(rows) == 2 * len(kernels)
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == 4 and all(float(c) > 0 for c in cells[1:]), line
