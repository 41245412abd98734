"""policy_loss on every backend vs the float64 spec: all config combinations, both layouts, gradients, metrics."""
import dataclasses
import itertools

import pytest
import torch
from _policy_loss_util import assert_close_masked, loss_backends, make_inputs, run, spec, to_packed

import flashrl_kernels as fk
from flashrl_kernels.loss_config import LOSS_AGG_MODES, METRIC_NAMES, TIS_MODES
from flashrl_kernels.reference.policy_loss import policy_loss_spec

BACKENDS = loss_backends("cpu")  # reference, torch, triton (interpreter) on this machine
FAST = [b for b in BACKENDS if b != "reference"]
LEVELS = ("token", "sequence", "sequence_token")


@pytest.fixture(autouse=True)
def _eager_torch(monkeypatch):
    # the compiled CPU path is tested in test_policy_loss_ops.py; here the eager math is what is checked
    monkeypatch.setenv("FLASHRL_TORCH_COMPILE", "0")


def _check_against_spec(inp, cfg, backend, *, normalizer=None, keys=None, positive=None):
    loss, metrics, gl, ge = run(inp, cfg, backend, normalizer=normalizer, keys=keys, positive=positive)
    e_loss, e_metrics, e_gl, e_ge = spec(inp, cfg, normalizer=normalizer, keys=keys, positive=positive)
    mask = inp.get("mask")
    torch.testing.assert_close(loss.double(), e_loss, atol=2e-5, rtol=2e-5)
    assert_close_masked(gl, e_gl, mask, atol=2e-6)
    if ge is not None:
        assert_close_masked(ge, e_ge, mask, atol=2e-6)
    assert set(metrics) == set(METRIC_NAMES)
    for k in METRIC_NAMES:
        assert metrics[k].dim() == 0 and metrics[k].dtype == torch.float32
        torch.testing.assert_close(metrics[k].double(), e_metrics[k], atol=2e-5, rtol=2e-5, msg=k)
    return loss


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("level,tis_mode,agg", list(itertools.product(LEVELS, TIS_MODES, LOSS_AGG_MODES)))
def test_every_combination_vs_spec(backend, level, tis_mode, agg):
    inp = make_inputs(b=5, t=11)
    cfg = fk.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=1.6, importance_sampling_level=level,
                        tis_mode=tis_mode, tis_min=0.6, tis_max=1.4, loss_agg_mode=agg, beta=0.05,
                        entropy_coef=0.01)
    loss = _check_against_spec(inp, cfg, backend)
    assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("tis_mode,reduce", [("sequence_truncate", "mean"), ("sequence_mask", "mean"),
                                             ("token_mask", "sum")])
