"""float64 reference implementations: readable, slow, the executable spec."""
from .logprobs import token_logprobs_backward, token_logprobs_forward, token_logprobs_spec
from .quantize import dequantize_rows_forward, quantize_rows_forward, quantize_rows_spec, scaled_linear_forward

__all__ = [
    "token_logprobs_spec", "token_logprobs_forward", "token_logprobs_backward",
    "quantize_rows_spec", "quantize_rows_forward", "dequantize_rows_forward", "scaled_linear_forward",
]
