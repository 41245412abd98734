"""Compile every Triton kernel the public ops launch, for GPUs that are not here.

`run_audit(archs)` compiles each kernel at the specializations the launch wrappers
pick for real shapes, for sm_80 / sm_86 / sm_90 / sm_100 and gfx942, without a GPU
(triton.compile with a GPUTarget given by hand), and reports per kernel and target:
compile errors, registers, spills (local / scratch memory), shared memory against the
architecture's limit, an occupancy estimate and the width of the global loads.

How the specializations are obtained: each spec calls the backend wrapper in
flashrl_kernels/triton_impl with small CPU tensors whose dtypes, flags and the sizes that
select constexprs (vocab, hidden, typical sequence length) are the real ones; the kernel
object is replaced by a recorder that captures the launch (arguments, constexprs,
num_warps) and aborts it. The recorded arguments then go through Triton's own binder
(`create_function_from_signature` + `JITFunction._pack_args`, as at a real launch), so
the signature, the constexprs and the divisibility attributes are those a GPU launch
would compile. Limits: row counts only change the grid (never compiled in), and a CPU
allocation's alignment (>= 64 bytes) stands in for CUDA's (256 bytes); the numbers are
what the compiler emits, nothing here has run on a GPU.

The kernels must be real `triton.jit` functions: when TRITON_INTERPRET was set before
flashrl_kernels.triton_impl was imported (the test suite does that on a CPU machine),
`run_audit` runs itself in a fresh subprocess without it.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator

import torch

from flashrl_kernels._cpu import usable_cpus

# ---- targets ----


@dataclasses.dataclass(frozen=True)
class Arch:
    key: str            # what --arch takes: "80", "gfx942"
    label: str
    backend: str        # "cuda" | "hip"
    arch: int | str
    warp_size: int
    regs_per_sm: int    # 32-bit registers per SM (CUDA); per SIMD lane file (AMD: VGPRs per lane)
    max_warps_per_sm: int
    max_blocks_per_sm: int
    shared_limit: int   # bytes one block may use (opt-in maximum) / LDS per workgroup
    shared_per_sm: int  # bytes per SM / CU

    def target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget(self.backend, self.arch, self.warp_size)


ARCHS = {
    "80": Arch("80", "sm_80 (A100)", "cuda", 80, 32, 65536, 64, 32, 163 * 1024, 164 * 1024),
    "86": Arch("86", "sm_86 (RTX 30xx / A10)", "cuda", 86, 32, 65536, 48, 16, 99 * 1024, 100 * 1024),
    "90": Arch("90", "sm_90 (H100 / H200)", "cuda", 90, 32, 65536, 64, 32, 227 * 1024, 228 * 1024),
    "100": Arch("100", "sm_100 (B200)", "cuda", 100, 32, 65536, 64, 32, 227 * 1024, 228 * 1024),
    # MI300: 4 SIMDs per CU, 512 VGPRs per lane per SIMD, at most 8 waves per SIMD
    "gfx942": Arch("gfx942", "gfx942 (MI300X)", "hip", "gfx942", 64, 512, 32, 32, 64 * 1024, 64 * 1024),
}
DEFAULT_ARCHS = ("80", "86", "90", "100", "gfx942")


def parse_archs(text: str | Iterable[str]) -> list[str]:
    keys = [a.strip().lower().removeprefix("sm_") for a in (text.split(",") if isinstance(text, str) else text)]
    keys = [k for k in keys if k]
    bad = [k for k in keys if k not in ARCHS]
    if bad:
        raise ValueError(f"unknown arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")
    return keys


# ---- recording launches ----


class _LaunchCaptured(Exception):
    def __init__(self, launch):
        super().__init__("launch captured")
        self.launch = launch


@dataclasses.dataclass
class Launch:
    kernel_name: str
    fn: object          # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a JITFunction: `kernel[grid](*args, **kwargs)` records the launch and aborts it."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            raise _LaunchCaptured(Launch(self.fn.__name__, self.fn, args, dict(kwargs)))

        return launch


@contextlib.contextmanager
def _recording(module, name: str) -> Iterator[None]:
    original = getattr(module, name)
    setattr(module, name, _Recorder(original))
    try:
        yield
    finally:
        setattr(module, name, original)


def capture(module, kernel_attr: str, call: Callable[[], object]) -> Launch:
    """Run `call` (a triton_impl wrapper) with `module.kernel_attr` replaced by a recorder; return its launch."""
    with _recording(module, kernel_attr):
        try:
            call()
        except _LaunchCaptured as done:
            return done.launch
    raise RuntimeError(f"{module.__name__}.{kernel_attr} was not launched by the wrapper")


# ---- the specializations ----


@dataclasses.dataclass
class Spec:
    kernel: str
    label: str
    streaming: bool     # a memory-bound streaming loop whose load width matters
    build: Callable[[], Launch]
    archs: tuple[str, ...] | None = None  # the targets whose dispatch picks this specialization (None: all)


BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
FP8 = torch.float8_e4m3fn
# 32003 (Llama-2 with 3 added tokens: no multiple of 16), 129920, 151936 (Qwen2.5-0.5B), 152064 (Qwen2.5-7B). The hidden size
# selects no Triton constexpr (the lm_head GEMMs are cuBLAS); the quantized linear's K does (its specs below).
VOCABS = (32003, 129920, 151936, 152064)


def _dt(d: torch.dtype) -> str:
    return str(d).removeprefix("torch.")


def _cu(nseq: int, length: int) -> torch.Tensor:
    return torch.arange(nseq + 1, dtype=torch.int64) * length


def _quantize_specs(quick: bool) -> list[Spec]:
    from .triton_impl import quantize as m

    out = []
    ks = (896, 4096, 8192, 18944) if not quick else (4096, 18944)  # 18944: Qwen-7B's MLP, the two-loop path
    wdts = (BF16, FP16, FP32) if not quick else (BF16,)
    for wdt in wdts:
        for qdt in (torch.int8, FP8):
            for k in ks:
                def build(wdt=wdt, qdt=qdt, k=k):
                    w = torch.zeros(2, k, dtype=wdt)
                    return capture(m, "_quantize_rows_kernel", lambda: m.quantize_rows(w, qdt))
                out.append(Spec("quantize_rows", f"w {_dt(wdt)} -> {_dt(qdt)}, K={k}", True, build))
    return out


def _token_logprobs_specs(quick: bool) -> list[Spec]:
    from .triton_impl import logprobs as m

    out = []
    vocabs = VOCABS if not quick else (32003, 151936)
    dts = (BF16, FP16, FP32) if not quick else (BF16, FP32)
    for dt in dts:
        for v in vocabs:
            for ent in (True, False):
                for temp, ign in ((1.0, None), (0.7, -100)) if not quick else ((1.0, None),):
                    tag = f"{_dt(dt)} V={v} entropy={'on' if ent else 'off'} T={temp} ignore={ign}"

                    def fwd(dt=dt, v=v, ent=ent, temp=temp, ign=ign):
                        x = torch.zeros(2, 3, v, dtype=dt)
                        t = torch.zeros(2, 3, dtype=torch.int64)
                        return capture(m, "_token_logprobs_fwd_kernel",
                                       lambda: m.token_logprobs_forward(x, t, temp, ign, ent))

                    def bwd(dt=dt, v=v, ent=ent, temp=temp, ign=ign):
                        x = torch.zeros(2, 3, v, dtype=dt)
                        t = torch.zeros(2, 3, dtype=torch.int64)
                        f = torch.zeros(2, 3)
                        return capture(m, "_token_logprobs_bwd_kernel", lambda: m.token_logprobs_backward(
                            f, f if ent else None, x, t, f.reshape(-1), f.reshape(-1), temp, ign))

                    out.append(Spec("token_logprobs_fwd", tag, True, fwd))
                    out.append(Spec("token_logprobs_bwd", tag, True, bwd))
    return out


def _linear_specs(quick: bool) -> list[Spec]:
    from .torch_impl.linear_logprobs import tile_shape
    from .triton_impl import linear_logprobs as m

    out = []
    cuda = torch.device("cuda")  # tile_shape reads only the device type: the GPU tiling, computed here
    vocabs = VOCABS if not quick else (151936,)
    for v in vocabs:
        widths = []
        for n in (1, 65536) if not quick else (65536,):
            _, cols = tile_shape(n, v, cuda)
            widths.append((n, cols, ""))
            if v % cols and not quick:  # the vocabulary's last block is narrower (32003 = 7 x 4096 + 3331)
                widths.append((n, v % cols, " last block"))
        for n, cols, last in widths:
            for bias in (False, True):
                for ent in (True, False):
                    tag = f"V={v} rows={n} (tile cols {cols}{last}) bias={'on' if bias else 'off'} entropy={ent}"

                    def fwd(cols=cols, bias=bias, ent=ent):
                        z = torch.zeros(2, cols)
                        b = torch.zeros(cols, dtype=BF16) if bias else None
                        t = torch.zeros(2, dtype=torch.int64)
                        r = torch.zeros(2)
                        return capture(m, "_linear_fwd_tile_kernel",
                                       lambda: m._fwd_epilogue(z, b, t, 1.0, ent, r, r, r, r))

                    out.append(Spec("linear_logprobs_fwd_tile", tag, True, fwd))
                    for odt in (BF16, FP16, FP32) if not quick else (BF16, FP32):
                        def bwd(cols=cols, bias=bias, ent=ent, odt=odt):
                            z = torch.zeros(2, cols)
                            b = torch.zeros(cols, dtype=BF16) if bias else None
                            t = torch.zeros(2, dtype=torch.int64)
                            r = torch.zeros(2)
                            return capture(m, "_linear_bwd_tile_kernel", lambda: m._bwd_epilogue(
                                z, b, t, 0.7, r, r, r, r if ent else None, odt, out=z if odt == FP32 else None))

                        out.append(Spec("linear_logprobs_bwd_tile", f"{tag} dZ {_dt(odt)}", True, bwd))
    return out


_TIS_MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _policy_specs(quick: bool) -> list[Spec]:
    from .triton_impl import policy_loss as m

    combos = []
    lengths = (512, 8192) if not quick else (8192,)  # 8192: the largest tile (BLOCK 1024)
    for length in lengths:
        for level in ("token", "sequence", "sequence_token"):
            tis_modes = _TIS_MODES if not quick else {"token": ("token_truncate",), "sequence": ("sequence_mask",),
                                                      "sequence_token": ("none",)}[level]
            for tis in tis_modes:
                for agg in ("token-mean", "seq-mean-token-mean") if not quick else ("seq-mean-token-mean",):
                    combos.append((length, level, tis, agg, True, True, FP32))
    # the optional inputs / dtypes, at one setting each
    combos += [(1024, "token", "none", "token-mean", False, False, FP32),
               (1024, "token", "token_mask", "token-mean", True, False, BF16),
               (64, "sequence", "sequence_truncate", "seq-mean-token-sum", False, True, FP32)]
    out = []
    for length, level, tis, agg, extras, has_mask, dt in combos:
        tag = f"len={length} {level} TIS={tis} {agg} mask={has_mask} ref/ent/dual={extras} {_dt(dt)}"

        def fwd(length=length, level=level, tis=tis, agg=agg, extras=extras, has_mask=has_mask, dt=dt):
            nseq = 2
            n = nseq * length
            lp = torch.zeros(n, dtype=dt)
            mask = torch.ones(n, dtype=torch.bool) if has_mask else None
            roll = lp if (tis != "none" or extras) else None
            return capture(m, "_policy_loss_fwd_kernel", lambda: m.policy_loss_forward(
                lp, lp, torch.zeros(n), mask, _cu(nseq, length), roll, lp if extras else None,
                lp if extras else None, None, 0.2, 0.28, 3.0 if extras else 0.0, level, tis, 0.5, 2.0, "mean", agg,
                0.01 if extras else 0.0, 0.001 if extras else 0.0, 1.0, length))

        def fwd_cuda(fwd=fwd):
            # the launch on an NVIDIA GPU (the register cap; compile_one drops it for HIP, as the wrapper does)
            with _patched(m, "register_cap", lambda device: {"maxnreg": 128}):
                return fwd()

        out.append(Spec("policy_loss_fwd", tag, True, fwd_cuda))
    for length in lengths:
        for has_seq, has_mask, has_ent in ((False, False, False), (True, True, True), (True, False, True)):
            tag = f"len={length} seq_coef={has_seq} mask={has_mask} entropy={has_ent}"

            def bwd(length=length, has_seq=has_seq, has_mask=has_mask, has_ent=has_ent):
                nseq = 2
                n = nseq * length
                g = torch.zeros(n)
                return capture(m, "_policy_loss_bwd_kernel", lambda: m.policy_loss_backward(
                    torch.ones(()), g, g if has_ent else g.new_empty(0), torch.zeros(nseq if has_seq else 0),
                    torch.ones(n, dtype=torch.bool) if has_mask else None, _cu(nseq, length), torch.ones(()), length))

            out.append(Spec("policy_loss_bwd", tag, True, bwd))
    out += _finalize_specs()
    return out


def _finalize_specs() -> list[Spec]:
    """The one-program merge + finalize after the loss kernels (triton_impl/loss_finalize.py)."""
    from .torch_impl.policy_loss import N_STATS as POLICY_STATS
    from .torch_impl.value_loss import N_STATS as VALUE_STATS
    from .triton_impl import loss_finalize as m

    out = []
    for has_norm, agg in ((False, "token-mean"), (True, "seq-mean-token-mean")):
        def policy(has_norm=has_norm, agg=agg):
            return capture(m, "_policy_finalize_kernel", lambda: m.policy_finalize(
                torch.zeros(256, POLICY_STATS), torch.ones(()) if has_norm else None, 0.0, agg))

        def value(has_norm=has_norm, agg=agg):
            return capture(m, "_value_finalize_kernel", lambda: m.value_finalize(
                torch.zeros(256 * 3, VALUE_STATS), 3, torch.ones(()) if has_norm else None, 0.0, agg))

        out.append(Spec("policy_finalize", f"{agg} normalizer={has_norm}", False, policy))
        out.append(Spec("value_finalize", f"{agg} normalizer={has_norm}", False, value))
    return out


def _value_specs(quick: bool) -> list[Spec]:
    from .triton_impl import value_loss as m

    out = []
    for length in (256, 4096) if not quick else (4096,):
        for dt in (BF16, FP32) if not quick else (BF16,):
            for has_mask, clip, agg in ((True, 0.2, "seq-mean-token-mean"), (False, 0.0, "token-mean"),
                                        (True, 0.0, "token-mean")):
                tag = f"len={length} {_dt(dt)} mask={has_mask} clip={clip} {agg}"

                def fwd(length=length, dt=dt, has_mask=has_mask, clip=clip, agg=agg):
                    nseq = 2
                    n = nseq * length
                    v = torch.zeros(n, dtype=dt)
                    mask = torch.ones(n, dtype=torch.bool) if has_mask else None
                    return capture(m, "_value_loss_fwd_kernel", lambda: m.value_loss_forward(
                        v, v, v, mask, _cu(nseq, length), None, clip, agg, 1.0, length, True))

                out.append(Spec("value_loss_fwd", tag, True, fwd))
    for dt in (BF16, FP16, FP32) if not quick else (BF16, FP32):
        def bwd(dt=dt):
            g = torch.zeros(4099)  # N not a multiple of 16: only the last block needs a mask
            return capture(m, "_value_loss_bwd_kernel",
                           lambda: m.value_loss_backward(torch.ones(()), g, torch.ones(()), dt))

        out.append(Spec("value_loss_bwd", f"grad {_dt(dt)}", True, bwd))
    return out


def _gae_specs(quick: bool) -> list[Spec]:
    from .triton_impl import gae as m

    out = []
    # float64 scans on the data-centre targets, fp32 on sm_86 (1/64-rate float64; triton_impl/gae.accumulate_fp64)
    for fp64, archs in ((True, ("80", "90", "100", "gfx942")), (False, ("86",))):
        for length in (64, 2048) if not quick else (2048,):
            for has_mask, two, whiten in ((True, True, True), (False, False, False), (True, False, True)):
                tag = (f"len={length} mask={has_mask} critic_lam={'own' if two else 'lam'} whiten={whiten} "
                       f"{'float64' if fp64 else 'fp32'} scans")

                def fwd(length=length, has_mask=has_mask, two=two, whiten=whiten, fp64=fp64):
                    nseq = 2
                    n = nseq * length
                    r = torch.zeros(n)
                    lam = torch.ones(nseq, dtype=torch.float64)
                    with _patched(m, "accumulate_fp64", lambda device: fp64):
                        return capture(m, "_gae_fwd_kernel", lambda: m.gae_forward(
                            r, r, torch.ones(n, dtype=torch.bool) if has_mask else None, _cu(nseq, length), lam,
                            torch.ones(nseq, dtype=torch.float64) if two else lam, 1.0, whiten, length))

                out.append(Spec("gae_fwd", tag, False, fwd, archs))
    for has_mask in (True, False):
        def whiten(has_mask=has_mask):
            from .triton_impl import gae as g

            # the whitening launch comes after the scan; let the scan "run" as a no-op
            with _recording(g, "_whiten_kernel"), _noop(g, "_gae_fwd_kernel"):
                try:
                    n = 4098  # N not a multiple of 16: only the last block needs a mask
                    r = torch.zeros(n)
                    lam = torch.ones(2, dtype=torch.float64)
                    seq = torch.zeros(2, 3)
                    with _patched(g, "merge_moments", lambda s: (torch.zeros(2), seq)):
                        g.gae_forward(r, r, torch.ones(n, dtype=torch.bool) if has_mask else None, _cu(2, n // 2),
                                      lam, lam, 1.0, True, n // 2)
                except _LaunchCaptured as done:
                    return done.launch
            raise RuntimeError("the whitening kernel was not launched")

        out.append(Spec("gae_whiten", f"mask={has_mask}", True, whiten))
    return out


def _qlinear_specs(quick: bool) -> list[Spec]:
    """The quantized linear's Triton kernels (triton_impl/qlinear.py) at the specializations its selection picks:
    decode (M = 1, split K), M = 32 / 64, prefill (M = 4096) on Qwen-7B-like layers, per weight format and decode
    mode (integer fp8 decoding below sm_89 and on ROCm, the hardware conversion on sm_89+)."""
    from .triton_impl import qlinear as m

    nv = ("80", "86", "90", "100")
    pre89, post89, hip = ("80", "86"), ("90", "100"), ("gfx942",)
    out = []

    def add(tag, x_codes, decode, xdt, qdt, mm, n, k, archs, bias=True, streaming=True):
        groups = []  # (targets, capability the plan is made for)
        for is_hip in (False, True):
            targets = tuple(a for a in archs if (a == "gfx942") == is_hip)
            if x_codes in (0, 1) and not is_hip and "90" in targets:  # sm_90: own INT8 tiles, transposed W8A16
                groups.append((("90",), (9, 0), False))
                targets = tuple(a for a in targets if a != "90")
            if targets:
                groups.append((targets, None, is_hip))
        for targets, cap, is_hip in groups:
            plan = m.plan_tiles(mm, n, k, 304 if is_hip else 132, is_hip, 4 if xdt == FP32 else 2,
                                int8_dot=x_codes == 1, capability=cap, weight_only=x_codes == 0)

            def build(x_codes=x_codes, decode=decode, xdt=xdt, qdt=qdt, mm=mm, n=n, k=k, bias=bias, plan=plan):
                x = torch.zeros(mm, k, dtype=xdt)
                q = torch.zeros(n, k, dtype=qdt)
                s = torch.zeros(n)
                xs = torch.zeros(mm) if x_codes else None
                b = torch.zeros(n, dtype=BF16) if bias else None
                return capture(m, "_w8_linear_kernel", lambda: m.w8_linear(
                    x, xs, q, s, b, BF16 if xdt != FP16 else FP16, x_codes, decode, plan, for_gpu=True))

            label = (f"{tag} M={mm} N={n} K={k} tile {plan.block_m}x{plan.block_n}x{plan.block_k} "
                     f"split {plan.split_k} stages {plan.num_stages}" + (" transposed" if plan.swap_ab else ""))
            out.append(Spec("w8_linear", label, streaming, build, targets))

    i8 = torch.int8
    # weight-only (W8A16): int8 everywhere; fp8 by integer decoding (sm_80/86, MI300) or the hardware (sm_89+:
    # e4m3 -> f16 conversion, then integer ops to bf16, mode 3; fp16 activations take the conversion alone)
    add("w8a16 int8 x bf16", 0, 0, BF16, i8, 1, 4096, 4096, nv + hip)
    add("w8a16 fp8(int decode) x bf16", 0, 1, BF16, FP8, 1, 4096, 4096, pre89 + hip)
    add("w8a16 fp8(hw cvt) x bf16", 0, 3, BF16, FP8, 1, 4096, 4096, post89)
    add("w8a16 int8 x bf16", 0, 0, BF16, i8, 4096, 4096, 4096, nv + hip, streaming=False)
    add("w8a16 fp8(int decode) x bf16", 0, 1, BF16, FP8, 4096, 4096, 4096, pre89 + hip, streaming=False)
    # W8A8: int8 dot (small M; large M without torch._int_mm), fp8 codes widened to bf16 (no fp8 tensor cores)
    add("w8a8 int8", 1, 0, torch.int8, i8, 1, 4096, 4096, nv + hip)
    add("w8a8 fp8 widened(int decode)", 2, 1, FP8, FP8, 1, 4096, 4096, pre89 + hip)
    if not quick:
        add("w8a16 fp8(hw cvt) x bf16", 0, 3, BF16, FP8, 4096, 4096, 4096, post89, streaming=False)
        add("w8a16 fp8(hw cvt) x fp16", 0, 3, FP16, FP8, 256, 4096, 4096, post89)
        add("w8a16 int8 x bf16", 0, 0, BF16, i8, 256, 4096, 4096, nv + hip)
        add("w8a16 int8 x fp16", 0, 0, FP16, i8, 32, 18944, 4096, nv + hip)
        add("w8a16 int8 x bf16", 0, 0, BF16, i8, 64, 4096, 18944, nv + hip)
        add("w8a16 int8 x bf16 (K not a multiple of 128)", 0, 0, BF16, i8, 16, 896, 1000, nv + hip)
        add("w8a16 int8 x fp32 (ieee dot)", 0, 0, FP32, i8, 1, 896, 896, nv + hip, bias=False)
        add("w8a8 int8", 1, 0, torch.int8, i8, 64, 18944, 4096, nv + hip)
        add("w8a8 int8", 1, 0, torch.int8, i8, 4096, 4096, 4096, nv + hip, streaming=False)
        add("w8a8 fp8 widened(int decode)", 2, 1, FP8, FP8, 4096, 4096, 4096, pre89 + hip, streaming=False)
        add("w8a8 fp8 widened(hw cvt)", 2, 3, FP8, FP8, 1, 4096, 4096, post89)

    # the epilogue pass: split-K partials (fp32 / int32) and torch._int_mm's int32 output
    for x_codes, pdt, odt in ((1, torch.int32, BF16), (0, FP32, BF16), (2, FP32, FP16)) if not quick else (
            (1, torch.int32, BF16),):
        def epi(x_codes=x_codes, pdt=pdt, odt=odt):
            part = torch.zeros(4, 16, 4096, dtype=pdt)
            y = torch.zeros(16, 4096, dtype=odt)
            s = torch.zeros(4096)
            return capture(m, "_w8_epilogue_kernel", lambda: m._epilogue(
                part, torch.zeros(16) if x_codes else None, s, torch.zeros(4096, dtype=odt), y, 4, x_codes))

        out.append(Spec("w8_epilogue", f"partials {_dt(pdt)} -> {_dt(odt)} x_codes={x_codes}", True, epi))
    return out


@contextlib.contextmanager
def _patched(module, name, value):
    original = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, original)


class _NoopKernel:
    def __getitem__(self, grid):
        return lambda *a, **k: None


@contextlib.contextmanager
def _noop(module, name):
    with _patched(module, name, _NoopKernel()):
        yield


SPEC_FAMILIES = {
    "quantize": _quantize_specs,
    "token_logprobs": _token_logprobs_specs,
    "linear_logprobs": _linear_specs,  # also the fused policy head's epilogues (triton_impl/linear_policy_loss.py)
    "policy_loss": _policy_specs,
    "value_loss": _value_specs,
    "gae": _gae_specs,
    "qlinear": _qlinear_specs,
}


def all_specs(quick: bool = False) -> list[Spec]:
    return [s for family in SPEC_FAMILIES.values() for s in family(quick)]


# ---- compiling ----


def _bind(launch: Launch, target):
    """(signature, constexprs, attrs, options) exactly as JITFunction.run computes them for this target."""
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = launch.fn
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound_args, specialization, options = binder(*launch.args, **launch.kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, launch.kwargs, bound_args, specialization, options)
    return signature, constexprs, attrs, options


_CUDA_ONLY_OPTIONS = ("maxnreg",)


def for_backend(launch: Launch, arch: Arch) -> Launch:
    """The launch as the wrappers make it for this backend: CUDA-only launch options (maxnreg) are not passed on
    ROCm (Triton's HIP backend rejects them)."""
    if arch.backend == "cuda" or not any(k in launch.kwargs for k in _CUDA_ONLY_OPTIONS):
        return launch
    kwargs = {k: v for k, v in launch.kwargs.items() if k not in _CUDA_ONLY_OPTIONS}
    return dataclasses.replace(launch, kwargs=kwargs)


def _compile_key(launch: Launch, signature, constexprs, attrs, options) -> str:
    consts = {str(k): str(v) for k, v in constexprs.items()}
    return json.dumps([launch.kernel_name, signature, consts, {str(k): str(v) for k, v in attrs.items()},
                       options.num_warps, options.num_stages, getattr(options, "maxnreg", None)], sort_keys=True)


_RES_RE = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def _nvidia_tool(name: str) -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
    return path if os.path.exists(path) else name


_SPILL_RE = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_spills(ptx: str, capability: int) -> int:
    """Spill store + load bytes that ptxas reports for this PTX, run with the options Triton's make_cubin uses
    (its own log is deleted after a compile, and a cache hit runs no ptxas at all)."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(capability).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o",
                               os.path.join(d, "k.o")], capture_output=True, text=True, check=True)
    return sum(int(a) + int(b) for a, b in _SPILL_RE.findall(done.stdout + done.stderr))


def _cuda_resources(cubin: bytes, ptx: str, capability: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([_nvidia_tool("cuobjdump"), "--dump-resource-usage", f.name],
                               capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([_nvidia_tool("cuobjdump"), "-sass", f.name],
                              capture_output=True, text=True, check=True).stdout
    m = _RES_RE.search(usage)
    if m is None:
        raise RuntimeError(f"cannot parse cuobjdump resource usage: {usage!r}")
    regs, stack, shared, local = map(int, m.groups())
    # global loads, and cp.async copies into shared memory (LDGSTS: the pipelined matmul loops)
    loads = re.findall(r"\bLDG(?:STS)?\.E(?:\.[A-Z0-9_]+)*", sass)
    widths = [_width(x) for x in loads]
    spills = _ptxas_spills(ptx, capability) if (stack or local) else 0
    return {"registers": regs, "spill_bytes": spills + local, "local_bytes": local, "stack_bytes": stack,
            "static_shared": shared, "global_loads": len(loads), "global_loads_128": widths.count(128),
            "global_loads_64": widths.count(64)}


def _width(instruction: str) -> int:
    """Bits per thread of one SASS global load, from its suffixes (.128, .64; else 32 or narrower)."""
    suffixes = instruction.split(".")
    return 128 if "128" in suffixes else (64 if "64" in suffixes else 32)


def _amd_resources(amdgcn: str) -> dict:
    def field(name, default=0):
        m = re.search(rf"\.{name}:\s+(\d+)", amdgcn)
        return int(m.group(1)) if m else default

    scratch = field("private_segment_fixed_size")
    vspill = field("vgpr_spill_count")
    sspill = field("sgpr_spill_count")
    loads = re.findall(r"\b(?:global|buffer)_load_(?:dword(?:x[234])?|ubyte|ushort|short_d16\w*|sbyte|sshort)\b",
                       amdgcn)
    return {"registers": field("vgpr_count"), "sgprs": field("sgpr_count"), "agprs": field("agpr_count"),
            "spill_bytes": scratch, "vgpr_spills": vspill, "sgpr_spills": sspill,
            "static_shared": field("group_segment_fixed_size"), "global_loads": len(loads),
            "global_loads_128": sum(x.endswith("dwordx4") for x in loads),
            "global_loads_64": sum(x.endswith("dwordx2") for x in loads)}


def occupancy_warps(arch: Arch, registers: int, shared: int, num_warps: int) -> int:
    """Resident warps (waves) per SM (CU) from registers, shared memory and the block size: an estimate
    (allocation granularities of the public occupancy calculators; ignores barriers and the L1/shared split)."""
    if arch.backend == "cuda":
        regs_warp = math.ceil(max(registers, 1) * arch.warp_size / 256) * 256
        by_regs = (arch.regs_per_sm // regs_warp) // num_warps  # blocks
        by_shared = arch.shared_per_sm // (shared + 1024) if shared else arch.max_blocks_per_sm
        by_warps = arch.max_warps_per_sm // num_warps
        blocks = min(by_regs, by_shared, by_warps, arch.max_blocks_per_sm)
        return max(blocks, 0) * num_warps
    # AMD: waves per SIMD from VGPRs (granule 8, 512 per lane), 4 SIMDs per CU, at most 8 waves per SIMD
    vgprs = math.ceil(max(registers, 1) / 8) * 8
    waves_simd = min(8, arch.regs_per_sm // vgprs)
    by_regs = (4 * waves_simd) // num_warps
    by_shared = arch.shared_per_sm // shared if shared else by_regs
    return max(min(by_regs, by_shared), 0) * num_warps


@dataclasses.dataclass
class Row:
    kernel: str
    spec: str
    arch: str
    ok: bool
    error: str = ""
    num_warps: int = 0
    constexprs: str = ""
    registers: int = 0
    spill_bytes: int = 0  # spill stores + loads (ptxas -v; AMD: scratch)
    stack_bytes: int = 0  # CUDA stack frame (holds the spills, if any)
    shared: int = 0
    shared_limit: int = 0
    occupancy_warps: int = 0
    max_warps: int = 0
    global_loads: int = 0
    global_loads_128: int = 0
    global_loads_64: int = 0
    streaming: bool = False
    seconds: float = 0.0

    @property
    def problem(self) -> str:
        if not self.ok:
            return "compile error"
        if self.spill_bytes:
            return "spills"
        if self.shared > self.shared_limit:
            return "shared memory over the limit"
        return ""


def compile_one(spec: Spec, launch: Launch, arch: Arch) -> Row:
    import triton
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    row = Row(spec.kernel, spec.label, arch.key, ok=False, shared_limit=arch.shared_limit,
              max_warps=arch.max_warps_per_sm, streaming=spec.streaming)
    try:
        target = arch.target()
        launch = for_backend(launch, arch)
        signature, constexprs, attrs, options = _bind(launch, target)
        row.num_warps = options.num_warps
        names = launch.fn.arg_names
        row.constexprs = ", ".join(f"{names[k[0]]}={v}" for k, v in constexprs.items()
                                   if isinstance(k, tuple) and len(k) == 1 and names[k[0]].isupper())
        src = ASTSource(launch.fn, signature, constexprs, attrs)
        compiled = triton.compile(src, target=target, options=options.__dict__)
        if arch.backend == "cuda":
            res = _cuda_resources(compiled.asm["cubin"], compiled.asm["ptx"], arch.arch)
            row.stack_bytes = res["stack_bytes"]
        else:
            res = _amd_resources(compiled.asm["amdgcn"])
        row.ok = True
        row.registers = res["registers"]
        row.spill_bytes = res["spill_bytes"]
        row.shared = max(int(compiled.metadata.shared), res["static_shared"])
        row.global_loads = res["global_loads"]
        row.global_loads_128 = res["global_loads_128"]
        row.global_loads_64 = res["global_loads_64"]
        row.occupancy_warps = occupancy_warps(arch, row.registers, row.shared, row.num_warps)
    except Exception as exc:  # the message is the finding
        msg = str(exc).strip().splitlines()
        row.error = f"{type(exc).__name__}: {msg[-1] if msg else ''}"[:300]
    row.seconds = round(time.perf_counter() - t0, 2)
    return row


def _kernels_are_jit() -> bool:
    from triton.runtime.jit import JITFunction

    from .triton_impl import logprobs

    return isinstance(logprobs._token_logprobs_fwd_kernel, JITFunction)


def default_jobs(n_archs: int) -> int:
    """Targets compiled at once by default: one process per target, as many as this process may use CPUs."""
    return max(1, min(n_archs, len(usable_cpus())))


def run_audit(archs: Iterable[str] = DEFAULT_ARCHS, specs: list[Spec] | None = None, quick: bool = False,
              only: str | None = None, progress: Callable[[Row], None] | None = None,
              jobs: int | None = None) -> list[Row]:
    """Compile every spec (default: all_specs(quick)) for every arch key; one Row per (distinct launch, arch).

    `only`: keep the specs whose "kernel label" contains this text (e.g. "float8", "policy_loss_fwd").
    `jobs`: targets compiled at once, each in a subprocess of its own (Triton compiles one kernel at a time on
    one core; default: default_jobs). With jobs > 1, `progress` sees a target's rows when that target is done;
    custom `specs` always compile in this process, one target after the other. Rows come in target order.

    Specializations that compile to the same kernel (same signature, constexprs, attributes and
    options) are compiled once per target; the row names the first spec that produced it.
    """
    keys = parse_archs(list(archs))
    jobs = default_jobs(len(keys)) if jobs is None else max(1, int(jobs))
    if not _kernels_are_jit():
        if specs is not None:
            raise RuntimeError("the Triton kernels were built for the interpreter (TRITON_INTERPRET was set at "
                               "import); custom specs cannot be sent to a subprocess: run without TRITON_INTERPRET")
        return _run_in_subprocesses(keys, quick, only, jobs, progress)
    if jobs > 1 and len(keys) > 1 and specs is None:
        return _run_in_subprocesses(keys, quick, only, jobs, progress)
    specs = all_specs(quick) if specs is None else specs
    if only:
        specs = [s for s in specs if only in f"{s.kernel} {s.label}"]
    launches = [(s, s.build()) for s in specs if s.archs is None or set(s.archs) & set(keys)]
    rows = []
    for key in keys:
        arch = ARCHS[key]
        seen = set()
        for spec, launch in launches:
            if spec.archs is not None and key not in spec.archs:
                continue
            try:
                signature, constexprs, attrs, options = _bind(for_backend(launch, arch), arch.target())
                ck = _compile_key(launch, signature, constexprs, attrs, options)
            except Exception:
                ck = None  # compile_one reports the error
            if ck is not None and ck in seen:
                continue
            seen.add(ck)
            row = compile_one(spec, launch, arch)
            rows.append(row)
            if progress is not None:
                progress(row)
    return rows


def _run_in_subprocesses(keys: list[str], quick: bool, only: str | None, jobs: int,
                         progress: Callable[[Row], None] | None) -> list[Row]:
    """The audit in `gpu-audit` subprocesses without TRITON_INTERPRET: one for all targets (jobs = 1), or one per
    target, `jobs` at a time."""
    from concurrent.futures import ThreadPoolExecutor

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    groups = [[k] for k in keys] if jobs > 1 else [keys]
    with tempfile.TemporaryDirectory() as d:
        def audit(i: int) -> list[Row]:
            path = os.path.join(d, f"audit{i}.json")
            cmd = [sys.executable, "-m", "flashrl_kernels.cli", "gpu-audit", "--arch", ",".join(groups[i]),
                   "--json", path, "--no-table", "--jobs", "1"] + (["--quick"] if quick else []) + (
                   ["--only", only] if only else [])
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)  # exit 1 = problems found: rows still written
            if not os.path.exists(path):
                raise RuntimeError(f"the audit subprocess for {','.join(groups[i])} failed (exit {done.returncode}): "
                                   f"{done.stderr[-2000:]}")
            with open(path) as f:
                return [Row(**r) for r in json.load(f)["rows"]]

        rows = []
        with ThreadPoolExecutor(max_workers=min(jobs, len(groups))) as pool:
            for part in pool.map(audit, range(len(groups))):  # in target order, each as soon as it and those before are done
                rows.extend(part)
                if progress is not None:
                    for r in part:
                        progress(r)
        return rows


def failures(rows: list[Row]) -> list[Row]:
    return [r for r in rows if r.problem]


def _kb(n: int) -> str:
    return f"{n / 1024:.1f}K" if n else "0"


def format_table(rows: list[Row], detail: bool = False) -> str:
    """A Markdown table: one line per (kernel, arch), the worst case over its specializations
    (most registers / spills / shared memory, least occupancy, fewest 128-bit loads); with
    detail=True one line per compiled specialization."""
    header = ("| kernel | target | specs | ok | regs | spills | shared / limit | occupancy (warps/SM) | "
              "global loads: 128-bit (min..max) / 64-bit (max) / all (max) |")
    lines = [header, "|" + "---|" * 9]
    if detail:
        for r in rows:
            status = "yes" if r.ok else f"NO: {r.error}"
            lines.append(f"| {r.kernel} [{r.spec}; {r.constexprs}; warps={r.num_warps}] | {r.arch} | 1 | {status} | "
                         f"{r.registers} | {r.spill_bytes} | {_kb(r.shared)} / {_kb(r.shared_limit)} | "
                         f"{r.occupancy_warps}/{r.max_warps} | {r.global_loads_128} / {r.global_loads_64} / "
                         f"{r.global_loads} |")
        return "\n".join(lines)
    groups: dict[tuple[str, str], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.arch), []).append(r)
    for (kernel, arch), rs in groups.items():
        good = [r for r in rs if r.ok]
        bad = len(rs) - len(good)
        status = "yes" if not bad else f"{bad} FAIL"
        if good:
            regs = f"{min(r.registers for r in good)}-{max(r.registers for r in good)}"
            spills = max(r.spill_bytes for r in good)
            shared = max(r.shared for r in good)
            occ = min(r.occupancy_warps for r in good)
            wide = min(r.global_loads_128 for r in good)
            allv = max(r.global_loads for r in good)
            widest = max(r.global_loads_128 for r in good)
            w64 = max(r.global_loads_64 for r in good)
            lines.append(f"| {kernel} | {arch} | {len(rs)} | {status} | {regs} | {spills} | "
                         f"{_kb(shared)} / {_kb(good[0].shared_limit)} | {occ}/{good[0].max_warps} | "
                         f"{wide}..{widest} / {w64} / {allv} |")
        else:
            lines.append(f"| {kernel} | {arch} | {len(rs)} | {status} | - | - | - | - | - |")
    errs = sorted({(r.kernel, r.arch, r.error) for r in rows if not r.ok})
    if errs:
        lines.append("")
        lines += [f"- {k} on {a}: {e}" for k, a, e in errs]
    return "\n".join(lines)


def rows_to_json(rows: list[Row]) -> dict:
    return {"rows": [dataclasses.asdict(r) for r in rows],
            "failures": len(failures(rows)), "note": "compiled without a GPU; nothing here has run on one"}


# ---- a static roofline: what the first GPU run has to beat (predictions, not measurements) ----


@dataclasses.dataclass(frozen=True)
class Gpu:
    name: str
    hbm_gbps: float  # peak HBM bandwidth, GB/s
    bf16_tflops: float  # dense tensor-core peaks (no sparsity)
    int8_tops: float
    fp8_tflops: float | None  # None: no FP8 tensor cores (FP8 runs as bf16 after widening)


ROOFLINE_GPUS = (
    Gpu("A100 80GB SXM (A800)", 2039, 312, 624, None),
    Gpu("H100 SXM", 3350, 989, 1979, 1979),
    Gpu("H200 SXM", 4800, 989, 1979, 1979),
    Gpu("MI300X", 5300, 1307, 2615, 2615),
)
BW_FRACTION, MM_FRACTION = 0.90, 0.75


@dataclasses.dataclass(frozen=True)
class Work:
    op: str
    shape: str
    stream_bytes: float  # bytes moved by memory-bound passes (time at BW_FRACTION of HBM bandwidth)
    gemm_flops: float = 0.0  # tensor-core FLOPs (time at MM_FRACTION of the dense peak of `math`) ...
    gemm_bytes: float = 0.0  # ... or the GEMMs' own operand / output traffic, whichever is longer
    math: str = "bf16"  # bf16 | int8 | fp8

    def seconds(self, gpu: Gpu) -> float:
        peak = {"bf16": gpu.bf16_tflops, "int8": gpu.int8_tops,
                "fp8": gpu.fp8_tflops or gpu.bf16_tflops}[self.math] * 1e12
        bw = gpu.hbm_gbps * 1e9 * BW_FRACTION
        gemm = max(self.gemm_flops / (peak * MM_FRACTION), self.gemm_bytes / bw) if self.gemm_flops else 0.0
        return gemm + self.stream_bytes / bw


def roofline_work() -> list[Work]:
    """Bytes and FLOPs per op at stated shapes (see docs/gpu.md for the accounting)."""
    out = []
    n, v = 16384, 151936  # 8 x 2048 response tokens, Qwen2 vocabulary
    out.append(Work("token_logprobs fwd (+entropy)", f"N={n}, V={v}, bf16 logits", n * v * 2 + n * 20))
    out.append(Work("token_logprobs fwd+bwd", f"N={n}, V={v}, bf16", 3 * n * v * 2 + n * 36))
    h = 4096
    cols = 4096  # the GPU tile: all N rows x 4096 vocabulary columns (tile_shape)
    w_b, hid_b, z = v * h * 2, n * h * 2, n * v
    gemm_b = w_b + hid_b * (v / cols) + z * 4  # W once, hidden per vocab block, the fp32 tile written
    out.append(Work("linear_token_logprobs fwd", f"N={n}, H={h}, V={v}, bf16", z * 4, 2 * n * h * v, gemm_b))
    out.append(Work("linear_token_logprobs fwd+bwd", f"N={n}, H={h}, V={v}, bf16", z * (4 + 4 + 2),
                    8 * n * h * v, 2 * gemm_b + 2 * (z * 2 + w_b + hid_b)))
    out.append(Work("linear_policy_loss fwd (grads included)", f"N={n}, H={h}, V={v}, bf16", z * (4 + 2),
                    6 * n * h * v, gemm_b + 2 * (z * 2 + w_b + hid_b)))
    t = 1 << 20
    out.append(Work("policy_loss fwd+bwd", f"{t} tokens (256 x 4096), fp32", 21 * t + 4 * 256))
    out.append(Work("value_loss fwd+bwd", f"{t} tokens (256 x 4096)", 17 * t))
    out.append(Work("gae (+whiten)", f"{512 * 8192} tokens (512 x 8192)", 17 * 512 * 8192))
    p = 7.0e9
    out.append(Work("quantize_rows (weight sync)", "7e9 weights bf16 -> int8/fp8", p * 3 + (p / 4096) * 4))
    nk = 4096 * 4096
    out.append(Work("scaled_linear decode, 8-bit weights", "M=1, N=K=4096", nk * 1 + 4096 * 4 + 4096 * 4))
    out.append(Work("bf16 linear decode (for scale)", "M=1, N=K=4096", nk * 2 + 4096 * 4))
    out.append(Work("scaled_linear decode, whole 7B model", "M=1, 7e9 8-bit weights", p))
    m = 4096
    mm = {"gemm_flops": 2 * m * nk, "gemm_bytes": nk + 2 * m * 4096 * 2}
    out.append(Work("scaled_linear prefill W8A16 (bf16 math)", "M=N=K=4096", 0.0, math="bf16", **mm))
    out.append(Work("scaled_linear prefill W8A8 INT8", "M=N=K=4096", m * 4096 * 3, math="int8", **mm))
    out.append(Work("scaled_linear prefill W8A8 FP8", "M=N=K=4096", m * 4096 * 3, math="fp8", **mm))
    return out


def _fmt_time(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s >= 1e-3 else f"{s * 1e6:.1f} us"


def _fmt_bytes(b: float) -> str:
    return f"{b / 1e9:.2f} GB" if b >= 1e8 else f"{b / 1e6:.1f} MB"


def roofline_markdown() -> str:
    """The docs/gpu.md roofline table: predicted times (not measured) per op and GPU."""
    gpus = ROOFLINE_GPUS
    lines = ["| op | shape | bytes (streamed + GEMM) | tensor FLOPs | " + " | ".join(g.name for g in gpus) + " |",
             "|" + "---|" * (4 + len(gpus))]
    for w in roofline_work():
        scale, unit = (1e12, "T") if w.gemm_flops >= 1e12 else (1e9, "G")
        flops = f"{w.gemm_flops / scale:.1f} {unit} ({w.math})" if w.gemm_flops else "-"
        moved = _fmt_bytes(w.stream_bytes + w.gemm_bytes)
        times = " | ".join(_fmt_time(w.seconds(g)) for g in gpus)
        lines.append(f"| {w.op} | {w.shape} | {moved} | {flops} | {times} |")
    return "\n".join(lines)
