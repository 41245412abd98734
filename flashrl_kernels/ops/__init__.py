"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .logprobs import token_logprobs

__all__ = ["token_logprobs"]
