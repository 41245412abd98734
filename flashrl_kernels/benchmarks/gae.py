"""gae (advantages + returns + whitening) vs verl's compute_gae_advantage_return.

Baseline: verl 0.9.1's function as written there (a reverse Python loop over
the T positions on [B] columns, returns = advantages + values, then
masked_whiten of the advantages), in eager torch, with gamma 1.0 and
lam 0.95 (verl's defaults). Then torch.compile of the loop body (one
compiled step per position: compiling the whole function unrolls the loop
over T: Inductor took 9 / 13 / 29 / 65 s at T = 32 / 64 / 128 / 256 on this
project's CPU, superlinear in T, which puts T = 8192 beyond half an hour, so
the whole-function compile is not a case), then each flashrl backend that
runs on the device, with whiten=True (the same outputs).

Inputs fp32 [B, T] with a right-padding mask (lengths uniform in [T/4, T]):
bool for flashrl, float for verl's arithmetic on it. Bytes: rewards and
values read (4 + 4 B/token), the mask (1 B/token), advantages and returns
written (4 + 4 B/token): 17 B/token for every row (the extra read and write
of the whitening pass is not counted).
"""
from __future__ import annotations

import functools

import torch

import flashrl_kernels as fk

from .harness import Case, flashrl_backends

GAMMA, LAM = 1.0, 0.95
BYTES_PER_TOKEN = 17


def _masked_mean(x, m):
    return (torch.where(m.bool(), x, 0.0) * m).sum() / (m.sum() + 1e-8)


def _masked_whiten(x, m):
    """verl.utils.torch_functional.masked_whiten (unbiased variance)."""
    mean = _masked_mean(x, m)
    var = _masked_mean((x - mean) ** 2, m)
    n = m.sum()
    var = var * n / (n - 1)
    return (x - mean) * torch.rsqrt(var + 1e-8)


def _step(r_t, v_t, m_t, nextvalues, lastgaelam, gamma: float, lam: float):
    """One position of verl's loop."""
    delta = r_t + gamma * nextvalues - v_t
    lastgaelam_ = delta + gamma * lam * lastgaelam
    nextvalues = v_t * m_t + (1 - m_t) * nextvalues
    lastgaelam = lastgaelam_ * m_t + (1 - m_t) * lastgaelam
    return nextvalues, lastgaelam


def verl_gae(rewards, values, response_mask, gamma=GAMMA, lam=LAM, step=_step):
    """verl's compute_gae_advantage_return (the loop written out; `step` may be a compiled _step)."""
    with torch.no_grad():
        nextvalues = torch.zeros_like(rewards[:, 0])
        lastgaelam = torch.zeros_like(rewards[:, 0])
        advantages_reversed = []
        for t in reversed(range(rewards.shape[-1])):
            nextvalues, lastgaelam = step(rewards[:, t], values[:, t], response_mask[:, t], nextvalues, lastgaelam,
                                          gamma, lam)
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        returns = advantages + values
        advantages = _masked_whiten(advantages, response_mask)
    return advantages, returns


@functools.cache
def _compiled_step():
    return torch.compile(_step, dynamic=False)


def _flashrl(backend):
    def f(rewards, values, mask):
        with fk.use_backend(backend):
            out = fk.gae(rewards, values, mask=mask, gamma=GAMMA, lam=LAM, whiten=True)
        return out.advantages, out.returns

    return f


def sizes(quick: bool) -> list[tuple[int, int]]:
    return [(16, 512), (4, 2048)] if quick else [(512, 8192), (64, 32768)]


def make_inputs(b, t, device, generator_seed=0):
    g = torch.Generator(device="cpu").manual_seed(generator_seed)
    lengths = torch.randint(t // 4, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    rewards = torch.randn(b, t, generator=g) * 0.1
    rewards[torch.arange(b), lengths - 1] += torch.rand(b, generator=g)  # the outcome reward on the last token
    values = torch.randn(b, t, generator=g) * 0.5
    return [x.to(device) for x in (rewards, values, mask)]


def _maker(fn, b, t, device, float_mask):
    def make():
        r, v, m = make_inputs(b, t, device)
        if float_mask:
            m = m.float()

        def step():
            fn(r, v, m)

        step()  # warm-up outside the timing (torch.compile compiles here)
        return step

    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    impls = [("verl loop (eager)", verl_gae, True, True),
             ("torch.compile (loop body)", lambda r, v, m: verl_gae(r, v, m, step=_compiled_step()), True, False)]
    for backend in flashrl_backends(device, "gae_forward"):
        impls.append((f"flashrl[{backend}]", _flashrl(backend), False, False))
    out = []
    for b, t in sizes(quick):
        size = f"B={b} T={t} fp32"
        for name, fn, float_mask, base in impls:
            out.append(Case("gae", name, "fwd", size, _maker(fn, b, t, device, float_mask),
                            BYTES_PER_TOKEN * b * t, None, base))
    return out
