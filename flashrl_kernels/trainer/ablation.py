"""`flashrl-kernels ablate`: the demo's run under several rollout/loss settings, one table.

Runs (same seed, same cached warm start):
  bf16 rollout + TIS, INT8 + TIS, INT8 without TIS, FP8 + TIS, INT8 + TIS + GFPO (shortest 4 of 8),
  INT8 + TIS with value-based PPO (VC-PPO: value pretraining, decoupled GAE) and with VAPO, and
  INT8 + TIS asynchronous at max staleness 1 and 2 (decoupled PPO; the engine in its own process).
Reported per run: held-out accuracy, mean response length over the last
steps, median rollout/trainer mismatch KL, and for GFPO the excess length
reduction ELR = (L_grpo - L_gfpo) / (L_grpo - L_start), with L_start the
mean length of the first rollout (the warm-started policy) and L_grpo the
INT8 + TIS (GRPO) run's; for PPO / VAPO the critic's value loss and explained
variance over the last sixth of the steps.
"""
from __future__ import annotations

import dataclasses
import os
import statistics

from .config import TrainConfig
from .run import train

RUNS = (
    ("bf16 rollout, TIS", {"rollout_quant": "bf16"}),
    ("int8 rollout, TIS", {"rollout_quant": "int8"}),
    ("int8 rollout, no TIS", {"rollout_quant": "int8", "tis": "none"}),
    ("fp8 rollout, TIS", {"rollout_quant": "fp8"}),
    ("int8 rollout, TIS, GFPO", {"rollout_quant": "int8", "advantage": "gfpo_length", "gfpo_keep": 4}),
    ("int8 rollout, TIS, PPO", {"rollout_quant": "int8", "algo": "ppo"}),
    ("int8 rollout, TIS, VAPO", {"rollout_quant": "int8", "algo": "vapo"}),
    ("int8 rollout, TIS, async (staleness 1)", {"rollout_quant": "int8", "max_staleness": 1}),
    ("int8 rollout, TIS, async (staleness 2)", {"rollout_quant": "int8", "max_staleness": 2}),
)
GRPO_REFERENCE = "int8 rollout, TIS"


def _lengths(out_dir: str, tail: int) -> tuple[float, float]:
    import json

    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        lens = [r["response_length"] for r in map(json.loads, f) if "response_length" in r]
    return lens[0], statistics.mean(lens[-tail:])


def ablation_configs(base: TrainConfig) -> list[tuple[str, TrainConfig | None]]:
    """(row name, its config, or None where it is skipped), every row's built before the first run: a row whose
    overrides do not fit the base options (GFPO's gfpo_keep 4 with group_size 4, the async rows with rollout_mode
    'sync') fails now, naming the row, not after the runs before it."""
    # the rows set TIS on / off and the rollout mode themselves: from the base they would run mislabelled
    if base.tis == "none":
        raise ValueError("option tis='none': the ablation turns TIS on and off per row (its 'TIS' rows would run "
                         "without it); leave tis at a TIS mode (the TIS rows use it)")
    if base.is_async:
        raise ValueError("options max_staleness / rollout_mode: the ablation chooses synchronous or asynchronous "
                         "rollout per row (every row would run asynchronously); leave them at their defaults")
    out = []
    for i, (name, overrides) in enumerate(RUNS):
        if base.rollout_engine == "hf" and (overrides.get("rollout_quant", "bf16") != "bf16"
                                            or overrides.get("max_staleness")):
            out.append((name, None))
            continue
        if base.algo != "grpo" or base.advantage != "grpo":
            overrides = {"algo": "grpo", "advantage": "grpo", **overrides}  # each row names its own algorithm
        try:
            out.append((name, dataclasses.replace(base, out_dir=os.path.join(base.out_dir, f"run{i}"), **overrides)))
        except ValueError as exc:
            raise ValueError(f"ablation row '{name}' ({', '.join(f'{k}={v!r}' for k, v in overrides.items())}): "
                             f"{exc}") from None
    return out


def run_ablation(base: TrainConfig, say=print) -> list[dict]:
    rows = []
    for i, (name, cfg) in enumerate(ablation_configs(base)):
        if cfg is None:
            say(f"[{i + 1}/{len(RUNS)}] {name}: skipped (quantized and asynchronous rollout need vLLM)")
            continue
        say(f"[{i + 1}/{len(RUNS)}] {name}")
        s = train(cfg, say=lambda *_: None)
        l_start, l_end = _lengths(cfg.out_dir, tail=max(1, cfg.steps // 6))
        rows.append({"run": name, "accuracy_start": s["accuracy_start"], "accuracy": s["accuracy_end"],
                     "length_start": l_start, "length": l_end, "mismatch_kl": s["mismatch_kl_median"],
                     "tis_frac_clipped": s["tis_frac_clipped_median"], "wall_s": s["wall_s"], "elr": None,
                     "value_loss": s.get("value_loss_end"), "explained_variance": s.get("explained_variance_end")})
    grpo = next((r for r in rows if r["run"] == GRPO_REFERENCE), None)
    for r in rows:
        if "GFPO" in r["run"] and grpo is not None:
            denom = grpo["length"] - grpo["length_start"]
            r["elr"] = (grpo["length"] - r["length"]) / denom if abs(denom) > 1e-9 else None
    return rows


def format_ablation(rows: list[dict]) -> str:
    def f(v, spec):
        return "-" if v is None else format(v, spec)

    headers = ["run", "acc start", "acc end", "len start", "len end", "mismatch KL", "TIS clipped", "ELR",
               "value loss", "expl var", "wall s"]
    table = [[r["run"], f(r["accuracy_start"], ".3f"), f(r["accuracy"], ".3f"), f(r["length_start"], ".2f"),
              f(r["length"], ".2f"), f(r["mismatch_kl"], ".1e"), f(r["tis_frac_clipped"], ".3f"), f(r["elr"], ".2f"),
              f(r.get("value_loss"), ".4f"), f(r.get("explained_variance"), ".2f"), f(r["wall_s"], ".0f")]
             for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(headers, *table)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines += ["  ".join(str(x).ljust(w) for x, w in zip(t, widths)) for t in table]
    lines.append("ELR = (L_grpo - L_gfpo) / (L_grpo - L_start): the share of GRPO's length change GFPO takes back; "
                 "L_start is the warm start's mean length, lengths are means over the last sixth of the steps; "
                 "value loss / explained variance: the critic's (PPO, VAPO), same window")
    return "\n".join(lines)
