"""GPU check section for gae (wired by bench/gpu_check.py: run(report)).

At B=512, T=8192 (4M tokens, fp32, right padding plus holes in the mask): the
Triton backend vs the float64 spec (reference/gae.py, a Python loop over all
tokens, a few seconds on the host) for a decoupled-lambda config with whitening
and a VAPO length-adaptive one, then timings of flashrl[triton] vs verl's loop
and the torch backend, as GB/s over the bytes read and written (rewards, values
4 B/token each, mask 1 B, advantages + returns 8 B), with the target of >= 50 %
of the measured copy bandwidth.
"""
from __future__ import annotations


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.benchmarks import gae as bench
    from flashrl_kernels.reference import gae_spec

    sec = "gae"
    dev = report.device
    b, t = (512, 8192) if not report.dry_run else (4, 64)
    rewards, values, mask = bench.make_inputs(b, t, dev, generator_seed=5)
    g = torch.Generator(device="cpu").manual_seed(6)
    mask &= (torch.rand(b, t, generator=g) > 0.05).to(dev)  # holes: tool-output tokens
    configs = {
        "decoupled lam + whiten": {"gamma": 0.999, "lam": 0.95, "critic_lam": 1.0, "whiten": True},
        "vapo lam_alpha": {"gamma": 1.0, "lam_alpha": 0.05, "critic_lam": 1.0},
    }
    for name, kw in configs.items():
        with fk.use_backend("triton"):
            out = fk.gae(rewards, values, mask=mask, **kw)
        e_adv, e_ret = gae_spec(rewards.cpu(), values.cpu(), mask=mask.cpu(), **kw)
        m = mask.cpu()
        adv, ret = out.advantages.cpu().double(), out.returns.cpu().double()
        scale = float(e_adv[m].abs().max()) or 1.0
        err_a = float((adv - e_adv)[m].abs().max())
        err_r = float((ret - e_ret)[m].abs().max())
        zeros = bool((adv[~m] == 0).all() and (ret[~m] == 0).all())
        r_max = float(e_ret[m].abs().max())
        # float64 scans with unrounded gamma / lambdas: within fp32 rounding of the outputs (~6e-8 relative);
        # until 2026-12-04 the fp32 scans were 1e-5-level off at this 1000-token horizon (1.27e-4 on the H200)
        report.check(sec, f"{name}: advantages err <= 1e-6 * max|A|", err_a <= 1e-6 * scale,
                     f"{err_a:.2e} (max|A| {scale:.2e})")
        report.check(sec, f"{name}: returns err <= 1e-6 * max|R|", err_r <= 1e-6 * r_max,
                     f"{err_r:.2e} (max|R| {r_max:.2e})")
        report.check(sec, f"{name}: masked positions 0", zeros, str(zeros))
        del out, e_adv, e_ret

    n = b * t
    nbytes = bench.BYTES_PER_TOKEN * n
    fmask = mask.float()
    impls = {
        "flashrl[triton] whiten": lambda: bench._flashrl("triton")(rewards, values, mask),
        "flashrl[triton] no whiten": lambda: fk.gae(rewards, values, mask=mask, lam=bench.LAM),
        "flashrl[torch] whiten": lambda: bench._flashrl("torch")(rewards, values, mask),
    }
    if dev.type == "cuda":  # the loop: T = 8192 small kernel launches per step, seconds; time it once
        impls["verl loop (eager)"] = lambda: bench.verl_gae(rewards, values, fmask)
    fk.set_value_checks(False)
    forced = fk.use_backend("triton")  # the dry run times the interpreter; on a GPU auto picks triton anyway
    forced.__enter__()
    try:
        for name, fn in impls.items():
            try:
                slow = name.startswith("verl")
                ms = report.time_ms(fn, warmup=1 if slow else 2, repeats=3 if slow else 10, graph=not slow)
                peak = None if slow else report.peak_extra_mb(fn)
                r = report.row(sec, f"{name} B={b} T={t}", ms, nbytes / (ms * 1e-3) / 1e9, peak_mb=peak)
                if name == "flashrl[triton] whiten":
                    report.target(sec, "whiten % copy BW", r["% BW"] or 0.0, 50)
                if name == "flashrl[triton] no whiten":
                    report.target(sec, "no whiten % copy BW", r["% BW"] or 0.0, 50)
            except Exception as exc:
                report.row(sec, name, note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
    finally:
        forced.__exit__(None, None, None)
        fk.set_value_checks(True)
