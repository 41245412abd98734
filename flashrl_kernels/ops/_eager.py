"""The eager path of the loss ops: the op's own forward, setup_context and backward, run as a torch.autograd.Function.

Calling a `torch.library.custom_op` from Python costs a fixed ~0.1-0.4 ms on a CPU before the kernel starts
(the custom-op Python dispatch, an autograd wrapper whose `fill_defaults` is quadratic in the number of schema
arguments, and a second custom-op call for the backward). At the micro-batch sizes trainers run (a few thousand
to a few hundred thousand tokens) that made `policy_loss` slower than the eager torch a trainer writes.

So the public functions run eagerly through an autograd.Function that calls the very same Python functions the
op registers (forward implementation, setup_context, backward), and call the registered op only where the op is
needed: under torch.compile / export tracing, under a torch dispatch mode (FakeTensorMode, the flop counter, ...),
and for tensor subclasses or meta tensors. Both paths run identical code, so they return identical results
(tested); `torch.ops.flashrl.*` stays the public op.
"""
from __future__ import annotations

from collections.abc import Callable

import torch

from .._checks import tracing

_PLAIN_TYPES = (torch.Tensor, torch.nn.Parameter)


def needs_op(*tensors) -> bool:
    """True where the registered op must run instead of the eager Function (see the module docstring)."""
    if tracing():
        return True
    for t in tensors:
        if t is not None and (type(t) not in _PLAIN_TYPES or t.device.type == "meta"):
            return True
    return False


def eager_function(name: str, forward: Callable, setup_context: Callable, backward: Callable):
    """An autograd.Function running `forward(*inputs)` and `setup_context(ctx, inputs, output)` in its forward, and
    `backward(ctx, *grads)`. The first output is the loss; every other output is marked non-differentiable."""

    # forward(ctx, ...) without a separate setup_context: Function.apply binds default arguments through
    # inspect.signature at every call when setup_context is defined (~20-40 us)
    def _forward(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        ctx.mark_non_differentiable(*output[1:])
        return output

    return type(name, (torch.autograd.Function,), {
        "forward": staticmethod(_forward),
        "backward": staticmethod(backward),
        "__doc__": f"Eager autograd path of {name}; see flashrl_kernels/ops/_eager.py.",
    })
