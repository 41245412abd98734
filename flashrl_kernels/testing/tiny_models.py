"""A tiny Qwen2 causal LM and a character-level tokenizer, built locally.

Tests (the vLLM plugin, the reference trainer) need a real Hugging Face model
directory that vLLM and transformers both load, without a model hub. This
module makes one from a config and a seed:

    from flashrl_kernels.testing import build_tiny_qwen2
    path = build_tiny_qwen2(tmp_path / "tiny", seed=0)      # -> the directory
    llm = vllm.LLM(str(path), ...)                           # or
    model = transformers.AutoModelForCausalLM.from_pretrained(path)

What it writes: config.json, generation_config.json, model.safetensors (in
`dtype`, default bf16) and a PreTrainedTokenizerFast (tokenizer.json,
tokenizer_config.json, special_tokens_map.json).

The tokenizer is character level (a byte-level BPE without merges over
TINY_ALPHABET, the format Qwen2's own tokenizer uses), so
`tok.decode(tok.encode(s)) == s` for every string over the alphabet and token
ids are easy to reason about in tests. Ids: 0 <pad>, 1 <eos> (also bos), 2
<unk>, then the alphabet in order. The model's vocabulary may be larger than
the tokenizer's (`vocab` >= len(alphabet) + 3); the extra rows are ordinary
untrained embeddings, as in real checkpoints whose vocab is padded.

The weights are random (normal, std `init_std`) and deterministic for a given
`seed` and config. Default size: hidden 128, 2 layers, 4 heads / 2 KV heads
(head_dim 32: vLLM's CPU attention has no kernel for head_dim 16),
intermediate 256, vocab 128: about 0.3 M parameters, so a vLLM
engine starts in seconds on a CPU and every linear layer type vLLM uses for
Qwen2 is exercised (QKV with bias, merged gate/up, row-parallel o/down).
"""
from __future__ import annotations

import json
import string
from pathlib import Path

import torch

TINY_ALPHABET = string.ascii_lowercase + string.digits + " .,:;!?+-*/=()'\"\n" + string.ascii_uppercase
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def _byte_level_chars() -> dict[int, str]:
    """GPT-2 / Qwen2 byte -> printable character table (bytes_to_unicode)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def build_char_tokenizer(alphabet: str = TINY_ALPHABET):
    """A PreTrainedTokenizerFast with one token per character of `alphabet`.

    Ids: 0 <pad>, 1 <eos> (bos and eos), 2 <unk>, then `alphabet` in order.
    `alphabet` must be ASCII.

    It is a byte-level BPE with no merges (Qwen2's own tokenizer format), so
    transformers' AutoTokenizer, which always rebuilds a `qwen2` model's
    tokenizer as Qwen2Tokenizer from tokenizer.json's vocab and merges, gets
    exactly the same tokenizer back, and so does vLLM.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = list(dict.fromkeys(alphabet))  # de-duplicated, order kept
    if any(ord(c) > 127 for c in chars):
        raise ValueError("alphabet must be ASCII")
    table = _byte_level_chars()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for ch in chars:
        vocab[table[ord(ch)]] = len(vocab)
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        bos_token="<eos>",
        unk_token="<unk>",
        clean_up_tokenization_spaces=False,
    )


def build_tiny_qwen2(
    path,
    *,
    vocab: int = 128,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate: int = 256,
    max_positions: int = 512,
    tie_word_embeddings: bool = False,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
    init_std: float = 0.1,
    alphabet: str = TINY_ALPHABET,
) -> Path:
    """Write a random tiny Qwen2ForCausalLM and its tokenizer to `path`; return the path.

    `init_std` is larger than the usual 0.02 so that the random model has
    peaked, input-dependent next-token distributions (greedy decoding is then
    not a tie-break lottery and logprob comparisons are meaningful).
    """
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = build_char_tokenizer(alphabet)
    if vocab < len(tok):
        raise ValueError(f"vocab must be at least the tokenizer size {len(tok)}, got {vocab}")
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=init_std,
        rms_norm_eps=1e-6,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        use_sliding_window=False,
    )
    gen = torch.Generator().manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(init_std * torch.randn(p.shape, generator=gen))
    model.to(dtype)
    model.config.dtype = dtype
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    # generation defaults that do not surprise a test: no sampling unless asked
    (path / "generation_config.json").write_text(json.dumps({
        "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "do_sample": False,
    }, indent=1))
    return path
