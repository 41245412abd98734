"""gpu_check section: quantize_rows bandwidth and INT8 / FP8 scaled-matmul throughput.

- correctness at real size: Triton quantize_rows of a 7B MLP weight (11008 x 4096
  bf16) bit-identical to the float64 spec (q and scale), int8 and fp8;
- quantize_rows GB/s (bf16 read + 1-byte q + fp32 scales written) vs the copy
  ceiling: target >= 80 %; the eager torch expression as the baseline.
The scaled linear (every kernel its selection can pick) is the qlinear section.
"""
from __future__ import annotations


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.reference import quantize_rows_spec

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
