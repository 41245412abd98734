"""Parts of the reference trainer: task and rewards, tokenizer, batch layout, config validation."""
import pytest
import torch

from flashrl_kernels.trainer.config import TrainConfig
from flashrl_kernels.trainer.loop import IGNORE, build_batch
from flashrl_kernels.trainer.task import ArithmeticTask, calculation_reward, exact_match_reward, parse_answer


def test_splits_are_disjoint_and_seeded():
    task = ArithmeticTask(max_operand=12, ops="+-", n_eval=40, seed=3)
    train, held = task.splits()
    assert len(held) == 40 and len(train) + len(held) == 2 * 12 * 12
    assert not {p.prompt for p in train} & {p.prompt for p in held}
    assert task.splits() == ArithmeticTask(max_operand=12, ops="+-", n_eval=40, seed=3).splits()
    assert task.splits()[1] != ArithmeticTask(max_operand=12, ops="+-", n_eval=40, seed=4).splits()[1]
    for p in held:
        assert eval(p.prompt[:-1]) == p.answer  # the answer is the arithmetic value of the prompt


def test_rewards():
    assert exact_match_reward("12", 12) == 1.0 and exact_match_reward(" 12", 12) == 1.0
    assert exact_match_reward("13", 12) == 0.0 and exact_match_reward("1 2", 12) == 0.0
    assert exact_match_reward("012", 12) == 0.0 and exact_match_reward("-3", -3) == 1.0  # canonical form only
    assert parse_answer("-7") == -7 and parse_answer("7-") is None and parse_answer("") is None
    # r = 1 - 0.5 min(|a-b|, 1) - 0.5 min(|a-b| / (|b| + eps), 1)
    assert calculation_reward("10", 10) == 1.0
    assert calculation_reward("11", 10) == pytest.approx(1 - 0.5 - 0.5 * 0.1)
    assert calculation_reward("0", 10) == pytest.approx(0.0, abs=1e-6)
    assert calculation_reward("x", 10) == 0.0
    assert calculation_reward("1", 0) == pytest.approx(0.0, abs=1e-6)


def test_char_tokenizer_round_trip():
    from flashrl_kernels.trainer.tiny_model import build_char_tokenizer

    tok = build_char_tokenizer("0123456789-+*=")
    ids = tok("12+7=").input_ids
    assert len(ids) == 5
    assert tok.decode(ids, skip_special_tokens=True) == "12+7="


