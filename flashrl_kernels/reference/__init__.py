"""float64 reference implementations: readable, slow, the executable spec."""
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_stats, linear_token_logprobs_spec
from .logprobs import token_logprobs_backward, token_logprobs_forward, token_logprobs_spec

__all__ = [
    "linear_logprobs_backward",
    "linear_logprobs_stats",
    "linear_token_logprobs_spec",
    "token_logprobs_backward",
    "token_logprobs_forward",
    "token_logprobs_spec",
]
