"""The reference trainer's value-based algorithms (algo ppo = VC-PPO, algo vapo): options, wiring, a short run.

The short runs are the CI check that the critic learns and the policy does not
collapse: value pretraining must cut the value loss, and held-out accuracy
after RL must not fall below the warm start's by more than COLLAPSE.
"""
import dataclasses

import pytest
import torch

from flashrl_kernels.trainer.config import TrainConfig
from flashrl_kernels.trainer.critic import token_rewards
from flashrl_kernels.trainer.loop import IGNORE, Trainer, gae_targets

COLLAPSE = 0.05


def small_cfg(tmp_path, **kw):
    base = {"rollout_engine": "hf", "rollout_quant": "bf16", "warmstart_steps": 20, "prompts_per_step": 4,
            "group_size": 4, "n_eval": 16, "value_pretrain_steps": 2, "cache_dir": str(tmp_path / "cache"),
            "out_dir": str(tmp_path / "run")}
    return TrainConfig(**{**base, **kw})


def test_algo_defaults_follow_the_algorithm():
    grpo = TrainConfig()
    assert (grpo.resolved("nll_coef"), grpo.resolved("lam_alpha")) == (0.0, 0.0)
    vapo = dataclasses.replace(grpo, algo="vapo")  # the fields stay None, so replace() picks up vapo's defaults
    assert (vapo.resolved("nll_coef"), vapo.resolved("lam_alpha"), vapo.resolved("critic_lam")) == (0.1, 0.05, 1.0)
    ppo = TrainConfig(algo="ppo", critic_lam=0.9)
    assert (ppo.resolved("critic_lam"), ppo.resolved("nll_coef"), ppo.resolved("lam")) == (0.9, 0.0, 0.95)
    assert ppo.value_based and vapo.value_based and not grpo.value_based


@pytest.mark.parametrize("kwargs,match", [
    ({"algo": "a2c"}, "algo"),
    ({"algo": "ppo", "advantage": "rloo"}, "advantage"),
    ({"nll_coef": 0.1}, "nll_coef"),
    ({"algo": "vapo", "lam": 1.2}, "lam"),
    ({"algo": "ppo", "gamma": -0.1}, "gamma"),
    ({"algo": "ppo", "value_clip": 0.0}, "value_clip"),
    ({"algo": "vapo", "lam_alpha": -1.0}, "lam_alpha"),
])
def test_bad_value_options_name_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


def test_token_rewards_sit_on_the_last_valid_token():
    mask = torch.tensor([[0, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    r = token_rewards(torch.tensor([0.5, -1.0, 2.0]), mask)
    assert torch.equal(r, torch.tensor([[0, 0, 0.5, 0], [0, 0, 0, -1.0], [0, 0, 0, 0]]))


def test_gae_targets_are_monte_carlo_returns_with_critic_lambda_one():
    cfg = TrainConfig(algo="ppo", whiten_advantages=False)
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]], dtype=torch.bool)
    values = torch.randn(2, 4)
    adv, ret = gae_targets(cfg, torch.tensor([1.0, 0.0]), values, mask)
    # gamma = 1, critic lambda = 1: every valid token's return is the sequence's reward
    torch.testing.assert_close(ret[mask], torch.tensor([1.0, 1, 1, 0, 0, 0]))
    assert torch.all(adv[~mask] == 0) and torch.all(ret[~mask] == 0)
    # the last valid token's advantage is its TD error r - V (terminal value 0)
    torch.testing.assert_close(adv[0, 2], 1.0 - values[0, 2])


def test_gae_targets_of_a_batch_dynamic_sampling_emptied():
    cfg = TrainConfig(algo="vapo")  # whitens by default; an empty batch must not raise (it trains nothing)
    mask = torch.zeros(3, 5, dtype=torch.bool)
    adv, ret = gae_targets(cfg, torch.ones(3), torch.randn(3, 5), mask)
    assert torch.all(adv == 0) and torch.all(ret == 0)


def test_ppo_step_trains_the_critic_and_resumes_bit_for_bit(tmp_path):
    cfg = small_cfg(tmp_path, algo="vapo", steps=2)
    straight = Trainer(cfg)
    m0 = straight.pretrain_value_step()
    assert m0["value_pretrain_step"] == 1 and m0["value_loss"] > 0
    head_before = straight.critic.head.weight.detach().clone()
    m1 = straight.rl_step()
    assert not torch.equal(head_before, straight.critic.head.weight)
    for key in ("value_loss", "explained_variance", "vf_clip_frac", "nll_mean", "num_positive_tokens"):
        assert key in m1, key
    assert m1["num_tokens"] == m1["rollout_tokens"]  # one pass's valid tokens, counted once (not per loss)
    straight.rl_step()

    first = Trainer(cfg)
    first.pretrain_value_step()
    first.rl_step()
    first.save(str(tmp_path / "ckpt"))
    resumed = Trainer(cfg)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.value_pretrained == 1
    resumed.rl_step()
    for a, b in ((straight.model, resumed.model), (straight.critic, resumed.critic)):
        for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
            assert torch.equal(x, y), name


def test_grpo_checkpoint_cannot_resume_a_ppo_run(tmp_path):
    grpo = Trainer(small_cfg(tmp_path, steps=1))
    grpo.save(str(tmp_path / "ckpt"))
    ppo = Trainer(small_cfg(tmp_path, steps=1, algo="ppo"))
    with pytest.raises(ValueError, match="no critic"):
        ppo.load(str(tmp_path / "ckpt"))


def test_masked_targets_of_dropped_groups_get_no_reward(tmp_path):
    cfg = small_cfg(tmp_path, algo="ppo", dynamic_sampling=True, steps=1)
    trainer = Trainer(cfg)
    r = trainer._rollout(seed=0)
    mask = r["targets"] != IGNORE
    mask[0] = False
    tr = token_rewards(r["rewards"] + 1.0, mask)
    assert tr[0].abs().sum() == 0 and tr[1].abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("algo", ["ppo", "vapo"])
def test_short_value_based_run_learns_a_critic_without_collapse(tmp_path_factory, algo):
    from flashrl_kernels.trainer.run import train

    cache = tmp_path_factory.getbasetemp() / "value_runs_cache"  # one warm start for both algorithms
    out = tmp_path_factory.mktemp(algo)
    cfg = TrainConfig(seed=0, algo=algo, steps=30, eval_every=30, cache_dir=str(cache), out_dir=str(out))
    s = train(cfg, progress=False, say=lambda *a: None)
    assert s["value_loss_pretrain_end"] < 0.75 * s["value_loss_pretrain_start"], s  # measured 0.47
    assert s["value_loss_end"] < s["value_loss_pretrain_start"], s
    assert s["accuracy_end"] >= s["accuracy_start"] - COLLAPSE, s
