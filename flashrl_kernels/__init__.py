"""flashrl_kernels: fast, lean kernels for RL training of LLMs."""
__version__ = "0.1.0"

from ._backend import BACKENDS, BackendUnavailableError, selected_backend, use_backend
from ._checks import set_value_checks
from .advantages import GroupAdvantages, dynamic_sampling_mask, group_advantages, overlong_penalty
from .loss_config import LossConfig, LossOutput
from .ops import policy_loss, token_logprobs

__all__ = [
    "BACKENDS",
    "BackendUnavailableError",
    "GroupAdvantages",
    "LossConfig",
    "LossOutput",
    "dynamic_sampling_mask",
    "group_advantages",
    "overlong_penalty",
    "policy_loss",
    "selected_backend",
    "set_value_checks",
    "token_logprobs",
    "use_backend",
]
