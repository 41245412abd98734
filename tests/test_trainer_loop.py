"""The reference trainer's loop: wiring of advantages, weight sync each step, resume, and a short real run.

The short run is the CI check that RL works end to end: seed 0, the demo's
settings (INT8 vLLM rollout + TIS when vllm is installed, else Hugging Face
generate). Held-out accuracy after 60 RL steps must beat the warm start by
MARGIN. Measured on the dev machine with vLLM INT8, 60 steps (warm start ->
after RL): seed 0 0.11 -> 0.59, seed 1 0.06 -> 0.42, seed 2 0.08 -> 0.30,
seed 3 0.22 -> 0.52; smallest gain 0.22, so MARGIN = 0.15.
"""
import json
import os

import pytest
import torch

from flashrl_kernels.trainer.config import TrainConfig
from flashrl_kernels.trainer.loop import Trainer, compute_advantages
from flashrl_kernels.trainer.rollout import vllm_available

MARGIN = 0.15


def small_cfg(tmp_path, **kw):
    base = {"rollout_engine": "hf", "rollout_quant": "bf16", "warmstart_steps": 20, "prompts_per_step": 4,
            "group_size": 4, "n_eval": 16, "cache_dir": str(tmp_path / "cache"), "out_dir": str(tmp_path / "run")}
    return TrainConfig(**{**base, **kw})


@pytest.mark.parametrize("advantage", ["gfpo_length", "gfpo_token_efficiency"])
def test_gfpo_keeps_k_per_group_and_zeroes_the_rest(advantage):
    cfg = TrainConfig(advantage=advantage, group_size=8, gfpo_keep=3, prompts_per_step=4)
    rewards = torch.rand(32).round()
    lengths = torch.randint(1, 6, (32,)).float()
    adv, keep = compute_advantages(cfg, rewards, lengths)
    assert keep.view(4, 8).sum(1).tolist() == [3, 3, 3, 3]
    assert (adv[~keep] == 0).all()


def test_dynamic_sampling_drops_flat_groups():
    cfg = TrainConfig(dynamic_sampling=True, group_size=4, prompts_per_step=2)
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    adv, keep = compute_advantages(cfg, rewards, torch.ones(8))
    assert keep.tolist() == [False] * 4 + [True] * 4
    assert (adv[:4] == 0).all() and (adv[4:] != 0).all()


def test_sync_runs_after_every_step(tmp_path):
    tr = Trainer(small_cfg(tmp_path, steps=3))
    calls = []
    real_sync = tr.engine.sync
    tr.engine.sync = lambda model: calls.append(tr.step) or real_sync(model)
    for _ in range(3):
        m = tr.rl_step()
        assert "time_sync" in m and m["loss"] == m["loss"]  # not NaN
        assert m["rollout_tokens"] == round(m["response_length"] * 4 * 4) > 0 and m["time_rollout"] > 0
        assert m["num_tokens"] == m["rollout_tokens"]  # the loss's valid tokens of one pass over the batch
    assert calls == [0, 1, 2]  # once per step, after the update and before the step counter moves


def test_summary_reports_rollout_tokens_per_s(tmp_path):
    from flashrl_kernels.trainer.run import format_summary, train

    summary = train(small_cfg(tmp_path, steps=2, eval_every=2), progress=False, say=lambda *a: None)
    with open(summary["log"]) as f:
        steps = [h for h in map(json.loads, f) if "time_rollout" in h]
    assert len(steps) == 2
    expected = sum(h["rollout_tokens"] for h in steps) / sum(h["time_rollout"] for h in steps)
    assert summary["rollout_tokens_per_s"] == pytest.approx(expected) and expected > 0
    table = format_summary(summary)
    row = next(line for line in table.splitlines() if line.startswith("rollout tokens/s"))
    assert float(row.split()[-1]) > 0
    assert "wall time (s)" in table and "held-out accuracy, after RL" in table  # the other rows stay


def test_resumed_run_keeps_the_warm_start_accuracy_and_history(tmp_path):
    """A resumed run's summary: the warm start's accuracy (not the checkpoint's) and medians over every step; a
    finished run resumed: the checkpoint's accuracy after RL."""
    from flashrl_kernels.trainer.run import train

    quiet = {"progress": False, "say": lambda *a: None}
    first = train(small_cfg(tmp_path, steps=2, eval_every=2), **quiet)
    loaded = Trainer(small_cfg(tmp_path, steps=3, eval_every=2))
    loaded.load(str(tmp_path / "run" / "checkpoint"))
    assert [h["step"] for h in loaded.history] == [0, 1, 2]  # the warm start's record and both steps'
    assert loaded.history[0]["eval_accuracy"] == first["accuracy_start"]
    loaded.close()
    # resuming the finished run trains nothing: 'after RL' is the checkpoint's last held-out accuracy (it was the
    # warm start's); the checkpoint's is set apart from it here, whatever the run gave
    path = tmp_path / "run" / "checkpoint" / "trainer_state.pt"
    state = torch.load(path, weights_only=False)
    state["history"][2]["eval_accuracy"] = 0.4375
    torch.save(state, path)
    assert train(small_cfg(tmp_path, steps=2, eval_every=2), resume=str(path.parent), **quiet)["accuracy_end"] == 0.4375
    resumed = train(small_cfg(tmp_path, steps=3, eval_every=2), resume=str(tmp_path / "run" / "checkpoint"), **quiet)
    assert resumed["accuracy_start"] == first["accuracy_start"]
    with open(resumed["log"]) as f:
        logged = [h for h in map(json.loads, f) if "time_rollout" in h]
    assert [h["step"] for h in logged] == [1, 2, 3]
    assert resumed["time_rollout_s"] == pytest.approx(sorted(h["time_rollout"] for h in logged)[1])


