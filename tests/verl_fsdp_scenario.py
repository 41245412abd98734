"""One actor update in verl 0.9.1's own FSDP training engine on the CPU, unpatched and patched by flashrl_kernels.

Run by tests/test_verl_fsdp_engine.py in a fresh process (torch.distributed, verl's platform singleton and the
engine registry are process-global):

    python tests/verl_fsdp_scenario.py MODEL_DIR OUT_FILE CASES_JSON

MODEL_DIR holds a tiny fp32 Qwen2 (flashrl_kernels.testing.build_tiny_qwen2); CASES_JSON is a list of
{"loss": "vanilla" | "gspo", "agg": <loss_agg_mode>, "weights": bool (rollout_is_weights in the batch),
"rmpad": bool (use_remove_padding), "optim": "SGD" | "AdamW", "entropy_coeff": float (optional, default 0;
non-zero makes verl compute the entropy and add it to the loss)}. For every case it runs
verl's actor update twice on the same batch from the same checkpoint, once unpatched with verl's loss_mode
(`vanilla` / `gspo`) and once after `flashrl_kernels.patch("verl")` with `flashrl` / `flashrl_gspo`, and
torch.save()s to OUT_FILE, per case and run: verl's metrics, the updated weights and what the step called.

The path is the one `ActorRolloutRefWorker.update_actor` takes in a PPO job (ray_trainer._update_actor ->
TrainingWorker.train_mini_batch -> TrainingWorker.train_batch -> FSDPEngine.train_batch ->
forward_backward_batch -> forward_step -> ppo_loss in verl/workers/utils/losses.py), built the way
ActorRolloutRefWorker.init_model builds its actor (TrainingWorkerConfig from the actor config, loss_fn =
partial(ppo_loss, config=actor_config)), without Ray and without hydra (the venv has no hydra-core, which
init_model needs to instantiate its OmegaConf config): the typed configs are constructed directly.

What verl needs to run on a CPU, set up here (nothing in verl or flashrl_kernels is changed):
- a CPU platform (verl.plugin.platform ships CUDA / NPU / ROCm only; without one it falls back to
  'nvidia' and fails on the first torch.cuda call), registered as "cpu" and selected by VERL_PLATFORM=cpu;
- the FSDP language-model engine registered for device "cpu" (verl registers it for cuda and npu only);
- a gloo process group of world size 1 (an in-memory HashStore, no port), created before TrainingWorker
  calls verl's initialize_global_process_group_ray (verl/utils/distributed.py), whose backend string
  f"cpu:gloo,{device}:{backend}" is "cpu:gloo,cpu:gloo" on a CPU platform, which torch rejects
  ("Duplicate device type cpu");
- fsdp2 (`strategy="fsdp2"`): FSDP1 on the CPU fails in FSDP(..., sync_module_states=True) ("The module has
  CPU parameters or buffers when `sync_module_states=True`, which requires them to be on GPU"), so only
  fsdp2 runs here; the model in fp32 (model_dtype and mixed_precision fp32, so no autocast), attention
  `sdpa` (verl's default flash_attention_2 is not installed on the CPU; with use_remove_padding the packed
  micro-batch goes through sdpa with per-sequence position_ids, which transformers masks per sequence).

Not covered: use_fused_kernels. verl's own FusedLinearForPPO path (impl_backend "torch") fails here before
any comparison: `hidden_states @ vocab_weights.t()` in verl/utils/experimental/torch_functional.py:42 gets the
fsdp2-sharded lm_head weight as a DTensor ("aten.mm.default got mixed torch.Tensor and DTensor").
"""
from __future__ import annotations

import json
import os
import sys
from contextlib import contextmanager
from functools import partial

os.environ["VERL_PLATFORM"] = "cpu"
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
os.environ.setdefault("MASTER_ADDR", "127.0.0.1")  # read by verl's Worker.__init__; the store is in memory
os.environ.setdefault("MASTER_PORT", "0")
os.environ.pop("FLASHRL_PATCH", None)  # the run decides when verl is patched, not the environment
os.environ.setdefault("OMP_NUM_THREADS", "1")  # a tiny model: one thread; two spin badly on a busy 2-core box

import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

