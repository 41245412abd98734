"""The packed W8A8 linear (csrc/cpu/qlinear_packed.cpp: AVX-512 VNNI tiles in 64-row blocks, AVX2 vpmaddwd tiles in
8-row blocks, AVX-VNNI ymm vpdpbusd tiles on the same 8-row blocks) and the quantizer that writes its layout.

flashrl_native::quantize_rows_packed must give exactly quantize_rows' codes and scales (in the packed order, with
each row's code sum); flashrl_native::qlinear_packed must equal the plain-layout W8A8 kernel bit for bit (same
integer sums, same epilogue) and the float64 spec within the dtype's tolerance, on both of its drivers (the
VNNI tiles and oneDNN's brgemm, which runs AMX-INT8 tiles on CPUs that have them and is forced here in a
subprocess with FLASHRL_NATIVE_BRGEMM_MIN_M=1; VNNI builds only).
"""
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import flashrl_kernels as fk
from flashrl_kernels import _backend
from flashrl_kernels.reference.quantize import quantize_rows_spec, scaled_linear_spec

pytestmark = pytest.mark.skipif(not _backend.native_built(), reason="native CPU kernels not built here")

TOL = {torch.float32: 2e-6, torch.bfloat16: 8e-3, torch.float16: 1e-3}


def _packed():
    from flashrl_kernels.native import quantize as nq

    if not nq.packed_w8a8_capabilities()["available"]:
        pytest.skip("the packed W8A8 kernel needs an AVX2 or AVX-512 VNNI build")
    return nq


def _pack(w):
    """(packed codes, scales, row sums) of w [N, K] through the packed quantizer."""
    nq = _packed()
    n, k = w.shape
    q = torch.empty(n, k, dtype=torch.int8)
    s = torch.empty(n)
    c = torch.empty(n, dtype=torch.int32)
    assert nq.quantize_rows_packed_(w, q, s, c, 0) == 0
    return q, s, c


@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", [(64, 4), (128, 100), (192, 896), (64, 1028)])
def test_packed_quantizer_equals_quantize_rows(wdtype, n, k):
    nq = _packed()
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * 3).to(wdtype)
    w[5] = 0.0  # a zero row: codes 0, scale 1
    w[9, 3] = float("nan")  # a non-finite row: scale NaN, codes 0 (as quantize_rows)
    q, s, c = _pack(w)
    ref_q, ref_s = quantize_rows_spec(w, torch.int8)  # the spec (the public op refuses the NaN row)
    assert torch.equal(nq.unpack_rows(q), ref_q)
    assert torch.equal(s.nan_to_num(7.0), ref_s.nan_to_num(7.0)) and s[9].isnan()
    assert torch.equal(c, ref_q.int().sum(1, dtype=torch.int32))
    assert k == 4 or not torch.equal(q, ref_q)  # really another byte order (the same one for a single k-group)
    ids = torch.tensor([n - 1, 0, 5, 9, 7, 7])
    assert torch.equal(nq.unpack_rows(q, ids), ref_q[ids])


def test_partial_writes_cross_blocks_and_count_changes():
    """Row ranges that start and end inside packed blocks (a TP shard of q/k/v) write only their rows, and the
    count is the number of codes whose value changed."""
    nq = _packed()
    g = torch.Generator().manual_seed(4)
    n, k = 256, 72
    w = torch.randn(n, k, generator=g)
    q, s, c = _pack(w)
    plain_q, plain_s = fk.quantize_rows(w, torch.int8)
    for row0, rows in ((70, 37), (0, 1), (127, 2), (200, 56), (63, 130)):
        new = w[row0:row0 + rows] + 0.02 * torch.randn(rows, k, generator=g)
        before = nq.unpack_rows(q)
        changed = nq.quantize_rows_packed_(new, q, s, c, row0, count=True)
        nq_, ns = fk.quantize_rows(new, torch.int8)
        plain_q[row0:row0 + rows], plain_s[row0:row0 + rows] = nq_, ns
        after = nq.unpack_rows(q)
        assert torch.equal(after, plain_q) and torch.equal(s, plain_s)
        assert torch.equal(c, plain_q.int().sum(1, dtype=torch.int32))
        assert changed == int((after != before).sum()) > 0


