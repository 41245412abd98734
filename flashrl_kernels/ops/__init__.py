"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .logprobs import token_logprobs
from .quantize import dequantize_rows, quantize_per_token, quantize_rows, quantize_rows_, scaled_linear

__all__ = [
    "dequantize_rows",
    "quantize_per_token",
    "quantize_rows",
    "quantize_rows_",
    "scaled_linear",
    "token_logprobs",
]
