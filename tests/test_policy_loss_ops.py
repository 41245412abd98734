"""policy_loss as a torch op: opcheck, torch.compile, the compiled CPU path, bad inputs."""
import pytest
import torch
from _policy_loss_util import loss_backends, make_inputs, run, spec, to_packed
from conftest import DEVICE

import flashrl_kernels as fk
from flashrl_kernels.loss_config import METRIC_NAMES

BACKENDS = loss_backends(DEVICE)
FAST = [b for b in BACKENDS if b != "reference"]


@pytest.fixture(autouse=True)
def _eager_torch(monkeypatch):
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "0")


def _op_args(level="sequence", tis="token_truncate", agg="seq-mean-token-mean", packed=False, ent=True, nll=False):
    b, t = 3, 6
    logp = torch.randn(b * t) - 1
    mask = torch.rand(b * t) > 0.3
    cu = torch.tensor([0, 6, 6, 18]) if packed else torch.arange(b + 1) * t
    return (
        logp.requires_grad_(True), logp.detach() + 0.1 * torch.randn(b * t), torch.randn(b), mask, cu,
        logp.detach() + 0.1 * torch.randn(b * t), logp.detach() + 0.1 * torch.randn(b * t),
        torch.rand(b * t, requires_grad=True) if ent else None, None,
        0.2, 0.28, 3.0, level, tis, 0.5, 2.0, "sum", agg, 0.05, 0.01 if ent else 0.0, 0.0, 0 if packed else t,
        torch.tensor([1.0, 0.0, 1.0]) if nll else None, 0.1 if nll else 0.0,
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level,packed,nll", [("token", False, False), ("sequence", True, False),
                                              ("sequence_token", False, False), ("token", True, True),
                                              ("sequence", False, True)])
def test_opcheck(backend, level, packed, nll):
    args = _op_args(level=level, packed=packed, nll=nll)
    with fk.use_backend(backend):
        torch.library.opcheck(torch.ops.flashrl.policy_loss.default, args)
        with torch.no_grad():
            out = torch.ops.flashrl.policy_loss(*args)
        _, _, g_tok, g_ent, seq_coef, scale = out
        bargs = (torch.tensor(1.3), g_tok, g_ent, seq_coef, args[3], args[4], scale, args[21])
        torch.library.opcheck(torch.ops.flashrl.policy_loss_backward.default, bargs)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("level,packed", [("token", True), ("sequence", False)])
def test_opcheck_token_sum(backend, level, packed):
    args = _op_args(level=level, agg="token-sum", packed=packed)
    with fk.use_backend(backend):
        torch.library.opcheck(torch.ops.flashrl.policy_loss.default, args)
        with torch.no_grad():
            out = torch.ops.flashrl.policy_loss(*args)
    assert out[5].item() == 1.0  # divisor 1 without a normalizer


def test_opcheck_without_entropy():
    args = _op_args(level="token", tis="none", agg="token-mean", ent=False)
    torch.library.opcheck(torch.ops.flashrl.policy_loss.default, args)


def _loss_fn(logp, old, adv, mask, roll, ref, ent):
    cfg = fk.LossConfig(eps_high=0.28, importance_sampling_level="sequence", tis_mode="token_truncate",
                        loss_agg_mode="seq-mean-token-mean", beta=0.04, entropy_coef=0.01)
    out = fk.policy_loss(logp, old, adv, mask=mask, rollout_logp=roll, ref_logp=ref, entropy=ent, config=cfg)
    return out.loss * 2.0, out.metrics["clip_frac_high"], out.metrics["kl_mean"]