@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 33, 300])
@pytest.mark.parametrize("n,k", [(64, 4), (128, 100), (192, 896), (8, 4), (72, 36), (200, 900)])
def test_packed_linear_equals_plain_kernel_and_spec(xdtype, m, n, k):
    """Every tile shape of both kernels: tokens left over after the 4-token tiles (1-3), and on AVX2 row-block
    counts that are not multiples of the 4 blocks the 1-token tiles take."""
    nq = _packed()
    if n % nq.packed_w8a8_capabilities()["pack_rows"]:
        pytest.skip(f"N = {n} is not a whole number of this build's packed blocks")
    g = torch.Generator().manual_seed(m * 7 + n + k)
    w = torch.randn(n, k, generator=g)
    q, s, c = _pack(w)
    plain = nq.unpack_rows(q)
    x = (torch.randn(m, k, generator=g) * 3).to(xdtype)
    bias = torch.randn(n, generator=g)
    for b in (None, bias):
        y = torch.ops.flashrl_native.qlinear_packed(x, q, s, c, b)
        assert y.dtype == xdtype and y.shape == (m, n)
        assert torch.equal(y, torch.ops.flashrl_native.qlinear(x, plain, s, b, True))
        ref = scaled_linear_spec(x, plain, s, b, True)
        assert (y.double() - ref).abs().max().item() <= TOL[xdtype] * ref.abs().max().item()


def test_packed_integer_sums_are_exact_at_the_largest_k():
    """K = 65536 with codes of the largest magnitude: every (u8 + 128) x s8 sum and the row-sum offset stay exact
    in int32 (integer rows whose amax is 127 quantize to themselves with scale 1, as do the tokens)."""
    _packed()
    k, n = 65536, 64
    g = torch.Generator().manual_seed(11)
    w = torch.where(torch.rand(n, k, generator=g) < 0.5, -127.0, 127.0)
    w[::2] = 127.0  # rows of one sign: the largest sums
    q, s, c = _pack(w)
    assert torch.equal(s, torch.ones(n))
    x = torch.where(torch.rand(3, k, generator=g) < 0.5, -127.0, 127.0)
    x[0] = 127.0
    y = torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None)
    exact = x.double() @ w.double().T
    assert exact.abs().max() == k * 127 * 127  # the largest product sum (the u8 offset sum is twice it)
    assert torch.equal(y.double(), exact.float().double())


def test_nonfinite_and_zero_tokens():
    _packed()
    q, s, c = _pack(torch.randn(64, 40))
    x = torch.randn(4, 40)
    x[1] = 0.0
    x[2, 7] = float("nan")
    x[3, 3] = float("inf")
    bias = torch.randn(64)
    y = torch.ops.flashrl_native.qlinear_packed(x, q, s, c, bias)
    assert torch.isfinite(y[0]).all() and torch.equal(y[1], bias)
    assert torch.isnan(y[2]).all() and torch.isnan(y[3]).all()


