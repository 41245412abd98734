"""Scaffolding shared by tests/test_openrlhf_integration.py, tests/openrlhf_ray_scenario.py and
bench/openrlhf_actor_step.py: OpenRLHF 0.11.2's own objects, set up on a CPU.

What runs is OpenRLHF's code: its `Actor` (a Hugging Face model loaded by `Actor.__init__`), its
`ActorPPOTrainer.__init__` and `training_step`, its `get_loss_batch_info`, `get_train_ds_config` and the
`DeepspeedStrategy.backward` / `optimizer_step` / `get_grad_norm` methods on a real DeepSpeed engine
(ZeRO-2, bf16, world size 1 on gloo). What this module replaces, and why:

- flash_attn: `openrlhf.models.ring_attn_utils` imports `flash_attn.bert_padding` and `flash_attn.utils.distributed`
  at module top, and flash-attn cannot be installed without CUDA. `install_flash_attn_stub()` puts a stub package
  on the path that covers those imports only: every function in it raises. They serve OpenRLHF's packing /
  ring-attention mode, which no test here runs (`packing_samples=False`); OpenRLHF's `log_probs_from_logits`
  imports `flash_attn.ops.triton.cross_entropy` in a try block, which the stub does not provide, so OpenRLHF
  takes its own torch fallback there, as on any machine without flash-attn.
- `ActorPPOTrainer.__init__` makes a replay buffer on `cuda:current_device` and ends with a barrier plus
  `torch.cuda.synchronize()`: both names are swapped for no-ops while it runs (`actor_trainer`). Neither takes
  part in a training step.
- DeepSpeed's shared-memory all-reduce op (a C++ extension built at first use, ~4 minutes on 2 cores) is
  switched off: with one rank there is nothing to all-reduce.
- the strategy object is a namespace holding OpenRLHF's `DeepspeedStrategy` methods (they use nothing of the
  strategy but their arguments) instead of a `DeepspeedStrategy`, whose setup needs CUDA.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch

_STUB_FILES = {
    "flash_attn/__init__.py": '"""Import stub (flashrl_kernels tests): flash-attn cannot be installed without CUDA."""\n',
    "flash_attn/bert_padding.py": (
        '"""Import stub: every function raises. See tests/openrlhf_scenario.py."""\n\n\n'
        "def _stub(*args, **kwargs):\n"
        '    raise RuntimeError("flash_attn is an import stub in the flashrl_kernels OpenRLHF tests: '
        'packing / ring attention cannot run here")\n\n\n'
        "index_first_axis = pad_input = rearrange = unpad_input = _stub\n"
    ),
    "flash_attn/utils/__init__.py": "",
    "flash_attn/utils/distributed.py": (
        "def all_gather(*args, **kwargs):\n"
        '    raise RuntimeError("flash_attn is an import stub in the flashrl_kernels OpenRLHF tests")\n'
    ),
}


def install_flash_attn_stub() -> str | None:
    """Make `import flash_attn.bert_padding` work (see the module docstring): a stub package on sys.path and on
    PYTHONPATH (for subprocesses and Ray workers). Nothing when a real flash_attn is importable. Returns the
    directory added, or None."""
    root = Path(tempfile.gettempdir()) / "flashrl_openrlhf_flash_attn_stub"
    spec = importlib.util.find_spec("flash_attn")
    if spec is not None and not str(spec.origin or "").startswith(str(root)):
        return None  # a real flash_attn
    for rel, text in _STUB_FILES.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        if not f.exists() or f.read_text() != text:
            f.write_text(text)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
        importlib.invalidate_caches()
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([str(root), *paths])
    return str(root)


def tiny_actor(path, temperature: float = 1.0, dtype: torch.dtype = torch.bfloat16):
    """OpenRLHF's Actor, loaded by its own __init__ from a local checkpoint (eager attention: no flash-attn)."""
    from openrlhf.models import Actor

    actor = Actor(str(path), attn_implementation="eager", param_dtype="bf16", packing_samples=False,
                  temperature=temperature)
    return actor.to(dtype)


def init_distributed() -> None:
    """A one-rank gloo process group (DeepSpeed and get_loss_batch_info need one); once per process."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    for k, v in {"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    dist.init_process_group("gloo", rank=0, world_size=1)


def deepspeed_actor(path, temperature: float = 1.0, lr: float = 1e-3, max_norm: float = 1.0, sgd: bool = False):
    """OpenRLHF's Actor whose model is a DeepSpeed engine built from OpenRLHF's `get_train_ds_config` (ZeRO-2,
    bf16), with torch's AdamW (DeepSpeed's fused Adam needs CUDA; `sgd`: plain SGD, whose update is the gradient
    itself, for comparing two runs' weights) and a constant LR: (actor, optimizer, scheduler), as
    `DeepspeedStrategy.prepare` returns them."""
    import deepspeed
    from openrlhf.utils.deepspeed.deepspeed_utils import get_train_ds_config

    init_distributed()
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # see the module docstring
    actor = tiny_actor(path, temperature)
    config = get_train_ds_config(offload=False, adam_offload=False, stage=2, param_dtype="bf16", max_norm=max_norm)
    config.update(train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    params = [p for p in actor.model.parameters() if p.requires_grad]
    client = None
    if sgd:
        client = torch.optim.SGD(params, lr=lr)
        config["zero_allow_untested_optimizer"] = True
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                           "weight_decay": 0.0, "torch_adam": True}}
    engine, optim, _, sched = deepspeed.initialize(
        model=actor.model, optimizer=client, model_parameters=params, config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0), dist_init_required=False)
    actor.model = engine
    return actor, optim, sched


def strategy(args):
    """What ActorPPOTrainer uses of a DeepspeedStrategy, as OpenRLHF's own methods (see the module docstring)."""
    from openrlhf.utils.deepspeed import DeepspeedStrategy as S

    return SimpleNamespace(
        args=args, ring_attn_group=None, accumulated_gradient=1, print=print,
        backward=lambda loss, model, optimizer, **kw: S.backward(None, loss, model, optimizer, **kw),
        optimizer_step=lambda optimizer, model, scheduler, name="model", **kw: S.optimizer_step(
            None, optimizer, model, scheduler, name, **kw),
        get_grad_norm=lambda model: S.get_grad_norm(None, model),
    )


