"""Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1)."""
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_stats
from .logprobs import token_logprobs_backward, token_logprobs_forward

__all__ = [
    "linear_logprobs_backward",
    "linear_logprobs_stats",
    "token_logprobs_backward",
    "token_logprobs_forward",
]