def test_results_do_not_depend_on_threads():
    _packed()
    g = torch.Generator().manual_seed(2)
    q, s, c = _pack(torch.randn(320, 256, generator=g))
    x = torch.randn(67, 256, generator=g).bfloat16()
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None))
    finally:
        torch.set_num_threads(before)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_brgemm_driver_equals_the_tiles(tmp_path):
    """oneDNN's brgemm on the same bytes (AMX-INT8 tiles where the CPU has them, VNNI here) gives the same
    outputs as the tiles: each driver forced for every M in its own fresh process (on AMX CPUs the default
    process runs the amx driver from 32 tokens, so neither side is this process; both turn it off)."""
    if _packed().packed_w8a8_capabilities()["kernel"] != "avx512_vnni":
        pytest.skip("oneDNN's u8 x s8 brgemm reads the 64-row VNNI layout only (AVX2 builds have no brgemm driver)")
    code = textwrap.dedent("""
        import os, sys, torch
        from flashrl_kernels import _native
        _native.native_status(load=True)
        from flashrl_kernels.native.quantize import packed_w8a8_capabilities, quantize_rows_packed_
        assert packed_w8a8_capabilities()["brgemm_min_m"] == int(os.environ["FLASHRL_NATIVE_BRGEMM_MIN_M"])
        g = torch.Generator().manual_seed(5)
        n, k = 192, 260
        q = torch.empty(n, k, dtype=torch.int8); s = torch.empty(n); c = torch.empty(n, dtype=torch.int32)
        quantize_rows_packed_(torch.randn(n, k, generator=g), q, s, c, 0)
        cases = []
        for m in (1, 5, 31, 32, 33, 100):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                x, b = (torch.randn(m, k, generator=g) * 2).to(dt), torch.randn(n, generator=g)
                cases.append((x, b, torch.ops.flashrl_native.qlinear_packed(x, q, s, c, b)))
        torch.save(cases, sys.argv[1])
    """)
    runs = {}
    for driver, min_m in (("brgemm", "1"), ("tiles", "0")):
        out = tmp_path / f"{driver}.pt"
        env = {**os.environ, "FLASHRL_NATIVE_BRGEMM_MIN_M": min_m, "FLASHRL_NATIVE_AMX_MIN_M": "0"}
        subprocess.run([sys.executable, "-c", code, str(out)], check=True, env=env, timeout=600)
        runs[driver] = torch.load(out)
    assert len(runs["brgemm"]) == len(runs["tiles"]) == 18
    for (x, _, y_brgemm), (x_t, _, y_tiles) in zip(runs["brgemm"], runs["tiles"]):
        assert torch.equal(x, x_t)
        assert torch.equal(y_tiles, y_brgemm), (x.shape, x.dtype)


