"""torch.library op definitions (namespace `flashrl`) and their public wrappers."""
from .gae import GAEOutput, gae
from .linear_logprobs import linear_token_logprobs
from .linear_policy_loss import LINEAR_METRIC_NAMES, linear_policy_loss
from .logprobs import token_logprobs
from .policy_loss import policy_loss
from .quantize import dequantize_rows, quantize_per_token, quantize_rows, quantize_rows_, scaled_linear
from .value_loss import VALUE_METRIC_NAMES, value_loss

__all__ = [
    "LINEAR_METRIC_NAMES",
    "VALUE_METRIC_NAMES",
    "GAEOutput",
    "dequantize_rows",
    "gae",
    "linear_policy_loss",
    "linear_token_logprobs",
    "policy_loss",
    "quantize_per_token",
    "quantize_rows",
    "quantize_rows_",
    "scaled_linear",
    "token_logprobs",
    "value_loss",
]
