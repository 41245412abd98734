"""The README's `## Use` example runs as written, with a tiny model and made-up rollout data in place of the user's,
so that the names, arguments and results it documents stay the code's."""
import importlib
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parents[1] / "README.md"
VLLM_PART = "# INT8 rollout in vLLM"


def _use_example() -> str:
    section = README.read_text(encoding="utf-8").split("\n## Use\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_use_example_runs_on_a_tiny_model():
    transformers = pytest.importorskip("transformers")
    trainer_part = _use_example().split(VLLM_PART)[0]
    vocab, b, t = 301, 8, 13  # a vocabulary that is no multiple of any block
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    mask = torch.ones(b, t - 1, dtype=torch.bool)
    mask[:, :3] = False  # the prompt
    mask[1, 9:] = False  # a response that ended early
    old = torch.randn(b, t - 1) * 0.5 - 6
    ns = {"model": model, "input_ids": torch.randint(0, vocab, (b, t)), "rewards": torch.randint(0, 2, (b,)).float(),
          "old_logp": old, "rollout_logp": old + 0.05 * torch.randn(b, t - 1), "response_mask": mask,
          "token_rewards": torch.randn(b, t - 1), "values": torch.randn(b, t - 1, requires_grad=True)}
    exec(compile(trainer_part, f"{README}: ## Use", "exec"), ns)  # noqa: S102 -- running the docs is the test
    assert ns["logp"].shape == (b, t - 1) and ns["logp"].dtype == torch.float32
    assert torch.isfinite(ns["logp"]).all() and (ns["logp"] <= 0).all()
    assert ns["ent"].shape == (b, t - 1) and (ns["ent"] >= 0).all()
    assert model.lm_head.weight.grad is not None and torch.isfinite(model.lm_head.weight.grad.float()).all()
    assert torch.isfinite(ns["out"].loss) and ns["out"].loss.requires_grad  # linear_policy_loss's result
    assert torch.isfinite(ns["vout"].loss) and ns["values"].grad is None
    ns["vout"].loss.backward()
    assert ns["values"].grad is not None and (ns["values"].grad[~mask] == 0).all()


def test_the_use_examples_vllm_lines_name_what_exists():
    """The vLLM lines need an engine (tests/test_vllm_plugin.py runs one): here, the names they use."""
    pytest.importorskip("vllm")
    from flashrl_kernels.integrations.vllm import SyncResult

    vllm_part = _use_example().split(VLLM_PART)[1]
    imports = re.findall(r"^from (flashrl_kernels[\w.]*) import (\w+)$", vllm_part, re.MULTILINE)
    assert imports
    for module, name in imports:
        assert callable(getattr(importlib.import_module(module), name)), (module, name)
    methods = re.findall(r'quantization="(\w+)"', vllm_part)
    from flashrl_kernels.integrations.vllm import register

    register()
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS

    assert methods and set(methods) <= set(QUANTIZATION_METHODS), methods
    fields = re.findall(r"\bres\.(\w+)", vllm_part)
    assert fields and all(hasattr(SyncResult, f) for f in fields), fields
