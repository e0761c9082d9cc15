"""How the ``superkernel.ops`` wrappers (and the backward formulas) call a ``torch.ops.mk`` operator.

The ops' gradients are registered with ``torch.library.register_autograd``, which puts a Python kernel on the
Autograd dispatch key: every call of ``torch.ops.mk.<op>``, even one that needs no gradient, goes from the
dispatcher back into Python and redispatches below autograd from there. On 2 ranks (one host) that round trip
cost 10-17 us per call (allgather_gemm 64^3: 62 us through it, 52 us below it; the unfused composition 42 us).
``call`` skips it when autograd has nothing to record (grad mode off, or no input requiring a gradient): the
same redispatch, done here. Under ``torch.compile`` the op is called as is, so the graph records the op and
AOTAutograd sees its autograd formula.
"""
from __future__ import annotations

from typing import Any

import torch


def call(op: torch._ops.OpOverload, *args: Any) -> Any:
    """``op(*args)``, below the autograd layer when no gradient can flow through this call."""
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
        return op(*args)
    with torch._C._AutoDispatchBelowAutograd():
        return op(*args)
