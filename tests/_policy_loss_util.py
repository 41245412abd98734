"""Shared input builders for the policy-loss tests."""
import torch

import flashrl_kernels as fk
from flashrl_kernels.reference import policy_loss_spec


def make_inputs(b=4, t=9, *, per_token_adv=False, zero_len=True, spread=0.3, seed_shift=0.0):
    """Random padded inputs with right padding; one sequence empty when zero_len. Garbage (NaN) in padding."""
    lengths = torch.randint(1, t + 1, (b,))
    if zero_len and b > 2:
        lengths[1] = 0
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    logp = torch.randn(b, t) * 0.5 - 1.0 + seed_shift
    old = logp + torch.randn(b, t) * spread
    roll = old + torch.randn(b, t) * spread
    ref = logp + torch.randn(b, t) * spread
    ent = torch.rand(b, t) * 2.0
    adv = torch.randn(b, t) if per_token_adv else torch.randn(b)
    for x in (logp, old, roll, ref, ent):
        x[~mask] = float("nan")  # padding values must never matter
    if per_token_adv:
        adv[~mask] = float("nan")
    return {"logp": logp, "old_logp": old, "advantages": adv, "mask": mask, "rollout_logp": roll, "ref_logp": ref, "entropy": ent,
                "lengths": lengths}


def to_packed(inp):
    """The same batch as packed [total] tensors with cu_seqlens."""
    mask, lengths = inp["mask"], inp["lengths"]
    out = {}
    for k in ("logp", "old_logp", "rollout_logp", "ref_logp", "entropy"):
        out[k] = inp[k][mask]
    adv = inp["advantages"]
    out["advantages"] = adv if adv.dim() == 1 else adv[mask]
    out["cu_seqlens"] = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    return out


def run(inp, cfg, backend, *, normalizer=None, grad=True, keys=None, positive=None):
    """policy_loss on `backend`; returns (loss, metrics, grad_logp, grad_entropy)."""
    keys = ("rollout_logp", "ref_logp", "entropy") if keys is None else keys
    lp = inp["logp"].clone().requires_grad_(grad)
    ent = inp["entropy"].clone().requires_grad_(grad) if "entropy" in keys else None
    kw = {k: inp[k] for k in keys if k != "entropy"}
    if "mask" in inp:
        kw["mask"] = inp["mask"]
    if "cu_seqlens" in inp:
        kw["cu_seqlens"] = inp["cu_seqlens"]
    with fk.use_backend(backend):
        out = fk.policy_loss(lp, inp["old_logp"], inp["advantages"], entropy=ent, config=cfg,
                             normalizer=normalizer, positive=positive, **kw)
        if not grad:
            return out.loss, out.metrics, None, None
        gl, ge = torch.autograd.grad(out.loss, [lp, ent] if ent is not None else [lp], allow_unused=True) + (None,) * (
            0 if ent is not None else 1)
    return out.loss, out.metrics, gl, ge


def spec(inp, cfg, *, normalizer=None, keys=None, positive=None):
    """float64 spec: (loss, metrics, grad_logp, grad_entropy), grads via autograd through the spec."""
    keys = ("rollout_logp", "ref_logp", "entropy") if keys is None else keys
    lp = inp["logp"].double().requires_grad_(True)
    ent = inp["entropy"].double().requires_grad_(True) if "entropy" in keys else None
    kw = {k: inp[k] for k in keys if k != "entropy"}
    if "mask" in inp:
        kw["mask"] = inp["mask"]
    if "cu_seqlens" in inp:
        kw["cu_seqlens"] = inp["cu_seqlens"]
    loss, metrics = policy_loss_spec(lp, inp["old_logp"], inp["advantages"], entropy=ent, config=cfg,
                                     normalizer=normalizer, positive=positive, **kw)
    grads = torch.autograd.grad(loss, [lp] + ([ent] if ent is not None else []), allow_unused=True)
    gl = grads[0] if grads[0] is not None else torch.zeros_like(lp)
    ge = None
    if ent is not None:
        ge = grads[1] if grads[1] is not None else torch.zeros_like(ent)
    return loss, metrics, gl, ge


def assert_close_masked(actual, expected, mask, atol, rtol=1e-5):
    a = actual.double()
    e = expected.double()
    if mask is not None:
        a = torch.where(mask, a, 0.0)
        e = torch.where(mask, e, 0.0)
    torch.testing.assert_close(a, e, atol=atol, rtol=rtol)


def loss_backends(device="cpu"):
    """Backends that can run here and implement policy_loss (the native CPU backend may not, yet)."""
    from conftest import available_backends

    return available_backends(device, op="policy_loss_forward")
