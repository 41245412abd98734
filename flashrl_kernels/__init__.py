"""flashrl_kernels: fast, lean kernels for RL training of LLMs."""
__version__ = "0.1.0"

from ._backend import BACKENDS, BackendUnavailableError, selected_backend, use_backend
from ._checks import set_value_checks
from .ops import linear_token_logprobs, token_logprobs

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "linear_token_logprobs",
    "selected_backend",
    "set_value_checks",
    "token_logprobs",
    "use_backend",
]
