"""float64 reference implementations: readable, slow, the executable spec."""
from .logprobs import token_logprobs_backward, token_logprobs_forward, token_logprobs_spec
from .policy_loss import policy_loss_backward, policy_loss_forward, policy_loss_spec

__all__ = [
    "policy_loss_backward",
    "policy_loss_forward",
    "policy_loss_spec",
    "token_logprobs_backward",
    "token_logprobs_forward",
    "token_logprobs_spec",
]