def test_naive_ppo_logs_no_mismatch_it_did_not_measure(tmp_path):
    """--proximal behaviour takes the rollout's log-probs as old_logp: the loss's mismatch KL and TIS weight are 0
    and 1 by construction, and the summary printed 'mismatch KL rollout vs trainer 0.00e+00' for an fp8,
    asynchronous rollout. They are left out of the step's log (the summary says '-')."""
    trainer = Trainer(small_cfg(tmp_path, proximal="behaviour", steps=1, num_iterations=1))
    m = trainer.rl_step()
    assert "loss" in m and "ratio_mean" in m
    assert "mismatch_kl" not in m and not [k for k in m if k.startswith("tis_")]


def test_step_metrics_reduce_by_kind():
    """Per-minibatch metrics to one value per step: extremes stay extremes, counts are per pass, others mean."""
    from flashrl_kernels.trainer.loop import _step_metric

    assert _step_metric("ratio_max", [1.0, 4.81, 1.99, 1.57], 2) == 4.81
    assert _step_metric("tis_weight_min", [0.5, 0.00095, 0.7, 0.2], 2) == 0.00095
    assert _step_metric("num_tokens", [10.0, 12.0, 10.0, 12.0], 2) == 22.0  # two minibatches, two passes
    assert _step_metric("clip_frac_high", [0.1, 0.3], 1) == pytest.approx(0.2)


# an entropy bonus keeps the gradient non-zero even when every group of this tiny step is flat
@pytest.mark.parametrize("extra", [{"entropy_coef": 0.01},
                                   {"level": "sequence", "loss_agg": "seq-mean-token-mean", "entropy_coef": 0.01}])
def test_fused_head_update_equals_logits_update(tmp_path, extra):
    """--fused-logprobs: the update's loss from linear_policy_loss equals policy_loss on the logits' logprobs,
    with the same weights after one step (same rollout, same seed)."""
    models = []
    for fused in (False, True):
        tr = Trainer(small_cfg(tmp_path / str(fused), steps=1, fused_logprobs=fused, **extra))
        before = {k: v.clone() for k, v in tr.model.state_dict().items()}
        m = tr.rl_step()
        models.append((m, tr.model.state_dict()))
    (m0, s0), (m1, s1) = models
    assert m1["loss"] == pytest.approx(m0["loss"], rel=1e-4, abs=1e-6)
    assert m1["grad_norm"] == pytest.approx(m0["grad_norm"], rel=1e-3) and m0["grad_norm"] > 0
    assert m1["logp_mean"] < 0 and "logp_mean" not in m0
    for name, a in s0.items():
        torch.testing.assert_close(s1[name], a, rtol=2e-3, atol=2e-5, msg=name)
    assert any(not torch.equal(s1[k], before[k]) for k in before)  # the step changed the weights


def test_resume_continues_bit_for_bit(tmp_path):
    cfg = small_cfg(tmp_path, steps=3)
    straight = Trainer(cfg)
    for _ in range(3):
        straight.rl_step()

    first = Trainer(cfg)
    first.rl_step()
    first.rl_step()
    first.save(str(tmp_path / "ckpt"))
    resumed = Trainer(cfg)
    resumed.load(str(tmp_path / "ckpt"))
    assert resumed.step == 2
    resumed.rl_step()
    for (name, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.slow
def test_rl_improves_held_out_accuracy(tmp_path):
    from flashrl_kernels.trainer.run import train

    cfg = TrainConfig(seed=0, steps=60, eval_every=60, cache_dir=str(tmp_path / "cache"),
                      out_dir=str(tmp_path / "run"))
    summary = train(cfg, progress=False, say=lambda *a: None)
    assert ("vLLM, int8" in summary["engine"]) == vllm_available()
    gain = summary["accuracy_end"] - summary["accuracy_start"]
    assert gain >= MARGIN, summary
    assert os.path.exists(summary["figure"]) and os.path.getsize(summary["log"]) > 0
    if vllm_available():  # the INT8 engine differs from the fp32 trainer, and TIS sees it
        assert summary["mismatch_kl_median"] > 0
