"""Helpers for tests, examples and benchmarks (no model hub, no downloads)."""
from .tiny_models import TINY_ALPHABET, build_tiny_qwen2, build_char_tokenizer

__all__ = ["TINY_ALPHABET", "build_char_tokenizer", "build_tiny_qwen2"]
