"""A tiny causal LM (Qwen2 architecture from a config) and a character-level tokenizer.

Nothing is downloaded: the tokenizer is built with the `tokenizers` package
from the task's alphabet, the model from a `Qwen2Config`. Both save with
`save_pretrained`, so vLLM and transformers load them from a local folder.
"""
from __future__ import annotations

import dataclasses

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


def build_char_tokenizer(alphabet: str):
    """A PreTrainedTokenizerFast with one token per character of `alphabet` plus pad/bos/eos."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(alphabet)))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=PAD))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, vocab[BOS])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, padding_side="left",
        model_max_length=64,
    )


@dataclasses.dataclass(frozen=True)
class TinyModelConfig:
    hidden_size: int = 96
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