def test_build_batch_aligns_targets_with_the_logits_that_predict_them():
    prompts = [[1, 5, 6], [1, 7]]
    comps = [[8, 2], [9, 9, 2]]
    lps = [[-0.1, -0.2], [-0.3, -0.4, -0.5]]
    ids, attn, targets, rlp = build_batch(prompts, comps, lps, pad_id=0)
    assert ids.tolist() == [[1, 5, 6, 8, 2], [1, 7, 9, 9, 2]]
    assert attn.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    # position j of logits[:, :-1] predicts ids[:, j+1]; only completion tokens are targets
    assert targets.tolist() == [[IGNORE, IGNORE, 8, 2], [IGNORE, 9, 9, 2]]
    torch.testing.assert_close(rlp, torch.tensor([[0, 0, -0.1, -0.2], [0, -0.3, -0.4, -0.5]]))
    m = targets != IGNORE
    assert torch.equal(ids[:, 1:][m], targets[m])


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"rollout_quant": "int4"}, "rollout_quant"),
        ({"advantage": "ppo"}, "advantage"),
        ({"group_size": 1}, "group_size"),
        ({"dual_clip": 1.0}, "dual_clip"),
        ({"tis_min": 3.0, "tis_max": 2.0}, "tis_min"),
        ({"advantage": "gfpo_length", "gfpo_keep": 8, "group_size": 8}, "gfpo_keep"),
        ({"minibatches": 3}, "minibatches"),
        ({"rollout_engine": "hf", "rollout_quant": "int8"}, "needs the vLLM engine"),
        ({"lr": 0.0}, "lr"),
        ({"hidden_size": 96}, "hidden_size"),
        ({"advantage": "gfpo_length", "gfpo_keep": 1}, "gfpo_keep"),  # one kept sample: advantage 0
        ({"eps_low": 1.0}, "eps_low"),
        ({"tis_max": 0.0, "tis_min": 0.0}, "tis_max"),
        ({"tis": "none", "tis_min": 3.0}, "tis_min"),  # the loss config rejects it whatever tis is
        # the task's own options, at construction (they used to fail as a traceback when the trainer built the task)
        ({"n_eval": 0}, "option n_eval"),
        ({"ops": "x"}, "option ops"),
        ({"max_operand": 1}, "option max_operand"),
        ({"task": "chain", "n_eval": -1}, "option n_eval"),
        # more prompts per step than the train split holds (used to fail at the first step, after the warm start)
        ({"prompts_per_step": 200}, "prompts_per_step .*136 problems"),
        ({"overlong_cache": 8}, "overlong_cache.*max_new_tokens \\(4, the task default"),
        # vLLM's CPU attention keeps an FP8 KV cache only for head sizes that are multiples of 32 (320 / 4 = 80)
        ({"kv_cache_dtype": "fp8", "hidden_size": 320}, "kv_cache_dtype.*multiple of 32"),
        # vLLM seeds numpy with it: a negative seed failed there, after the warm start
        ({"seed": -1}, "option seed"),
    ],
)
def test_bad_config_names_the_option(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig(**kwargs)


@pytest.mark.parametrize("kwargs, match", [({"dynamic_sampling": "false"}, "dynamic_sampling must be bool"),
                                           ({"group_size": 4.0}, "group_size must be int"),
                                           ({"lr": True}, "lr must be a number"),
                                           ({"lam": "0.9"}, "lam must be a number or None")])
def test_config_option_types(kwargs, match):
    """A YAML `dynamic_sampling: "false"` is a true string: types are checked, not coerced."""
    with pytest.raises(TypeError, match=match):
        TrainConfig(**kwargs)
    assert TrainConfig(lr=1, lam=1).lr == 1  # ints are numbers


def test_overlong_cache_beyond_the_response_budget_fails_before_the_warm_start(tmp_path, monkeypatch):
    from flashrl_kernels.trainer import loop

    monkeypatch.setattr(loop, "warm_start", lambda *a, **k: pytest.fail("warm start ran"))
    with pytest.raises(ValueError, match="overlong_cache.*max_new_tokens"):
        loop.Trainer(TrainConfig(overlong_cache=8, max_new_tokens=4, cache_dir=str(tmp_path)))


def test_dynamic_sampling_filters_on_scores_and_dr_grpo_constant():
    """DAPO filters on accuracy: an all-correct group whose overlong penalties differ is still dropped; and
    seq-mean-token-sum-norm divides by the response budget."""
    from flashrl_kernels.trainer.loop import compute_advantages, loss_config

    cfg = TrainConfig(dynamic_sampling=True, group_size=4, prompts_per_step=2)
    scores = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0])
    rewards = scores + torch.tensor([0.0, -0.5, -0.25, 0.0, 0.0, 0.0, 0.0, 0.0])  # overlong penalties
    _, keep = compute_advantages(cfg, rewards, torch.ones(8), scores=scores)
    assert keep.tolist() == [False] * 4 + [True] * 4
    assert loss_config(TrainConfig(loss_agg="seq-mean-token-sum-norm"), 12).normalizer == 12.0
    assert loss_config(TrainConfig(), 12).normalizer is None


def test_unknown_option_and_yaml(tmp_path):
    with pytest.raises(ValueError, match="unknown option.*learning_rate"):
        TrainConfig.from_dict({"learning_rate": 1.0})
    f = tmp_path / "c.yaml"
    f.write_text("steps: 7\nrollout_quant: fp8\n")
    cfg = TrainConfig.from_yaml(str(f), {"steps": 9})
    assert cfg.steps == 9 and cfg.rollout_quant == "fp8"
    f.write_text("- 1\n- 2\n")
    with pytest.raises(TypeError, match="mapping"):
        TrainConfig.from_yaml(str(f))
    f.write_text("steps: [2\n")  # malformed: was yaml's ScannerError/ParserError, a traceback from the CLI
    with pytest.raises(ValueError, match="c.yaml is not valid YAML: .*line 2"):
        TrainConfig.from_yaml(str(f))


