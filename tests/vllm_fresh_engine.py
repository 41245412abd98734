"""One flashrl engine started in a fresh process, as a user's script starts it, for test_vllm_fresh_process.py.

    python tests/vllm_fresh_engine.py QUANT {inproc|mp} CKPT OUT_JSON

Nothing here runs a torch matmul before the engine's first forward (on AMX CPUs a oneDNN matmul would ask Linux
for the AMX tile state as a side effect and hide a missing request: issue 23, SIGILL in vLLM's CPU attention).
Writes what it saw to OUT_JSON: the generated token counts and, per process that ran the model, whether AMX
instructions were permitted there.
"""
import json
import os
import sys
from pathlib import Path


def main():
    quant, mode, ckpt, dst = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if mode == "inproc" else "1"
    from flashrl_kernels import _cpu

    before = _cpu.amx_permitted()
    import vllm

    llm = vllm.LLM(ckpt, quantization=quant, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                   max_num_seqs=4, kv_cache_memory_bytes=32 << 20, seed=0)
    outs = llm.generate(["hello world", "12+3="], vllm.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                        use_tqdm=False)
    # sampled decoding too (greedy batches skip the sampler's draw), seeded: the same seed gives the same tokens
    sampled = [[list(o.outputs[0].token_ids) for o in llm.generate(
        ["hello world", "12+3="], vllm.SamplingParams(max_tokens=8, temperature=1.0, seed=7, ignore_eos=True),
        use_tqdm=False)] for _ in range(2)]
    sys.path.insert(0, str(Path(__file__).parent))
    from _vllm_util import amx_state, sampler_state

    result = {"tokens": [len(o.outputs[0].token_ids) for o in outs], "has_amx": _cpu.has_amx(),
              "sampled": sampled, "flashrl_sampler": llm.collective_rpc(sampler_state),
              "amx_before": before, "amx_driver": _cpu.amx_permitted(),
              # the process(es) that ran the forward: this one in-process, the engine's worker otherwise
              "amx_workers": llm.apply_model(amx_state)}
    if mode != "inproc":
        llm.llm_engine.engine_core.shutdown()
    Path(dst).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
