"""Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1)."""
from .logprobs import token_logprobs_backward, token_logprobs_forward

__all__ = ["token_logprobs_backward", "token_logprobs_forward"]
