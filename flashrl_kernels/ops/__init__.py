"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .linear_logprobs import linear_token_logprobs
from .logprobs import token_logprobs
from .policy_loss import policy_loss
from .quantize import dequantize_rows, quantize_per_token, quantize_rows, quantize_rows_, scaled_linear

__all__ = [
    "dequantize_rows",
    "linear_token_logprobs",
    "policy_loss",
    "quantize_per_token",
    "quantize_rows",
    "quantize_rows_",
    "scaled_linear",
    "token_logprobs",
]
