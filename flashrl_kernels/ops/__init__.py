"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .linear_logprobs import linear_token_logprobs
from .logprobs import token_logprobs

__all__ = ["linear_token_logprobs", "token_logprobs"]
