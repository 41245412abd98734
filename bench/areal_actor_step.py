"""One AReaL actor loss step on packed logits, unpatched vs `flashrl_kernels.patch("areal")`: time and peak memory.

    python bench/areal_actor_step.py                          # defaults below; runs in the AReaL environment
    python bench/areal_actor_step.py --vocab 151936 --seqs 8 --prompt 64 --response 448 --repeats 5

Runs in the AReaL environment (tests/requirements-areal.txt + areal 1.0.4; docs/integrations/areal.md). The step
is AReaL's own code from the logits on: `FSDPEngine._compute_logprobs_and_loss` (AReaL 1.0.4, called on an
FSDPEngine whose only state is what that method reads: its config, no tree training, tensor and sequence
parallel size 1) with `loss_fn = areal.trainer.ppo.actor.grpo_loss_fn` (decoupled PPO, clip 0.2 / 0.28, dual clip
3, token-level rejection sampling), then `loss.backward()` into the logits. That is: `gather_logprobs_entropy` on
the packed `[total_tokens, V]` logits, the vocab-wide min / max of the logits, `ppo_actor_loss_fn`, AReaL's
statistics, the backward of all of it. The logits are a leaf tensor (bf16 by default, as an FSDP actor in bf16
produces them) standing in for the LM head's output: the model itself is the same in both variants and left out.

Time: median of --repeats steps per variant after one warm-up step each, the variants interleaved step by step
in one process (patch() / unpatch() between steps), alternating which goes first. Peak memory: the peak resident
memory above the level before the step (inputs built, one warm-up step done), each variant in its own process;
it includes the logits' gradient (N x V in the logits' dtype), which both variants produce.
Prints the CPU model and ISA flags with the numbers.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import time
import types
import warnings


def build(args):
    """(run_step, n_tokens): AReaL's packed micro-batch and its loss step on random logits."""
    import torch
    from areal.api.cli_args import PPOActorConfig, RejectionSamplingConfig
    from areal.engine.fsdp_engine import FSDPEngine, FSDPTrainContext
    from areal.trainer.ppo import actor

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    lengths = torch.full((args.seqs,), args.prompt + args.response)
    lengths -= torch.randint(0, args.response // 2 + 1, (args.seqs,), generator=g)  # responses of different lengths
    n = int(lengths.sum())
    cu = torch.cat([torch.zeros(1, dtype=torch.int32), lengths.cumsum(0).to(torch.int32)])
    pos = torch.arange(n) - torch.repeat_interleave(cu[:-1].long(), lengths)
    seq_end = torch.repeat_interleave(lengths, lengths)
    loss_mask = (pos >= args.prompt) & (pos < seq_end - 1)  # response tokens (AReaL rolls the mask by one)
    input_ids = torch.randint(0, args.vocab, (1, n), generator=g)
    prox = -torch.rand(n, generator=g) * 4
    mb_input = {
        "input_ids": input_ids, "cu_seqlens": cu, "loss_mask": loss_mask,
        "logprobs": prox + 0.3 * torch.randn(n, generator=g),  # behaviour (inference engine)
        "prox_logp": prox, "advantages": torch.randn(n, generator=g),
    }
    ctx = FSDPTrainContext(model_inputs={"input_ids": input_ids}, mb_input=mb_input)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = PPOActorConfig(experiment_name="bench", trial_name="bench", path="unused", temperature=1.0,
                             use_decoupled_loss=True)
    engine = FSDPEngine.__new__(FSDPEngine)  # only what _compute_logprobs_and_loss reads
    engine.config = cfg
    engine.enable_tree_training = False
    engine.parallel_helper = types.SimpleNamespace(tp_size=1, sp_size=1, tp_group=None)
    loss_fn = functools.partial(
        actor.grpo_loss_fn, eps_clip=0.2, eps_clip_higher=0.28, c_clip=3.0,
        rejection_sampling=RejectionSamplingConfig(level="token", action="mask", metric="ratio", upper=5.0),
        use_decoupled_loss=True)
    weight_fn = lambda x: x["loss_mask"].count_nonzero()
    dtype = getattr(torch, args.dtype)
    logits = (torch.randn(n, args.vocab, generator=g) * 2).to(dtype).requires_grad_(True)

    def step():
        loss = engine._compute_logprobs_and_loss(logits, ctx, loss_fn, weight_fn, weight_fn(mb_input))
        loss.backward()
        logits.grad = None  # an optimizer step would consume it; the peak below counts it while it lives
        return float(loss.detach())

    return step, n


def setup(args):
    import torch
    from areal.utils import stats_tracker

    torch.set_num_threads(args.threads)
    step, n = build(args)

    def run():
        out = step()
        stats_tracker.export_all(reset=True)  # AReaL exports once per step; keeps the tracker from growing
        return out

    return run, n


def child(args):
    """Peak extra memory of one step of one variant (own process, after a warm-up step)."""
    from flashrl_kernels.benchmarks.harness import cpu_peak_extra_mb
    from flashrl_kernels.integrations import areal as adapter

    if args.child == "flashrl":
        adapter.patch()
    run, _ = setup(args)
    run()
    peak = cpu_peak_extra_mb(run)
    print(json.dumps({"peak_mb": peak, "calls": adapter.call_counts()}))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--response", type=int, default=192)
    ap.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--child", choices=("areal", "flashrl"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return child(args)

    import torch

    from flashrl_kernels._cpu import cpu_name, isa_flags
    from flashrl_kernels.integrations import areal as adapter

    peaks = {}
    for variant in ("areal", "flashrl"):
        cmd = [sys.executable, __file__, "--child", variant] + [
            f"--{k}={v}" for k, v in vars(args).items() if k != "child"]
        r = subprocess.run(cmd, check=False, capture_output=True, text=True,
                           env={**os.environ, "OMP_NUM_THREADS": str(args.threads), "FLASHRL_PATCH": ""})
        if r.returncode:
            print(r.stdout[-2000:], r.stderr[-4000:])
            raise SystemExit(f"{variant} memory run failed")
        peaks[variant] = json.loads(r.stdout.strip().splitlines()[-1])
    assert peaks["flashrl"]["calls"].get("ppo_actor_loss_fn") and not peaks["areal"]["calls"]

    run, n = setup(args)
    times = {"areal": [], "flashrl": []}
    losses = {}
    for i in range(args.repeats + 1):
        order = ("areal", "flashrl") if i % 2 == 0 else ("flashrl", "areal")
        for variant in order:
            (adapter.patch if variant == "flashrl" else adapter.unpatch)()
            t0 = time.perf_counter()
            losses[variant] = run()
            if i:  # the first round warms up (torch.compile of AReaL's gather, native kernels, allocator)
                times[variant].append(time.perf_counter() - t0)
    adapter.unpatch()
    assert abs(losses["flashrl"] - losses["areal"]) <= 1e-3 * max(1.0, abs(losses["areal"])), losses
    n_resp = args.seqs * args.response
    print(f"AReaL actor loss step (FSDPEngine._compute_logprobs_and_loss + grpo_loss_fn + backward), packed logits "
          f"[{n}, {args.vocab}] {args.dtype} ({args.seqs} seqs x <= {args.prompt} + {args.response} tokens, "
          f"~{n_resp * 3 // 4} response tokens), token-level rejection sampling; torch {torch.__version__}, "
          f"{args.threads} threads")
    print(f"CPU: {cpu_name()}; flags: {' '.join(isa_flags()) or 'none of ' + 'avx2/avx512/amx'}")
    base = statistics.median(times["areal"])
    for variant in ("areal", "flashrl"):
        med = statistics.median(times[variant])
        print(f"  {variant:8s} {med:8.3f} s/step  x{base / med:5.2f} vs AReaL  peak extra {peaks[variant]['peak_mb']:8.0f}"
              f" MiB  (steps: {', '.join(f'{t:.3f}' for t in times[variant])})")


if __name__ == "__main__":
    main()
