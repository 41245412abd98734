"""Asynchronous rollout, as AReaL does it: the engine generates while the trainer trains.

The engine is vLLM's AsyncLLM: its core runs in a process of its own, pinned to `engine_cpus`, and the
front end runs on an asyncio loop in a background thread of the trainer process. A producer task keeps
admitting prompt groups (group_size requests each) while the staleness budget allows; finished groups wait
in a buffer that the trainer takes batches from (`next_batch`). At every weight update (`update_weights`)
the engine is paused, the trainer's weights are written into it in place (`sync_weights_async`: validated on
every rank first, so a bad tensor leaves the previous version serving), and generation resumes:

- interrupt "abort": in-flight requests are aborted, their KV dropped; each is resubmitted as its prompt plus
  the tokens it had, so the rest is generated, and its prefix recomputed, under the new weights;
- interrupt "keep": in-flight requests are frozen with their KV and continue after the sync on the stale KV
  (PipelineRL).

Every generated token records the version of the weights that produced it (0 = the warm start, v = after
v updates). Staleness of a trajectory = the trainer's version when it trains on it minus its oldest token's.

Staleness bound eta (AReaL's `max_head_offpolicyness`), in prompt groups with B groups per batch:
- admission: a new group starts only while accepted + running < (version + credits + eta + 1) * B, where
  accepted counts the groups finished (trained on or waiting), running those in flight, and credits the
  batches the trainer took without a weight update after them (VC-PPO's value pretraining); eta = 0 is the
  synchronous schedule;
- consumption (a hard bound): a finished group older than eta versions is dropped, not trained on, and its
  slot given back; `dropped_stale` counts them.

A checkpoint holds `snapshot()`: the groups admitted (or drawn) and not yet trained on, with the sampler state
each one's batch was drawn from. A resumed engine admits those first, regenerated under the checkpoint's
weights, then draws on from the saved state: no problem is skipped or trained twice across a resume.
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import threading
import time
from collections import deque

from .rollout import RolloutBatch


class StalenessController:
    """The admission and consumption bookkeeping (pure; the engine driver holds the lock around it)."""

    def __init__(self, batch_groups: int, eta: int, version: int = 0, credits: int = 0):
        if batch_groups < 1 or eta < 0:
            raise ValueError(f"batch_groups must be >= 1 and eta >= 0, got {batch_groups}, {eta}")
        self.B, self.eta = batch_groups, eta
        self.version = version  # weight updates applied to the engine
        self.credits = credits  # batches taken without a weight update after them
        self.accepted = (version + credits) * batch_groups  # as if every earlier batch had been accepted
        self.running = 0
        self.dropped = 0

    def can_admit(self) -> bool:
        return self.accepted + self.running < (self.version + self.credits + self.eta + 1) * self.B

    def admit(self) -> None:
        self.running += 1

    def finish(self) -> None:
        self.running -= 1
        self.accepted += 1

    def staleness(self, oldest_version: int) -> int:
        return self.version - oldest_version

    def fresh_enough(self, oldest_version: int) -> bool:
        return self.staleness(oldest_version) <= self.eta

    def drop(self) -> None:
        """A finished group too old to train on: not accepted, its slot free again."""
        self.accepted -= 1
        self.dropped += 1

    def updated(self) -> None:
        self.version += 1

    def took_without_update(self) -> None:
        self.credits += 1


class RolloutBuffer:
    """Finished groups waiting for the trainer, and the staleness bookkeeping around them; thread-safe (the
    engine's loop thread finishes groups, the trainer takes batches)."""

    def __init__(self, ctl: StalenessController, wake=None):
        self.ctl = ctl
        self.wake = wake or (lambda: None)  # tells the producer that a slot may have opened
        self._ready: deque = deque()
        self.outstanding: set[int] = set()  # group indices admitted and not yet taken or dropped
        self._cond = threading.Condition()
        self._error: BaseException | None = None

    def can_admit(self) -> bool:
        with self._cond:
            return self.ctl.can_admit()

    def admit(self, index: int) -> None:
        with self._cond:
            self.ctl.admit()
            self.outstanding.add(index)

    def finished(self, group) -> None:
        with self._cond:
            self.ctl.finish()
            self._ready.append(group)
            self._cond.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self._cond:
            if self._error is None:
                self._error = exc
            self._cond.notify_all()

    def take_ready(self, n: int, partial: list) -> bool:
        """Move finished groups into `partial` (dropping those older than the bound) until it holds n; whether
        it does. Call with the lock held (take) or from one thread (a simulation)."""
        if self._error is not None:
            raise RuntimeError(f"asynchronous rollout failed: {self._error!r}") from self._error
        while self._ready and len(partial) < n:
            g = self._ready.popleft()
            self.outstanding.discard(g.index)
            if self.ctl.fresh_enough(g.oldest_version):
                partial.append(g)
            else:
                self.ctl.drop()
                self.wake()
        return len(partial) == n

    def take(self, n: int, timeout: float) -> list:
        """The next n finished groups fresh enough to train on, in order of admission; blocks."""
        batch: list = []
        deadline = time.perf_counter() + timeout
        with self._cond:
            while not self.take_ready(n, batch):
                left = deadline - time.perf_counter()
                if left <= 0 or not self._cond.wait(timeout=left):
                    raise TimeoutError(f"asynchronous rollout: no batch after {timeout:.0f} s")
        batch.sort(key=lambda g: g.index)
        return batch

    def updated(self) -> None:
        with self._cond:
            self.ctl.updated()
        self.wake()

    def took_without_update(self) -> None:
        with self._cond:
            self.ctl.took_without_update()
        self.wake()


@dataclasses.dataclass
class Sample:
    prompt_ids: list[int]
    seed: int
    max_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    finish_reason: str | None = None
    submissions: int = 0  # 1 + how many times an abort resubmitted it


@dataclasses.dataclass
class Group:
    index: int  # admission order: batch index * B + position (the synchronous loop's step and prompt)
    problem: object
    samples: list[Sample]
    done: int = 0

    @property
    def oldest_version(self) -> int:
        return min(v for s in self.samples for v in (s.versions or [0]))


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (from /proc; empty where there is no /proc)."""
    children: dict[int, list[int]] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(e))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pin_processes(engine_cpus: list[int], trainer_cpus: list[int], frontend: frozenset[int] = frozenset()) -> None:
    """Every thread of the engine's processes (this process's descendants; none when engine_cpus is empty) on
    engine_cpus, every thread of this process on trainer_cpus except the `frontend` thread ids, which join the
    engine's; threads created later inherit their creator's CPUs. vLLM binds only its OpenMP workers
    (VLLM_CPU_OMP_THREADS_BIND); its engine core's own loop polls and would take a trainer core."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for pid in _descendants(os.getpid()) if engine_cpus else []:
        for tid in _threads(pid):
            try:
                os.sched_setaffinity(tid, engine_cpus)
            except OSError:  # a thread that just ended
                pass
    for tid in _threads(os.getpid()) or [0]:
        try:
            os.sched_setaffinity(tid, engine_cpus if tid in frontend else trainer_cpus)
        except OSError:
            pass