def test_amx_driver_equals_the_tiles(tmp_path):
    """The AMX-INT8 tiles driven by the library (qlinear_packed.cpp's amx driver: the tokens' codes as A, the
    packed block as B) give the tiles' outputs bit for bit: forced for every M in a fresh process, on real tiles
    where this CPU has AMX-INT8 (and Linux grants it), else emulated in scalar code (FLASHRL_NATIVE_EMULATE=amx), which also traps on
    a tile shape the real instruction would refuse. K % 64 != 0 falls back to the other drivers."""
    if _packed().packed_w8a8_capabilities()["kernel"] != "avx512_vnni":
        pytest.skip("the amx driver reads the 64-row VNNI layout of AVX-512 builds")
    code = textwrap.dedent("""
        import os, sys, torch
        from flashrl_kernels import _native
        _native.native_status(load=True)
        from flashrl_kernels.native.quantize import packed_w8a8_capabilities, quantize_rows_packed_
        caps = packed_w8a8_capabilities()
        assert caps["amx_min_m"] == int(sys.argv[2]) and caps["amx_emulated"] == (sys.argv[3] == "1"), caps
        g = torch.Generator().manual_seed(7)
        weights, cases = [], []
        for n, k in ((64, 64), (192, 256), (128, 260), (320, 896)):
            q = torch.empty(n, k, dtype=torch.int8); s = torch.empty(n); c = torch.empty(n, dtype=torch.int32)
            quantize_rows_packed_(torch.randn(n, k, generator=g) * 2, q, s, c, 0)
            weights.append((q, s, c))
            for m in (1, 3, 15, 16, 17, 40, 300):
                for dt in (torch.float32, torch.bfloat16, torch.float16):
                    x, b = (torch.randn(m, k, generator=g) * 2).to(dt), torch.randn(n, generator=g)
                    x[m // 2] = 0.0
                    if m > 2:
                        x[m - 1, k // 3] = float("nan")
                    for bias in (None, b):
                        y = torch.ops.flashrl_native.qlinear_packed(x, q, s, c, bias)
                        cases.append((len(weights) - 1, x, bias, y))
        torch.save({"weights": weights, "cases": cases}, sys.argv[1])
    """)
    real = _packed().packed_w8a8_capabilities()["amx"]  # AMX-INT8 here and Linux granted the tile state
    runs = {}
    for driver, env_add, min_m, emulated in (
            ("amx", {"FLASHRL_NATIVE_AMX_MIN_M": "1", "FLASHRL_NATIVE_EMULATE": "" if real else "amx"}, "1",
             "0" if real else "1"),
            ("tiles", {"FLASHRL_NATIVE_AMX_MIN_M": "0", "FLASHRL_NATIVE_BRGEMM_MIN_M": "0",
                       "FLASHRL_NATIVE_EMULATE": ""}, "0", "0")):
        out = tmp_path / f"{driver}.pt"
        env = {**os.environ, **env_add}
        subprocess.run([sys.executable, "-c", code, str(out), min_m, emulated], check=True, env=env, timeout=900)
        runs[driver] = torch.load(out)
    assert len(runs["amx"]["cases"]) == len(runs["tiles"]["cases"]) == 4 * 7 * 3 * 2

    def same(a, b):  # bit for bit, NaN where NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))

    for (i, x, bias, y_amx), (_, x_t, _, y_tiles) in zip(runs["amx"]["cases"], runs["tiles"]["cases"]):
        assert same(x, x_t)
        assert same(y_amx, y_tiles), (x.shape, x.dtype, runs["amx"]["weights"][i][0].shape)
        m = x.shape[0]
        zero_token = bias.to(y_amx.dtype) if bias is not None else torch.zeros_like(y_amx[0])
        assert torch.equal(y_amx[m // 2], zero_token)  # u8 codes all 128, offset by the row sums to exactly 0
        if m > 2:
            assert y_amx[m - 1].isnan().all()


_DECODE_TILES = textwrap.dedent("""
    import json, sys, torch
    from flashrl_kernels import _native
    _native.native_status(load=True)
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, quantize_rows_packed_
    caps = packed_w8a8_capabilities()
    assert caps["decode_tiles"] == json.loads(sys.argv[2]), caps
    assert caps["amx_min_m"] == caps["brgemm_min_m"] == 0, caps
    g = torch.Generator().manual_seed(11)
    n, k = 64 * 7, 192  # 7 blocks: a thread's run is long enough for prefetches 1-3 blocks ahead
    q = torch.empty(n, k, dtype=torch.int8); s = torch.empty(n); c = torch.empty(n, dtype=torch.int32)
    quantize_rows_packed_(torch.randn(n, k, generator=g), q, s, c, 0)
    b = torch.randn(n, generator=g)
    cases = []
    for m in list(range(1, 21)) + [33, 64, 70]:
        x = torch.randn(m, k, generator=g) * 2
        cases.append((x, torch.ops.flashrl_native.qlinear_packed(x, q, s, c, b)))
    torch.save({"weight": (q, s, b), "cases": cases}, sys.argv[1])
""")


def test_decode_tile_shapes_and_prefetch_do_not_change_the_outputs(tmp_path):
    """The VNNI tiles' decode shapes chosen per CPU class (one wide tile up to wide_max_m tokens, 4-token tiles
    prefetching the block pf_spread ahead from pf_min_tiles tiles, the wide tile prefetching wide_pf ahead) give
    the same outputs bit for bit at every token count 1-20 and a few prefill counts; each setting in a fresh
    process, its capabilities checked so a setting that did not take effect fails."""
    if _packed().packed_w8a8_capabilities()["kernel"] != "avx512_vnni":
        pytest.skip("the decode tile shapes are the AVX-512 VNNI tiles'")
    settings = [
        {"pf_spread": 0, "pf_min_tiles": 4, "wide_max_m": 0, "wide_pf": 0},  # plain 4-token tiles, no prefetch
        {"pf_spread": 1, "pf_min_tiles": 1, "wide_max_m": 8, "wide_pf": 1},
        {"pf_spread": 3, "pf_min_tiles": 2, "wide_max_m": 7, "wide_pf": 2},
        {"pf_spread": 1, "pf_min_tiles": 4, "wide_max_m": 5, "wide_pf": 0},
    ]
    env_names = {"pf_spread": "FLASHRL_NATIVE_PACKED_PF_SPREAD", "pf_min_tiles": "FLASHRL_NATIVE_PACKED_PF_MIN_TILES",
                 "wide_max_m": "FLASHRL_NATIVE_PACKED_WIDE_MAX_M", "wide_pf": "FLASHRL_NATIVE_PACKED_WIDE_PF"}
    runs = []
    for i, setting in enumerate(settings):
        out = tmp_path / f"s{i}.pt"
        env = {**os.environ, "FLASHRL_NATIVE_AMX_MIN_M": "0", "FLASHRL_NATIVE_BRGEMM_MIN_M": "0",
               **{env_names[key]: str(v) for key, v in setting.items()}}
        subprocess.run([sys.executable, "-c", _DECODE_TILES, str(out), json.dumps(setting)], check=True, env=env,
                       timeout=600)
        runs.append(torch.load(out))
    assert len(runs[0]["cases"]) == 23
    for run, setting in zip(runs[1:], settings[1:]):
        for (x, y0), (x1, y1) in zip(runs[0]["cases"], run["cases"]):
            assert torch.equal(x, x1)
            assert torch.equal(y0, y1), (x.shape[0], setting)
    q, s, b = runs[0]["weight"]  # the shared baseline against the float64 spec
    plain = _packed().unpack_rows(q)
    for x, y in runs[0]["cases"]:
        ref = scaled_linear_spec(x, plain, s, b, True)
        assert (y.double() - ref).abs().max().item() <= TOL[torch.float32] * ref.abs().max().item()


def test_amx_tile_instructions_are_the_ones_the_emulation_models(tmp_path):
    """The emulation checks the drivers' addressing, not the encoding of their hand-written tile instructions
    (amx_tiles.h's asm): every tdpbusd / tdpbf16ps in the library must be the instruction GCC's own intrinsics
    assemble for the (C, A, B) the drivers name, e.g. _tile_dpbusd(4, 0, 2) = tmm4 += u8 tmm0 . s8 tmm2."""
    import shutil

    from flashrl_kernels import _native

    if _packed().packed_w8a8_capabilities()["kernel"] != "avx512_vnni":
        pytest.skip("an AVX2 build: the AMX drivers are the AVX-512 build's")
    if not shutil.which("objdump") or not shutil.which("gcc"):
        pytest.skip("no objdump / gcc to assemble and disassemble with")
    # (C, A, B) of every dot product the drivers issue (qlinear_packed.cpp amx_blocks, qlinear.cpp drive_amx_rows
    # and drive_amx_wb)
    ops = {"tdpbusd": [(4, 0, 2), (5, 0, 3), (6, 0, 2), (7, 0, 3)],
           "tdpbf16ps": [(4, 0, 1), (5, 2, 1), (6, 0, 1), (7, 2, 1), (4, 0, 2), (5, 0, 3), (6, 0, 2), (7, 0, 3)]}
    src = tmp_path / "ref.c"
    body = "".join(f"  _tile_{op[1:]}({c}, {a}, {b});\n" for op, triples in ops.items() for c, a, b in triples)
    src.write_text('#include <immintrin.h>\n__attribute__((target("amx-tile,amx-int8,amx-bf16")))\n'
                   f"void f(void) {{\n{body}}}\n")
    obj = tmp_path / "ref.o"
    r = subprocess.run(["gcc", "-O2", "-c", str(src), "-o", str(obj)], check=False, capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"this gcc has no AMX intrinsics: {r.stderr[-300:]}")

    def dots(path):
        asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], check=True, capture_output=True,
                             text=True).stdout
        return {" ".join(line.split()[1:]) for line in asm.splitlines() if "tdpb" in line}

    want = dots(obj)
    assert len(want) == sum(map(len, ops.values()))
    assert dots(_native.native_status().library) == want


