"""gpu_check section: fused linear log-probabilities (linear_token_logprobs).

At N=16384, H=4096, V=151936 bf16 (dry run: tiny sizes on the CPU):
- correctness vs the float64 spec: every output and gradient at N=512 (full V, full H), and the logprobs /
  entropy of a row sample of the full-size run;
- time and peak extra memory of fwd and fwd+bwd for flashrl (triton backend, and the torch backend),
  the unfused path (hidden @ weight.T, fp32 log_softmax, gather), its torch.compile, and Liger's fused
  linear cross entropy / Cut Cross-Entropy when importable;
- fraction of the measured bf16 matmul rate, counting 2NHV (fwd) and 6NHV (fwd+bwd) flops.
  Targets: fwd+bwd >= 70 % of the matmul rate, peak memory <= 10 % of the unfused path's.
"""
from __future__ import annotations

SEC = "linear_logprobs"


def _inputs(torch, n, h, v, dev, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(device=dev, dtype=torch.bfloat16)
    weight = (torch.randn(v, h, generator=g) * (2.0 / h**0.5)).to(device=dev, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,), generator=g).to(dev)
    return hidden, weight, targets


def _tol(report, zmax, h):
    """fp32 logits: fp32 GEMM + epilogue error. On the CPU (dry run) the bf16 tile GEMM rounds the
    logits to bf16 (no bf16 x bf16 -> fp32 GEMM in torch there): add half an ulp on z_y and on lse."""
    tol = 1e-5 + 8 * 1.2e-7 * zmax * h**0.5
    if report.device.type != "cuda":
        tol += 2 * 2**-8 * zmax
    return tol


def _correctness(report, torch, fk, spec, n, h, v):
    dev = report.device
    hidden, weight, targets = _inputs(torch, n, h, v, dev, 2)
    targets[3] = -100
    g = torch.Generator(device="cpu").manual_seed(3)
    g_lp, g_h = torch.randn(n, generator=g).to(dev), torch.randn(n, generator=g).to(dev)
    hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    with fk.use_backend("triton"):
        lp, ent = fk.linear_token_logprobs(hx, wx, targets, temperature=0.9, return_entropy=True, ignore_index=-100)
        ((lp * g_lp).sum() + (ent * g_h).sum()).backward()
    hr, wr = hidden.double().requires_grad_(True), weight.double().requires_grad_(True)
    rlp, rent = spec(hr, wr, targets, None, 0.9, -100)
    ((rlp * g_lp.double()).sum() + (rent * g_h.double()).sum()).backward()
    zmax = float((hidden[:64].double() @ weight.double().T).abs().max()) / 0.9
    tol = _tol(report, zmax, h)
    for what, a, b in [("logprob", lp, rlp), ("entropy", ent, rent)]:
        err = float((a.detach().double() - b.detach()).abs().max())
        report.check(SEC, f"N={n} {what} max err vs fp64 <= {tol:.1e}", err <= tol, f"{err:.2e}")
    for what, a, b in [("grad_hidden", hx.grad, hr.grad), ("grad_weight", wx.grad, wr.grad)]:
        gmax = float(b.abs().max())
        err = float((a.double() - b).abs().max())
        lim = (4 * 2**-8 + 2 * tol) * gmax
        report.check(SEC, f"N={n} {what} max err <= (4 * 2^-8 + 2 tol) max|grad|", err <= lim,
                     f"{err:.2e} (max|grad| {gmax:.2e})")


