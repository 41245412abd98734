"""Synchronous vs asynchronous reference trainer: wall time and held-out accuracy at equal updates (issue 25).

Every run is `flashrl-kernels train` in a fresh process (INT8 rollout with TIS, the default), with held-out
evaluation only at the start and the end. Prints one markdown row per run and a summary per mode:

    python bench/async_wall.py --task chain --steps 60 --seeds 0,1 --modes sync,1,2,4 --num-iterations 1
    python bench/async_wall.py --task arith --steps 60 --seeds 0 --modes sync,1,2,4,8 --proximal recompute,behaviour

A mode is `sync` (the synchronous loop) or an integer max staleness eta (0 is the asynchronous engine held to
the synchronous bound). Wall time is the whole command (engine start, evaluations), less the warm start's
training in the run that trained it (a seed's first; the others load it from the cache); RL time is the sum of
the RL steps' own times. Timings need a quiet machine: the engine and the trainer each own a core.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

from flashrl_kernels._cpu import cpu_name, isa_flags


def _ppo(mode: str, proximal: str) -> str:
    if mode == "sync":
        return "on-policy"
    return "decoupled" if proximal == "recompute" else "naive"


def run_one(task: str, steps: int, seed: int, mode: str, proximal: str, extra: list[str], out: str) -> dict:
    cmd = [sys.executable, "-m", "flashrl_kernels.cli", "train", "--task", task, "--steps", str(steps), "--seed",
           str(seed), "--eval-every", str(steps), "--out-dir", out, "--proximal", proximal, *extra]
    cmd += ["--rollout-mode", "sync"] if mode == "sync" else ["--rollout-mode", "async", "--max-staleness", mode]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, check=False, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    with open(os.path.join(out, "summary.json")) as f:
        s = json.load(f)
    with open(os.path.join(out, "metrics.jsonl")) as f:
        hist = [json.loads(line) for line in f if line.strip()]
    rl = [h for h in hist if "time_step" in h]
    # a seed's first run trains its warm start (cached for the others): not part of the comparison
    warm = re.search(r"warm start: trained in ([0-9.]+)s", proc.stdout)
    s["command_wall_s"] = wall - (float(warm.group(1)) if warm else 0.0)
    s["rl_s"] = sum(h["time_step"] for h in rl)
    return s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--task", default="chain")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--modes", default="sync,1,2,4")
    ap.add_argument("--proximal", default="recompute", help="comma-separated: recompute (decoupled), behaviour")
    ap.add_argument("--num-iterations", type=int, default=None)
    ap.add_argument("--json", default=None, help="also write every run's summary here")
    ap.add_argument("--train-args", default="", help="more `flashrl-kernels train` options for every run, e.g. "
                    "'--trainer-cpus all'")
    a = ap.parse_args(argv)
    extra = [] if a.num_iterations is None else ["--num-iterations", str(a.num_iterations)]
    extra += a.train_args.split()
    print(f"# {a.task}, {a.steps} updates; {cpu_name()}: {' '.join(isa_flags())}", flush=True)
    print("| mode | PPO | seed | wall s | RL s | s/step | acc start -> end | staleness mean/max | front end CPU s/step |")
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in map(int, a.seeds.split(",")):
            for mode in a.modes.split(","):  # modes interleaved within a seed: drift hits every mode alike
                for prox in a.proximal.split(","):
                    if mode == "sync" and prox == "behaviour":
                        continue  # the synchronous loop is on-policy: the two coincide
                    s = run_one(a.task, a.steps, seed, mode, prox, extra, os.path.join(tmp, f"{mode}-{prox}-{seed}"))
                    s.update(mode=mode, proximal=prox, seed=seed)
                    rows.append(s)
                    stale = "-" if s.get("staleness_mean") is None else f"{s['staleness_mean']:.2f}/{s['staleness_max']}"
                    fe = "-" if s.get("frontend_cpu_s") is None else f"{s['frontend_cpu_s']:.3f}"
                    print(f"| {mode} | {_ppo(mode, prox)} | {seed} | "
                          f"{s['command_wall_s']:.1f} | {s['rl_s']:.1f} | {s['rl_s'] / a.steps:.3f} | "
                          f"{s['accuracy_start']:.3f} -> {s['accuracy_end']:.3f} | {stale} | {fe} |", flush=True)
    print("\n| mode | PPO | runs | wall s (median) | RL s (median) | x sync RL time | acc end (mean, min-max) |")
    print("|---|---|---|---|---|---|---|")
    sync_rl = [r["rl_s"] for r in rows if r["mode"] == "sync"]
    base = statistics.median(sync_rl) if sync_rl else None
    for key in dict.fromkeys((r["mode"], r["proximal"]) for r in rows):
        sel = [r for r in rows if (r["mode"], r["proximal"]) == key]
        acc = [r["accuracy_end"] for r in sel]
        rl = statistics.median(r["rl_s"] for r in sel)
        print(f"| {key[0]} | {_ppo(*key)} | {len(sel)} | "
              f"{statistics.median(r['command_wall_s'] for r in sel):.1f} | {rl:.1f} | "
              f"{'-' if base is None else f'{base / rl:.2f}x'} | "
              f"{statistics.mean(acc):.3f} ({min(acc):.3f}-{max(acc):.3f}) |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
