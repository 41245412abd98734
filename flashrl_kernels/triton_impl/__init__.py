"""Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1)."""
from .logprobs import token_logprobs_backward, token_logprobs_forward
from .policy_loss import policy_loss_backward, policy_loss_forward

__all__ = ["policy_loss_backward", "policy_loss_forward", "token_logprobs_backward", "token_logprobs_forward"]