_EMULATED_AVX_VNNI = textwrap.dedent("""
    import sys, torch
    from flashrl_kernels import _native
    _native.native_status(load=True)
    from flashrl_kernels.native.quantize import packed_w8a8_capabilities, quantize_rows_packed_
    assert packed_w8a8_capabilities()["kernel"] == "avx_vnni_emulated", packed_w8a8_capabilities()
    g = torch.Generator().manual_seed(9)
    weights, cases = [], []
    for n, k in ((8, 4), (24, 12), (72, 36), (200, 900), (64, 1028)):
        q = torch.empty(n, k, dtype=torch.int8); s = torch.empty(n); c = torch.empty(n, dtype=torch.int32)
        quantize_rows_packed_(torch.randn(n, k, generator=g), q, s, c, 0)
        weights.append((q, s, c))
        for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 13, 33, 300):
            for dt in (torch.float32, torch.bfloat16, torch.float16):
                x, b = (torch.randn(m, k, generator=g) * 3).to(dt), torch.randn(n, generator=g)
                x[m // 2] = 0.0  # a zero token: its u8 codes are all 128, offset by the row sums to 0
                if m > 2:
                    x[m - 1, k // 2] = float("nan")
                for bias in (None, b):
                    cases.append((len(weights) - 1, x, bias, torch.ops.flashrl_native.qlinear_packed(x, q, s, c, bias)))
    # K = 65536 with the largest codes: (u8 + 128) x s8 sums and the offset exact in int32
    k = 65536
    w = torch.where(torch.rand(16, k, generator=g) < 0.5, -127.0, 127.0)
    w[::2] = 127.0
    q = torch.empty(16, k, dtype=torch.int8); s = torch.empty(16); c = torch.empty(16, dtype=torch.int32)
    quantize_rows_packed_(w, q, s, c, 0)
    x = torch.where(torch.rand(3, k, generator=g) < 0.5, -127.0, 127.0)
    x[0] = 127.0
    exact = torch.equal(torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None).double(),
                        (x.double() @ w.double().T).float().double())
    torch.save({"weights": weights, "cases": cases, "largest_k_exact": exact}, sys.argv[1])
""")


