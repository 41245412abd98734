"""GPU check section for value_loss (wired by bench/gpu_check.py: run(report)).

At 1M tokens (B=256, T=4096): the Triton backend vs the float64 spec (loss, gradient, metrics)
padded with clipping (token-mean) and packed with variable lengths (seq-mean-token-mean, bf16
values, returns at an offset of 100 so explained_variance's centred moments are exercised),
then fwd+bwd timings of flashrl[triton] vs verl's eager code and torch.compile of it, as GB/s
over the bytes of the inputs and the gradient, with the target of >= 70 % of the measured
copy bandwidth.
"""
from __future__ import annotations


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.benchmarks import value_loss as bench
    from flashrl_kernels.reference import value_loss_spec

    sec = "value_loss"
    dev = report.device
    b, t = (256, 4096) if not report.dry_run else (4, 64)
    values, old, returns, mask = bench.make_inputs(b, t, dev, generator_seed=3)

    # packed: variable lengths (one empty, one single token), bf16 values, fp32 returns around 100
    g = torch.Generator(device="cpu").manual_seed(4)
    lens = torch.randint(1, t + 1, (b,), generator=g)
    lens[1], lens[2] = 0, 1
    n_packed = int(lens.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(dev)
    r_p = (torch.randn(n_packed, generator=g) + 100.0).to(dev)
    o_p = r_p + 0.5 * torch.randn(n_packed, generator=g).to(dev)
    v_p = (o_p + 0.3 * torch.randn(n_packed, generator=g).to(dev)).to(torch.bfloat16)
    m_p = (torch.rand(n_packed, generator=g) > 0.05).to(dev)
    padded = {"values": values, "old_values": old, "returns": returns, "mask": mask}
    packed = {"values": v_p, "old_values": o_p, "returns": r_p, "mask": m_p, "cu_seqlens": cu}
    checks = {
        "padded clip token-mean": (padded, {"clip_range": bench.CLIP, "loss_agg_mode": "token-mean"}),
        "packed bf16 seq-mean-token-mean": (packed, {"clip_range": 0.1, "loss_agg_mode": "seq-mean-token-mean"}),
    }
    for name, (inp, kw) in checks.items():
        with fk.use_backend("triton"):
            x = inp["values"].clone().requires_grad_(True)
            extra = {k: inp[k] for k in ("mask", "cu_seqlens") if k in inp}
            out = fk.value_loss(x, inp["old_values"], inp["returns"], **extra, **kw)
            (out.loss * 3.0).backward()
        x64 = inp["values"].double().requires_grad_(True)
        loss64, m64 = value_loss_spec(x64, inp["old_values"], inp["returns"], **extra, **kw)
        (loss64 * 3.0).backward()
        err_l = abs(float(out.loss.detach()) - float(loss64.detach()))
        gscale = float(x64.grad.abs().max()) or 1.0
        err_g = float((x.grad.double() - x64.grad).abs().max())
        err_m = max(abs(float(out.metrics[k]) - float(m64[k])) / max(1.0, abs(float(m64[k]))) for k in m64)
        gtol = 2**-8 if x.dtype == torch.bfloat16 else 1e-5  # the gradient is rounded once to values' dtype
        report.check(sec, f"{name}: loss err vs fp64 <= 1e-5 * max(1, |loss|)",
                     err_l <= 1e-5 * max(1.0, abs(float(loss64.detach()))), f"{err_l:.2e}")
        report.check(sec, f"{name}: grad err <= {gtol:.1e} * max|grad|", err_g <= gtol * gscale,
                     f"{err_g:.2e} (max|grad| {gscale:.2e})")
        report.check(sec, f"{name}: metrics rel err <= 1e-4", err_m <= 1e-4, f"{err_m:.2e}")
        clip_frac = float(out.metrics["vf_clip_frac"])
        report.check(sec, f"{name}: some tokens clip, not all", 0.0 < clip_frac < 1.0, f"{clip_frac:.3f}")
        del x, x64

    n = b * t
    nbytes = 17 * n
    impls = {"flashrl[triton]": bench._flashrl("triton"), "eager torch (verl code)": bench.eager_loss}
    if dev.type == "cuda":
        impls["torch.compile"] = torch.compile(bench.eager_loss)
    fk.set_value_checks(False)
    try:
        for name, fn in impls.items():
            try:
                x = values.clone().requires_grad_(True)

                def step(x=x, fn=fn):
                    x.grad = None
                    loss, _ = fn(x, old, returns, mask)
                    loss.backward()

                ms = report.time_ms(step)
                peak = report.peak_extra_mb(step)
                r = report.row(sec, f"fwd+bwd {name} B={b} T={t}", ms, nbytes / (ms * 1e-3) / 1e9, peak_mb=peak)
                if name == "flashrl[triton]":
                    report.target(sec, "fwd+bwd % copy BW", r["% BW"] or 0.0, 70)
            except Exception as exc:
                report.row(sec, name, note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
    finally:
        fk.set_value_checks(True)
