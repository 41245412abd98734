"""gpu_check section: the quantized linear (fk.scaled_linear on CUDA; flashrl_kernels/triton_impl/qlinear.py).

For 7B layer shapes (N x K) 4096x4096, 11008x4096, 4096x11008, int8 and fp8 weights, weight-only (W8A16) and
dynamic W8A8, M = 1 / 16 / 64 / 256 / 4096 tokens:
- which kernel qlinear.select_scaled_linear picks on this GPU (with what vLLM exposes here, if it is installed);
- every candidate kernel that can run here, checked against the float64 spec at M = 16 (error relative to
  |x| |w|) and timed at every M: the selected one, the other Triton / cuBLAS / vLLM kernels, the former path
  (dequantize the whole weight to bf16, then F.linear) and a bf16 F.linear; so the first GPU run shows whether
  the selection's thresholds (SMALL_M, the split-K plan) are right;
- the weight-only path allocates nothing weight-sized (peak extra memory < 1/4 of the bf16 weight).
The decode rows (M <= 16) report GB/s over the weight bytes (1 byte per weight, memory bound), the others
TFLOP/s. Budget: about 2 minutes on an H200 (most of it Triton compiles).
"""
from __future__ import annotations

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008)]  # (N = out, K = in)
TOKENS = [1, 16, 64, 256, 4096]


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.reference.quantize import dequantize_rows_spec, scaled_linear_spec
    from flashrl_kernels.torch_impl.quantize import cuda_fast_path
    from flashrl_kernels.triton_impl import qlinear as ql
    from flashrl_kernels.triton_impl.quantize import quantize_rows

    sec = "qlinear"
    dev = report.device
    dry = report.dry_run
    if dev.type == "cuda":
        try:  # let the selection see vLLM's kernels when vLLM is installed (FLASHRL_VLLM_KERNELS=0 turns it off)
            import os

            if os.environ.get("FLASHRL_VLLM_KERNELS", "") != "0":
                import vllm._custom_ops
        except Exception as exc:
            print(f"vLLM kernels not available: {type(exc).__name__}: {str(exc)[:100]}")
    cap, is_hip, sms = ql.device_facts(dev)
    vllm = ql.available_vllm(dev)
    report.check(sec, "device facts", True, f"capability {cap}, hip {is_hip}, {sms} SMs, vLLM {vllm}")
    shapes = SHAPES if not dry else [(64, 160)]
    tokens = TOKENS if not dry else [1, 16, 70]
    g = torch.Generator(device="cpu").manual_seed(7)
    fk.set_value_checks(False)
    try:
        for n, k in shapes:
            w = (torch.randn(n, k, generator=g) * 0.02).to(device=dev, dtype=torch.bfloat16)
            x_all = torch.randn(max(tokens), k, generator=g).to(device=dev, dtype=torch.bfloat16)
            bias = (torch.randn(n, generator=g) * 0.1).to(device=dev, dtype=torch.bfloat16)
            for m in tokens:  # the bf16 baseline, once per (shape, M)
                xm = x_all[:m]
                ms = report.time_ms(lambda xm=xm, w=w, bias=bias: torch.nn.functional.linear(xm, w, bias))
                _row(report, sec, f"bf16 F.linear N={n} K={k} M={m}", ms, m, n, k, 2, "baseline")
            for dtype, tag in ((torch.int8, "int8"), (torch.float8_e4m3fn, "fp8")):
                q, s = fk.quantize_rows(w, dtype)
                for aq in (False, True):
                    mode = "W8A8" if aq else "W8A16"
                    torch_ok = aq and dev.type == "cuda" and cuda_fast_path(dev.index or 0, dtype)
                    cands = _candidates(ql, cap, is_hip, dtype, aq, vllm, torch_ok, dev)
                    # correctness of every candidate against the float64 spec: at M = 16 (decode tiles) and at a
                    # prefill-like M (the large-M tiles; on sm_90 W8A16's transposed tile)
                    for mc in (16, 70 if dry else 256):
                        xc = x_all[:mc]
                        ref = scaled_linear_spec(xc.cpu(), q.cpu(), s.cpu(), bias.cpu(), aq)
                        mag = xc.cpu().double().abs() @ dequantize_rows_spec(q.cpu(), s.cpu()).abs().T + \
                            bias.cpu().double().abs()
                        for kern in cands:
                            try:
                                y = ql.run_choice(kern, quantize_rows, xc, q, s, bias, cap, is_hip, sms)
                                err = float(((y.cpu().double() - ref).abs() / (mag + 1e-6)).max())
                                report.check(sec, f"{mode} {tag} {kern} N={n} K={k} M={mc} vs spec (rel. |x||w|) "
                                             "<= 2^-7", err <= 2**-7, f"{err:.2e}")
                            except Exception as exc:
                                report.check(sec, f"{mode} {tag} {kern} N={n} K={k} M={mc} ran", False,
                                             f"{type(exc).__name__}: {str(exc)[:120]}")
                    for m in tokens:
                        xm = x_all[:m]
                        chosen = ql.select_scaled_linear(cap, is_hip, dtype, m, n, k, aq, xm.dtype, vllm, torch_ok)

                        def op(xm=xm, q=q, s=s, aq=aq, bias=bias):
                            with fk.use_backend("triton"):  # what a GPU picks anyway; the dry run's interpreter
                                return fk.scaled_linear(xm, q, s, bias, activation_quant=aq)

                        ms = report.time_ms(op)
                        peak = report.peak_extra_mb(op)
                        _row(report, sec, f"{mode} {tag} N={n} K={k} M={m} fk.scaled_linear", ms, m, n, k, 1,
                             f"selected {chosen.kernel}", peak)
                        if not aq and peak is not None:
                            # allowed: the output and the split-K plan's fp32 partials (split x M x N x 4 bytes)
                            wmb = n * k * 2 / 2**20
                            split = ql.plan_tiles(m, n, k, sms, is_hip, xm.element_size(), capability=cap,
                                                  weight_only=True).split_k
                            room = (m * n * 4 * (1 + (split if split > 1 else 0))) / 2**20
                            report.check(sec, f"{mode} {tag} N={n} K={k} M={m}: no weight-sized temporary",
                                         peak < wmb / 4 + room, f"peak {peak:.1f} MB, bf16 weight {wmb:.1f} MB, "
                                         f"split-K {split}")
                        for kern in cands:
                            if kern == chosen.kernel:
                                continue
                            try:
                                ms = report.time_ms(lambda xm=xm, kern=kern, q=q, s=s, bias=bias: ql.run_choice(
                                    kern, quantize_rows, xm, q, s, bias, cap, is_hip, sms))
                                _row(report, sec, f"{mode} {tag} N={n} K={k} M={m} {kern}", ms, m, n, k, 1,
                                     "candidate")
                            except Exception as exc:
                                report.row(sec, f"{mode} {tag} N={n} K={k} M={m} {kern}",
                                           note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
                        if m in (1, 4096) or dry:  # the former path: the whole weight dequantized per call
                            def old(xm=xm, q=q, s=s, aq=aq, bias=bias):
                                x = xm
                                if aq:
                                    xq, xs = quantize_rows(xm, q.dtype)
                                    x = (xq.float() * xs[:, None]).to(xm.dtype)
                                return torch.nn.functional.linear(x, (q.float() * s[:, None]).to(xm.dtype), bias)

                            ms = report.time_ms(old)
                            _row(report, sec, f"{mode} {tag} N={n} K={k} M={m} dequantize+F.linear (former)", ms,
                                 m, n, k, 1, "former path", report.peak_extra_mb(old))
            del w, x_all
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        fk.set_value_checks(True)


def _candidates(ql, cap, is_hip, dtype, aq, vllm, torch_ok, dev):
    """The kernels that can run here for this weight dtype and mode."""
    if not aq:
        return [ql.TRITON_W8A16]
    out = []
    if dtype == __import__("torch").int8:
        out += [ql.TRITON_W8A8_INT8, ql.TORCH_INT_MM]
        if vllm.cutlass and not is_hip and cap < (10, 0):
            out.append(ql.VLLM_CUTLASS)
    else:
        out.append(ql.TRITON_W8A8_FP8_WIDEN)
        if torch_ok or dev.type != "cuda":
            out.append(ql.TORCH_SCALED_MM)
        if vllm.cutlass_fp8:
            out.append(ql.VLLM_CUTLASS)
    return out


def _row(report, sec, case, ms, m, n, k, weight_bytes, note, peak=None):
    flops = 2 * m * n * k
    gbps = (n * k * weight_bytes + m * k * 2 + m * n * 2) / (ms * 1e-3) / 1e9 if m <= 16 else None
    report.row(sec, case, ms, gbps, flops / (ms * 1e-3) / 1e12, peak_mb=peak, note=note)
