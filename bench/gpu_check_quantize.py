"""gpu_check section: quantize_rows bandwidth and INT8 / FP8 scaled-matmul throughput.

- correctness at real size: Triton quantize_rows of a 7B MLP weight (11008 x 4096
  bf16) bit-identical to the float64 spec (q and scale), int8 and fp8;
- quantize_rows GB/s (bf16 read + 1-byte q + fp32 scales written) vs the copy
  ceiling: target >= 80 %; the eager torch expression as the baseline;
- scaled linear (dynamic per-token W8A8: torch._int_mm / torch._scaled_mm with
  row-wise scales, plus the Triton activation quantization) vs a bf16 F.linear,
  at 7B layer shapes (N x K) 4096x4096, 11008x4096, 4096x11008 and 1..256 tokens,
  checked against the float64 spec first.
"""
from __future__ import annotations

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N = out, K = in)
TOKENS = [1, 16, 64, 256]


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.reference import quantize_rows_spec
    from flashrl_kernels.reference.quantize import scaled_linear_spec
    from flashrl_kernels.torch_impl.quantize import w8a8_fast_path_ok

    sec = "quantize"
    dev = report.device
    dry = report.dry_run
    n, k = (11008, 4096) if not dry else (64, 256)
    g = torch.Generator(device="cpu").manual_seed(0)
    w = (torch.randn(n, k, generator=g) * 0.02).to(device=dev, dtype=torch.bfloat16)
    backend = "triton"

    for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
        with fk.use_backend(backend):
            q, s = fk.quantize_rows(w, dtype)
        rq, rs = quantize_rows_spec(w.cpu(), dtype)
        same_q = torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
        same_s = torch.equal(s.cpu(), rs)
        report.check(sec, f"{tag} quantize_rows[{backend}] {n}x{k} bit-identical to spec", same_q and same_s,
                     f"q equal {same_q}, scale equal {same_s}")

        nbytes = n * k * 2 + n * k + n * 4
        qo = torch.empty(n, k, dtype=dtype, device=dev)
        so = torch.empty(n, dtype=torch.float32, device=dev)

        def inplace(qo=qo, so=so):
            with fk.use_backend(backend):
                torch.ops.flashrl.quantize_rows_(w, qo, so)

        ms = report.time_ms(inplace)
        r = report.row(sec, f"quantize_rows_ {tag} {n}x{k} [{backend}]", ms, nbytes / (ms * 1e-3) / 1e9,
                       peak_mb=report.peak_extra_mb(inplace))
        report.target(sec, f"quantize_rows {tag} % copy BW", r["% BW"] or 0.0, 80)

        qmax = 127.0 if dtype == torch.int8 else 448.0

        def naive(dtype=dtype, qmax=qmax):
            sc = w.float().abs().amax(1, keepdim=True) / qmax
            y = w.float() / sc
            return (y.round().clamp(-128, 127) if dtype == torch.int8 else y.clamp(-qmax, qmax)).to(dtype), sc

        ms = report.time_ms(naive)
        report.row(sec, f"eager torch expression {tag} {n}x{k}", ms, nbytes / (ms * 1e-3) / 1e9,
                   peak_mb=report.peak_extra_mb(naive), note="baseline")

    shapes = SHAPES if not dry else [(64, 128)]
    tokens = TOKENS if not dry else [1, 16]
    for nn, kk in shapes:
        wl = (torch.randn(nn, kk, generator=g) * 0.02).to(device=dev, dtype=torch.bfloat16)
        for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
            q, s = fk.quantize_rows(wl, dtype)
            x = torch.randn(max(tokens), kk, generator=g).to(device=dev, dtype=torch.bfloat16)
            fast = w8a8_fast_path_ok(x, q)
            y = fk.scaled_linear(x[:16], q, s, activation_quant=True)
            ref = scaled_linear_spec(x[:16].cpu(), q.cpu(), s.cpu(), None, True)
            mag = (x[:16].cpu().double().abs() @ (q.cpu().double() * s.cpu().double()[:, None]).abs().T)
            err = float(((y.cpu().double() - ref).abs() / (mag + 1e-6)).max())
            report.check(sec, f"scaled_linear W8A8 {tag} {nn}x{kk} vs spec (rel. to |x||w|) <= 2^-7", err <= 2**-7,
                         f"{err:.2e} (fast path {fast})")
            for m in tokens:
                xm = x[:m]
                flops = 2 * m * nn * kk
                ms = report.time_ms(lambda xm=xm, q=q, s=s: fk.scaled_linear(xm, q, s, activation_quant=True))
                report.row(sec, f"W8A8 {tag} N={nn} K={kk} M={m}", ms, tflops=flops / (ms * 1e-3) / 1e12,
                           note="fast path" if fast else "emulated (no W8A8 GEMM here)")
            if tag == "int8":
                for m in tokens:
                    xm = x[:m]
                    ms = report.time_ms(lambda xm=xm, wl=wl: torch.nn.functional.linear(xm, wl))
                    report.row(sec, f"bf16 F.linear N={nn} K={kk} M={m}", ms,
                               tflops=2 * m * nn * kk / (ms * 1e-3) / 1e12, note="baseline")
        del wl
