"""The loss ops' eager path (ops/_eager.py) against their registered torch.library ops.

Outside torch.compile and dispatch modes, `policy_loss` / `value_loss` run the op's own forward, setup_context and
backward through an autograd.Function (the custom-op call cost more than the kernel at trainer sizes). Both paths
must give bit-identical losses, metrics and gradients, and the op must still be what compile / fake tensors see.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import flashrl_kernels as fk

pl_mod = importlib.import_module("flashrl_kernels.ops.policy_loss")  # (the package re-exports the functions)
vl_mod = importlib.import_module("flashrl_kernels.ops.value_loss")

POLICY_CONFIGS = {
    "token dapo+tis+kl+entropy": {"eps_low": 0.2, "eps_high": 0.28, "dual_clip": 3.0, "tis_mode": "token_truncate",
                                  "tis_max": 2.0, "beta": 0.01, "entropy_coef": 0.001, "loss_agg_mode": "token-mean"},
    "gspo seq-tis": {"importance_sampling_level": "sequence", "eps_low": 3e-4, "eps_high": 4e-4,
                     "tis_mode": "sequence_mask", "tis_min": 0.5, "tis_max": 2.0, "loss_agg_mode": "seq-mean-token-mean"},
    "vapo nll": {"nll_coef": 0.1, "loss_agg_mode": "token-sum"},
}


def _policy_inputs(packed: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    b, t = 5, 37
    logp = -torch.rand(b, t, generator=g) * 3
    old = logp + torch.randn(b, t, generator=g) * 0.1
    roll = old + torch.randn(b, t, generator=g) * 0.05
    ref = logp + torch.randn(b, t, generator=g) * 0.1
    ent = torch.rand(b, t, generator=g) * 2
    adv = torch.randn(b, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.2
    kw = {"rollout_logp": roll, "ref_logp": ref, "entropy": ent}
    if packed:
        lengths = torch.tensor([37, 1, 20, 36, 5])
        cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
        n = int(cu[-1])
        flat = {k: v.reshape(-1)[:n] for k, v in kw.items()}
        return logp.reshape(-1)[:n], old.reshape(-1)[:n], adv, dict(flat, mask=mask.reshape(-1)[:n], cu_seqlens=cu,
                                                                    normalizer=float(n))
    return logp, old, adv, dict(kw, mask=mask)


def _run_policy(force_op: bool, monkeypatch, cfg, packed, seed):
    logp, old, adv, kw = _policy_inputs(packed, seed)
    x = logp.clone().requires_grad_(True)
    e = kw["entropy"].clone().requires_grad_(True)
    kw = dict(kw, entropy=e)
    if cfg.get("nll_coef"):
        kw["positive"] = torch.tensor([True, False, True, True, False])
    with monkeypatch.context() as mp:
        if force_op:
            mp.setattr(pl_mod, "needs_op", lambda *a: True)
        out = fk.policy_loss(x, old, adv, config=fk.LossConfig(**cfg), **kw)
    out.loss.backward()
    return out, x.grad, e.grad


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("name", list(POLICY_CONFIGS))
def test_policy_loss_eager_path_equals_op(name, packed, monkeypatch):
    cfg = POLICY_CONFIGS[name]
    eager, gx, ge = _run_policy(False, monkeypatch, cfg, packed, seed=len(name))
    op, ox, oe = _run_policy(True, monkeypatch, cfg, packed, seed=len(name))
    assert "PolicyLossFunction" in type(eager.loss.grad_fn).__name__  # the eager path ran
    assert "PolicyLossFunction" not in type(op.loss.grad_fn).__name__
    assert torch.equal(eager.loss, op.loss) and torch.isfinite(eager.loss)
    assert eager.metrics.keys() == op.metrics.keys()
    for k in eager.metrics:
        assert torch.equal(eager.metrics[k], op.metrics[k]), k
        assert not eager.metrics[k].requires_grad
    assert torch.equal(gx, ox) and gx.abs().sum() > 0
    assert torch.equal(ge, oe)


def _value_inputs(seed):
    g = torch.Generator().manual_seed(seed)
    v = torch.randn(4, 29, generator=g)
    old = v + torch.randn(4, 29, generator=g) * 0.3
    ret = torch.randn(4, 29, generator=g)
    mask = torch.rand(4, 29, generator=g) > 0.25
    return v, old, ret, mask


@pytest.mark.parametrize("clip", [None, 0.2])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_value_loss_eager_path_equals_op(clip, agg, monkeypatch):
    v, old, ret, mask = _value_inputs(3)
    outs = []
    for force_op in (False, True):
        x = v.clone().requires_grad_(True)
        with monkeypatch.context() as mp:
            if force_op:
                mp.setattr(vl_mod, "needs_op", lambda *a: True)
            out = fk.value_loss(x, old, ret, mask=mask, clip_range=clip, loss_agg_mode=agg)
        out.loss.backward()
        outs.append((out, x.grad))
    (e, ge), (o, go) = outs
    assert "ValueLossFunction" in type(e.loss.grad_fn).__name__
    assert torch.equal(e.loss, o.loss) and torch.equal(ge, go) and ge.abs().sum() > 0
    for k in e.metrics:
        assert torch.equal(e.metrics[k], o.metrics[k]), k


def test_fake_tensors_take_the_op():
    logp, old, adv, kw = _policy_inputs(False, 0)
    with FakeTensorMode() as mode:
        f = [mode.from_tensor(t) for t in (logp, old, adv, kw["mask"])]
        out = fk.policy_loss(f[0], f[1], f[2], mask=f[3])
        assert out.loss.shape == () and out.loss.dtype == torch.float32
        v = fk.value_loss(mode.from_tensor(torch.randn(2, 3)), mode.from_tensor(torch.randn(2, 3)),
                          mode.from_tensor(torch.randn(2, 3)))
        assert v.loss.shape == ()


def test_compiled_graph_holds_the_op():
    logp, old, adv, kw = _policy_inputs(False, 1)
    mask = kw["mask"]

    def step(x):
        out = fk.policy_loss(x, old, adv, mask=mask, config=fk.LossConfig(eps_high=0.28))
        return out.loss, out.metrics["clip_frac_high"]

    x1 = logp.clone().requires_grad_(True)
    l1, m1 = step(x1)
    l1.backward()
    x2 = logp.clone().requires_grad_(True)
    torch._dynamo.reset()
    l2, m2 = torch.compile(step, fullgraph=True, backend="aot_eager")(x2)
    l2.backward()
    torch.testing.assert_close(l2, l1, rtol=0, atol=0)
    torch.testing.assert_close(m2, m1, rtol=0, atol=0)
    torch.testing.assert_close(x2.grad, x1.grad, rtol=0, atol=0)


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("norm", [None, 7.0, "tensor"])
def test_value_finalize_on_host_is_bit_identical(agg, norm):
    from flashrl_kernels.torch_impl import value_loss as tv

    g = torch.Generator().manual_seed(5)
    for trial in range(20):
        st = torch.rand(tv.N_STATS, generator=g, dtype=torch.float64) * 100
        st[0] = float(torch.randint(0, 50, (1,), generator=g))  # n_tok, 0 included
        if trial % 5 == 0:
            st[7] = 0.0  # Var(R) = 0: explained variance 0
        normalizer = torch.tensor(3.5) if norm == "tensor" else None
        divisor = norm if isinstance(norm, float) else 0.0
        host = tv._finalize_on_host(st, normalizer, divisor, agg)
        tens = tv._finalize_tensors(st, normalizer, divisor, agg)
        for a, b in zip(host, tens):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
            assert torch.equal(a, b), (trial, a, b)


@pytest.mark.parametrize("agg", ["token-mean", "token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("norm", [None, 7.0, "tensor", "zero"])
@pytest.mark.parametrize("nll_coef", [None, 0.0, 0.3])
def test_policy_finalize_on_host_is_bit_identical(agg, norm, nll_coef):
    from flashrl_kernels.torch_impl import policy_loss as tp

    g = torch.Generator().manual_seed(7)
    for trial in range(10):
        st = torch.rand(tp.N_STATS, generator=g) * 50
        st[0] = float(torch.randint(0, 40, (1,), generator=g)) if trial % 3 else 0.0  # n_tok, 0 included
        st[1] = float(torch.randint(0, 5, (1,), generator=g))
        normalizer = {"tensor": torch.tensor(3.3), "zero": torch.tensor(0.0)}.get(norm)
        divisor = norm if isinstance(norm, float) else 0.0
        nll = None if nll_coef is None else torch.rand(2, generator=g) * torch.tensor([10.0, float(trial)])
        host = tp._finalize_on_host(st, normalizer, divisor, agg, nll, nll_coef or 0.0)
        tens = tp._finalize_tensors(st, normalizer, divisor, agg, nll, nll_coef or 0.0)
        for a, b in zip(host, tens):
            assert a.dtype == b.dtype == torch.float32 and a.shape == b.shape
            assert torch.equal(a, b) or (torch.isnan(a).equal(torch.isnan(b)) and torch.equal(a.nan_to_num(),
                                                                                         b.nan_to_num())), (trial, a, b)
