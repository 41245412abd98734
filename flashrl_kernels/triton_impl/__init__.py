"""Triton kernels (GPU; CPU tensors under TRITON_INTERPRET=1)."""
from .gae import gae_forward
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_stats
from .linear_policy_loss import linear_policy_loss_forward
from .logprobs import token_logprobs_backward, token_logprobs_forward
from .policy_loss import policy_loss_backward, policy_loss_forward
from .quantize import dequantize_rows_forward, quantize_rows_forward, scaled_linear_forward
from .value_loss import value_loss_backward, value_loss_forward

__all__ = [
    "dequantize_rows_forward",
    "gae_forward",
    "linear_logprobs_backward",
    "linear_logprobs_stats",
    "linear_policy_loss_forward",
    "policy_loss_backward",
    "policy_loss_forward",
    "quantize_rows_forward",
    "scaled_linear_forward",
    "token_logprobs_backward",
    "token_logprobs_forward",
    "value_loss_backward",
    "value_loss_forward",
]