def test_rollout_tokens_per_s_sums_over_the_run():
    from flashrl_kernels.trainer.run import format_summary, rollout_tokens_per_s

    steps = [{"rollout_tokens": 30, "time_rollout": 1.0}, {"rollout_tokens": 90, "time_rollout": 2.0},
             {"step": 0, "eval_accuracy": 0.5}]
    assert rollout_tokens_per_s(steps) == pytest.approx(40.0)  # 120 tokens / 3 s, not the mean of 30 and 45
    assert rollout_tokens_per_s([]) is None
    summary = {"accuracy_start": 0.1, "accuracy_end": 0.5, "response_length_end": 3.0, "mismatch_kl_median": 1e-3,
               "tis_frac_clipped_median": 0.0, "time_rollout_s": 1.0, "time_logprob_s": 0.1, "time_update_s": 0.2,
               "time_sync_s": 0.01, "rollout_tokens_per_s": 40.0, "wall_s": 5.0, "engine": "hf", "log": "l",
               "figure": "f"}
    lines = format_summary(summary).splitlines()
    assert any(line.startswith("rollout tokens/s") and line.endswith("40.0") for line in lines)
    assert len(lines) == 12 and any(line.startswith("rollout mode") for line in lines)
    assert "rollout tokens/s" in format_summary({k: v for k, v in summary.items() if k != "rollout_tokens_per_s"})
    asynchronous = {**summary, "rollout_mode": "asynchronous, max staleness 2", "staleness_mean": 1.2,
                    "staleness_max": 2, "multi_version_share": 0.25, "trainer_wait_s": 0.01, "engine_idle_s": 0.2,
                    "dropped_stale": 3, "task": "chain", "frontend_cpu_s": 0.391}
    text = format_summary(asynchronous)
    assert "1.20 / 2 ; 25.0%" in text and "0.010 / 0.200 ; 3" in text and "step accuracy" in text
    assert any(line.startswith("vLLM front end") and line.endswith("0.391") for line in text.splitlines())
    # asynchronous steps: tokens over the engine's busy time (step time less its idle time), not the trainer's wait
    async_steps = [{"rollout_tokens": 100, "time_rollout": 0.01, "time_step": 2.0, "engine_idle": 0.5},
                   {"rollout_tokens": 60, "time_rollout": 0.0, "time_step": 1.5, "engine_idle": 1.0}]
    assert rollout_tokens_per_s(async_steps) == pytest.approx(160 / 2.0)


def test_chain_task_splits_answers_and_lengths():
    from flashrl_kernels.trainer.task import ChainSumTask

    task = ChainSumTask(n_eval=32, n_train=500, seed=1)
    train, held = task.splits()
    assert len(train) == 500 and len(held) == 32 and not {p.prompt for p in train} & {p.prompt for p in held}
    assert task.splits() == ChainSumTask(n_eval=32, n_train=500, seed=1).splits()
    for p in held + train[:50]:
        terms = [int(t) for t in p.prompt[:-1].split("+")]
        assert 7 <= len(terms) <= 14 and all(0 <= t < 10 for t in terms)
        steps = p.answer.split(",")
        assert len(steps) == len(terms) - 1 and int(steps[-1].split("=")[1]) == sum(terms)
        assert 36 <= len(p.answer) <= task.max_answer_chars  # the rollout-heavy lengths
    assert ChainSumTask.chain([3, 5, 2]) == "3+5=8,8+2=10"
    with pytest.raises(ValueError, match="single-digit"):
        ChainSumTask(max_operand=12)


def test_chain_steps_reward_and_flaw():
    from flashrl_kernels.trainer.data import flawed_text
    from flashrl_kernels.trainer.task import chain_step_reward

    ans = "3+5=8,8+2=10,10+7=17"
    assert chain_step_reward(ans, ans) == 1.0 and chain_step_reward(" " + ans + " ", ans) == 1.0
    assert chain_step_reward("3+5=8,8+2=11,10+7=17", ans) == pytest.approx(2 / 3)
    assert chain_step_reward("3+5=8", ans) == pytest.approx(1 / 3)  # missing steps count as wrong
    assert chain_step_reward(ans + ",17+1=18", ans) == pytest.approx(3 / 4)  # so do extra ones
    assert chain_step_reward("", ans) == 0.0
    assert flawed_text(ans) == "3+5=08,8+2=10,10+7=17" and chain_step_reward(flawed_text(ans), ans) == pytest.approx(2 / 3)
    assert flawed_text(7) == "07" and flawed_text(-3) == "-3"
    with pytest.raises(TypeError):
        chain_step_reward("1", 1)


def test_chain_config_resolves_reward_and_positions():
    from flashrl_kernels.trainer.warmstart import max_positions_of

    assert TrainConfig(task="chain").reward_name == "steps" and TrainConfig().reward_name == "exact"
    assert max_positions_of(TrainConfig()) == 64  # the demo's model (and its cached warm start) unchanged
    assert max_positions_of(TrainConfig(task="chain")) >= 28 + 107 + 2
    with pytest.raises(ValueError, match="task 'chain' only"):
        TrainConfig(reward="steps")