def test_avx_vnni_tiles_equal_the_plain_kernel(tmp_path):
    """The AVX-VNNI tiles (ymm vpdpbusd on AVX2 builds; Alder Lake and later client cores, Sierra Forest), run with
    their dot products emulated by AVX2 instructions (FLASHRL_NATIVE_EMULATE=avxvnni) in a fresh process, on every
    tile shape (4 x 2 blocks, 2 and 1 tokens x 4 blocks, single blocks) with zero and non-finite tokens: bit for
    bit the plain-layout kernel here, and this process's packed kernel (vpmaddwd tiles, or the real AVX-VNNI
    instruction on CPUs that have it)."""
    if _packed().packed_w8a8_capabilities()["kernel"] not in ("avx2", "avx_vnni"):
        pytest.skip("the AVX-VNNI tiles are the AVX2 build's (8-row blocks); this build runs the AVX-512 ones")
    out = tmp_path / "avx_vnni.pt"
    env = {**os.environ, "FLASHRL_NATIVE_EMULATE": "avxvnni"}
    subprocess.run([sys.executable, "-c", _EMULATED_AVX_VNNI, str(out)], check=True, env=env, timeout=600)
    saved = torch.load(out)
    assert saved["largest_k_exact"]
    assert len(saved["cases"]) == 5 * 12 * 3 * 2
    from flashrl_kernels.native.quantize import unpack_rows

    def same(a, b):  # bit for bit, NaN where NaN
        return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))

    for i, x, bias, y in saved["cases"]:
        q, s, c = saved["weights"][i]
        plain = torch.ops.flashrl_native.qlinear(x, unpack_rows(q), s, bias, True)
        assert same(y, plain), (x.shape, x.dtype, q.shape)
        assert same(y, torch.ops.flashrl_native.qlinear_packed(x, q, s, c, bias)), (x.shape, x.dtype)
        m = x.shape[0]
        if m > 2:
            assert y[m - 1].isnan().all() and y[:m - 1].isfinite().all()


