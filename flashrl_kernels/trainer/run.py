"""Run a training job: progress bar, held-out evaluation, JSONL log, figure, results table."""
from __future__ import annotations

import json
import os
import statistics
import time

from .config import TrainConfig
from .loop import Trainer, write_jsonl

CURVES = [
    ("reward_mean", "train reward"),
    ("eval_accuracy", "held-out accuracy"),
    ("response_length", "response length (tokens)"),
    ("mismatch_kl", "rollout/trainer mismatch KL (k3)"),
    ("tis_frac_clipped", "TIS truncated/masked fraction"),
    ("entropy_mean", "entropy"),
    ("explained_variance", "critic explained variance (ppo / vapo)"),
    ("value_loss", "value loss (ppo / vapo)"),
]


def plot(history: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [(k, t) for k, t in CURVES if any(h.get(k) is not None for h in history)]  # no empty panels
    n = len(curves) + 2
    cols = 5 if n > 8 else 4
    fig, axes = plt.subplots(-(-n // cols), cols, figsize=(4 * cols, 3.5 * -(-n // cols)), squeeze=False)
    for ax, (key, title) in zip(axes.flat, curves):
        pts = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        ax.plot(*zip(*pts), marker="o" if key == "eval_accuracy" else None, markersize=3)
        ax.set_title(title)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    ax = axes.flat[len(curves)]
    for key in ("clip_frac_low", "clip_frac_high", "clip_frac_dual"):
        pts = [(h["step"], h[key]) for h in history if h.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), label=key.removeprefix("clip_frac_"))
    ax.set_title("PPO clip fractions")
    ax.legend(fontsize=7)
    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    ax = axes.flat[n - 1]
    timed = [h for h in history if "time_rollout" in h]
    steps = [h["step"] for h in timed]
    bottom = [0.0] * len(steps)
    for key in ("time_rollout", "time_logprob", "time_update", "time_sync"):
        vals = [h.get(key, 0.0) for h in timed]
        ax.bar(steps, vals, bottom=bottom, label=key.removeprefix("time_"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    title = "time per step (s)"
    if len(bottom) > 2:
        # the first step carries one-time set-up (engine warm-up, first compiles): drawn, but kept out of the scale
        rest = max(bottom[1:])
        if bottom[0] > 2 * rest:
            ax.set_ylim(0, 1.15 * rest)
            title += f"; step {steps[0]}: {bottom[0]:.1f} s (off scale)"
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _median_of(steps: list[dict], key: str):
    vals = [h[key] for h in steps if h.get(key) is not None]
    return statistics.median(vals) if vals else None


def _tail_mean(steps: list[dict], key: str, frac: int = 6):
    """Mean of `key` over the last sixth of the steps (None if no step logged it)."""
    vals = [h[key] for h in steps if h.get(key) is not None]
    tail = vals[-max(1, len(vals) // frac):]
    return statistics.mean(tail) if tail else None


def _mean_of(steps: list[dict], key: str):
    vals = [h[key] for h in steps if h.get(key) is not None]
    return statistics.mean(vals) if vals else None


def rollout_mode_desc(cfg: TrainConfig, trainer=None) -> str:
    if not cfg.is_async:
        return "synchronous (generate, then train)"
    eng = getattr(trainer, "async_engine", None)
    cpus = f"; engine on CPUs {eng.engine_cpus}, trainer on {eng.trainer_cpus}" if eng is not None else ""
    return (f"asynchronous, max staleness {cfg.max_staleness}, interrupt {cfg.interrupt}, "
            f"{'decoupled PPO' if cfg.proximal == 'recompute' else 'naive PPO (behaviour ratio)'}{cpus}")


def rollout_tokens_per_s(steps: list[dict]):
    """Generated completion tokens / rollout wall time, both summed over the steps that logged them. Asynchronous
    steps: over the engine's busy time (the step's wall time less the engine's idle time), since the trainer's
    wait for a batch is not the time it took to generate."""

    def seconds(h):
        if h.get("engine_idle") is not None and h.get("time_step") is not None:
            return max(h["time_step"] - h["engine_idle"], 0.0)
        return h.get("time_rollout")

    pairs = [(h["rollout_tokens"], seconds(h)) for h in steps
             if h.get("rollout_tokens") is not None and seconds(h)]
    seconds = sum(t for _, t in pairs)
    return sum(n for n, _ in pairs) / seconds if seconds > 0 else None


def train(cfg: TrainConfig, resume: str | None = None, progress: bool = True, say=print) -> dict:
    """Run the job described by cfg; returns a summary dict (also written to <out_dir>/summary.json)."""

    os.makedirs(cfg.out_dir, exist_ok=True)
    log_path = os.path.join(cfg.out_dir, "metrics.jsonl")
    if not resume and os.path.exists(log_path):
        os.remove(log_path)
    with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_dict(), f, indent=1)

    t_start = time.perf_counter()
    trainer = Trainer(cfg)
    try:
        return _train(trainer, cfg, resume, progress, say, log_path, t_start)
    finally:
        trainer.close()


def _train(trainer, cfg: TrainConfig, resume, progress, say, log_path: str, t_start: float) -> dict:
    from tqdm import tqdm

    if resume:
        trainer.load(resume)
        say(f"resumed from {resume} at step {trainer.step}")
    if cfg.is_async:
        trainer.start_async()
    engine_desc = (
        f"vLLM, {cfg.rollout_quant} weights" + (f", {cfg.kv_cache_dtype} KV cache" if cfg.kv_cache_dtype != "auto" else "")
        if cfg.is_async or trainer.engine.name == "vllm"
        else "Hugging Face generate (the trainer's fp32 weights" + (
            "; vLLM is not installed, so no quantized rollout)" if cfg.rollout_engine == "auto" else ")")
    )
    say(f"warm start: {'cache hit' if trainer.warmstart_cached else 'trained'} in {trainer.warmstart_seconds:.1f}s "
        f"({trainer.model_dir})")
    say(f"rollout engine: {engine_desc}")
    say(f"rollout mode: {rollout_mode_desc(cfg, trainer)}")
    if cfg.is_async and len({*trainer.async_engine.engine_cpus, *trainer.async_engine.trainer_cpus}) < 4:
        say("note: the asynchronous mode splits these few CPUs between the engine and the trainer, while the "
            "synchronous loop gives each phase all of them; on 2 CPUs it measured 0.89-1.10x the synchronous "
            "loop's speed on the chain task and 0.66-0.79x on the demo task (bench/RESULTS.md)")
    if cfg.value_based:
        alpha = cfg.resolved("lam_alpha")
        lam = f"length-adaptive lambda (alpha {alpha})" if alpha > 0 else f"lambda {cfg.resolved('lam')}"
        say(f"RL: {cfg.algo}, GAE with {lam}, critic lambda {cfg.resolved('critic_lam')}, "
            f"NLL coef {cfg.resolved('nll_coef')}, {cfg.value_pretrain_steps} value-pretraining steps; "
            f"{cfg.level}-level ratios, TIS {cfg.tis}, {cfg.loss_agg}, "
            f"{cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples")
    else:
        say(f"RL: {cfg.advantage} advantages, {cfg.level}-level ratios, TIS {cfg.tis}, {cfg.loss_agg}, "
            f"{cfg.steps} steps x {cfg.prompts_per_step} prompts x {cfg.group_size} samples")

    # resumed: the warm start's accuracy and the steps before the checkpoint come from it (load), so the
    # summary covers the whole run
    acc_start = next((h["eval_accuracy"] for h in trainer.history if h.get("step") == 0 and "eval_accuracy" in h),
                     None) if resume else None
    if acc_start is None:
        acc_start = trainer.evaluate()
        if resume:
            say("note: the checkpoint holds no warm-start accuracy (written before 2026-12-04): the 'warm start' "
                "row is the resumed model's")
        else:
            write_jsonl(log_path, {"step": 0, "eval_accuracy": acc_start})
            trainer.history.append({"step": 0, "eval_accuracy": acc_start})
    pretrain: list[dict] = []
    if cfg.value_based and trainer.value_pretrained < cfg.value_pretrain_steps:
        vbar = tqdm(total=cfg.value_pretrain_steps, initial=trainer.value_pretrained, desc="value pretraining",
                    unit="step", disable=not progress, dynamic_ncols=True)
        while trainer.value_pretrained < cfg.value_pretrain_steps:
            vm = trainer.pretrain_value_step()
            pretrain.append(vm)
            write_jsonl(log_path, vm)
            vbar.set_postfix(value_loss=f"{vm['value_loss']:.4f}", ev=f"{vm['explained_variance']:.2f}")
            vbar.update(1)
        vbar.close()
    bar = tqdm(total=cfg.steps, initial=trainer.step, desc="RL", unit="step", disable=not progress, dynamic_ncols=True)
    # the latest held-out accuracy: a resumed run's checkpoint was written at an evaluation (resuming a finished
    # run trains nothing, and its 'after RL' is the checkpoint's)
    acc = next((h["eval_accuracy"] for h in reversed(trainer.history) if "eval_accuracy" in h), acc_start)
    ckpt = os.path.join(cfg.out_dir, "checkpoint")
    while trainer.step < cfg.steps:
        m = trainer.rl_step()
        evaluate = trainer.step % cfg.eval_every == 0 or trainer.step == cfg.steps
        if evaluate:
            if trainer.step == cfg.steps:
                trainer.close()  # async: what the engine generates ahead is not needed; its CPUs go to the evaluation
            acc = m["eval_accuracy"] = trainer.evaluate()
        trainer.history.append(m)
        if evaluate:
            trainer.save(ckpt)  # with the history up to this step
        write_jsonl(log_path, m)
        bar.set_postfix(reward=f"{m['reward_mean']:.2f}", acc=f"{acc:.2f}", len=f"{m['response_length']:.1f}")
        bar.update(1)
    bar.close()

    steps = [h for h in trainer.history if "time_rollout" in h]
    summary = {
        "accuracy_start": acc_start,
        "accuracy_end": acc,
        "response_length_end": steps[-1]["response_length"] if steps else None,
        "mismatch_kl_median": _median_of(steps, "mismatch_kl"),
        "tis_frac_clipped_median": _median_of(steps, "tis_frac_clipped"),
        "time_rollout_s": _median_of(steps, "time_rollout"),
        "time_logprob_s": _median_of(steps, "time_logprob"),
        "time_update_s": _median_of(steps, "time_update"),
        "time_sync_s": _median_of(steps, "time_sync"),
        "sync_codes_changed_median": _median_of(steps, "sync_codes_changed"),
        "sync_max_scale_change_median": _median_of(steps, "sync_max_scale_change"),
        "rollout_tokens_per_s": rollout_tokens_per_s(steps),
        "task": cfg.task,
        "rollout_mode": rollout_mode_desc(cfg, trainer),
        "staleness_mean": _mean_of(steps, "staleness_mean"),
        "staleness_max": max((h["staleness_max"] for h in steps if "staleness_max" in h), default=None),
        "multi_version_share": _mean_of(steps, "multi_version_share"),
        "dropped_stale": sum(h.get("dropped_stale", 0) for h in steps),
        "trainer_wait_s": _median_of(steps, "trainer_wait"),
        "engine_idle_s": _median_of(steps, "engine_idle"),
        "frontend_cpu_s": _median_of(steps, "frontend_cpu"),
        "algo": cfg.algo,
        "value_loss_pretrain_start": pretrain[0]["value_loss"] if pretrain else None,
        "value_loss_pretrain_end": pretrain[-1]["value_loss"] if pretrain else None,
        "value_loss_end": _tail_mean(steps, "value_loss"),
        "explained_variance_end": _tail_mean(steps, "explained_variance"),
        "wall_s": time.perf_counter() - t_start,
        "engine": engine_desc,
        "log": log_path,
        "figure": os.path.join(cfg.out_dir, "curves.png"),
    }
    plot(trainer.history, summary["figure"])
    with open(os.path.join(cfg.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


def format_summary(s: dict) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    what = "held-out step accuracy (running totals right)" if s.get("task") == "chain" else "held-out accuracy"
    rows = [
        (f"{what}, warm start", f(s["accuracy_start"], ".3f")),
        (f"{what}, after RL", f(s["accuracy_end"], ".3f")),
        ("response length (tokens), last step", f(s["response_length_end"], ".2f")),
        ("mismatch KL rollout vs trainer (median)", f(s["mismatch_kl_median"], ".2e")),
        ("TIS truncated/masked fraction (median)", f(s["tis_frac_clipped_median"], ".3f")),
        ("time per step: rollout / logprob / update / sync (s, median)",
         " / ".join(f(s[k], ".3f") for k in ("time_rollout_s", "time_logprob_s", "time_update_s", "time_sync_s"))),
        ("rollout tokens/s (completion tokens / rollout time or, async, engine busy time; whole run)", f(s.get("rollout_tokens_per_s"), ".1f")),
        ("rollout mode", s.get("rollout_mode", "-")),
    ]
    if s.get("staleness_mean") is not None:
        rows += [
            ("staleness: mean / max (versions); multi-version trajectories",
             f"{s['staleness_mean']:.2f} / {s['staleness_max']} ; {s['multi_version_share']:.1%}"),
            ("idle per step: trainer waiting / engine (s, median); groups dropped as stale",
             f"{f(s['trainer_wait_s'], '.3f')} / {f(s['engine_idle_s'], '.3f')} ; {s['dropped_stale']}"),
            ("vLLM front end in the trainer process (CPU s per step, median)", f(s.get("frontend_cpu_s"), ".3f")),
        ]
    if s.get("sync_codes_changed_median") is not None:
        rows.append(("sync: quantized codes changed / max row-scale change (median)",
                     f"{s['sync_codes_changed_median']:.2%} / {s['sync_max_scale_change_median']:.2e}"))
    if s.get("value_loss_end") is not None:
        rows += [
            ("value loss: pretraining start / end / last RL steps",
             " / ".join(f(s[k], ".4f") for k in ("value_loss_pretrain_start", "value_loss_pretrain_end",
                                                  "value_loss_end"))),
            ("critic explained variance (last RL steps)", f(s["explained_variance_end"], ".3f")),
        ]
    rows += [
        ("wall time (s)", f(s["wall_s"], ".0f")),
        ("rollout engine", s["engine"]),
        ("metrics log", s["log"]),
        ("figure", s["figure"]),
    ]
    w = max(len(r[0]) for r in rows)
    return "\n".join(f"{k.ljust(w)}  {v}" for k, v in rows)
