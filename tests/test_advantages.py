"""group_advantages / GFPO / dynamic_sampling_mask / overlong_penalty vs the float64 spec."""
import math

import pytest
import torch

import flashrl_kernels as fk
from flashrl_kernels.advantages import default_k_schedule, gfpo_keep_mask
from flashrl_kernels.reference.advantages import gfpo_keep_spec, group_advantages_spec, overlong_penalty_spec


def _rewards(p, g, binary=False):
    r = (torch.rand(p * g) > 0.5).float() if binary else torch.randn(p * g)
    return r


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("unbiased", [True, False])
@pytest.mark.parametrize("p,g", [(3, 8), (5, 3), (2, 1)])
def test_modes_vs_spec(mode, unbiased, p, g):
    r = _rewards(p, g)
    out = fk.group_advantages(r, g, mode=mode, unbiased_std=unbiased, std_eps=1e-6)
    exp = group_advantages_spec(r, g, mode=mode, unbiased_std=unbiased, std_eps=1e-6)
    assert out.advantages.dtype == torch.float32 and out.keep.all()
    torch.testing.assert_close(out.advantages.double(), exp, atol=1e-5, rtol=1e-5)


def test_grpo_known_values_and_equal_group():
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    out = fk.group_advantages(r, 4, std_eps=0.0).advantages
    std = math.sqrt(4 * 0.25 / 3)  # sample std of [1, 0, 1, 0]
    torch.testing.assert_close(out[:4], torch.tensor([0.5, -0.5, 0.5, -0.5]) / std)
    assert torch.all(out[4:] == 0)  # equal rewards: zero advantage, no NaN even with std_eps = 0
    rloo = fk.group_advantages(r, 4, mode="rloo").advantages
    torch.testing.assert_close(rloo[:4], torch.tensor([1 - 1 / 3, -2 / 3, 1 - 1 / 3, -2 / 3]))


@pytest.mark.parametrize("g, value", [(15, 3.852453064766108), (9, 5.598136790149003)])
def test_equal_float64_rewards_give_zero_advantage(g, value):
    """sum / G of G equal float64 rewards is 1 ulp off the reward for these; over a std of the same size that gave
    +-0.95 advantages with std_eps = 0 (the spec too). Also a GFPO-kept subset of equal rewards."""
    r = torch.cat([torch.full((g,), value, dtype=torch.float64), torch.randn(g, dtype=torch.float64)])
    assert float(r[:g].sum() / g) != value  # the case: the plain mean is off
    for mode in ("grpo", "dr_grpo", "rloo"):
        out = fk.group_advantages(r, g, mode=mode, std_eps=0.0).advantages
        assert torch.all(out[:g] == 0), mode
        assert torch.all(group_advantages_spec(r, g, mode=mode, std_eps=0.0)[:g] == 0), mode
        torch.testing.assert_close(out, group_advantages_spec(r, g, mode=mode, std_eps=0.0))
    lengths = torch.arange(2 * g) % 5 + 1
    kept = fk.group_advantages(r, g, std_eps=0.0, gfpo_metric="length", keep_k=g - 2, lengths=lengths)
    assert torch.all(kept.advantages[:g] == 0)


def test_float64_rewards_stay_float64():
    r = torch.randn(12, dtype=torch.float64)
    out = fk.group_advantages(r, 4)
    assert out.advantages.dtype == torch.float64
    torch.testing.assert_close(out.advantages, group_advantages_spec(r, 4))


@pytest.mark.parametrize("metric", ["length", "token_efficiency"])
@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo"])
@pytest.mark.parametrize("k", [1, 3, 6, 9])
def test_gfpo_fixed_k(metric, mode, k):
    p, g = 4, 6
    r = _rewards(p, g, binary=True) + 0.1 * torch.rand(p * g)
    lengths = torch.randint(5, 50, (p * g,))
    lengths[2] = lengths[3]  # a tie: the earlier sample wins
    out = fk.group_advantages(r, g, mode=mode, lengths=lengths, gfpo_metric=metric, keep_k=k)
    keep = gfpo_keep_spec(r, lengths, g, metric, lambda gi, rs: min(k, g))
    assert torch.equal(out.keep, keep)
    assert int(out.keep.sum()) == p * min(k, g)
    exp = group_advantages_spec(r, g, mode=mode, keep=keep)
    torch.testing.assert_close(out.advantages.double(), exp, atol=1e-5, rtol=1e-5)
    assert torch.all(out.advantages[~out.keep] == 0)


def test_gfpo_length_keeps_shortest():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0])
    lengths = torch.tensor([30, 10, 5, 20])
    keep = gfpo_keep_mask(r, 4, lengths, metric="length", keep_k=2)
    assert keep.tolist() == [False, True, True, False]
    keep = gfpo_keep_mask(r, 4, lengths, metric="token_efficiency", keep_k=2)
    assert keep.tolist() == [False, True, False, True]  # 1/10, 1/20 beat 1/30 and 0/5


