"""How the ``superkernel.ops`` wrappers (and the backward formulas) call a ``torch.ops.mk`` operator.

The ops' gradients are registered with ``torch.library.register_autograd``, which puts a Python kernel on the
Autograd dispatch key: every call of ``torch.ops.mk.<op>``, even one that needs no gradient, goes from the
dispatcher back into Python and redispatches below autograd from there. On 2 ranks (one host) that round trip
cost 10-17 us per call (allgather_gemm 64^3: 62 us through it, 52 us below it; the unfused composition 42 us).
``call`` skips it when autograd has nothing to record (grad mode off, or no input requiring a gradient).

Such a call goes through ``superkernel._C.eager_call`` (csrc/kernels/eager_call.h): the op's positional
arguments converted in C++ and the operator called through the dispatcher below autograd, without the
OpOverload's generic argument parsing and result conversion. That entry declines (returns NotImplemented)
whenever the generic path could behave differently: keyword arguments, unexpected argument types, Tensor
subclasses, torch-function modes, inputs that need a gradient; the OpOverload then takes the call. Under
``torch.compile`` the op is called as is, so the graph records the op and AOTAutograd sees its autograd
formula.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from superkernel import _C

_eager_entries: dict[torch._ops.OpOverload, Callable[..., Any]] = {}


def eager_entry(op: torch._ops.OpOverload) -> Callable[..., Any]:
    """``superkernel._C.eager_call`` for ``op`` (made once per op)."""
    entry = _eager_entries.get(op)
    if entry is None:
        entry = _eager_entries[op] = _C.eager_call(op._schema.name, op._schema.overload_name)
    return entry


def call(op: torch._ops.OpOverload, *args: Any) -> Any:
    """``op(*args)``, below the autograd layer when no gradient can flow through this call."""
    if torch.compiler.is_compiling():
        return op(*args)
    out = eager_entry(op)(*args)
    if out is not NotImplemented:
        return out
    if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)
