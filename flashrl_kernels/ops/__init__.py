"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .logprobs import token_logprobs
from .quantize import dequantize_rows, quantize_per_token, quantize_rows, quantize_rows_, scaled_linear

__all__ = [
    "token_logprobs",
    "quantize_rows", "quantize_rows_", "quantize_per_token", "dequantize_rows", "scaled_linear",
]
