"""OpenRLHF's vLLM weight sync on flashrl_int8 / flashrl_fp8 engines (run by tests/test_openrlhf_integration.py).

    VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 python tests/openrlhf_vllm_scenario.py

OpenRLHF builds its engines with `worker_extension_cls="openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"` and,
after each training step, calls `update_weight(name, dtype, shape)` on every worker through `collective_rpc`,
once per parameter: WorkerWrap allocates the tensor on CUDA, receives it by NCCL broadcast from the trainer and
calls `model.load_weights(weights=[(name, weight)])`; nothing runs vLLM's process_weights_after_loading after.
Here that very method runs on an in-process CPU engine. Its two CUDA-only steps get CPU stand-ins, in this
process only: `torch.empty(..., device="cuda")` allocates on the CPU, and the broadcast (the `use_ray` branch,
`ray.util.collective.broadcast`) copies the trainer's tensor in. Everything else (the dtype check, the
per-tensor load_weights into flashrl's quantized storage) is OpenRLHF's and flashrl's code.

Checked per engine: every parameter and buffer kept its storage (in place), the engine's state is
byte-equal to a fresh engine built from the new checkpoint, greedy generations and their logprobs are equal, and
the sync changed the rollout. Prints one line `RESULT {json}`.
"""
import json
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import openrlhf_scenario as sc

sc.install_flash_attn_stub()

import torch
import vllm
from _vllm_util import engine_kwargs, generate, perturbed_copy, state_dict_of

from flashrl_kernels.testing import build_tiny_qwen2

WORKER_WRAP = "openrlhf.trainer.ray.vllm_worker_wrap.WorkerWrap"
_incoming: list = []  # the trainer's tensors, in the order update_weight asks for them


def _fake_broadcast(tensor, src_rank=0, group_name="default"):
    tensor.copy_(_incoming.pop(0))


def _cpu_empty(real_empty):
    def empty(*args, **kwargs):
        if str(kwargs.get("device", "")) == "cuda":
            kwargs["device"] = "cpu"
        return real_empty(*args, **kwargs)
    return empty


def _use_ray_group(worker):
    worker = getattr(worker, "worker", worker)  # vLLM hands callables its worker wrapper
    worker._model_update_with_ray = True  # WorkerWrap.init_process_group sets these; its NCCL group cannot exist here
    worker._model_update_group = "openrlhf"


def engine_state(llm):
    def grab(model):  # every parameter and buffer (flashrl's scales and any packed layout among them)
        tensors = dict(model.named_parameters())
        tensors.update(dict(model.named_buffers()))
        return {n: (t.detach().clone(), t.data_ptr()) for n, t in tensors.items()}

    return llm.apply_model(grab)[0]


def same_state(a, b):
    return a.keys() == b.keys() and all(
        a[n][0].dtype == b[n][0].dtype and a[n][0].shape == b[n][0].shape
        and torch.equal(a[n][0].reshape(-1).view(torch.uint8), b[n][0].reshape(-1).view(torch.uint8)) for n in a)


def openrlhf_sync(llm, tensors):
    """What OpenRLHF's broadcast_to_vllm -> LLMRayActor.update_weight does, one parameter at a time."""
    from ray.util import collective

    saved_broadcast, saved_empty = collective.broadcast, torch.empty
    collective.broadcast, torch.empty = _fake_broadcast, _cpu_empty(torch.empty)
    try:
        llm.collective_rpc(_use_ray_group)
        for count, (name, t) in enumerate(tensors, 1):
            _incoming.append(t)
            llm.collective_rpc("update_weight", args=(name, t.dtype, tuple(t.shape), count == len(tensors)))
        assert not _incoming
    finally:
        collective.broadcast, torch.empty = saved_broadcast, saved_empty
    llm.reset_prefix_cache()  # OpenRLHF resets it with prefix caching on


def main():
    root = Path(tempfile.mkdtemp(prefix="openrlhf_vllm_"))
    base = build_tiny_qwen2(root / "base", seed=0)
    new = perturbed_copy(base, root / "perturbed")
    tensors = list(state_dict_of(new).items())
    out = {}
    for quant in ("flashrl_int8", "flashrl_fp8"):
        llm = vllm.LLM(str(base), quantization=quant, worker_extension_cls=WORKER_WRAP, **engine_kwargs())
        before = engine_state(llm)
        ids0, _ = generate(llm)
        openrlhf_sync(llm, tensors)
        after = engine_state(llm)
        ids, lps = generate(llm)
        del llm
        fresh = vllm.LLM(str(new), quantization=quant, **engine_kwargs())
        ids_f, lps_f = generate(fresh)
        quantized = [n for n, (t, _) in after.items() if t.dtype in (torch.int8, torch.float8_e4m3fn)]
        out[quant] = {
            "n_tensors": len(tensors), "quantized_params": len(quantized),
            "in_place": {n: p for n, (_, p) in before.items()} == {n: p for n, (_, p) in after.items()},
            "state_equal": same_state(after, engine_state(fresh)),
            "generate_equal": ids == ids_f and lps == lps_f, "changed": ids != ids0,
        }
        del fresh
    print("RESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
