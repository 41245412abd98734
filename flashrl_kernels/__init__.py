"""flashrl_kernels: fast, lean kernels for RL training of LLMs."""
__version__ = "0.1.0"

from ._backend import BACKENDS, BackendUnavailableError, selected_backend, use_backend
from ._checks import set_value_checks
from ._native import native_status
from .advantages import GroupAdvantages, dynamic_sampling_mask, group_advantages, overlong_penalty
from .integrations import patch, unpatch
from .integrations import patch_from_env as _patch_from_env
from .loss_config import LossConfig, LossOutput
from .ops import (
    LINEAR_METRIC_NAMES,
    GAEOutput,
    dequantize_rows,
    gae,
    linear_policy_loss,
    linear_token_logprobs,
    policy_loss,
    quantize_per_token,
    quantize_rows,
    quantize_rows_,
    scaled_linear,
    token_logprobs,
)
from .ops.value_loss import VALUE_METRIC_NAMES, value_loss

__all__ = [
    "BACKENDS",
    "LINEAR_METRIC_NAMES",
    "VALUE_METRIC_NAMES",
    "BackendUnavailableError",
    "GAEOutput",
    "GroupAdvantages",
    "LossConfig",
    "LossOutput",
    "dequantize_rows",
    "dynamic_sampling_mask",
    "gae",
    "group_advantages",
    "linear_policy_loss",
    "linear_token_logprobs",
    "native_status",
    "overlong_penalty",
    "patch",
    "policy_loss",
    "quantize_per_token",
    "quantize_rows",
    "quantize_rows_",
    "scaled_linear",
    "selected_backend",
    "set_value_checks",
    "token_logprobs",
    "unpatch",
    "use_backend",
    "value_loss",
]

_patch_from_env()  # FLASHRL_PATCH=trl patches TRL at import; a no-op (nothing imported) when unset
