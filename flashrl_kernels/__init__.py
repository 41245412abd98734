"""flashrl_kernels: fast, lean kernels for RL training of LLMs."""
__version__ = "0.1.0"

from ._backend import BACKENDS, BackendUnavailableError, selected_backend, use_backend
from ._checks import set_value_checks
from ._native import native_status
from .ops import (
    dequantize_rows,
    linear_token_logprobs,
    quantize_per_token,
    quantize_rows,
    quantize_rows_,
    scaled_linear,
    token_logprobs,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "dequantize_rows",
    "linear_token_logprobs",
    "native_status",
    "quantize_per_token",
    "quantize_rows",
    "quantize_rows_",
    "scaled_linear",
    "selected_backend",
    "set_value_checks",
    "token_logprobs",
    "use_backend",
]