def test_avx2_build_encodes_vpdpbusd_without_evex():
    """AVX-VNNI CPUs without AVX-512 (Alder Lake, Sierra Forest) fault on the EVEX vpdpbusd that the plain mnemonic
    assembles to, while AVX-512 machines, where the suite may run the real instruction, would not notice: every
    vpdpbusd in an AVX2 build's library must carry the VEX prefix."""
    import shutil

    from flashrl_kernels import _native

    if _packed().packed_w8a8_capabilities()["kernel"] not in ("avx2", "avx_vnni"):
        pytest.skip("an AVX-512 build: its vpdpbusd are EVEX, run only where AVX-512 VNNI is")
    if not shutil.which("objdump"):
        pytest.skip("no objdump to disassemble the library with")
    asm = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(_native.native_status().library)],
                         check=True, capture_output=True, text=True).stdout
    dots = [line for line in asm.splitlines() if "vpdpbusd" in line]
    assert dots and all("{vex} vpdpbusd" in line and "%ymm" in line for line in dots), dots[:5]


def test_avx2_build_picks_avx_vnni_where_the_cpu_has_it():
    """On AVX2 builds the packed kernel is the AVX-VNNI tiles exactly when the CPU lists avx_vnni (and
    FLASHRL_NATIVE_CPU_DISABLE does not hide it), else the vpmaddwd tiles."""
    from flashrl_kernels._cpu import cpu_flags

    kernel = _packed().packed_w8a8_capabilities()["kernel"]
    if kernel not in ("avx2", "avx_vnni"):
        pytest.skip("an AVX-512 build: the AVX-VNNI tiles are the AVX2 build's")
    if not cpu_flags():
        pytest.skip("no /proc/cpuinfo to read the CPU's flags from")
    hidden = "avxvnni" in os.environ.get("FLASHRL_NATIVE_CPU_DISABLE", "")
    assert kernel == ("avx_vnni" if "avx_vnni" in cpu_flags() and not hidden else "avx2")


def test_in_place_write_is_seen_by_the_next_call():
    nq = _packed()
    g = torch.Generator().manual_seed(8)
    q, s, c = _pack(torch.randn(128, 96, generator=g))
    ptrs = (q.data_ptr(), s.data_ptr(), c.data_ptr())
    x = torch.randn(3, 96, generator=g).bfloat16()
    w2 = torch.randn(128, 96, generator=g) * 4
    nq.quantize_rows_packed_(w2, q, s, c, 0)
    assert (q.data_ptr(), s.data_ptr(), c.data_ptr()) == ptrs
    ref_q, ref_s = fk.quantize_rows(w2, torch.int8)
    assert torch.equal(torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None),
                       torch.ops.flashrl_native.qlinear(x, ref_q, ref_s, None, True))


def test_packed_op_traces_under_torch_compile():
    _packed()
    q, s, c = _pack(torch.randn(64, 32))

    @torch.compile(fullgraph=True, backend="eager")
    def f(x):
        return torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None) * 2

    x = torch.randn(5, 32)
    assert torch.equal(f(x), torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None) * 2)