def run(report):
    import torch

    import flashrl_kernels as fk
    from flashrl_kernels.reference import linear_token_logprobs_spec

    dev = report.device
    dry = report.dry_run
    n, h, v = (16384, 4096, 151936) if not dry else (16, 24, 50)
    _correctness(report, torch, fk, linear_token_logprobs_spec, 512 if not dry else 8, h, v)
    if dev.type == "cuda":
        from flashrl_kernels.torch_impl import linear_logprobs as impl

        report.check(SEC, "tile GEMM writes fp32 logits (torch.mm out_dtype=float32)",
                     impl._out_dtype_ok.get("cuda", True), "else bf16-rounded tiles: see docs/linear_logprobs.md")

    hidden, weight, targets = _inputs(torch, n, h, v, dev, 1)
    gout = torch.randn(n, device=dev)

    # full size: logprobs/entropy of a row sample vs fp64
    with torch.no_grad(), fk.use_backend("triton"):
        lp, ent = fk.linear_token_logprobs(hidden, weight, targets, return_entropy=True)
    rows = torch.arange(0, n, max(1, n // 128), device=dev)
    rlp, rent = linear_token_logprobs_spec(hidden[rows], weight, targets[rows])
    zmax = float((hidden[rows].double() @ weight.double().T).abs().max())
    tol = _tol(report, zmax, h)
    err = max(float((lp[rows].double() - rlp).abs().max()), float((ent[rows].double() - rent).abs().max()))
    report.check(SEC, f"N={n} sampled rows logprob/entropy err <= {tol:.1e}", err <= tol, f"{err:.2e}")
    del lp, ent, rlp, rent

    def unfused(hd, w, t):
        return torch.log_softmax((hd @ w.T).float(), -1).gather(-1, t[:, None])[:, 0]

    def fused_triton(hd, w, t):
        with fk.use_backend("triton"):
            return fk.linear_token_logprobs(hd, w, t)

    def fused_torch(hd, w, t):
        with fk.use_backend("torch"):
            return fk.linear_token_logprobs(hd, w, t)

    impls = {"flashrl[triton]": fused_triton, "flashrl[torch]": fused_torch, "unfused eager": unfused}
    if dev.type == "cuda":
        impls["unfused torch.compile"] = torch.compile(unfused)
        try:
            from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

            def liger(hd, w, t):
                out = LigerFusedLinearCrossEntropyFunction.apply(hd, w, t, None, None, -100, 0.0, 0.0, "none")
                return -(out[0] if isinstance(out, tuple) else out)

            impls["liger fused linear CE"] = liger
        except Exception as exc:
            print(f"liger-kernel baseline skipped: {type(exc).__name__}: {exc}")
        try:
            from cut_cross_entropy import linear_cross_entropy

            impls["cut cross-entropy"] = lambda hd, w, t: -linear_cross_entropy(hd, w, t, reduction="none")
        except Exception as exc:
            print(f"cut-cross-entropy baseline skipped: {type(exc).__name__}: {exc}")

    fk.set_value_checks(False)  # the timed path: no host sync
    peaks = {}
    try:
        for name, fn in impls.items():
            try:
                with torch.no_grad():
                    ms = report.time_ms(lambda fn=fn: fn(hidden, weight, targets), warmup=1, repeats=5)
                    peak = report.peak_extra_mb(lambda fn=fn: fn(hidden, weight, targets))
                report.row(SEC, f"fwd {name}", ms, tflops=2 * n * h * v / (ms * 1e-3) / 1e12, peak_mb=peak)
                hx, wx = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)

                def step(fn=fn, hx=hx, wx=wx):
                    hx.grad = None
                    wx.grad = None
                    (fn(hx, wx, targets) * gout).sum().backward()

                ms = report.time_ms(step, warmup=1, repeats=5)
                step()
                hx.grad = None
                wx.grad = None
                peak = report.peak_extra_mb(step)
                peaks[name] = peak
                r = report.row(SEC, f"fwd+bwd {name}", ms, tflops=6 * n * h * v / (ms * 1e-3) / 1e12, peak_mb=peak,
                               note="6NHV counted")
                if name == "flashrl[triton]":
                    report.target(SEC, "fwd+bwd % bf16 matmul rate", r["% MM"] or 0.0, 70)
                del hx, wx
            except Exception as exc:
                report.row(SEC, name, note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        fk.set_value_checks(True)
    if peaks.get("flashrl[triton]") is not None and peaks.get("unfused eager"):
        saving = 100 * (1 - peaks["flashrl[triton]"] / peaks["unfused eager"])
        report.target(SEC, "fwd+bwd peak memory saving vs unfused (>= 90 means <= 10 %)", saving, 90)
