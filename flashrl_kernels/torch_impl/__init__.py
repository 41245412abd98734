"""Chunked PyTorch implementations: the CPU path and the fallback on any device."""
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_stats
from .logprobs import token_logprobs_backward, token_logprobs_forward

__all__ = [
    "linear_logprobs_backward",
    "linear_logprobs_stats",
    "token_logprobs_backward",
    "token_logprobs_forward",
]
