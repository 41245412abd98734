"""value_loss forward+backward vs the clipped value loss as verl writes it.

Baseline: verl 0.9.1's `compute_value_loss` (= TRL PPO's) written out in eager torch:
clip_by_value, both squared errors, their max, a masked token mean times 0.5, and the
vf_clipfrac metric it returns; then torch.compile of that same function; then each flashrl
backend that runs on the device (which also computes explained variance, value / return
means, the squared error and the token count, inside the same pass). clip_range 0.2,
token-mean. Inputs fp32 [B, T] with a right-padding mask.
Bytes: values, old_values, returns read (12 B/token) + mask (1 B/token); fwd+bwd adds the fp32
gradient write (4 B/token).
"""
from __future__ import annotations

import functools

import torch

import flashrl_kernels as fk

from .harness import Case, flashrl_backends

CLIP = 0.2


def eager_loss(vpreds, values, returns, mask):
    """verl's compute_value_loss (token-mean, dp_size 1) and its vf_clipfrac, as written there."""
    m = mask.float()
    vpredclipped = torch.max(torch.min(vpreds, values + CLIP), values - CLIP)  # verl_F.clip_by_value
    vf_losses1 = (vpreds - returns) ** 2
    vf_losses2 = (vpredclipped - returns) ** 2
    clipped_vf_losses = torch.max(vf_losses1, vf_losses2)
    loss = 0.5 * (torch.where(mask, clipped_vf_losses, 0.0) * m).sum() / m.sum()
    vf_clipfrac = (torch.gt(vf_losses2, vf_losses1).float() * m).sum() / (m.sum() + 1e-8)
    return loss, {"vf_clip_frac": vf_clipfrac}


@functools.cache
def _compiled_eager():
    return torch.compile(eager_loss, dynamic=False)


def _flashrl(backend):
    def f(vpreds, values, returns, mask):
        with fk.use_backend(backend):
            out = fk.value_loss(vpreds, values, returns, mask=mask, clip_range=CLIP)
        return out.loss, out.metrics

    return f


def sizes(quick: bool, device: torch.device):
    return (16, 512) if quick else (256, 4096)


def make_inputs(b, t, device, generator_seed=0):
    """(values, old_values, returns, mask) fp32 [B, T] with right padding; about a third of the tokens clip."""
    g = torch.Generator(device="cpu").manual_seed(generator_seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    returns = torch.randn(b, t, generator=g)
    old = returns + 0.5 * torch.randn(b, t, generator=g)
    values = old + 0.3 * torch.randn(b, t, generator=g)
    return [x.to(device) for x in (values, old, returns, mask)]


def _maker(fn, b, t, device, backward):
    def make():
        values, old, returns, mask = make_inputs(b, t, device)
        x = values.requires_grad_(backward)

        def step():
            if backward:
                x.grad = None
                loss, _metrics = fn(x, old, returns, mask)
                loss.backward()
            else:
                with torch.no_grad():
                    fn(x, old, returns, mask)

        step()  # warm-up outside the timing: torch.compile (flashrl's CPU torch path included) compiles here
        return step

    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    b, t = sizes(quick, device)
    n = b * t
    size = f"B={b} T={t} fp32"
    impls = [("eager torch (verl code)", eager_loss, True),
             ("torch.compile", lambda *a: _compiled_eager()(*a), False)]
    for backend in flashrl_backends(device, "value_loss_forward"):
        impls.append((f"flashrl[{backend}]", _flashrl(backend), False))
    out = []
    for mode, backward, nbytes in (("fwd", False, 13 * n), ("fwd+bwd", True, 17 * n)):
        for name, fn, base in impls:
            out.append(Case("value_loss", name, mode, size, _maker(fn, b, t, device, backward), nbytes, None, base))
    return out
