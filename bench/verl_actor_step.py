"""One verl actor update step, unpatched vs flashrl-patched: time and peak memory (verl's own FSDP engine).

    python bench/verl_actor_step.py                       # defaults below; runs in the verl virtual environment
    python bench/verl_actor_step.py --vocab 151936 --response 512 --loss gspo --agg seq-mean-token-mean

Runs in the verl environment (tests/requirements-verl.txt + verl 0.9.1; see docs/integrations/verl.md). The
engine is set up as in tests/verl_fsdp_scenario.py (fsdp2, world size 1, gloo, CPU platform registered by the
test helper): a random Qwen2 of the given size (fp32), a batch of --batch sequences with --prompt prompt and
--response response tokens, one mini-batch of --micro micro-batches per update. Each variant runs in its own
process (peak RSS is the process's, model and optimizer included: the difference between the two is the loss
path); times are the median of --repeats update steps after one warm-up step. Patched = flashrl's
logprobs_from_logits / entropy / policy loss (`flashrl` for vanilla, `flashrl_gspo` for gspo).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(args):
    sys.path.insert(0, str(ROOT / "tests"))
    import torch
    import verl_fsdp_scenario as sc  # sets the CPU platform environment at import

    torch.set_num_threads(args.threads)
    sc.B, sc.P, sc.R, sc.MINI, sc.MICRO = args.batch, args.prompt, args.response, args.batch, args.batch // args.micro
    sc._setup()
    g = torch.Generator().manual_seed(0)
    b, p, r = args.batch, args.prompt, args.response
    prompts = torch.randint(3, 70, (b, p), generator=g)
    responses = torch.randint(3, 70, (b, r), generator=g)
    attention_mask = torch.ones(b, p + r, dtype=torch.long)
    response_mask = torch.ones(b, r, dtype=torch.long)
    for i in range(b):  # responses of different lengths
        n = r - int(torch.randint(0, r // 2, (1,), generator=g))
        response_mask[i, n:] = 0
        attention_mask[i, p + n:] = 0
    tensors = {
        "input_ids": torch.cat([prompts, responses], 1), "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0), "prompts": prompts, "responses": responses,
        "response_mask": response_mask,
        "old_log_probs": (-3 - torch.rand(b, r, generator=g)) * response_mask,
        "advantages": torch.randn(b, 1, generator=g).expand(b, r) * response_mask,
        "rollout_is_weights": (0.5 + torch.rand(b, r, generator=g)) * response_mask,
    }
    case = {"loss": args.loss, "agg": args.agg, "weights": True, "rmpad": True, "optim": "AdamW"}
    worker, cfg, _, _ = sc.make_worker(args.model, case, patched=args.child == "flashrl")
    times = []
    for i in range(args.repeats + 1):
        td = sc.to_update_actor_input(tensors, True, cfg.calculate_entropy or cfg.entropy_coeff != 0)
        t0 = time.perf_counter()
        worker.train_mini_batch(td)
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "peak_rss_mb": rss_mb}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per update")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--response", type=int, default=256)
    ap.add_argument("--loss", choices=("vanilla", "gspo"), default="vanilla")
    ap.add_argument("--agg", default="token-mean")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=os.environ.get("FLASHRL_BENCH_CACHE", "/tmp/flashrl_verl_bench"))
    ap.add_argument("--child", choices=("verl", "flashrl"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    from flashrl_kernels.testing import build_tiny_qwen2

    model = Path(args.cache_dir) / f"qwen2-h{args.hidden}-l{args.layers}-v{args.vocab}"
    if not (model / "model.safetensors").exists():
        build_tiny_qwen2(model, vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=4, kv_heads=2,
                         intermediate=4 * args.hidden, max_positions=max(512, args.prompt + args.response),
                         dtype=__import__("torch").float32, init_std=0.02)
    results = {}
    for variant in ("verl", "flashrl"):
        cmd = [sys.executable, __file__, "--child", variant, "--model", str(model)] + [
            f"--{k}={v}" for k, v in vars(args).items() if k not in ("child", "model", "cache_dir")]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS":
                                                                                 str(args.threads)})
        if r.returncode:
            print(r.stdout[-2000:], r.stderr[-4000:])
            raise SystemExit(f"{variant} run failed")
        results[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    from flashrl_kernels._cpu import isa_flags

    flags = isa_flags()
    print(f"verl actor update step: Qwen2 hidden {args.hidden}, {args.layers} layers, vocab {args.vocab}; "
          f"{args.batch} x ({args.prompt} + {args.response}) tokens, {args.micro} micro-batches; loss {args.loss}, "
          f"{args.agg}; {args.threads} threads; {platform.processor() or platform.machine()} {' '.join(flags)}")
    base = statistics.median(results["verl"]["times"])
    for variant, res in results.items():
        med = statistics.median(res["times"])
        print(f"  {variant:8s} {med:8.3f} s/step  x{base / med:5.2f} vs verl  peak RSS {res['peak_rss_mb']:7.0f} MB"
              f"  (steps: {', '.join(f'{t:.3f}' for t in res['times'])})")


if __name__ == "__main__":
    main()
