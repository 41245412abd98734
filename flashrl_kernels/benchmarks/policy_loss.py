"""policy_loss forward+backward vs the same math as trainers write it.

Baseline: the per-token clipped loss written the way TRL / verl write it in
eager torch (ratio, clamp, min, TIS weight, k3 KL, masked token mean, plus the
clip-fraction and KL metrics they log), then torch.compile of that same
function, then each flashrl backend that runs on the device. Config:
eps_low 0.2, eps_high 0.28 (clip-higher), token-level TIS truncated at 2,
beta 0.04, token-mean. Inputs fp32 [B, T] with a right-padding mask.
Bytes: logp, old_logp, rollout_logp, ref_logp read (16 B/token) + mask
(1 B/token) + advantages; fwd+bwd adds the fp32 gradient write (4 B/token).
"""
from __future__ import annotations

import functools

import torch

import flashrl_kernels as fk

from .harness import Case, flashrl_backends

EPS_LOW, EPS_HIGH, TIS_CAP, BETA = 0.2, 0.28, 2.0, 0.04
CONFIG = fk.LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, tis_mode="token_truncate", tis_min=0.0, tis_max=TIS_CAP,
                       beta=BETA, loss_agg_mode="token-mean")


def eager_loss(logp, old_logp, advantages, mask, rollout_logp, ref_logp):
    """The loss and metrics as a trainer writes them in eager torch."""
    m = mask.float()
    coef_1 = torch.exp(logp - old_logp)
    coef_2 = torch.clamp(coef_1, 1 - EPS_LOW, 1 + EPS_HIGH)
    adv = advantages.unsqueeze(1)
    per_token = -torch.min(coef_1 * adv, coef_2 * adv)
    per_token = per_token * torch.exp(old_logp - rollout_logp).clamp(max=TIS_CAP)
    d = ref_logp - logp
    kl = torch.exp(d) - d - 1
    per_token = per_token + BETA * kl
    count = m.sum().clamp(min=1.0)
    loss = (per_token * m).sum() / count
    low = ((coef_1 < 1 - EPS_LOW) & (adv < 0)).float()
    high = ((coef_1 > 1 + EPS_HIGH) & (adv > 0)).float()
    metrics = {"clip_frac_low": (low * m).sum() / count, "clip_frac_high": (high * m).sum() / count,
               "kl_mean": (kl.detach() * m).sum() / count}
    return loss, metrics


@functools.cache
def _compiled_eager():
    return torch.compile(eager_loss, dynamic=False)


def _flashrl(backend):
    def f(logp, old_logp, advantages, mask, rollout_logp, ref_logp):
        with fk.use_backend(backend):
            out = fk.policy_loss(logp, old_logp, advantages, mask=mask, rollout_logp=rollout_logp,
                                 ref_logp=ref_logp, config=CONFIG)
        return out.loss, out.metrics

    return f


def sizes(quick: bool, device: torch.device):
    return (16, 512) if quick else (256, 4096)


def make_inputs(b, t, device, generator_seed=0):
    g = torch.Generator(device="cpu").manual_seed(generator_seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    logp = torch.randn(b, t, generator=g) * 0.5 - 1.0
    old = logp + torch.randn(b, t, generator=g) * 0.1
    roll = old + torch.randn(b, t, generator=g) * 0.1
    ref = logp + torch.randn(b, t, generator=g) * 0.1
    adv = torch.randn(b, generator=g)
    return [x.to(device) for x in (logp, old, adv, mask, roll, ref)]


def _maker(fn, b, t, device, backward):
    def make():
        logp, old, adv, mask, roll, ref = make_inputs(b, t, device)
        x = logp.requires_grad_(backward)

        def step():
            if backward:
                x.grad = None
                loss, _metrics = fn(x, old, adv, mask, roll, ref)
                loss.backward()
            else:
                with torch.no_grad():
                    fn(x, old, adv, mask, roll, ref)

        step()  # warm-up outside the timing: torch.compile (flashrl's CPU path included) compiles here
        return step

    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    b, t = sizes(quick, device)
    n = b * t
    size = f"B={b} T={t} fp32"
    impls = [("eager torch (trainer code)", eager_loss, True),
             ("torch.compile", lambda *a: _compiled_eager()(*a), False)]
    for backend in flashrl_backends(device, "policy_loss_forward"):
        impls.append((f"flashrl[{backend}]", _flashrl(backend), False))
    out = []
    for mode, backward, nbytes in (("fwd", False, 17 * n + 4 * b), ("fwd+bwd", True, 21 * n + 4 * b)):
        for name, fn, base in impls:
            out.append(Case("policy_loss", name, mode, size, _maker(fn, b, t, device, backward), nbytes, None, base))
    return out