@pytest.mark.parametrize("compile_backend", ["aot_eager", "inductor"])
def test_compile_fullgraph(compile_backend):
    torch._dynamo.reset()
    inp = make_inputs(b=3, t=7)
    args = [inp[k] for k in ("logp", "old_logp", "advantages", "mask", "rollout_logp", "ref_logp", "entropy")]
    compiled = torch.compile(_loss_fn, fullgraph=True, backend=compile_backend)
    x1, e1 = args[0].clone().requires_grad_(True), args[6].clone().requires_grad_(True)
    x2, e2 = args[0].clone().requires_grad_(True), args[6].clone().requires_grad_(True)
    out1 = compiled(x1, *args[1:6], e1)
    out1[0].backward()
    out2 = _loss_fn(x2, *args[1:6], e2)
    out2[0].backward()
    for a, b in zip(out1, out2):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(x1.grad, x2.grad)
    torch.testing.assert_close(e1.grad, e2.grad)


def assert_torch_matches_spec(layout, cfg, **kw):
    """The torch backend's loss, gradients (valid tokens) and metrics against the spec."""
    loss, metrics, g, ge = run(layout, cfg, "torch", **kw)
    e_loss, e_m, e_g, e_ge = spec(layout, cfg, **kw)
    torch.testing.assert_close(loss.double(), e_loss, atol=2e-5, rtol=2e-5)
    m = layout.get("mask")

    def sel(x):
        return x if m is None else x[m]

    torch.testing.assert_close(sel(g).double(), sel(e_g), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(sel(ge).double(), sel(e_ge), atol=2e-6, rtol=1e-5)
    for k in METRIC_NAMES:
        torch.testing.assert_close(metrics[k].double(), e_m[k], atol=2e-5, rtol=2e-5, msg=k)


@pytest.mark.skipif(DEVICE != "cpu", reason="the compiled path is the CPU torch backend")
def test_compiled_cpu_path_matches_spec(monkeypatch):
    """The torch backend on CPU compiles its token math with Inductor; it must equal the spec (padded and packed)."""
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "1")
    from flashrl_kernels.torch_impl import policy_loss as tp

    cfg = fk.LossConfig(eps_high=0.28, dual_clip=3.0, importance_sampling_level="token", tis_mode="token_truncate",
                        tis_max=1.5, loss_agg_mode="seq-mean-token-mean", beta=0.04, entropy_coef=0.01)
    before = len(tp._compiled)
    for b, t in ((4, 9), (5, 13)):  # two shapes: dynamic, one compile
        inp = make_inputs(b=b, t=t)
        for layout in (inp, to_packed(inp)):
            assert_torch_matches_spec(layout, cfg)
    assert not tp._compile_broken, tp._compile_broken
    assert len(tp._compiled) == before + 1


@pytest.mark.skipif(DEVICE != "cpu", reason="the compiled path is the CPU torch backend")
def test_compiled_cpu_path_token_sum_matches_spec(monkeypatch):
    """token-sum (divisor 1, or the normalizer) through the compiled CPU path, GSPO level, padded and packed."""
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "1")
    from flashrl_kernels.torch_impl import policy_loss as tp

    cfg = fk.LossConfig(eps_high=0.28, dual_clip=3.0, importance_sampling_level="sequence",
                        tis_mode="sequence_truncate", tis_max=1.5, loss_agg_mode="token-sum", beta=0.04,
                        entropy_coef=0.01)
    inp = make_inputs(b=5, t=11)
    for layout in (inp, to_packed(inp)):
        for norm in (None, 17.0):
            assert_torch_matches_spec(layout, cfg, normalizer=norm)
    assert not tp._compile_broken, tp._compile_broken


# ---- bad inputs ----

def _good():
    inp = make_inputs(b=3, t=5)
    return inp["logp"], inp["old_logp"], inp["advantages"], inp["mask"]


@pytest.mark.parametrize("kwargs,match", [
    ({"dual_clip": 1.0}, "dual_clip"),
    ({"dual_clip": 0.5}, "dual_clip"),
    ({"tis_min": 2.0, "tis_max": 1.0}, "tis_min"),
    ({"tis_mode": "token_clip"}, "tis_mode"),
    ({"importance_sampling_level": "seq"}, "importance_sampling_level"),
    ({"loss_agg_mode": "mean"}, "loss_agg_mode"),
    ({"tis_sequence_reduce": "prod"}, "tis_sequence_reduce"),
    ({"eps_low": 1.0}, "eps_low"),
    ({"eps_high": -0.1}, "eps_high"),
    ({"normalizer": 0.0}, "normalizer"),
    ({"tis_min": -1.0}, "tis_min"),
    ({"beta": float("nan")}, "beta"),
    ({"nll_coef": -0.1}, "nll_coef"),
])
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        fk.LossConfig(**kwargs)


