"""superkernel.ops.dispatch.call: the wrappers' way round the Python autograd kernel that
torch.library.register_autograd installs. A test operator with a counting Autograd kernel shows when that
kernel runs: it must be skipped exactly when autograd has nothing to record, and the result must be the op's."""
from __future__ import annotations

import pytest
import torch

from superkernel.ops.dispatch import call

_lib = torch.library.Library("sk_dispatch_test", "DEF")
_lib.define("scale(Tensor x, float f) -> Tensor")
_autograd_calls: list[bool] = []


def _cpu(x: torch.Tensor, f: float) -> torch.Tensor:
    return x * f


def _autograd(keyset: torch._C.DispatchKeySet, x: torch.Tensor, f: float) -> torch.Tensor:
    _autograd_calls.append(torch.is_grad_enabled())

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            with torch._C._AutoDispatchBelowAutograd():
                return torch.ops.sk_dispatch_test.scale.default.redispatch(
                    keyset & torch._C._after_autograd_keyset, x, f)

        @staticmethod
        def backward(ctx, g: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
            return g * f

    return Scale.apply(x)


_lib.impl("scale", _cpu, "CPU")
_lib.impl("scale", _autograd, "Autograd", with_keyset=True)
torch.library.register_fake("sk_dispatch_test::scale", lambda x, f: torch.empty_like(x), lib=_lib)
OP = torch.ops.sk_dispatch_test.scale.default


@pytest.fixture(autouse=True)
def _reset() -> None:
    _autograd_calls.clear()


def test_no_input_requires_grad_skips_the_autograd_kernel() -> None:
    x = torch.arange(4.0)
    assert torch.equal(call(OP, x, 3.0), x * 3)
    assert _autograd_calls == []
    OP(x, 3.0)  # called directly, the op goes through it
    assert _autograd_calls == [True]


def test_grad_mode_off_skips_it_even_for_inputs_that_require_grad() -> None:
    x = torch.arange(4.0, requires_grad=True)
    with torch.no_grad():
        y = call(OP, x, 2.0)
    assert not y.requires_grad and torch.equal(y, torch.arange(4.0) * 2)
    with torch.inference_mode():
        call(OP, x, 2.0)
    assert _autograd_calls == []


def test_an_input_that_requires_grad_goes_through_autograd() -> None:
    x = torch.arange(4.0, requires_grad=True)
    y = call(OP, x, 2.5)
    assert _autograd_calls == [True] and y.requires_grad
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((4,), 2.5))


def test_under_torch_compile_the_op_is_traced_as_called() -> None:
    @torch.compile(fullgraph=True, backend="eager")
    def f(x: torch.Tensor) -> torch.Tensor:
        return call(OP, x, 4.0) + 1

    x = torch.arange(4.0)
    assert torch.equal(f(x), x * 4 + 1)