def sample_seed(base: int, index: int, j: int) -> int:
    """Sampling seed of response j of prompt group `index`; the synchronous engine uses the same."""
    return (base * 1_000_003 + index * 1009 + j) % (2**31 - 1)


class AsyncVLLMRollout:
    """The AsyncLLM engine, its producer and the trainer-facing batch / weight-update calls."""

    name = "vllm-async"

    def __init__(self, model_dir: str, quant: str, cfg, *, sampler, max_new_tokens: int, max_model_len: int,
                 version: int = 0, credits: int = 0, seed_base: int = 0, resume: dict | None = None):
        self.cfg = cfg
        self.B, self.G = cfg.prompts_per_step, cfg.group_size
        self.sampler = sampler  # the trainer's ProblemSampler (drawn from on the loop thread only)
        self.max_new_tokens = max_new_tokens
        self.seed_base = seed_base
        self.ctl = StalenessController(self.B, cfg.max_staleness, version, credits)
        self.buffer = RolloutBuffer(self.ctl, wake=lambda: self._loop.call_soon_threadsafe(self._wake.set))
        self.gen_version = version  # the version the engine's weights are at
        self._next_index = (version + credits) * self.B  # the first group of the next batch drawn
        self._queued: deque = deque()  # (group index, problem) drawn and not yet admitted
        self._batch_states: dict[int, object] = {}  # batch -> the sampler state it was drawn from
        if resume:
            self._restore(resume, version + credits)
        self._closing = False
        self._inflight: set[asyncio.Task] = set()
        self._aborted: list[tuple[Group, Sample]] = []
        self._resubmitted: list[tuple[Group, Sample]] = []
        self._paused = False
        self._last_delta = time.perf_counter()
        # idle accounting: seconds the engine had no request to run (or was paused), the trainer waited
        self._engine_idle = 0.0
        self._idle_since: float | None = time.perf_counter()
        self.engine_cpus, self.trainer_cpus = cfg.split_cpus()

        quantization = {"bf16": None, "int8": "flashrl_int8", "fp8": "flashrl_fp8"}[quant]
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, self.engine_cpus))
        before = set(_threads(os.getpid()))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="flashrl-async-rollout", daemon=True)
        self._thread.start()
        self._call(self._start(model_dir, quantization, max_model_len))
        import torch

        # what close() gives back to the trainer (the final evaluation then runs on every CPU)
        self._cpus0 = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._torch_threads0 = torch.get_num_threads()
        # frontend_cpus "engine": the threads vLLM's front end brought into this process (our event loop, which
        # decodes every engine step's outputs, and its sockets' I/O threads) run on the engine's CPUs instead of
        # the trainer's (on 2 cores: no gain within noise, docs/trainer.md)
        frontend = frozenset(set(_threads(os.getpid())) - before) if cfg.frontend_cpus == "engine" else frozenset()
        pin_processes(self.engine_cpus, self.trainer_cpus, frontend)
        torch.set_num_threads(len(self.trainer_cpus))
        self._producer = None

    def start(self, model=None) -> None:
        """Write `model`'s weights first (a resumed run's; None: the checkpoint the engine loaded is current),
        then start generating."""
        if model is not None:
            res = self._call(self._write(list(model.state_dict().items())))
            del res
        self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self._loop)

    async def _write(self, tensors):
        from flashrl_kernels.integrations.vllm import sync_weights_async

        return await sync_weights_async(self.engine, tensors)

    # -- plumbing --
    def _call(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _start(self, model_dir: str, quantization, max_model_len: int) -> None:
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model_dir, tokenizer=model_dir, quantization=quantization, dtype="bfloat16", seed=self.seed_base,
            max_model_len=max_model_len, enforce_eager=True, logprobs_mode="processed_logprobs", max_num_seqs=256,
            kv_cache_dtype=self.cfg.kv_cache_dtype,
            # a prefix computed under old weights must not serve a request after a sync (the group's G requests
            # share their prompt, a few tokens: caching it saves little)
            enable_prefix_caching=False,
            # vLLM 0.32's CPU sampler fails a seeded request whose prompt is prefilled in chunks ("CPU Generator
            # does not use offset"); without chunked prefill a prompt is scheduled whole or waits
            enable_chunked_prefill=False, max_num_batched_tokens=max(8192, max_model_len),
        )
        self.engine = AsyncLLM.from_engine_args(args)
        self._wake = asyncio.Event()
        self.tokenizer = await self.engine.get_tokenizer() if asyncio.iscoroutinefunction(
            getattr(self.engine, "get_tokenizer", None)) else self.engine.get_tokenizer()

    # -- the producer (loop thread) --
    def _engine_busy(self, busy: bool) -> None:
        now = time.perf_counter()
        if busy and self._idle_since is not None:
            self._engine_idle += now - self._idle_since
            self._idle_since = None
        elif not busy and self._idle_since is None:
            self._idle_since = now

    async def _produce(self) -> None:
        try:
            while not self._closing:
                while not self._paused and self.buffer.can_admit():
                    self._admit()
                self._engine_busy(bool(self._inflight) and not self._paused)
                self._wake.clear()
                await self._wake.wait()
        except BaseException as exc:  # reported to the trainer at its next call
            self.buffer.fail(exc)

    def _admit(self) -> None:
        if not self._queued:  # one batch's worth, as the synchronous loop draws them
            first = self._next_index
            state, problems = self.sampler.draw()
            self._batch_states[first // self.B] = state
            self._queued.extend(zip(range(first, first + self.B), problems))
            self._next_index += self.B
            self._forget_batches()
        index, problem = self._queued.popleft()
        prompt_ids = self.tokenizer(problem.prompt).input_ids
        group = Group(index, problem, [Sample(prompt_ids, sample_seed(self.seed_base, index, j), self.max_new_tokens)
                                       for j in range(self.G)])
        self.buffer.admit(index)
        for s in group.samples:
            self._submit(group, s)

    def _submit(self, group: Group, s: Sample) -> None:
        task = asyncio.ensure_future(self._generate(group, s))
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)

    async def _generate(self, group: Group, s: Sample) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        cfg = self.cfg
        remaining = s.max_tokens - len(s.tokens)
        # a resubmission draws from another stream (a seeded request restarts its generator)
        params = SamplingParams(n=1, temperature=cfg.temperature, top_k=-1, top_p=1.0, max_tokens=remaining,
                                logprobs=0, seed=s.seed + 7919 * s.submissions, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        rid = f"g{group.index}-{group.samples.index(s)}-{s.submissions}"
        s.submissions += 1
        reason = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": s.prompt_ids + s.tokens}, params, rid):
                comp = out.outputs[0]
                new = list(comp.token_ids)
                if new:
                    self._last_delta = time.perf_counter()
                    s.tokens += new
                    s.logprobs += [lp[t].logprob for t, lp in zip(new, comp.logprobs)]
                    s.versions += [self.gen_version] * len(new)
                if out.finished:
                    reason = comp.finish_reason
        except BaseException as exc:
            self.buffer.fail(exc)
            raise
        if reason == "abort" and self._paused:
            self._aborted.append((group, s))  # resubmitted after the weight update
            return
        s.finish_reason = reason
        group.done += 1
        if group.done == self.G:
            self.buffer.finished(group)
        # out of the in-flight set before the producer wakes (the task's own done-callback runs after it has
        # looked): else the engine never counts as idle once the last request before the bound has finished
        self._inflight.discard(asyncio.current_task())
        self._wake.set()

    # -- checkpoints (the snapshot is taken on the loop thread, between two admissions) --
    def _pending(self) -> list[int]:
        with self.buffer._cond:
            outstanding = set(self.buffer.outstanding)
        return sorted(outstanding | {i for i, _ in self._queued})

    def _forget_batches(self) -> None:
        keep = {i // self.B for i in self._pending()}
        for b in [b for b in self._batch_states if b not in keep]:
            del self._batch_states[b]

    def snapshot(self) -> dict:
        """What a checkpoint needs to resume without skipping a problem: the groups not yet trained on (in
        flight, finished and waiting, or drawn and not admitted), the sampler state of each one's batch, and
        the sampler's state for the batches after them."""

        async def take() -> dict:
            pending = self._pending()
            return {"batch_groups": self.B, "next_index": self._next_index, "pending": pending,
                    "batch_states": {b: self._batch_states[b] for b in sorted({i // self.B for i in pending})},
                    "sampler": self.sampler.getstate()}

        return self._call(take())

    def _restore(self, snap: dict, batches_taken: int) -> None:
        if snap.get("batch_groups") != self.B:
            raise ValueError(f"the checkpoint's asynchronous state has {snap.get('batch_groups')} prompt groups "
                             f"per batch, this run {self.B} (prompts_per_step must not change across a resume)")
        if snap["next_index"] < batches_taken * self.B:
            raise ValueError("the checkpoint's asynchronous state is older than its step count")
        self._next_index = snap["next_index"]
        redrawn = {b: self.sampler.redraw(state) for b, state in snap["batch_states"].items()}
        self._queued.extend((i, redrawn[i // self.B][i % self.B]) for i in snap["pending"])
        self._batch_states = dict(snap["batch_states"])
        self.sampler.setstate(snap["sampler"])

    # -- the trainer's side --
    def next_batch(self, timeout: float = 1800.0) -> tuple[list[Group], dict]:
        """The next B finished groups fresh enough to train on (blocks while the engine generates them); the
        step's metrics: the trainer's wait and the groups dropped as too stale."""
        t0 = time.perf_counter()
        dropped0 = self.ctl.dropped
        batch = self.buffer.take(self.B, timeout)
        return batch, {"time_wait": time.perf_counter() - t0, "dropped_stale": self.ctl.dropped - dropped0}

    def took_without_update(self) -> None:
        """The trainer trained no policy on its last batch (value pretraining): one more batch may be admitted."""
        self.buffer.took_without_update()

    def to_rollout_batch(self, groups: list[Group]) -> tuple[RolloutBatch, list[list[int]]]:
        batch = RolloutBatch([], [], [], [], [])
        versions = []
        for g in groups:
            for s in g.samples:
                batch.prompt_ids.append(s.prompt_ids)
                batch.completion_ids.append(s.tokens)
                batch.rollout_logprobs.append(s.logprobs)
                batch.texts.append(self.tokenizer.decode(s.tokens, skip_special_tokens=True))
                batch.finished.append(s.finish_reason == "stop")
                versions.append(s.versions)
        return batch, versions

    def update_weights(self, model) -> dict:
        """Pause, write the trainer's weights in place, resume; the step's sync metrics. A sync that fails
        (a tensor the engine refuses) leaves the previous weights serving, generation resumed, and raises."""
        return self._call(self._update(list(model.state_dict().items())))

    async def _update(self, tensors) -> dict:
        mode = self.cfg.interrupt
        t0 = time.perf_counter()
        self._paused = True
        self._engine_busy(False)
        await self.engine.pause_generation(mode=mode, clear_cache=mode == "abort")
        if mode == "abort":
            # every request that was in flight ends with "abort" (its last tokens delivered): wait for them all
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
        else:
            # the scheduler is frozen: tokens still arriving were generated before the pause
            while time.perf_counter() - self._last_delta < 0.05:
                await asyncio.sleep(0.01)
        t_paused = time.perf_counter()
        try:
            res = await self._write(tensors)
        except BaseException:
            await self._resume()
            raise
        self.gen_version = self.ctl.version + 1  # tokens from here on come from the new weights
        self.buffer.updated()
        await self._resume()
        m = {"time_sync": time.perf_counter() - t0, "time_pause": t_paused - t0, "sync_write_s": res.seconds,
             "resubmitted": len(self._resubmitted)}
        if res.changed_share is not None:
            m.update(sync_codes_changed=res.changed_share, sync_max_scale_change=res.max_scale_change)
        return m

    async def _resume(self) -> None:
        aborted, self._aborted = self._aborted, []
        self._resubmitted = aborted
        self._paused = False
        for group, s in aborted:
            self._submit(group, s)
        await self.engine.resume_generation()
        self._wake.set()

    def engine_idle_seconds(self) -> float:
        """Seconds so far the engine had nothing to run (no request in flight, or paused for a sync)."""
        idle = self._engine_idle
        if self._idle_since is not None:
            idle += time.perf_counter() - self._idle_since
        return idle

    def frontend_cpu_seconds(self) -> float:
        """CPU seconds so far of the thread that runs vLLM's front end in this process (AsyncLLM's output
        handler decodes every engine step's outputs here, and our per-request coroutines take them): time taken
        from the trainer's CPUs."""

        async def now() -> float:
            return time.thread_time()

        return self._call(now())

    @property
    def version(self) -> int:
        return self.ctl.version

    def close(self) -> None:
        if self._closing:
            return
        self._closing = True

        async def stop():
            self._wake.set()
            for t in list(self._inflight):
                t.cancel()
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
            if self._producer is not None:
                self._producer.cancel()
            self.engine.shutdown()
            self.engine = None  # collected now, not at interpreter exit (its __del__ shuts down again)

        try:
            self._call(stop(), timeout=60)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            import gc

            import torch

            gc.collect()  # the engine's objects now, not at interpreter exit
            if getattr(self, "_cpus0", None) is not None:
                pin_processes([], self._cpus0)  # this process's threads only: the engine's processes are gone
                torch.set_num_threads(self._torch_threads0)
