"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .logprobs import token_logprobs
from .policy_loss import policy_loss

__all__ = ["token_logprobs", "policy_loss"]
