"""float64 reference implementations: readable, slow, the executable spec."""
from .gae import gae_forward, gae_spec
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_stats, linear_token_logprobs_spec
from .linear_policy_loss import linear_policy_loss_forward
from .logprobs import token_logprobs_backward, token_logprobs_forward, token_logprobs_spec
from .policy_loss import policy_loss_backward, policy_loss_forward, policy_loss_spec
from .quantize import dequantize_rows_forward, quantize_rows_forward, quantize_rows_spec, scaled_linear_forward
from .sampling import sample_categorical, token_logprob_rank
from .value_loss import value_loss_backward, value_loss_forward, value_loss_spec

__all__ = [
    "dequantize_rows_forward",
    "gae_forward",
    "gae_spec",
    "linear_logprobs_backward",
    "linear_logprobs_stats",
    "linear_policy_loss_forward",
    "linear_token_logprobs_spec",
    "policy_loss_backward",
    "policy_loss_forward",
    "policy_loss_spec",
    "quantize_rows_forward",
    "quantize_rows_spec",
    "sample_categorical",
    "scaled_linear_forward",
    "token_logprob_rank",
    "token_logprobs_backward",
    "token_logprobs_forward",
    "token_logprobs_spec",
    "value_loss_backward",
    "value_loss_forward",
    "value_loss_spec",
]
