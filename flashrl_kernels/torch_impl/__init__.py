"""Chunked PyTorch implementations: the CPU path and the fallback on any device."""
from .logprobs import token_logprobs_backward, token_logprobs_forward
from .policy_loss import policy_loss_backward, policy_loss_forward

__all__ = ["policy_loss_backward", "policy_loss_forward", "token_logprobs_backward", "token_logprobs_forward"]
