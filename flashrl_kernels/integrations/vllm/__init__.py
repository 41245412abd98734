"""vLLM plugin: INT8 / FP8 rollout weights that a trainer syncs in place.

    # registered automatically in every vLLM process through the
    # `vllm.general_plugins` entry point (flashrl_quant) after `pip install`:
    llm = vllm.LLM(model_dir, quantization="flashrl_int8")      # or "flashrl_fp8"
    ...
    from flashrl_kernels.integrations.vllm import sync_weights
    stats = sync_weights(llm, trainer_model.state_dict().items())   # bf16 / fp32 tensors
    stats.bytes_written, stats.seconds, stats.n_tensors
    stats.changed_share, stats.max_scale_change      # how much of the quantized policy the sync moved

Importing this package does not import vLLM; `register()` does (vLLM calls
it, once per process, when it loads its plugins). See docs/quantized_rollout.md.
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["SyncResult", "load_into_model", "register", "sync_weights", "sync_weights_async"]

_registered = False


class SyncResult(NamedTuple):
    bytes_written: int  # bytes written into the engine's weight storage (quantized rows + scales + others)
    seconds: float  # wall time of the whole sync (validation + quantize-and-write + prefix-cache reset)
    n_tensors: int  # number of trainer tensors written
    # What the sync did to the quantized weights (all ranks; 0 for a bf16 engine). An RL step whose update is
    # below half a quantization step changes no code: the rollout policy then lags the trainer's.
    codes_changed: int = 0  # int8 / fp8 codes whose value this sync changed
    codes_total: int = 0  # int8 / fp8 codes this sync wrote
    # largest relative change of a row scale, |s_new - s_old| / s_old; a zero row has scale 1, so a row that becomes
    # zero gives 1 / s_old - 1 (see docs/quantized_rollout.md)
    max_scale_change: float = 0.0

    @property
    def changed_share(self) -> float | None:
        """codes_changed / codes_total, None when the sync wrote no quantized weight."""
        return self.codes_changed / self.codes_total if self.codes_total else None


def register() -> None:
    """Register the flashrl_int8 / flashrl_fp8 quantization methods with vLLM. Idempotent and cheap.

    It also asks Linux for the AMX tile state on CPUs that have AMX (flashrl_kernels._cpu.request_amx): vLLM's
    CPU attention runs AMX instructions, and in a flashrl engine no oneDNN matmul asks for them first, so a
    fresh engine process would die with SIGILL at its first forward. vLLM calls this in every process that
    runs the model (in-process engine, engine core, every worker / tensor-parallel rank).
    """
    global _registered
    from flashrl_kernels._cpu import request_amx

    request_amx()  # before the early return: a forked child inherits _registered but asks again (cheap, no-op)
    if _registered:
        return
    from .quant import register_configs
    from .sampler import install as install_sampler
    from .worker import install_worker_methods

    register_configs()
    install_worker_methods()  # sync_weights into multi-process / tensor-parallel engines
    install_sampler()  # the native CPU sampler in flashrl engines (FLASHRL_VLLM_SAMPLER; sampler.py)
    _registered = True


def sync_weights(llm, named_tensors) -> SyncResult:
    """Validate, then quantize and write trainer tensors into a running vLLM engine, in place."""
    from .sync import sync_weights as _sync

    return _sync(llm, named_tensors)


async def sync_weights_async(engine, named_tensors) -> SyncResult:
    """sync_weights for vLLM's AsyncLLM: the same validation and in-place, two-phase write, awaited."""
    from .sync import sync_weights_async as _sync

    return await _sync(engine, named_tensors)


def load_into_model(model, named_tensors, vllm_config=None) -> SyncResult:
    """The worker-side half of sync_weights: validate and write into a vLLM model module."""
    from .sync import load_into_model as _load

    return _load(model, named_tensors, vllm_config)
