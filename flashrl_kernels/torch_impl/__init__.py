"""Chunked PyTorch implementations: the CPU path and the fallback on any device."""
from .logprobs import token_logprobs_backward, token_logprobs_forward

__all__ = ["token_logprobs_backward", "token_logprobs_forward"]