def test_gfpo_adaptive_k():
    g = 16
    p_easy = torch.ones(g)                                 # mean 1.0  -> ceil(16/4) = 4
    p_mid = torch.tensor([1.0] * 10 + [0.0] * 6)           # mean 0.625 -> ceil(6) = 6
    p_hard = torch.tensor([1.0] * 2 + [0.0] * 14)          # mean 0.125 -> 8
    r = torch.cat([p_easy, p_mid, p_hard])
    lengths = torch.randint(10, 100, (3 * g,))
    out = fk.group_advantages(r, g, lengths=lengths, gfpo_metric="length", keep_k="adaptive")
    assert out.keep.view(3, g).sum(1).tolist() == [4, 6, 8]
    sched = default_k_schedule(g)
    k_of = {0: 4, 1: 6, 2: 8}
    keep = gfpo_keep_spec(r, lengths, g, "length", lambda gi, rs: k_of[gi])
    assert torch.equal(out.keep, keep)
    torch.testing.assert_close(out.advantages.double(), group_advantages_spec(r, g, keep=keep), atol=1e-5, rtol=1e-5)
    # a custom schedule
    out2 = fk.group_advantages(r, g, lengths=lengths, gfpo_metric="length", keep_k="adaptive",
                               k_schedule=[(0.9, 2), (0.5, 3), (-math.inf, 16)])
    assert out2.keep.view(3, g).sum(1).tolist() == [2, 3, 16]
    assert sched[-1][1] == 8


def test_dynamic_sampling_mask():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.2])
    assert fk.dynamic_sampling_mask(r, 3).tolist() == [True] * 6 + [False] * 3  # True: all equal, drop
    r = torch.randn(20)
    assert not fk.dynamic_sampling_mask(r, 4).any()
    # the dropped groups are exactly those where GRPO advantages vanish
    r = (torch.rand(40) > 0.7).float()
    flat = fk.dynamic_sampling_mask(r, 4)
    adv = fk.group_advantages(r, 4).advantages
    assert torch.all(adv[flat] == 0)
    assert torch.all(adv.view(10, 4).abs().sum(1)[~flat.view(10, 4)[:, 0]] > 0)


def test_overlong_penalty():
    lengths = torch.tensor([0, 100, 768, 769, 900, 1024, 1025, 5000])
    out = fk.overlong_penalty(lengths, 1024, 256)
    exp = overlong_penalty_spec(lengths, 1024, 256)
    torch.testing.assert_close(out.double(), exp, atol=1e-7, rtol=0)
    assert out[2] == 0 and out[5] == -1 and out[6] == -1 and -1 < out[4] < 0
    torch.testing.assert_close(fk.overlong_penalty(lengths, 1024, 256, factor=0.5), out * 0.5)


def test_bad_inputs():
    r = torch.randn(12)
    with pytest.raises(ValueError, match="group_size"):
        fk.group_advantages(r, 5)
    with pytest.raises(ValueError, match="group_size"):
        fk.group_advantages(r, 0)
    with pytest.raises(ValueError, match="mode"):
        fk.group_advantages(r, 4, mode="ppo")
    with pytest.raises(ValueError, match="rewards"):
        fk.group_advantages(r.view(3, 4), 4)
    with pytest.raises(TypeError, match="rewards"):
        fk.group_advantages(torch.arange(12), 4)
    with pytest.raises(ValueError, match="lengths"):
        fk.group_advantages(r, 4, gfpo_metric="length", keep_k=2)
    with pytest.raises(ValueError, match="lengths"):
        fk.group_advantages(r, 4, gfpo_metric="length", keep_k=2, lengths=torch.ones(5))
    with pytest.raises(ValueError, match="keep_k"):
        fk.group_advantages(r, 4, gfpo_metric="length", lengths=torch.ones(12))
    with pytest.raises(ValueError, match="keep_k"):
        fk.group_advantages(r, 4, gfpo_metric="length", keep_k=0, lengths=torch.ones(12))
    with pytest.raises(ValueError, match="gfpo_metric"):
        fk.group_advantages(r, 4, gfpo_metric="reward", keep_k=2, lengths=torch.ones(12))
    with pytest.raises(ValueError, match="gfpo_metric"):
        fk.group_advantages(r, 4, keep_k=2)
    with pytest.raises(ValueError, match="k_schedule"):
        fk.group_advantages(r, 4, gfpo_metric="length", keep_k="adaptive", lengths=torch.ones(12), k_schedule=[(0.5, 0)])
    with pytest.raises(ValueError, match="cache_len"):
        fk.overlong_penalty(torch.tensor([10]), 100, 0)
    with pytest.raises(ValueError, match="cache_len"):
        fk.overlong_penalty(torch.tensor([10]), 100, 101)
    with pytest.raises(TypeError, match="max_len"):
        fk.overlong_penalty(torch.tensor([10]), 100.0, 10)


@pytest.mark.parametrize("advantage", ["grpo", "dr_grpo", "rloo", "gfpo_length", "gfpo_token_efficiency",
                                       "gfpo_adaptive"])
def test_reference_trainer_advantage_options(advantage):
    """The reference trainer's advantage options all map onto group_advantages / dynamic_sampling_mask."""
    from flashrl_kernels.trainer.config import TrainConfig
    from flashrl_kernels.trainer.loop import compute_advantages

    cfg = TrainConfig(advantage=advantage, group_size=8, gfpo_keep=4, dynamic_sampling=True)
    r = torch.tensor([1.0] * 8 + [0.0, 1.0] * 4 + [0.0] * 7 + [1.0])
    lengths = torch.randint(3, 30, (24,))
    adv, keep = compute_advantages(cfg, r, lengths)
    assert not keep[:8].any()  # the all-equal group is dropped
    per_group = keep.view(3, 8).sum(1)[1:]
    if advantage.startswith("gfpo"):
        assert torch.all(per_group <= 4) and torch.all(per_group >= 1)
    else:
        assert torch.all(per_group == 8)
    assert torch.all(adv[~keep] == 0) and adv[keep].abs().sum() > 0
