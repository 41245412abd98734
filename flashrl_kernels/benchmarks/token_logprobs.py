"""token_logprobs vs the paths trainers use today.

Baseline: `log_softmax(logits.float(), -1).gather(...)` in eager torch (what
most trainers write), then torch.compile of the same, TRL's
selective_log_softmax when trl is installed, and each flashrl backend that can
run on the device. Bytes: the logits read once and the fp32 output written
(fwd); fwd+bwd adds one more read of the logits and the gradient write.
"""
from __future__ import annotations

import functools

import torch

import flashrl_kernels as fk

from .harness import Case, flashrl_backends


def naive(logits, targets):
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


@functools.cache
def _compiled_naive():
    return torch.compile(naive, dynamic=False)


def _trl_selective_log_softmax():
    import warnings

    try:
        with warnings.catch_warnings():  # trl warns at import about the vLLM version it was tested with
            warnings.simplefilter("ignore")
            from trl.trainer.utils import selective_log_softmax
    except Exception:
        return None
    return selective_log_softmax


def _flashrl(backend):
    def f(logits, targets):
        with fk.use_backend(backend):
            return fk.token_logprobs(logits, targets)

    return f


def sizes(quick: bool, device: torch.device):
    if device.type == "cuda":
        return (4096 if quick else 16384), 151936
    return (128 if quick else 1024), 151936


def _maker(fn, n, v, dtype, device, backward):
    def make():
        g = torch.Generator(device="cpu").manual_seed(0)
        logits = (torch.randn(n, v, generator=g) * 2).to(device=device, dtype=dtype)
        targets = torch.randint(0, v, (n,), generator=g).to(device)
        if not backward:
            return lambda: fn(logits, targets)
        x = logits.requires_grad_(True)
        grad_out = torch.randn(n, generator=g).to(device)

        def step():
            x.grad = None
            fn(x, targets).backward(grad_out)

        return step

    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    n, v = sizes(quick, device)
    dtype = torch.bfloat16
    es = torch.finfo(dtype).bits // 8
    size = f"N={n} V={v} bf16"
    impls = [("eager log_softmax+gather", naive, True), ("torch.compile", lambda x, t: _compiled_naive()(x, t), False)]
    trl = _trl_selective_log_softmax()
    if trl is not None:
        impls.append(("trl selective_log_softmax", trl, False))
    for b in flashrl_backends(device, "token_logprobs_forward"):
        impls.append((f"flashrl[{b}]", _flashrl(b), False))
    out = []
    for mode, backward, nbytes in (
        ("fwd", False, n * v * es + n * 12),
        ("fwd+bwd", True, 3 * n * v * es + n * 16),
    ):
        for name, fn, base in impls:
            out.append(Case("token_logprobs", name, mode, size, _maker(fn, n, v, dtype, device, backward), nbytes, None, base))
    return out