B, P, R = 8, 6, 9  # sequences, padded prompt length, padded response length
MINI, MICRO = 4, 2  # ppo_mini_batch_size (2 optimizer steps), ppo_micro_batch_size_per_gpu (2 per step)
# SGD makes the updated weights a linear function of the (clipped) gradients, so comparing them compares the
# gradients; AdamW (verl's default) normalises them (a gradient near its eps moves its weight by up to ~lr).
LR = {"SGD": 0.5, "AdamW": 1e-3}
FLASHRL_LOSS = {"vanilla": "flashrl", "gspo": "flashrl_gspo"}


# ---------------------------------------------------------------------------------------------- CPU platform

class _CPUDeviceModule:
    """torch.cpu plus the few torch.cuda calls verl makes on get_torch_device() (memory stats, seeds)."""

    def __getattr__(self, name):
        return getattr(torch.cpu, name)

    def empty_cache(self):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    manual_seed_all = manual_seed

    def max_memory_allocated(self, *args, **kwargs):
        return 0

    max_memory_reserved = memory_allocated = memory_reserved = max_memory_allocated

    def mem_get_info(self, *args, **kwargs):
        return (0, 0)

    def reset_peak_memory_stats(self, *args, **kwargs):
        pass

    def get_device_name(self, *args, **kwargs):
        return "CPU"  # verl's flops counter: unknown device, promised flops inf


@PlatformRegistry.register(platform="cpu")
class PlatformCPU(PlatformBase):
    device_name = "cpu"
    vendor_name = "cpu"
    device_module = _CPUDeviceModule()

    def is_available(self):
        return True

    def current_device(self):
        return "cpu"  # verl moves batches with .to(get_device_id()): an index would mean cuda:<index>

    def device_count(self):
        return 1

    def set_device(self, device_index):
        pass

    def synchronize(self, device_index=None):
        pass

    def manual_seed(self, seed):
        torch.manual_seed(seed)

    def manual_seed_all(self, seed):
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings):
        pass

    def empty_cache(self):
        pass

    def get_device_capability(self, device_index=0):
        return None, None

    def communication_backend_name(self):
        return "gloo"

    def visible_devices_envvar(self):
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg):
        yield

    def profiler_start(self):
        pass

    def profiler_stop(self):
        pass

    def ray_resource_name(self):
        return "CPU"

    def ray_noset_envvars(self):
        return []

    def is_ipc_supported(self):
        return False

    def cudart(self):
        return None


# ---------------------------------------------------------------------------------------------- verl set-up

def _setup():
    from verl.plugin.platform import get_platform

    torch.set_num_threads(1)

    assert get_platform().device_name == "cpu", get_platform()
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    from verl.workers.engine import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    EngineRegistry.register(model_type="language_model", backend=["fsdp", "fsdp2"], device="cpu")(
        FSDPEngineWithLMHead)
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead


class _Probe:
    """What the step called: the policy-loss function verl's ppo_loss looked up, and flashrl's kernels."""

    def __init__(self):
        from verl.workers.utils import losses

        import flashrl_kernels as fk

        self.loss_fns, self.token_logprobs, self.entropy, self.policy_loss = [], 0, 0, 0
        self._fk, self._losses = fk, losses
        self._orig = (losses.get_policy_loss_fn, fk.token_logprobs, fk.policy_loss)
        get_fn, token_logprobs, policy_loss = self._orig

        def get_policy_loss_fn(name):
            fn = get_fn(name)
            self.loss_fns.append(f"{fn.__module__}.{fn.__qualname__}")
            return fn

        def counted_token_logprobs(*args, **kwargs):
            self.token_logprobs += 1
            self.entropy += bool(kwargs.get("return_entropy", False))
            return token_logprobs(*args, **kwargs)

        def counted_policy_loss(*args, **kwargs):
            self.policy_loss += 1
            return policy_loss(*args, **kwargs)

        losses.get_policy_loss_fn = get_policy_loss_fn
        fk.token_logprobs = counted_token_logprobs  # the adapter imports these from flashrl_kernels per call
        fk.policy_loss = counted_policy_loss

    def close(self):
        self._losses.get_policy_loss_fn, self._fk.token_logprobs, self._fk.policy_loss = self._orig


# ---------------------------------------------------------------------------------------------- the batch

