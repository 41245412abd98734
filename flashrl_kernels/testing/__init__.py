"""Helpers for tests, examples and benchmarks (no model hub, no downloads)."""
from .tiny_models import TINY_ALPHABET, build_char_tokenizer, build_tiny_qwen2

__all__ = ["TINY_ALPHABET", "build_char_tokenizer", "build_tiny_qwen2"]
