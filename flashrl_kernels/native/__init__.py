"""Native C++ CPU kernels (csrc/cpu/*.cpp), registered as torch.ops.flashrl_native.*.

Importing this package builds the library on first use (cached afterwards,
see flashrl_kernels/_native.py) and raises ImportError when it cannot be
built or loaded, which is how the backend selection learns that "native" is
unavailable. The functions have the signatures of every other backend
package. Ops without a native kernel yet are simply absent: under automatic
selection they run on the torch backend (see _backend.implementation).

Native ops: token_logprobs (csrc/cpu/token_logprobs.cpp), policy_loss
(csrc/cpu/policy_loss.cpp), value_loss (csrc/cpu/value_loss.cpp), gae (csrc/cpu/gae.cpp),
linear_token_logprobs and linear_policy_loss (csrc/cpu/linear_logprobs.cpp: torch_impl's
tile loops and ATen GEMMs with native per-tile epilogues), and the rollout side's
quantize_rows (csrc/cpu/quantize.cpp) and scaled linears (csrc/cpu/qlinear.cpp, plain
weight rows; csrc/cpu/qlinear_packed.cpp, the packed W8A8 layout). A new
one is a wrapper module here plus one import line, and its kernels as
csrc/cpu/<op>.cpp with their own
TORCH_LIBRARY_FRAGMENT(flashrl_native, m) / TORCH_LIBRARY_IMPL(flashrl_native, CPU, m)
blocks, which the build picks up automatically; shared vector helpers are in
csrc/cpu/vec_utils.h.
"""
from .. import _native

if not _native.load():
    raise ImportError(f"flashrl native CPU kernels unavailable: {_native.native_status().reason}")

from .gae import gae_forward
from .linear_logprobs import linear_logprobs_backward, linear_logprobs_stats
from .linear_policy_loss import linear_policy_loss_forward
from .logprobs import token_logprobs_backward, token_logprobs_forward
from .policy_loss import policy_loss_backward, policy_loss_forward
from .quantize import dequantize_rows_forward, quantize_rows_forward, scaled_linear_forward
from .value_loss import value_loss_backward, value_loss_forward

__all__ = [
    "dequantize_rows_forward",
    "gae_forward",
    "linear_logprobs_backward",
    "linear_logprobs_stats",
    "linear_policy_loss_forward",
    "policy_loss_backward",
    "policy_loss_forward",
    "quantize_rows_forward",
    "scaled_linear_forward",
    "token_logprobs_backward",
    "token_logprobs_forward",
    "value_loss_backward",
    "value_loss_forward",
]