def test_bad_arguments():
    nq = _packed()
    q, s, c = _pack(torch.randn(64, 32))
    x = torch.randn(2, 32)
    op = torch.ops.flashrl_native.qlinear_packed
    with pytest.raises(RuntimeError, match="packed layout"):
        op(x[:, :30], torch.zeros(64, 30, dtype=torch.int8), s, c, None)  # K % 4
    with pytest.raises(RuntimeError, match="packed layout"):  # N % 64 (AVX-512) or % 8 (AVX2)
        op(x, torch.zeros(68, 32, dtype=torch.int8), torch.ones(68), torch.zeros(68, dtype=torch.int32), None)
    with pytest.raises(RuntimeError, match="comp must be"):
        op(x, q, s, c.float(), None)
    with pytest.raises(RuntimeError, match="scale must be"):
        op(x, q, s[:10], c, None)
    with pytest.raises(RuntimeError, match="x \\[M, K\\]"):
        op(torch.randn(2, 31), q, s, c, None)
    with pytest.raises(RuntimeError, match="outside the weight"):
        nq.quantize_rows_packed_(torch.randn(10, 32), q, s, c, 60)
    with pytest.raises(RuntimeError, match="comp_out must be"):
        nq.quantize_rows_packed_(torch.randn(10, 32), q, s, c[:10], 0)
    with pytest.raises(RuntimeError, match="outside \\[0, 64\\)"):
        nq.unpack_rows(q, torch.tensor([64]))


def test_layout_fits_only_whole_blocks():
    nq = _packed()
    assert nq.packed_w8a8_fits((896, 896)) and nq.packed_w8a8_fits((151936, 896))
    assert not nq.packed_w8a8_fits((100, 896)) and not nq.packed_w8a8_fits((128, 30))
    assert not nq.packed_w8a8_fits((64, 65540))


_THP_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from flashrl_kernels import _native
    _native.native_status(load=True)
    from flashrl_kernels.native.quantize import quantize_rows_packed_
    g = torch.Generator().manual_seed(3)
    q = torch.empty(4096, 256, dtype=torch.int8); s = torch.empty(4096); c = torch.empty(4096, dtype=torch.int32)
    quantize_rows_packed_(torch.randn(4096, 256, generator=g), q, s, c, 0)
    x = torch.randn(2048, 256, generator=g).bfloat16()
    ys = [torch.ops.flashrl_native.qlinear_packed(x, q, s, c, None) for _ in range(2)]  # 16 MB each
    # any fp8 rows (the packed bytes read as e4m3): only the output's pages matter here
    yf = torch.ops.flashrl_native.qlinear(x, q.view(torch.float8_e4m3fn), s, None, False)
    def huge_kb(t):  # AnonHugePages of the mappings over t's data (the advice splits a mapping in three)
        p0, p1 = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
        total, inside = 0, False
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(v, 16) for v in head.split("-"))
                inside = lo < p1 and p0 < hi
            elif inside and line.startswith("AnonHugePages:"):
                total += int(line.split()[1])
        return total
    json.dump({"packed": [huge_kb(y) for y in ys], "fp8": huge_kb(yf), "same": torch.equal(ys[0], ys[1])},
              open(sys.argv[1], "w"))
""")


@pytest.mark.parametrize("thp", ["1", "0"])
def test_large_linear_outputs_ask_for_huge_pages(tmp_path, thp):
    """A prefill-sized output (16 MB here) is madvise(MADV_HUGEPAGE)'d before the kernel writes it
    (csrc/cpu/linear_memory.h): on a system whose THP mode is "madvise" its mapping then holds huge pages, and with
    FLASHRL_NATIVE_THP=0 none; its values are the same either way. Fresh processes, as the engines start."""
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        pytest.skip("no /sys/kernel/mm/transparent_hugepage: not Linux, or THP not built in")
    if "[madvise]" not in mode:
        pytest.skip(f"THP mode {mode.strip()!r}: the advice is only observable where THP is madvise-only")
    out = tmp_path / "thp.json"
    subprocess.run([sys.executable, "-c", _THP_SCRIPT, str(out)], check=True, timeout=600,
                   env={**os.environ, "FLASHRL_NATIVE_THP": thp})
    got = json.loads(out.read_text())
    assert got["same"]
    if thp == "1":
        # (a huge page can be refused when memory is fragmented; most of 16 MB is not)
        assert all(kb >= 8192 for kb in got["packed"]), got
        assert got["fp8"] >= 8192, got
    else:
        assert got["packed"] == [0, 0] and got["fp8"] == 0, got
