"""gpu_check section: the fused policy head (linear_policy_loss, issue 16).

At B=8, T=2048 (N=16384), H=4096, V=151936 bf16 (dry run: tiny sizes on the CPU):
- correctness vs the float64 spec (loss, metrics, gradients to hidden, weight and bias) at N=512 for a
  token-level config (clip-higher, token TIS, KL, entropy) and GSPO with chunks smaller than a sequence
  (the two-pass path);
- fwd+bwd time and peak extra memory of flashrl fused (triton), the composition policy_loss(linear_token_logprobs)
  (8NHV), the unfused path and its torch.compile, and Liger's LigerFusedLinearGRPOLoss when importable;
- fraction of the measured bf16 matmul rate counting 6NHV. Target: >= 75 %.
"""
from __future__ import annotations

import os

SEC = "linear_policy_loss"


def _correctness(report, torch, fk, n_seq, t, h, v):
    from flashrl_kernels.reference.linear_policy_loss import linear_policy_loss_spec

    dev = report.device
    g = torch.Generator(device="cpu").manual_seed(5)
    hidden = torch.randn(n_seq, t, h, generator=g).to(dev)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dev)
    bias = (0.1 * torch.randn(v, generator=g)).to(dev)
    targets = torch.randint(0, v, (n_seq, t), generator=g).to(dev)
    mask = (torch.rand(n_seq, t, generator=g) > 0.2).to(dev)
    old = (-torch.rand(n_seq, t, generator=g) * 2 - 10).to(dev)
    roll = old + 0.05 * torch.randn(n_seq, t, generator=g).to(dev)
    ref = old + 0.05 * torch.randn(n_seq, t, generator=g).to(dev)
    adv = torch.randn(n_seq, generator=g).to(dev)
    configs = {
        "token: clip-higher, TIS, KL, entropy": (fk.LossConfig(eps_high=0.28, tis_mode="token_truncate", beta=0.02,
                                                               entropy_coef=0.01), None),
        "GSPO, chunks < a sequence (two passes)": (fk.LossConfig(importance_sampling_level="sequence",
                                                                 loss_agg_mode="seq-mean-token-mean"), str(t // 3)),
    }
    for name, (cfg, rows) in configs.items():
        old_rows = os.environ.get("FLASHRL_POLICY_CHUNK_ROWS")
        if rows:
            os.environ["FLASHRL_POLICY_CHUNK_ROWS"] = rows
        try:
            leaves = [x.clone().requires_grad_(True) for x in (hidden, weight, bias)]
            with fk.use_backend("triton"):
                out = fk.linear_policy_loss(leaves[0], leaves[1], targets, old, adv, bias=leaves[2], mask=mask,
                                            rollout_logp=roll, ref_logp=ref, config=cfg)
                out.loss.backward()
        finally:
            if rows:
                if old_rows is None:
                    os.environ.pop("FLASHRL_POLICY_CHUNK_ROWS", None)
                else:
                    os.environ["FLASHRL_POLICY_CHUNK_ROWS"] = old_rows
        ref64 = [x.double().requires_grad_(True) for x in (hidden, weight, bias)]
        loss64, m64, _, _ = linear_policy_loss_spec(ref64[0], ref64[1], targets, old, adv, bias=ref64[2], mask=mask,
                                                    rollout_logp=roll, ref_logp=ref, config=cfg)
        loss64.backward()
        err_l = abs(float(out.loss.detach()) - float(loss64.detach()))
        report.check(SEC, f"{name}: loss err vs fp64 <= 1e-4 * max(1, |loss|)",
                     err_l <= 1e-4 * max(1.0, abs(float(loss64.detach()))), f"{err_l:.2e}")
        for label, a, b in zip(("hidden", "weight", "bias"), leaves, ref64):
            scale = float(b.grad.abs().max()) or 1.0
            err = float((a.grad.double() - b.grad).abs().max()) / scale
            report.check(SEC, f"{name}: grad_{label} rel err <= 1e-3", err <= 1e-3, f"{err:.2e}")
        err_m = max(abs(float(out.metrics[k]) - float(m64[k])) / max(1.0, abs(float(m64[k]))) for k in m64)
        report.check(SEC, f"{name}: metrics rel err <= 1e-4", err_m <= 1e-4, f"{err_m:.2e}")


def run(report):
    torch = report.torch
    import flashrl_kernels as fk
    from flashrl_kernels.benchmarks import linear_policy_loss as bench

    dev = report.device
    if report.dry_run:
        _correctness(report, torch, fk, 3, 12, 16, 301)
        b, t, h, v = 2, 16, 32, 1031
    else:
        _correctness(report, torch, fk, 4, 128, 4096, 151936)
        b, t, h, v = 8, 2048, 4096, 151936
    n = b * t
    flops = 6 * n * h * v
    impls = {"flashrl fused[triton]": bench._fused("triton"), "flashrl composed[triton]": bench._composed("triton"),
             "unfused eager": bench.unfused_loss}
    if dev.type == "cuda":
        impls["unfused torch.compile"] = bench.compiled_unfused
    liger = bench._liger()
    if liger is not None and dev.type == "cuda":
        impls["liger LigerFusedLinearGRPOLoss"] = liger
    fk.set_value_checks(False)
    try:
        for name, fn in impls.items():
            try:
                step = bench._maker(fn, b, t, h, v, torch.bfloat16, dev)()
                ms = report.time_ms(step, warmup=1, repeats=3)
                peak = report.peak_extra_mb(step)
                r = report.row(SEC, f"fwd+bwd {name} N={n} H={h}", ms, tflops=flops / (ms * 1e-3) / 1e12,
                               peak_mb=peak)
                if name == "flashrl fused[triton]":
                    report.target(SEC, "fwd+bwd % of bf16 matmul rate (6NHV)", r["% MM"] or 0.0, 75)
            except Exception as exc:
                report.row(SEC, name, note=f"error: {type(exc).__name__}: {str(exc)[:80]}")
    finally:
        fk.set_value_checks(True)
