"""Benchmark cases for the TRL integration (see flashrl_kernels/benchmarks/harness.py).

One GRPO loss step of TRL's GRPOTrainer on a small Qwen2 with a real vocabulary (32768 quick, 151936 full):
`trainer.compute_loss(model, batch)` + backward, i.e. the policy forward, the per-token log-probabilities and
entropy, the loss and the whole backward. Parameter gradients stay allocated between calls (zeroed in place), as
in a training step after the first, so the peak is the step's transient memory. Three implementations:

- "TRL 1.16 fused head" (baseline): GRPOTrainer as installed. TRL 1.16 already avoids the [N, V] logits with its
  own chunked kernel, but on CPU it scores every position (prompt included) in [4096 x 32768] tiles.
- "TRL + flashrl": the same trainer after `flashrl_kernels.integrations.trl.patch()`.
- "TRL logits path": the pre-1.16 path, still importable from TRL: full logits from the model, then TRL's
  `selective_log_softmax` and `entropy_from_logits`.

No cases without trl (pip install 'flashrl_kernels[trl]') or with a TRL version the integration refuses.
"""
from __future__ import annotations

import contextlib
import os

import torch

from flashrl_kernels.benchmarks.harness import Case

OP = "trl_grpo"
IN_DEFAULT_RUN = False  # ~10 minutes on a 2-core CPU at the full size: `flashrl-kernels bench --op trl_grpo`


def sizes(quick: bool):
    """(batch, prompt length, completion length, hidden, vocab)."""
    return (8, 32, 128, 128, 32768) if quick else (8, 64, 256, 512, 151936)


def _supported() -> bool:
    try:
        import trl
        from packaging.version import Version

        from flashrl_kernels.integrations import trl as fk_trl
    except Exception:
        return False
    return Version(trl.__version__).release[:2] == fk_trl.SUPPORTED_TRL


def _trainer(size, device, dtype):
    import trl
    from datasets import Dataset
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from flashrl_kernels.testing import build_char_tokenizer

    batch, _, completion, hidden, vocab = size
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=2 * hidden, max_position_embeddings=1024,
                         tie_word_embeddings=False)
    model = Qwen2ForCausalLM(config).to(device=device, dtype=dtype)
    args = trl.GRPOConfig(
        output_dir=os.path.join(os.environ.get("TMPDIR", "/tmp"), "flashrl_trl_bench"), report_to=[],
        bf16=False, use_cpu=device.type == "cpu", per_device_train_batch_size=batch, num_generations=batch,
        max_completion_length=completion, loss_type="dapo", beta=0.0, use_vllm=False, save_strategy="no")
    trainer = trl.GRPOTrainer(model=model, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                              args=args, train_dataset=Dataset.from_dict({"prompt": ["a"]}),
                              processing_class=build_char_tokenizer())
    trainer.current_gradient_accumulation_steps = 1
    trainer.model.train()
    return trainer


def _batch(size, device):
    batch, prompt, completion, _, vocab = size
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(completion // 2, completion + 1, (batch,), generator=g)
    inputs = {
        "prompt_ids": torch.randint(0, vocab, (batch, prompt), generator=g),
        "prompt_mask": torch.ones(batch, prompt, dtype=torch.long),
        "completion_ids": torch.randint(0, vocab, (batch, completion), generator=g),
        "completion_mask": (torch.arange(completion)[None] < lengths[:, None]).long(),
        "advantages": torch.randn(batch, generator=g),
        "num_items_in_batch": lengths.sum().float(),
        "old_per_token_logps": -torch.rand(batch, completion, generator=g) * 2 - 9.5,
    }
    return {k: v.to(device) for k, v in inputs.items()}


def _logits_path(trainer):
    """The pre-fused-head way: full [B, T, V] logits, TRL's selective_log_softmax and entropy_from_logits."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    def per_token(model, input_ids, attention_mask, logits_to_keep, compute_entropy=False, **_):
        logits = model(input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=logits_to_keep + 1).logits
        logits = logits[:, :-1] / trainer.temperature
        targets = input_ids[:, -logits_to_keep:]
        logp = selective_log_softmax(logits, targets)
        return logp, entropy_from_logits(logits) if compute_entropy else None, None

    return per_token


def _case(size, device, dtype, impl):
    def make():
        from flashrl_kernels.integrations import trl as fk_trl

        trainer = _trainer(size, device, dtype)
        inputs = _batch(size, device)
        if impl == "logits":
            trainer._get_per_token_logps_and_entropies = _logits_path(trainer)

        def step():
            ctx = _patched(fk_trl) if impl == "flashrl" else contextlib.nullcontext()
            with ctx:
                trainer.model.zero_grad(set_to_none=False)
                loss = trainer.compute_loss(trainer.model, inputs)
                loss.backward()
            return loss

        step()  # gradients allocated once, as after the first training step
        return step

    return make


@contextlib.contextmanager
def _patched(fk_trl):
    fk_trl.patch()
    try:
        yield
    finally:
        fk_trl.unpatch()


def cases(quick: bool, device: torch.device) -> list[Case]:
    if not _supported() or device.type not in ("cpu", "cuda"):
        return []
    size = sizes(quick)
    batch, prompt, completion, hidden, vocab = size
    dtype = torch.bfloat16
    label = f"B={batch} prompt={prompt} completion={completion} H={hidden} V={vocab} bf16"
    rows = batch * completion
    flops = 8 * rows * hidden * vocab  # lm_head forward + backward (with recompute), the dominant GEMMs
    return [
        Case(OP, "TRL 1.16 fused head", "fwd+bwd", label, _case(size, device, dtype, "trl"), flops=flops,
             baseline=True),
        Case(OP, "TRL + flashrl", "fwd+bwd", label, _case(size, device, dtype, "flashrl"), flops=flops),
        Case(OP, "TRL logits path", "fwd+bwd", label, _case(size, device, dtype, "logits"), flops=flops),
    ]
