"""The trainer's tiny causal LM: Qwen2 architecture from a config, fp32, in memory.

Nothing is downloaded. The tokenizer is the character-level one of
flashrl_kernels.testing (a byte-level BPE without merges, the format
transformers and vLLM rebuild a qwen2 tokenizer as, so it round-trips through
both). Head size 32: vLLM's CPU attention has no kernel below that.
"""
from __future__ import annotations

import dataclasses

from ..testing.tiny_models import build_char_tokenizer

__all__ = ["VLLM_CPU_HEAD_SIZES", "TinyModelConfig", "build_char_tokenizer", "build_tiny_qwen2"]

VLLM_CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 256)


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 128
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 256
    max_positions: int = 64


def build_tiny_qwen2(tokenizer, cfg: TinyModelConfig = TinyModelConfig(), seed: int = 0):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        max_position_embeddings=cfg.max_positions,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)
