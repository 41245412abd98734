"""One OpenRLHF actor loss step, unpatched vs flashrl-patched: time and peak memory (OpenRLHF's own code path).

    python bench/openrlhf_actor_step.py                        # vocab 151936, 1 x (256 + 1024) and 1 x (256 + 4096)
    python bench/openrlhf_actor_step.py --response 2048 --batch 2 --entropy --correction

Runs in the OpenRLHF environment (tests/requirements-openrlhf.txt + openrlhf 0.11.2; docs/integrations/openrlhf.md).
What runs is OpenRLHF 0.11.2's `ActorPPOTrainer.training_step` (built by its own __init__, so its PolicyLoss is
the one `ppo_actor` names): `Actor.forward` (the logits, log-probs and, with --entropy, the entropy), the policy
loss with its default options (ppo, token-mean, eps 0.2, no dual clip, no IS correction; --correction: token-level
TIS mask on [0.5, 5], --entropy: entropy_coef 0.01), the backward and the optimizer step on a DeepSpeed ZeRO-2 bf16
engine built from OpenRLHF's `get_train_ds_config` (tests/openrlhf_scenario.py: world size 1, gloo, torch AdamW).
The model is a random Qwen2 of Qwen2.5-0.5B's width (hidden 896, 14 / 2 heads, tied embeddings, vocab 151936) with
--layers layers: the LM head, where the patch acts, is the real size; the transformer body is cut to fit the
machine. Responses are full length (no padding), after a left-padded prompt.

Unpatched and patched steps alternate in one process (patch() / unpatch() between them, one warm-up step each),
`--repeats` timed steps each; the time is the median. Peak memory is the largest resident set size seen during
the step (sampled every 2 ms) above the one before it: what the step itself allocates (large tensors are mmapped
by the allocator, so they show in the RSS while they live and leave it when freed).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The largest RSS seen while the block runs, sampled by a thread."""

    def __init__(self, interval=0.002):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        self.base = self.peak = _rss()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, _rss())
            time.sleep(self.interval)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss())

    @property
    def extra_mb(self):
        return (self.peak - self.base) / 2**20


def build_model(args) -> Path:
    import torch

    from flashrl_kernels.testing import build_tiny_qwen2

    path = Path(args.cache_dir) / (f"qwen2-h{args.hidden}-l{args.layers}-i{args.intermediate}-v{args.vocab}"
                                   f"{'-tied' if not args.untied else ''}")
    if not (path / "model.safetensors").exists():
        build_tiny_qwen2(path, vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                         kv_heads=args.kv_heads, intermediate=args.intermediate,
                         max_positions=max(512, args.prompt + max(args.response)), tie_word_embeddings=not args.untied,
                         dtype=torch.bfloat16, init_std=0.02)
    return path


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=14)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=4864)
    ap.add_argument("--untied", action="store_true", help="a separate lm_head (Qwen2.5-0.5B ties it to the embedding)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--response", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--entropy", action="store_true", help="entropy_coef 0.01 (OpenRLHF's default: None, no entropy)")
    ap.add_argument("--correction", action="store_true", help="token-level IS mask against rollout log-probs")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--cache-dir", default=os.environ.get("FLASHRL_BENCH_CACHE",
                                                          str(Path(tempfile.gettempdir()) / "flashrl_openrlhf_bench")))
    args = ap.parse_args(argv)

    import openrlhf_scenario as sc

    sc.install_flash_attn_stub()
    import torch

    import flashrl_kernels as fk
    from flashrl_kernels._cpu import cpu_name, isa_flags
    from flashrl_kernels.integrations import openrlhf as adapter

    torch.set_num_threads(args.threads)
    model = build_model(args)
    actor, optim, sched = sc.deepspeed_actor(model, temperature=args.temperature, lr=1e-6)
    targs = sc.trainer_args(eps=(0.2, 0.2), entropy_coef=0.01 if args.entropy else None,
                            is_correction=("token", "mask", "ratio", (0.5, 5.0)) if args.correction else
                            ("off", "mask", "ratio", (0.5, 5.0)))
    trainers = {"openrlhf": sc.actor_trainer(actor, optim, sched, targs)}
    adapter.patch()
    trainers["flashrl"] = sc.actor_trainer(actor, optim, sched, targs)
    path = "fused lm_head (linear_token_logprobs)" if adapter.fused_head_of(actor)[0] is not None else \
        f"token_logprobs on the logits ({adapter.fused_head_of(actor)[1]})"
    adapter.unpatch()

    flags = isa_flags()
    header = (f"OpenRLHF {adapter._check_version()} actor step: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab "
              f"{args.vocab} ({'untied' if args.untied else 'tied'}), DeepSpeed ZeRO-2 bf16, "
              f"{'entropy, ' if args.entropy else ''}{'IS mask, ' if args.correction else ''}T={args.temperature}; "
              f"{args.threads} threads; {cpu_name()} [{' '.join(flags)}]; flashrl path: {path}")
    print(header, flush=True)
    rows = []
    for response in args.response:
        exp = sc.random_experience(args.vocab, args.batch, args.prompt, response, seed=response, full=True)
        info = sc.loss_batch_info(exp)
        times = {"openrlhf": [], "flashrl": []}
        mems = {"openrlhf": [], "flashrl": []}
        for i in range(args.repeats + 1):
            for variant in ("openrlhf", "flashrl"):
                (adapter.patch if variant == "flashrl" else adapter.unpatch)()
                with PeakRSS() as peak:
                    t0 = time.perf_counter()
                    trainers[variant].training_step(exp, 0.0, 0, info)
                    dt = time.perf_counter() - t0
                if i:  # the first round warms up (torch.compile of OpenRLHF's entropy, allocator)
                    times[variant].append(dt)
                    mems[variant].append(peak.extra_mb)
                print(f"  response {response}: {variant:8s} step {i}: {dt:7.2f} s, +{peak.extra_mb:7.0f} MB"
                      f"{'  (warm-up)' if not i else ''}", flush=True)
        adapter.unpatch()
        n = args.batch * (args.prompt + response)
        row = {"batch": args.batch, "prompt": args.prompt, "response": response, "tokens": n}
        for v in ("openrlhf", "flashrl"):
            row[v] = {"median_s": statistics.median(times[v]), "times_s": times[v], "peak_extra_mb": max(mems[v])}
        row["speedup"] = row["openrlhf"]["median_s"] / row["flashrl"]["median_s"]
        row["memory_saved_mb"] = row["openrlhf"]["peak_extra_mb"] - row["flashrl"]["peak_extra_mb"]
        rows.append(row)
    print(header)
    print(f"  {'tokens':>14s}  {'OpenRLHF s/step':>15s}  {'flashrl s/step':>14s}  {'speedup':>7s}  "
          f"{'OpenRLHF peak':>13s}  {'flashrl peak':>12s}")
    for r in rows:
        print(f"  {r['batch']} x ({r['prompt']} + {r['response']}){'':>2s}  {r['openrlhf']['median_s']:15.2f}  "
              f"{r['flashrl']['median_s']:14.2f}  {r['speedup']:6.2f}x  {r['openrlhf']['peak_extra_mb']:10.0f} MB  "
              f"{r['flashrl']['peak_extra_mb']:9.0f} MB")
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "cpu": cpu_name(), "isa_flags": flags,
                                               "native": str(fk.native_status()), "rows": rows}, indent=1,
                                              default=str))


if __name__ == "__main__":
    main()