def test_config_type_errors():
    with pytest.raises(TypeError, match="eps_low"):
        fk.LossConfig(eps_low="0.2")
    with pytest.raises(TypeError, match="config"):
        fk.policy_loss(*_good()[:3], config={"eps_low": 0.2})


def test_shape_errors():
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match="old_logp"):
        fk.policy_loss(logp, old[:, :4], adv, mask=mask)
    with pytest.raises(ValueError, match="mask"):
        fk.policy_loss(logp, old, adv, mask=mask[:2])
    with pytest.raises(ValueError, match="advantages"):
        fk.policy_loss(logp, old, adv[:2], mask=mask)
    with pytest.raises(ValueError, match="ref_logp"):
        fk.policy_loss(logp, old, adv, mask=mask, ref_logp=old.T)
    with pytest.raises(ValueError, match="padded inputs"):
        fk.policy_loss(logp.reshape(-1), old.reshape(-1), adv)
    with pytest.raises(TypeError, match="logp"):
        fk.policy_loss(logp.long(), old, adv)
    with pytest.raises(TypeError, match="old_logp"):
        fk.policy_loss(logp, old.numpy(), adv)


def test_missing_inputs_for_config():
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match="rollout_logp"):
        fk.policy_loss(logp, old, adv, mask=mask, config=fk.LossConfig(tis_mode="token_truncate"))
    with pytest.raises(ValueError, match="ref_logp"):
        fk.policy_loss(logp, old, adv, mask=mask, config=fk.LossConfig(beta=0.1))
    with pytest.raises(ValueError, match="entropy"):
        fk.policy_loss(logp, old, adv, mask=mask, config=fk.LossConfig(entropy_coef=0.1))
    with pytest.raises(ValueError, match="nll_coef=0.1 needs positive"):
        fk.policy_loss(logp, old, adv, mask=mask, config=fk.LossConfig(nll_coef=0.1))
    with pytest.raises(ValueError, match="one flag per sequence"):
        fk.policy_loss(logp, old, adv, mask=mask, config=fk.LossConfig(nll_coef=0.1),
                       positive=torch.ones(logp.shape[0] + 1))
    with pytest.raises(TypeError, match="positive"):
        fk.policy_loss(logp, old, adv, mask=mask, config=fk.LossConfig(nll_coef=0.1), positive=[1, 0])


def test_bad_cu_seqlens():
    x = torch.randn(10)
    adv = torch.randn(3)
    for cu, match in ((torch.tensor([1, 4, 6, 10]), "start at 0"), (torch.tensor([0, 4, 6, 9]), "end at"),
                      (torch.tensor([0, 6, 4, 10]), "non-decreasing"), (torch.tensor([0]), "at least 2")):
        with pytest.raises(ValueError, match=match):
            fk.policy_loss(x, x + 0.1, adv, cu_seqlens=cu)
    with pytest.raises(TypeError, match="cu_seqlens"):
        fk.policy_loss(x, x, adv, cu_seqlens=torch.tensor([0.0, 4.0, 6.0, 10.0]))
    with pytest.raises(ValueError, match="packed"):
        fk.policy_loss(x.view(2, 5), x.view(2, 5), adv, cu_seqlens=torch.tensor([0, 4, 6, 10]))
    with pytest.raises(ValueError, match="normalizer"):
        fk.policy_loss(x, x, adv, cu_seqlens=torch.tensor([0, 4, 6, 10]),
                       config=fk.LossConfig(loss_agg_mode="seq-mean-token-sum-norm"))