def make_batch(model_dir):
    """A rollout batch as ray_trainer hands it to update_actor: left-padded prompts, right-padded responses,
    old log-probs (the model's own, perturbed: ratios inside, past the clip and past the dual clip), GRPO-like
    per-sequence advantages of both signs, and token-level rollout IS weights."""
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(1234)
    plen = torch.randint(2, P + 1, (B,), generator=g)
    rlen = torch.randint(2, R + 1, (B,), generator=g)
    rlen[0] = R  # one full-length response
    prompts = torch.zeros(B, P, dtype=torch.long)
    responses = torch.zeros(B, R, dtype=torch.long)
    attention_mask = torch.zeros(B, P + R, dtype=torch.long)
    for i in range(B):
        prompts[i, P - plen[i]:] = torch.randint(3, 70, (int(plen[i]),), generator=g)
        responses[i, :rlen[i]] = torch.randint(3, 70, (int(rlen[i]),), generator=g)
        attention_mask[i, P - plen[i]:P + rlen[i]] = 1
    input_ids = torch.cat([prompts, responses], 1)
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    response_mask = attention_mask[:, P:].clone()

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids).logits
    logp = torch.log_softmax(logits[:, P - 1:-1].float(), -1).gather(-1, responses[..., None])[..., 0]
    del model

    advantages = torch.tensor([1.2, -0.8, 0.5, -1.5, 0.9, -0.3, 1.7, -1.1])[:, None].expand(B, R).clone()
    old = logp + 0.35 * torch.randn(B, R, generator=g)  # ratios around 1: some inside, some past the clip
    old[1, 1] = logp[1, 1] - 1.6  # negative advantages with ratio e^1.6 > clip_ratio_c = 3: the dual clip
    old[3, 0] = logp[3, 0] - 2.0
    old[5, 2] = logp[5, 2] + 1.0  # a ratio far below 1 - eps_low
    old[2] += 0.3  # whole sequences shifted: gspo's sequence ratio clips on these
    old[6] -= 0.4
    old = old * response_mask
    advantages = advantages * response_mask
    rollout_is_weights = (0.2 + 1.8 * torch.rand(B, R, generator=g)) * response_mask  # TIS-style, in [0.2, 2]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids,
            "prompts": prompts, "responses": responses, "response_mask": response_mask,
            "old_log_probs": old.float(), "advantages": advantages.float(),
            "rollout_is_weights": rollout_is_weights.float()}


def to_update_actor_input(tensors, with_weights, calculate_entropy):
    """ray_trainer._update_actor's conversion: DataProto -> TensorDict -> no-padding, plus its non-tensor keys."""
    from verl import DataProto
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    tensors = {k: v.clone() for k, v in tensors.items() if with_weights or k != "rollout_is_weights"}
    batch = DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0, "multi_turn": False})
    td = left_right_2_no_padding(batch.to_tensordict())
    tu.assign_non_tensor(td, calculate_entropy=calculate_entropy, distillation_use_topk=False, distillation_only=False,
                         global_batch_size=MINI, mini_batch_size=MINI, epochs=1, seed=42,
                         dataloader_kwargs={"shuffle": False}, compute_loss=True)
    return td


# ---------------------------------------------------------------------------------------------- one run

def actor_config(model_config, loss_mode, agg, rmpad, optim, entropy_coeff):
    from verl.workers.config import FSDPActorConfig, FSDPEngineConfig, FSDPOptimizerConfig, PolicyLossConfig

    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    cfg = FSDPActorConfig(
        strategy="fsdp2", rollout_n=1, ppo_mini_batch_size=MINI, ppo_micro_batch_size_per_gpu=MICRO,
        use_dynamic_bsz=False, clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0,
        loss_agg_mode=agg, entropy_coeff=entropy_coeff, policy_loss=PolicyLossConfig(loss_mode=loss_mode),
        use_torch_compile=False, use_remove_padding=rmpad,
        optim=FSDPOptimizerConfig(optimizer=optim, lr=LR[optim], total_training_steps=10, clip_grad=1.0),
        fsdp_config=FSDPEngineConfig(strategy="fsdp2", model_dtype="fp32", mixed_precision=fp32,
                                     use_torch_compile=False, seed=42),
    )
    cfg.model_config = model_config
    return cfg


def _flat_weights(engine):
    """Every weight, gathered by verl's own export for the rollout sync (get_per_tensor_param), as one vector."""
    params = dict(engine.get_per_tensor_param()[0])
    assert all(p.dtype == torch.float32 for p in params.values())
    return torch.cat([params[k].detach().reshape(-1) for k in sorted(params)]).clone()


