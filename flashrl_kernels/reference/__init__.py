"""float64 reference implementations: readable, slow, the executable spec."""
from .logprobs import token_logprobs_backward, token_logprobs_forward, token_logprobs_spec

__all__ = ["token_logprobs_backward", "token_logprobs_forward", "token_logprobs_spec"]
