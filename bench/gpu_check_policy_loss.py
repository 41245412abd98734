"""GPU check section for policy_loss (wired by bench/gpu_check.py: run(report)).

At 1M tokens (B=256, T=4096): the Triton backend vs the float64 spec (loss,
gradient, metrics) for a token-level DAPO-style config and a GSPO config with
sequence TIS, then fwd+bwd timings of flashrl[triton] vs the eager trainer code
and torch.compile of it, as GB/s over the bytes of the inputs and the gradient,
with the target of >= 70 % of the measured copy bandwidth; then the same batch
packed (sequences at odd cu_seqlens offsets), checked against the padded result
and timed.
"""
from __future__ import annotations


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.benchmarks import policy_loss as bench
    from flashrl_kernels.reference import policy_loss_spec

    sec = "policy_loss"
    dev = report.device
    b, t = (256, 4096) if not report.dry_run else (4, 64)
    logp, old, adv, mask, roll, ref = bench.make_inputs(b, t, dev, generator_seed=3)
    ent = torch.rand(b, t, device=dev)
    configs = {
        "token dapo+tis": bench.CONFIG,
        "gspo seq-tis": fk.LossConfig(eps_low=3e-4, eps_high=4e-4, importance_sampling_level="sequence",
                                      tis_mode="sequence_truncate", tis_sequence_reduce="mean", tis_min=0.5,
                                      tis_max=2.0, loss_agg_mode="seq-mean-token-mean", entropy_coef=0.001),
    }
    for name, cfg in configs.items():
        with fk.use_backend("triton"):
            x = logp.clone().requires_grad_(True)
            e = ent.clone().requires_grad_(True)
            out = fk.policy_loss(x, old, adv, mask=mask, rollout_logp=roll, ref_logp=ref, entropy=e, config=cfg)
            out.loss.backward()
        lp64 = logp.double().requires_grad_(True)
        e64 = ent.double().requires_grad_(True)
        loss64, m64 = policy_loss_spec(lp64, old, adv, mask=mask, rollout_logp=roll, ref_logp=ref, entropy=e64,
                                       config=cfg)
        loss64.backward()
        err_l = abs(float(out.loss.detach()) - float(loss64.detach()))
        gscale = float(lp64.grad.abs().max()) or 1.0
        err_g = float((x.grad.double() - lp64.grad).abs().max())
        err_e = float((e.grad.double() - e64.grad).abs().max())
        err_m = max(abs(float(out.metrics[k]) - float(m64[k])) / max(1.0, abs(float(m64[k]))) for k in m64)
        report.check(sec, f"{name}: loss err vs fp64 <= 1e-5 * max(1, |loss|)",
                     err_l <= 1e-5 * max(1.0, abs(float(loss64.detach()))), f"{err_l:.2e}")
        report.check(sec, f"{name}: grad err <= 1e-4 * max|grad|", err_g <= 1e-4 * gscale,
                     f"{err_g:.2e} (max|grad| {gscale:.2e})")
        report.check(sec, f"{name}: entropy grad err <= 1e-6", err_e <= 1e-6, f"{err_e:.2e}")
        report.check(sec, f"{name}: metrics rel err <= 1e-4", err_m <= 1e-4, f"{err_m:.2e}")
        del x, e, lp64, e64

    n = b * t
    nbytes = 21 * n + 4 * b
    impls = {"flashrl[triton]": bench._flashrl("triton"), "eager torch (trainer code)": bench.eager_loss}
    if dev.type == "cuda":
        impls["torch.compile"] = torch.compile(bench.eager_loss)
    fk.set_value_checks(False)
    try:
        for name, fn in impls.items():
            try:
                x = logp.clone().requires_grad_(True)

                def step(x=x, fn=fn):
                    x.grad = None
                    loss, _ = fn(x, old, adv, mask, roll, ref)
                    loss.backward()

                ms = report.time_ms(step)
                peak = report.peak_extra_mb(step)
                r = report.row(sec, f"fwd+bwd {name} B={b} T={t}", ms, nbytes / (ms * 1e-3) / 1e9, peak_mb=peak)
                if name == "flashrl[triton]":
                    report.target(sec, "fwd+bwd % copy BW", r["% BW"] or 0.0, 70)
            except Exception as exc:
                report.row(sec, name, note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
        _packed(report, sec, logp, old, adv, mask, roll, ref, ent, configs["token dapo+tis"])
    finally:
        fk.set_value_checks(True)


def _packed(report, sec, logp, old, adv, mask, roll, ref, ent, cfg):
    """The same batch packed (verl remove-padding): sequences start at odd cu_seqlens offsets, where the kernels'
    loops start with a masked head and load the rest with vector loads (docs/gpu.md). Checked against the padded
    result, then timed."""
    torch = report.torch
    import flashrl_kernels as fk

    lengths = mask.sum(1)
    cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).to(torch.int32)
    pk = [x[mask] for x in (logp, old, roll, ref, ent)]
    with fk.use_backend("triton"):
        x = pk[0].clone().requires_grad_(True)
        out = fk.policy_loss(x, pk[1], adv, cu_seqlens=cu, rollout_logp=pk[2], ref_logp=pk[3], entropy=pk[4],
                             config=cfg, normalizer=None)
        out.loss.backward()
        xp = logp.clone().requires_grad_(True)
        outp = fk.policy_loss(xp, old, adv, mask=mask, rollout_logp=roll, ref_logp=ref, entropy=ent, config=cfg)
        outp.loss.backward()
    err_l = abs(float(out.loss) - float(outp.loss))
    err_g = float((x.grad - xp.grad[mask]).abs().max())
    odd = int((lengths % 16 != 0).sum())
    report.check(sec, "packed (odd offsets) = padded: loss within 1e-5, grad within 1e-6",
                 err_l <= 1e-5 * max(1.0, abs(float(outp.loss))) and err_g <= 1e-6,
                 f"loss {err_l:.1e}, grad {err_g:.1e}, {odd} of {len(lengths)} lengths not multiples of 16")
    # a fresh leaf for the timing: the checks' graphs (alive in out / outp) hold an AccumulateGrad node made on the
    # default stream, and the CUDA-graph capture on a side stream then failed on the stream mismatch (2026-12-04)
    del out, outp, xp
    x = pk[0].clone().requires_grad_(True)

    def step():
        x.grad = None
        with fk.use_backend("triton"):
            o = fk.policy_loss(x, pk[1], adv, cu_seqlens=cu, rollout_logp=pk[2], ref_logp=pk[3], entropy=pk[4],
                               config=cfg)
            o.loss.backward()

    n = int(lengths.sum())
    ms = report.time_ms(step)
    report.row(sec, f"fwd+bwd flashrl[triton] packed {n} tokens", ms, (25 * n) / (ms * 1e-3) / 1e9,
               note="sequences at odd offsets")