def trainer_args(*, eps=(0.2, 0.28), dual_clip=None, loss_agg_mode="token-mean", policy_loss_type="ppo",
                 entropy_coef=None, is_correction=("off", "mask", "ratio", (0.5, 5.0)), kl_loss=False):
    """The slice of OpenRLHF's train_ppo_ray arguments that ActorPPOTrainer reads."""
    level, mode, gating, threshold = is_correction
    return SimpleNamespace(
        actor=SimpleNamespace(eps_clip_low_high=list(eps), dual_clip=dual_clip, loss_agg_mode=loss_agg_mode,
                              policy_loss_type=policy_loss_type, entropy_coef=entropy_coef, aux_loss_coef=0.0),
        algo=SimpleNamespace(
            advantage=SimpleNamespace(is_correction_level=level, is_correction_mode=mode,
                                      is_correction_gating=gating, is_correction_threshold=list(threshold)),
            kl=SimpleNamespace(use_loss=kl_loss, init_coef=0.01 if kl_loss else 0.0, estimator="k3",
                               unbiased_gradient=False)),
        train=SimpleNamespace(max_epochs=1, dynamic_batch_enable=False, colocate_all=False, async_enable=False),
        ds=SimpleNamespace(packing_samples=False),
        vllm=SimpleNamespace(sync_backend="gloo"),
    )


def actor_trainer(actor, optimizer, scheduler, args):
    """ActorPPOTrainer built by its own __init__ (its PolicyLoss is whatever `ppo_actor.PolicyLoss` names)."""
    from openrlhf.trainer.ray import ppo_actor

    @contextlib.contextmanager
    def cpu_init():
        saved = ppo_actor.NaiveReplayBuffer, ppo_actor.torch_dist_barrier_and_cuda_sync
        ppo_actor.NaiveReplayBuffer = lambda *a, **k: None            # allocates on cuda:current_device
        ppo_actor.torch_dist_barrier_and_cuda_sync = lambda: None     # torch.cuda.synchronize()
        try:
            yield
        finally:
            ppo_actor.NaiveReplayBuffer, ppo_actor.torch_dist_barrier_and_cuda_sync = saved

    with cpu_init():
        return ppo_actor.ActorPPOTrainer(strategy(args), actor, None, optimizer, scheduler, micro_train_batch_size=1)


def random_experience(vocab: int, batch: int, prompt: int, response: int, seed: int = 0, empty_row: bool = True,
                      full: bool = False):
    """An OpenRLHF Experience as the replay buffer hands it over: left-padded prompts, responses of different
    lengths (one empty when `empty_row`; all `response` long when `full`), old / rollout / reference log-probs near
    each other, token advantages."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(3, vocab, (batch, prompt + response), generator=g)
    attention = torch.ones(batch, prompt + response, dtype=torch.long)
    action_mask = torch.zeros(batch, response, dtype=torch.bool)
    for i in range(batch):
        pad = int(torch.randint(0, max(prompt // 2, 1), (1,), generator=g))
        attention[i, :pad] = 0
        seq[i, :pad] = 0
        n = int(torch.randint(max(response // 2, 1), response + 1, (1,), generator=g))
        if full:
            n = response
        elif empty_row and i == 1:
            n = 0
        action_mask[i, :n] = True
        attention[i, prompt + n:] = 0
        seq[i, prompt + n:] = 0
    old = (-3.0 - torch.rand(batch, response, generator=g)) * action_mask
    adv = torch.randn(batch, response, generator=g) * action_mask
    return Experience(
        sequences=seq, attention_mask=attention, action_mask=action_mask, action_log_probs=old,
        rollout_log_probs=(old + 0.2 * torch.randn(batch, response, generator=g)) * action_mask,
        base_action_log_probs=(old + 0.1 * torch.randn(batch, response, generator=g)) * action_mask,
        advantages=adv, info={})


def loss_batch_info(experience, args=None):
    """OpenRLHF's get_loss_batch_info for this micro-batch (global counts over the one-rank group)."""
    from openrlhf.utils.loss_utils import get_loss_batch_info

    init_distributed()
    return get_loss_batch_info(strategy(args), experience.action_mask)
