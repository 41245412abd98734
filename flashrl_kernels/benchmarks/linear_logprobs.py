"""Benchmark cases for linear_token_logprobs (see flashrl_kernels/benchmarks/harness.py).

Against the unfused path a trainer writes today: `logits = hidden @ weight.T`
(a full [N, V] tensor in the model dtype), then fp32 log_softmax and gather
(and the same under torch.compile), against each flashrl backend that can run
on the device (`flashrl[torch]`, `flashrl[native]` on a CPU: same tile loops and
GEMMs, torch vs C++ tile epilogues). fwd+bwd backpropagates a random
per-token weight into hidden and weight.
"""
from __future__ import annotations

import functools

import torch

from flashrl_kernels.benchmarks.harness import Case, flashrl_backends

OP = "linear_logprobs"


def unfused_logprobs(hidden, weight, targets):
    logits = hidden @ weight.T
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, targets[:, None])[:, 0]


def fused_logprobs(hidden, weight, targets, backend=None):
    """flashrl on `backend` (None: the automatic choice)."""
    import flashrl_kernels as fk

    if backend is None:
        return fk.linear_token_logprobs(hidden, weight, targets)
    with fk.use_backend(backend):
        return fk.linear_token_logprobs(hidden, weight, targets)


_compiled = {}


def compiled_unfused(hidden, weight, targets):
    if "f" not in _compiled:
        _compiled["f"] = torch.compile(unfused_logprobs)
    return _compiled["f"](hidden, weight, targets)


def _inputs(n, h, v, dtype, device, grad):
    g = torch.Generator(device="cpu").manual_seed(1234)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device=device, dtype=dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    gout = torch.randn(n, generator=g).to(device)
    if grad:
        hidden.requires_grad_(True)
        weight.requires_grad_(True)
    return hidden, weight, targets, gout


def _maker(fn, n, h, v, dtype, device, mode):
    def make():
        hidden, weight, targets, gout = _inputs(n, h, v, dtype, device, mode == "fwd+bwd")
        if mode == "fwd":
            def run():
                with torch.no_grad():
                    return fn(hidden, weight, targets)
        else:
            def run():
                hidden.grad = None
                weight.grad = None
                lp = fn(hidden, weight, targets)
                (lp * gout).sum().backward()
                return hidden.grad
        return run
    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        sizes = [(4096, 4096, 151936)] if quick else [(4096, 4096, 151936), (16384, 4096, 151936)]
    else:
        sizes = [(256, 896, 151936)] if quick else [(2048, 896, 151936)]
    dtype = torch.bfloat16
    out = []
    for n, h, v in sizes:
        size = f"N={n} H={h} V={v} bf16"
        esz = 2
        for mode in ("fwd", "fwd+bwd"):
            flops = (2 if mode == "fwd" else 6) * n * h * v
            nbytes = (n * h + v * h) * esz * (1 if mode == "fwd" else 3)
            impls = [("unfused eager", unfused_logprobs, True)]
            if not quick:
                impls.append(("unfused torch.compile", compiled_unfused, False))
            for b in flashrl_backends(device, "linear_logprobs_stats"):
                impls.append((f"flashrl[{b}]", functools.partial(fused_logprobs, backend=b), False))
            for impl, fn, base in impls:
                out.append(Case(op=OP, impl=impl, mode=mode, size=size, make=_maker(fn, n, h, v, dtype, device, mode),
                                bytes=nbytes, flops=flops, baseline=base))
    return out