def make_worker(model_dir, case, patched):
    """ActorRolloutRefWorker.init_model's actor part: (TrainingWorker, actor config, loss mode, whether the
    engine module sees the patched logprobs_from_logits). Also used by bench/verl_actor_step.py."""
    from verl.workers.config import HFModelConfig, TrainingWorkerConfig
    from verl.workers.engine.fsdp import transformer_impl
    from verl.workers.engine_workers import TrainingWorker
    from verl.workers.utils.losses import ppo_loss

    import flashrl_kernels as fk
    from flashrl_kernels.integrations import verl as adapter

    if patched:
        fk.patch("verl")
    else:
        fk.unpatch("verl")
    assert adapter.is_patched() == patched
    patched_logprobs = transformer_impl.logprobs_from_logits is adapter.logprobs_from_logits
    assert patched_logprobs == patched
    loss_mode = FLASHRL_LOSS[case["loss"]] if patched else case["loss"]

    rmpad = case["rmpad"]
    model_config = HFModelConfig(path=model_dir, use_remove_padding=rmpad, enable_gradient_checkpointing=False,
                                 override_config={"attn_implementation": "sdpa"})
    cfg = actor_config(model_config, loss_mode, case["agg"], rmpad, case.get("optim", "SGD"),
                       case.get("entropy_coeff", 0.0))
    worker_config = TrainingWorkerConfig(model_type="language_model", model_config=model_config,
                                         engine_config=cfg.engine, optimizer_config=cfg.optim,
                                         checkpoint_config=cfg.checkpoint)
    # init_model's engine settings for the actor
    worker_config.engine_config.use_dynamic_bsz = cfg.use_dynamic_bsz
    worker_config.engine_config.max_token_len_per_gpu = cfg.ppo_max_token_len_per_gpu
    worker_config.engine_config.micro_batch_size_per_gpu = cfg.ppo_micro_batch_size_per_gpu
    worker_config.engine_config.infer_micro_batch_size_per_gpu = MICRO
    worker_config.engine_config.use_remove_padding = rmpad

    torch.manual_seed(0)
    worker = TrainingWorker(config=worker_config)
    worker.reset()
    worker.set_loss_fn(partial(ppo_loss, config=cfg))
    return worker, cfg, loss_mode, patched_logprobs


def run_update(model_dir, tensors, case, patched):
    """ActorRolloutRefWorker.init_model's actor part, then its update_actor (= TrainingWorker.train_mini_batch)."""
    import verl
    from verl.utils import tensordict_utils as tu

    import flashrl_kernels as fk

    worker, cfg, loss_mode, patched_logprobs = make_worker(model_dir, case, patched)
    engine = worker.engine
    assert type(engine).__name__ == "FSDPEngineWithLMHead"
    from verl.utils.fsdp_utils import fsdp_version

    assert fsdp_version(engine.module) == 2
    initial = _flat_weights(engine)

    probe = _Probe()
    try:
        # ray_trainer._update_actor: calculate_entropy = actor.calculate_entropy or entropy_coeff != 0
        td = to_update_actor_input(tensors, case["weights"], cfg.calculate_entropy or cfg.entropy_coeff != 0)
        out = worker.train_mini_batch(td)
    finally:
        probe.close()
    # verl's metrics, less the timing / memory ones (perf/*, mfu); per mini-batch (= optimizer step)
    metrics = {k: [float(x) for x in (v if isinstance(v, list) else [v])]
               for k, v in tu.get(out, "metrics").items() if not k.startswith("perf/") and k != "mfu"}
    final = _flat_weights(engine)
    entropy_fn = engine.compute_entropy_from_logits  # bound at FSDPEngine.__init__ (the rmpad path's entropy)
    del worker, engine
    fk.unpatch("verl")
    return {"metrics": metrics, "initial": initial, "final": final, "loss_mode": loss_mode,
            "loss_fns": probe.loss_fns, "token_logprobs_calls": probe.token_logprobs,
            "entropy_calls": probe.entropy, "policy_loss_calls": probe.policy_loss,
            "patched_logprobs": patched_logprobs, "entropy_fn": f"{entropy_fn.__module__}.{entropy_fn.__qualname__}",
            "verl_version": verl.__version__}


def main(model_dir, out_file, cases_json):
    _setup()
    cases = json.loads(cases_json)
    tensors = make_batch(model_dir)
    results = []
    for case in cases:
        results.append({"case": case, "verl": run_update(model_dir, tensors, case, patched=False),
                        "flashrl": run_update(model_dir, tensors, case, patched=True)})
    torch.save({"results": results, "batch": tensors, "micro_batches": (B // MINI) * (MINI // MICRO)}, out_file)


if __name__ == "__main__":
    main(*sys.argv[1:4])
