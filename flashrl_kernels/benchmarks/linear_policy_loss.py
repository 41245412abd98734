"""The policy head, hidden states to loss, forward+backward (issue 16): fused vs composed vs unfused.

Loss: GRPO/DAPO token-level clipped loss, eps 0.2 / 0.28, token-mean, no KL (the config Liger-Kernel's
`LigerFusedLinearGRPOLoss(loss_type="dapo", beta=0)` computes too). Inputs: hidden [B, T, H] and weight
[V, H] in bf16, targets, old logprobs and per-sequence advantages, every token valid.

- unfused eager (baseline): logits = hidden @ weight.T ([N, V] in bf16), fp32 log_softmax, gather, and the
  loss as a trainer writes it in torch;
- unfused torch.compile: the same function under torch.compile;
- flashrl composed[<backend>]: policy_loss(linear_token_logprobs(...)) (logits recomputed in the backward:
  8NHV of matmul);
- flashrl fused[<backend>]: linear_policy_loss (6NHV);
- liger: LigerFusedLinearGRPOLoss, when liger-kernel is installed.
fwd+bwd backpropagates into hidden and weight.
"""
from __future__ import annotations

import functools

import torch

import flashrl_kernels as fk

from .harness import Case, flashrl_backends

OP = "linear_policy_loss"
EPS_LOW, EPS_HIGH = 0.2, 0.28
CONFIG = fk.LossConfig(eps_low=EPS_LOW, eps_high=EPS_HIGH, loss_agg_mode="token-mean")


def unfused_loss(hidden, weight, targets, old_logp, advantages, mask):
    logits = hidden @ weight.T
    logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ratio = torch.exp(logp - old_logp)
    adv = advantages.unsqueeze(-1)
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 1 - EPS_LOW, 1 + EPS_HIGH) * adv)
    m = mask.float()
    return (per_token * m).sum() / m.sum().clamp(min=1.0)


@functools.cache
def _compiled_unfused():
    return torch.compile(unfused_loss)


def compiled_unfused(*args):
    return _compiled_unfused()(*args)


def _composed(backend):
    def f(hidden, weight, targets, old_logp, advantages, mask):
        with fk.use_backend(backend):
            logp = fk.linear_token_logprobs(hidden, weight, targets)
            return fk.policy_loss(logp, old_logp, advantages, mask=mask, config=CONFIG).loss
    return f


def _fused(backend):
    def f(hidden, weight, targets, old_logp, advantages, mask):
        with fk.use_backend(backend):
            return fk.linear_policy_loss(hidden, weight, targets, old_logp, advantages, mask=mask,
                                         config=CONFIG).loss
    return f


def _liger():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
    except Exception:  # not installed, or its Triton import fails
        return None
    mod = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, epsilon_low=EPS_LOW, epsilon_high=EPS_HIGH,
                                   loss_type="dapo")

    def f(hidden, weight, targets, old_logp, advantages, mask):
        out = mod(hidden, weight, targets, mask.long(), advantages, old_per_token_logps=old_logp)
        return out[0] if isinstance(out, tuple) else out
    return f


def _inputs(b, t, h, v, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(1234)
    hidden = torch.randn(b, t, h, generator=g).to(device=device, dtype=dtype).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(device=device, dtype=dtype).requires_grad_(True)
    targets = torch.randint(0, v, (b, t), generator=g).to(device)
    old = (-torch.rand(b, t, generator=g) * 3 - 10).to(device)  # near the logprobs of random logits over 152k
    adv = torch.randn(b, generator=g).to(device)
    mask = torch.ones(b, t, dtype=torch.bool, device=device)
    return hidden, weight, targets, old, adv, mask


def _maker(fn, b, t, h, v, dtype, device):
    def make():
        hidden, weight, targets, old, adv, mask = _inputs(b, t, h, v, dtype, device)

        def run():
            hidden.grad = None
            weight.grad = None
            fn(hidden, weight, targets, old, adv, mask).backward()
            return hidden.grad
        return run
    return make


def cases(quick: bool, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        sizes = [(4, 1024, 4096, 151936)] if quick else [(8, 1024, 4096, 151936), (16, 1024, 4096, 151936)]
    else:
        sizes = [(2, 128, 896, 151936)] if quick else [(8, 256, 896, 151936)]
    dtype = torch.bfloat16
    out = []
    for b, t, h, v in sizes:
        n = b * t
        size = f"N={n} (B={b} T={t}) H={h} V={v} bf16"
        impls = [("unfused eager", unfused_loss, True)]
        if not quick:
            impls.append(("unfused torch.compile", compiled_unfused, False))
        for be in flashrl_backends(device, "linear_policy_loss_forward"):
            impls.append((f"flashrl composed[{be}]", _composed(be), False))
            impls.append((f"flashrl fused[{be}]", _fused(be), False))
        liger = _liger()
        if liger is not None:
            impls.append(("liger LigerFusedLinearGRPOLoss", liger, False))
        for impl, fn, base in impls:
            out.append(Case(op=OP, impl=impl, mode="fwd+bwd", size=size, make=_maker(fn, b, t, h, v, dtype, device),
                            bytes=None, flops=6 * n * h * v, baseline=base))
    return out