def test_non_finite_valid_input_is_named():
    logp, old, adv, mask = _good()
    old = old.clone()
    old[0, 1] = float("nan")  # row 0 is full length: a valid position
    with pytest.raises(ValueError, match="old_logp"):
        fk.policy_loss(logp, old, adv, mask=mask)
    # the same NaN in a padding position is ignored (make_inputs already fills padding with NaN)
    logp, old, adv, mask = _good()
    out = fk.policy_loss(logp, old, adv, mask=mask)
    assert torch.isfinite(out.loss)


def test_bad_normalizer():
    logp, old, adv, mask = _good()
    with pytest.raises(ValueError, match="normalizer"):
        fk.policy_loss(logp, old, adv, mask=mask, normalizer=0)
    with pytest.raises(TypeError, match="normalizer"):
        fk.policy_loss(logp, old, adv, mask=mask, normalizer="10")
    with pytest.raises(ValueError, match="normalizer"):
        fk.policy_loss(logp, old, adv, mask=mask, normalizer=torch.ones(2))


def test_metrics_are_detached_tensors_without_sync():
    logp, old, adv, mask = _good()
    out = fk.policy_loss(logp.requires_grad_(True), old, adv, mask=mask)
    assert isinstance(out, fk.LossOutput)
    assert list(out.metrics) == list(METRIC_NAMES)
    assert all(isinstance(v, torch.Tensor) and not v.requires_grad for v in out.metrics.values())
    assert out.loss.requires_grad and out.loss.dtype == torch.float32 and out.loss.dim() == 0


@pytest.mark.parametrize("agg", ["seq-mean-token-sum-norm", "token-sum"])
def test_compile_fullgraph_packed_with_tensor_normalizer(agg):
    torch._dynamo.reset()
    inp = to_packed(make_inputs(b=4, t=6))
    cfg = fk.LossConfig(importance_sampling_level="sequence_token", tis_mode="sequence_mask",
                        tis_sequence_reduce="mean", loss_agg_mode=agg, tis_max=3.0)

    def f(logp, old, adv, cu, roll, norm):
        return fk.policy_loss(logp, old, adv, cu_seqlens=cu, rollout_logp=roll, config=cfg, normalizer=norm).loss

    args = (inp["old_logp"], inp["advantages"], inp["cu_seqlens"], inp["rollout_logp"], torch.tensor(24.0))
    x1 = inp["logp"].clone().requires_grad_(True)
    x2 = inp["logp"].clone().requires_grad_(True)
    l1 = torch.compile(f, fullgraph=True, backend="aot_eager")(x1, *args)
    l1.backward()
    l2 = f(x2, *args)
    l2.backward()
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(x1.grad, x2.grad)
    e_loss, _, e_g, _ = spec(inp, cfg, normalizer=24.0, keys=("rollout_logp",))
    torch.testing.assert_close(l1.double(), e_loss, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(x1.grad.double(), e_g, atol=1e-7, rtol=1e-5)


def test_auto_native_without_policy_loss_falls_back_to_torch(monkeypatch):
    """A native CPU backend that lacks policy_loss must not break it when chosen automatically."""
    import sys
    import types

    from flashrl_kernels import _backend

    fake = types.ModuleType("flashrl_kernels.native")  # has no policy_loss_forward
    monkeypatch.setitem(sys.modules, "flashrl_kernels.native", fake)
    monkeypatch.setattr(_backend, "native_built", lambda: True)
    monkeypatch.delenv("FLASHRL_BACKEND", raising=False)
    assert _backend.selected_backend(torch.device("cpu")) == "native"
    logp, old, adv, mask = _good()
    out = fk.policy_loss(logp, old, adv, mask=mask)
    with fk.use_backend("torch"):
        ref = fk.policy_loss(logp, old, adv, mask=mask)
    torch.testing.assert_close(out.loss, ref.loss)
    with fk.use_backend("native"), pytest.raises(fk.BackendUnavailableError, match="policy_loss"):
        fk.policy_loss(logp, old, adv, mask=mask)
