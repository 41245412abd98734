"""The trainer-side head ops on a CPU whose bf16 GEMM is slow (AVX2-only x86): what widening to fp32 buys.

Two parts, each in one process with its variants interleaved (a noisy neighbour slows all alike):

1. logprobs: `linear_token_logprobs` (entropy on) forward+backward on the torch and native backends, fp32 inputs,
   bf16 inputs with `FLASHRL_CPU_GEMM_DTYPE=auto` (widened where the probe finds bf16 slow) and bf16 with `input`
   (torch's own bf16 GEMM; slow: --input-reps calls only). The issue 16 target: bf16 (auto) within 1.3x of fp32.
2. policy: `linear_policy_loss` and the unfused paths of `flashrl_kernels.benchmarks.linear_policy_loss` at a
   size where the unfused bf16 baseline still finishes (one call: ~4 min on the Zen 3 VM), beside what a user of
   such a CPU would run instead: the unfused loss in fp32, eager and under torch.compile.

    PYTHONPATH=. python bench/cpu_gemm_dtype.py [--part logprobs,policy] [--repeats 8] [--input-reps 1]
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from unittest import mock

import torch

from flashrl_kernels import _cpu, _cpu_gemm, linear_token_logprobs
from flashrl_kernels._backend import use_backend
from flashrl_kernels.benchmarks import linear_policy_loss as lpl


def logprobs_part(rows: int, hidden: int, vocab: int, repeats: int, input_reps: int) -> None:
    g = torch.Generator().manual_seed(0)
    h32 = torch.randn(rows, hidden, generator=g)
    w32 = torch.randn(vocab, hidden, generator=g) * 0.05
    targets = torch.randint(0, vocab, (rows,), generator=g)

    def call(dtype, backend, mode):
        h, w = h32.to(dtype).requires_grad_(), w32.to(dtype).requires_grad_()
        # the mode is read at every call; restored after it, so the policy part runs on the user's setting
        with mock.patch.dict(os.environ, {_cpu_gemm.ENV: mode}), use_backend(backend):
            t0 = time.perf_counter()
            lp, ent = linear_token_logprobs(h, w, targets, return_entropy=True)
            (lp.sum() + ent.sum()).backward()
            return (time.perf_counter() - t0) * 1e3

    print(f"linear_token_logprobs fwd+bwd, entropy on, N={rows} H={hidden} V={vocab}")
    variants = [(torch.float32, "auto"), (torch.bfloat16, "auto"), (torch.bfloat16, "input")]
    times: dict[tuple, list[float]] = {}
    for rep in range(repeats + 1):  # round 0: warm-up, not kept
        for backend in ("torch", "native"):
            for dtype, mode in variants:
                if mode == "input" and rep > input_reps:
                    continue
                ms = call(dtype, backend, mode)
                if rep:
                    times.setdefault((backend, dtype, mode), []).append(ms)
    for backend in ("torch", "native"):
        fp32 = statistics.median(times[(backend, torch.float32, "auto")])
        for dtype, mode in variants:
            ts = times.get((backend, dtype, mode))
            if ts:
                med = statistics.median(ts)
                print(f"  {backend:6s} {dtype!s:15s} {mode:5s} median {med:9.0f} ms  x fp32 {med / fp32:6.2f}  "
                      f"({len(ts)} calls)")


def policy_part(batch: int, seq: int, hidden: int, vocab: int, repeats: int) -> None:
    print(f"linear_policy_loss fwd+bwd, N={batch * seq} (B={batch} T={seq}) H={hidden} V={vocab}")
    impls = [("flashrl fused[native] bf16", lpl._fused("native"), torch.bfloat16, repeats),
             ("flashrl fused[torch] bf16", lpl._fused("torch"), torch.bfloat16, repeats),
             ("flashrl composed[native] bf16", lpl._composed("native"), torch.bfloat16, repeats),
             ("unfused eager fp32", lpl.unfused_loss, torch.float32, repeats),
             ("unfused torch.compile fp32", lpl.compiled_unfused, torch.float32, repeats),
             ("unfused eager bf16", lpl.unfused_loss, torch.bfloat16, 1)]
    for name, fn, dtype, reps in impls:
        run = lpl._maker(fn, batch, seq, hidden, vocab, dtype, torch.device("cpu"))()
        if reps > 1:
            run()  # warm-up: compile, first-call set-up
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            ts.append((time.perf_counter() - t0) * 1e3)
        print(f"  {name:32s} median {statistics.median(ts):9.0f} ms  {[round(t) for t in ts]}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--part", default="logprobs,policy")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--input-reps", type=int, default=1, help="calls of the slow bf16-input logprobs variant")
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=896)
    ap.add_argument("--vocab", type=int, default=32000, help="logprobs part")
    ap.add_argument("--policy-vocab", type=int, default=151936)
    ap.add_argument("--policy-repeats", type=int, default=3)
    args = ap.parse_args()
    print(f"CPU {_cpu.cpu_name()}; flags {' '.join(_cpu.isa_flags())}; threads {torch.get_num_threads()}; "
          f"bf16 GEMM probe {_cpu_gemm.gemm_slowdown(torch.bfloat16):.1f}x fp32's time", flush=True)
    parts = args.part.split(",")
    if "logprobs" in parts:
        logprobs_part(args.rows, args.hidden, args.vocab, args.repeats, args.input_reps)
    if "policy" in parts:
        policy_part(2, 128, args.hidden, args.policy_vocab, args.policy_repeats)


if __name__ == "__main__":
    main()