def test_per_token_advantages_and_geometric_tis(backend, level, tis_mode, reduce):
    inp = make_inputs(b=4, t=10, per_token_adv=True)
    cfg = fk.LossConfig(eps_low=0.1, eps_high=0.15, importance_sampling_level=level, tis_mode=tis_mode,
                        tis_sequence_reduce=reduce, tis_min=0.8, tis_max=1.2, loss_agg_mode="seq-mean-token-mean")
    _check_against_spec(inp, cfg, backend, keys=("rollout_logp",))


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("agg", LOSS_AGG_MODES)
def test_padded_and_packed_agree(backend, level, agg):
    inp = make_inputs(b=6, t=13)
    packed = to_packed(inp)
    cfg = fk.LossConfig(importance_sampling_level=level, loss_agg_mode=agg, tis_mode="token_truncate",
                        beta=0.02, entropy_coef=0.003, dual_clip=2.0)
    norm = 13.0 if agg == "seq-mean-token-sum-norm" else None  # the padded default (T) spelled out for packed
    lp, mp, gp, gep = run(inp, cfg, backend)
    lk, mk, gk, gek = run(packed, cfg, backend, normalizer=norm)
    torch.testing.assert_close(lk, lp, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(gk, gp[inp["mask"]], atol=1e-7, rtol=1e-6)
    torch.testing.assert_close(gek, gep[inp["mask"]], atol=1e-7, rtol=1e-6)
    for k in METRIC_NAMES:
        torch.testing.assert_close(mk[k], mp[k], atol=1e-6, rtol=1e-6, msg=k)
    assert torch.all(gp[~inp["mask"]] == 0)


@pytest.mark.parametrize("backend", FAST)
def test_packed_with_mask_and_int64_cu(backend):
    inp = make_inputs(b=5, t=8)
    packed = to_packed(inp)
    packed["cu_seqlens"] = packed["cu_seqlens"].long()
    packed["mask"] = torch.rand(packed["logp"].shape) > 0.3
    cfg = fk.LossConfig(importance_sampling_level="sequence", loss_agg_mode="seq-mean-token-mean",
                        tis_mode="sequence_truncate", beta=0.1)
    _check_against_spec(packed, cfg, backend, keys=("rollout_logp", "ref_logp"))


@pytest.mark.parametrize("backend", FAST)
def test_gspo_forms_same_forward_different_backward(backend):
    inp = make_inputs(b=4, t=12, per_token_adv=True, spread=0.1)
    base = {"eps_low": 0.05, "eps_high": 0.05, "loss_agg_mode": "seq-mean-token-mean"}
    seq = fk.LossConfig(importance_sampling_level="sequence", **base)
    st = fk.LossConfig(importance_sampling_level="sequence_token", **base)
    l1, _m1, g1, _ = run(inp, seq, backend, keys=())
    l2, _m2, g2, _ = run(inp, st, backend, keys=())
    torch.testing.assert_close(l1, l2)
    valid = inp["mask"]
    assert (g1[valid] - g2[valid]).abs().max() > 1e-4  # per-token advantages: the two gradients differ
    # each matches its own spec
    for cfg, g in ((seq, g1), (st, g2)):
        assert_close_masked(g, spec(inp, cfg, keys=())[2], valid, atol=2e-6)
    # with one advantage per sequence (and no token TIS) the two gradients coincide
    inp1 = make_inputs(b=4, t=12, spread=0.01)
    _, _, h1, _ = run(inp1, seq, backend, keys=())
    _, _, h2, _ = run(inp1, st, backend, keys=())
    torch.testing.assert_close(h1, h2, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", FAST)
def test_dual_clip_caps_negative_advantages(backend):
    b, t = 3, 5
    logp = torch.full((b, t), -1.0)
    old = logp - 2.0  # r = e^2 = 7.39 > c = 3
    adv = torch.tensor([-1.5, 0.5, -0.25])
    cfg = fk.LossConfig(eps_low=0.2, eps_high=0.2, dual_clip=3.0)
    inp = {"logp": logp, "old_logp": old, "advantages": adv}
    loss, metrics, g, _ = run(inp, cfg, backend, keys=())
    # A < 0: loss -c*A, no gradient; A > 0: clipped at 1 + eps_high, no gradient
    expected = (3.0 * 1.5 - 1.2 * 0.5 + 3.0 * 0.25) / 3
    torch.testing.assert_close(loss, torch.tensor(expected))
    assert torch.all(g == 0)
    torch.testing.assert_close(metrics["clip_frac_dual"], torch.tensor(2 / 3))
    torch.testing.assert_close(metrics["clip_frac_high"], torch.tensor(1 / 3))
    # without dual clip the A < 0 rows are unbounded: -A * r
    l2, m2, _g2, _ = run(inp, fk.LossConfig(), backend, keys=())
    r = torch.exp(torch.tensor(2.0))
    torch.testing.assert_close(l2, ((1.5 * r - 1.2 * 0.5 + 0.25 * r) / 3).float())
    assert m2["clip_frac_dual"] == 0


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_tis_boundaries_are_inclusive(backend, mode):
    b, t = 2, 4
    logp = torch.randn(b, t) * 0.1 - 1.0
    old = logp.clone()
    roll = old.clone()  # rho = exp(0) = 1 exactly
    adv = torch.tensor([1.0, -1.0])
    inp = {"logp": logp, "old_logp": old, "advantages": adv, "rollout_logp": roll}
    # rho == tis_min == tis_max == 1: inside, weight 1
    l_in, m_in, _, _ = run(inp, fk.LossConfig(tis_mode=mode, tis_min=1.0, tis_max=1.0), backend, keys=("rollout_logp",))
    l_none, _, _, _ = run(inp, fk.LossConfig(), backend, keys=())
    torch.testing.assert_close(l_in, l_none)
    assert m_in["tis_frac_clipped"] == 0 and m_in["tis_weight_min"] == 1 and m_in["tis_weight_max"] == 1
    # rho = 1 > tis_max = 0.5: truncated to 0.5 or masked to 0
    l_out, m_out, _, _ = run(inp, fk.LossConfig(tis_mode=mode, tis_min=0.0, tis_max=0.5), backend,
                             keys=("rollout_logp",))
    factor = 0.5 if mode.endswith("truncate") else 0.0
    torch.testing.assert_close(l_out, l_none * factor)
    assert m_out["tis_frac_clipped"] == 1
    torch.testing.assert_close(m_out["tis_weight_mean"], torch.tensor(factor))


@pytest.mark.parametrize("backend", FAST)
def test_all_masked_batch(backend):
    inp = make_inputs(b=3, t=6)
    inp["mask"] = torch.zeros_like(inp["mask"])
    for agg in LOSS_AGG_MODES:
        cfg = fk.LossConfig(loss_agg_mode=agg, importance_sampling_level="sequence", tis_mode="sequence_mask",
                            beta=0.1, entropy_coef=0.1)
        loss, metrics, gl, ge = run(inp, cfg, backend)
        assert loss.item() == 0.0
        assert torch.all(gl == 0) and torch.all(ge == 0)
        assert all(torch.isfinite(v) for v in metrics.values())
        assert metrics["num_tokens"] == 0 and metrics["num_seqs"] == 0


@pytest.mark.parametrize("backend", FAST)
def test_zero_length_sequences_packed(backend):
    inp = make_inputs(b=5, t=7)
    packed = to_packed(inp)
    packed["cu_seqlens"] = torch.tensor([0, 0, 7, 7, 7] + [int(packed["cu_seqlens"][-1])], dtype=torch.int32)
    packed["advantages"] = torch.randn(5)
    cfg = fk.LossConfig(importance_sampling_level="sequence", loss_agg_mode="seq-mean-token-mean")
    loss = _check_against_spec(packed, cfg, backend, keys=())
    assert torch.isfinite(loss)


@pytest.mark.parametrize("backend", FAST)
def test_packed_advantages_when_sequences_equal_tokens(backend):
    """A packed batch with as many sequences as tokens (some empty, some longer): a [total_tokens] vector is read
    per token (it has logp's shape), [S, 1] per sequence; both against the spec, and [S, 1] equal to its
    per-token expansion. (AReaL's packed GSPO passed [S] there and got 0.0772 for a loss of -0.3893.)"""
    cu = torch.tensor([0, 2, 2, 3])
    g = torch.Generator().manual_seed(3)
    lp, old, seq_adv = (torch.randn(3, generator=g) for _ in range(3))
    tok_adv = torch.randn(3, generator=g)
    for cfg in (fk.LossConfig(importance_sampling_level="sequence"), fk.LossConfig(eps_high=0.28)):
        with fk.use_backend(backend):
            per_seq = fk.policy_loss(lp, old, seq_adv[:, None], cu_seqlens=cu, config=cfg).loss
            expanded = fk.policy_loss(lp, old, seq_adv.repeat_interleave(cu.diff()), cu_seqlens=cu, config=cfg).loss
            per_tok = fk.policy_loss(lp, old, tok_adv, cu_seqlens=cu, config=cfg).loss
        want_seq, _ = policy_loss_spec(lp.double(), old.double(), seq_adv[:, None].double(), cu_seqlens=cu, config=cfg)
        want_tok, _ = policy_loss_spec(lp.double(), old.double(), tok_adv.double(), cu_seqlens=cu, config=cfg)
        torch.testing.assert_close(per_seq.double(), want_seq, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(per_tok.double(), want_tok, atol=1e-6, rtol=1e-5)
        assert torch.equal(per_seq, expanded) and not torch.isclose(want_seq, want_tok)
    with pytest.raises(ValueError, match=r"\[num_seqs, 1\]"):
        fk.policy_loss(lp, old, torch.randn(2, 2), cu_seqlens=cu)


@pytest.mark.parametrize("backend", FAST)
def test_normalizer_overrides(backend):
    inp = make_inputs(b=4, t=8)
    cfg = fk.LossConfig(loss_agg_mode="token-mean")
    base, _, g0, _ = run(inp, cfg, backend, keys=())
    n_tok = inp["mask"].sum().item()
    for norm in (37.0, torch.tensor(37.0)):
        l1, _, g1, _ = run(inp, cfg, backend, normalizer=norm, keys=())
        torch.testing.assert_close(l1, base * n_tok / 37.0)
        torch.testing.assert_close(g1, g0 * n_tok / 37.0)
    l2, _, _, _ = run(inp, fk.LossConfig(normalizer=37.0), backend, keys=())
    torch.testing.assert_close(l2, base * n_tok / 37.0)
    _check_against_spec(inp, fk.LossConfig(loss_agg_mode="seq-mean-token-mean", normalizer=3.0), backend, keys=())


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("packed", [False, True])
def test_token_sum_vs_spec_with_and_without_normalizer(backend, level, packed):
    """verl's token-sum: the plain sum of the per-token losses (divisor 1) unless a normalizer is given."""
    inp = make_inputs(b=5, t=9)
    if packed:
        inp = to_packed(inp)
    cfg = fk.LossConfig(eps_low=0.2, eps_high=0.28, dual_clip=2.0, importance_sampling_level=level,
                        tis_mode="sequence_truncate" if level == "sequence" else "token_truncate", tis_max=1.5,
                        loss_agg_mode="token-sum", beta=0.05, entropy_coef=0.01)
    summed = _check_against_spec(inp, cfg, backend)
    # the same numerator as token-mean, without its division by the number of valid tokens
    mean_cfg = dataclasses.replace(cfg, loss_agg_mode="token-mean")
    mean, _, g_mean, ge_mean = run(inp, mean_cfg, backend)
    n_tok = int(inp["mask"].sum()) if "mask" in inp else inp["logp"].numel()
    torch.testing.assert_close(summed, mean * n_tok, atol=1e-5, rtol=1e-5)
    for norm in (29.0, torch.tensor(29.0)):  # an explicit normalizer divides as for every other mode
        loss = _check_against_spec(inp, cfg, backend, normalizer=norm)
        torch.testing.assert_close(loss, summed / 29.0, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(loss, run(inp, mean_cfg, backend, normalizer=norm)[0], atol=1e-6, rtol=1e-5)
    norm_cfg = dataclasses.replace(cfg, normalizer=29.0)
    _, _, g_norm, ge_norm = run(inp, norm_cfg, backend)
    _check_against_spec(inp, norm_cfg, backend)
    torch.testing.assert_close(g_norm, g_mean * n_tok / 29.0, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(ge_norm, ge_mean * n_tok / 29.0, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("backend", FAST)
def test_bf16_logp(backend):
    inp = make_inputs(b=3, t=8, zero_len=False)
    inp["logp"] = inp["logp"].bfloat16()
    cfg = fk.LossConfig(beta=0.05)
    loss, _, gl, _ = run(inp, cfg, backend, keys=("ref_logp",))
    assert gl.dtype == torch.bfloat16
    e_loss, _, e_gl, _ = spec(inp, cfg, keys=("ref_logp",))
    torch.testing.assert_close(loss.double(), e_loss, atol=1e-5, rtol=1e-5)
    assert_close_masked(gl.float(), e_gl, inp["mask"], atol=1e-3, rtol=1e-2)


def test_backends_agree_at_moderate_size():
    # a size with several Triton tiles per sequence (BLOCK = 1024) and long packed sequences
    lengths = torch.tensor([2500, 0, 1, 1023, 1025, 3000])
    total = int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    logp = torch.randn(total) * 0.3 - 1
    inp = {"logp": logp, "old_logp": logp + torch.randn(total) * 0.01, "advantages": torch.randn(6), "cu_seqlens": cu,
               "rollout_logp": logp + torch.randn(total) * 0.01, "ref_logp": logp + torch.randn(total) * 0.05,
               "entropy": torch.rand(total)}
    cfg = fk.LossConfig(eps_high=0.28, importance_sampling_level="sequence", tis_mode="token_truncate",
                        loss_agg_mode="seq-mean-token-mean", beta=0.04, entropy_coef=0.01, dual_clip=3.0)
    _check_multi_tile(inp, cfg)
    inp["mask"] = torch.rand(total) > 0.2  # and with a mask inside the packed sequences, GSPO-token, sequence TIS
    inp["advantages"] = torch.randn(total)
    cfg = fk.LossConfig(importance_sampling_level="sequence_token", tis_mode="sequence_mask", tis_min=0.9,
                        tis_max=1.1, tis_sequence_reduce="mean", loss_agg_mode="token-mean", beta=0.04)
    _check_multi_tile(inp, cfg)


def _check_multi_tile(inp, cfg):
    e_loss, e_m, e_g, e_ge = spec(inp, cfg)
    m = inp.get("mask")
    if m is not None:
        e_g, e_ge = e_g * m, e_ge * m
    for backend in FAST:
        loss, met, g, ge = run(inp, cfg, backend)
        torch.testing.assert_close(loss.double(), e_loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(g.double(), e_g, atol=1e-7, rtol=1e-4)
        torch.testing.assert_close(ge.double(), e_ge, atol=1e-8, rtol=1e-5)
        for k in METRIC_NAMES:
            torch.testing.assert_close(met[k].double(), e_m[k], atol=1e-4, rtol=1e-4, msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_batch_without_tokens(backend):
    x = torch.zeros(0, requires_grad=True)
    cfg = fk.LossConfig(importance_sampling_level="sequence", tis_mode="token_mask")
    with fk.use_backend(backend):
        out = fk.policy_loss(x, torch.zeros(0), torch.randn(2), cu_seqlens=torch.tensor([0, 0, 0]),
                             rollout_logp=torch.zeros(0), config=cfg)
        out.loss.backward()
    assert out.loss.item() == 0.0 and x.grad.shape == (0,)
    assert out.metrics["num_seqs"] == 0 and all(torch.isfinite(v) for v in out.metrics.values())


@pytest.mark.parametrize("backend", FAST)
@pytest.mark.parametrize("level,agg,packed", [("token", "token-mean", False), ("sequence", "seq-mean-token-mean", True),
                                              ("sequence_token", "token-sum", False), ("token", "token-mean", True)])
def test_vapo_nll_term_vs_spec(backend, level, agg, packed):
    inp = make_inputs(b=6, t=13)
    positive = torch.tensor([True, True, False, True, False, True])  # sequence 1 is empty (make_inputs)
    if packed:
        inp = to_packed(inp)
    cfg = fk.LossConfig(eps_high=0.28, importance_sampling_level=level, tis_mode="token_truncate", loss_agg_mode=agg,
                        beta=0.02, entropy_coef=0.01, nll_coef=0.1)
    _check_against_spec(inp, cfg, backend, positive=positive)
    # with the normalizer overriding the PG divisor, the NLL term keeps its own token mean
    _check_against_spec(inp, cfg, backend, positive=positive.long(), normalizer=7.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vapo_nll_term_is_the_positive_token_mean(backend):
    inp = make_inputs(b=5, t=9)
    positive = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.0])
    base = fk.LossConfig(loss_agg_mode="token-mean")
    with_nll = dataclasses.replace(base, nll_coef=0.25)
    keys = ()
    l0, m0, g0, _ = run(inp, base, backend, keys=keys, positive=positive)
    l1, m1, g1, _ = run(inp, with_nll, backend, keys=keys, positive=positive)
    mask = inp["mask"]
    pos_tok = mask & positive.bool()[:, None]
    nll = -inp["logp"][pos_tok].double().mean()
    torch.testing.assert_close(m1["nll_mean"].double(), nll, atol=1e-5, rtol=1e-5)
    assert m0["nll_mean"] == m1["nll_mean"] and m1["num_positive_tokens"] == pos_tok.sum()
    torch.testing.assert_close((l1 - l0).double(), 0.25 * nll, atol=1e-5, rtol=1e-5)
    expected = torch.where(pos_tok, -0.25 / pos_tok.sum(), 0.0)
    assert_close_masked(g1 - g0, expected, mask, atol=1e-6)
    # no positive token: the term and its gradient vanish (no division by zero)
    l2, m2, g2, _ = run(inp, with_nll, backend, keys=keys, positive=torch.zeros(5, dtype=torch.bool))
    torch.testing.assert_close(l2, l0)
    assert m2["nll_mean"] == 0 and m2["num_positive_tokens"] == 0
    assert_close_masked(g2, g0, mask, atol=0.0)
