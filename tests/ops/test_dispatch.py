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


# ------------------------------------------------------------------------------------------- eager entry
# call() goes through superkernel._C.eager_call (csrc/kernels/eager_call.h) when it may: the op's positional
# arguments converted in C++, the dispatcher called below autograd. It must decline (NotImplemented) whenever
# the OpOverload could behave differently, and otherwise give what the OpOverload gives.
from superkernel.ops.dispatch import eager_entry  # noqa: E402

_lib.define("pair(Tensor x, float? f=None, int n=1, bool neg=False, str tag='') -> (Tensor, Tensor)")
_lib.define("fail(Tensor x, str why) -> Tensor")


def _pair(x: torch.Tensor, f: float | None = None, n: int = 1, neg: bool = False,
          tag: str = "") -> tuple[torch.Tensor, torch.Tensor]:
    y = x * (2.0 if f is None else f) * n
    return (-y if neg else y), torch.tensor([float(len(tag))])


def _fail(x: torch.Tensor, why: str) -> torch.Tensor:
    raise ValueError(f"sk_dispatch_test fail: {why}")


_lib.impl("pair", _pair, "CPU")
_lib.impl("fail", _fail, "CPU")
PAIR = torch.ops.sk_dispatch_test.pair.default


def test_eager_entry_takes_plain_calls_and_fills_defaults() -> None:
    x = torch.arange(4.0)
    entry = eager_entry(PAIR)
    y, t = entry(x)
    assert torch.equal(y, x * 2) and torch.equal(t, torch.tensor([0.0]))
    y, t = entry(x, 0.5, 3, True, "abc")
    assert torch.equal(y, -(x * 1.5)) and torch.equal(t, torch.tensor([3.0]))
    assert eager_entry(PAIR) is entry  # made once per op
    assert torch.equal(eager_entry(OP)(x, 3.0), x * 3) and _autograd_calls == []


@pytest.mark.parametrize("case", ["keyword", "int for float", "bool for int", "too many", "missing", "list"])
def test_eager_entry_declines_what_the_overload_must_parse(case: str) -> None:
    x = torch.arange(4.0)
    args, kwargs = {
        "keyword": ((x,), {"f": 1.0}),
        "int for float": ((x, 3), {}),
        "bool for int": ((x, 1.0, True), {}),
        "too many": ((x, 1.0, 1, False, "", 7), {}),
        "missing": ((), {}),
        "list": (([1.0, 2.0],), {}),
    }[case]
    assert eager_entry(PAIR)(*args, **kwargs) is NotImplemented
    if case == "int for float":  # the OpOverload accepts an int for a float: call() falls back to it
        assert torch.equal(call(PAIR, *args)[0], x * 3)
    elif case in ("missing", "list", "too many"):  # and the OpOverload's own error is what the caller sees
        with pytest.raises((RuntimeError, TypeError)):
            call(PAIR, *args)


def test_eager_entry_declines_inputs_that_need_a_gradient_only_in_grad_mode() -> None:
    x = torch.arange(4.0, requires_grad=True)
    assert eager_entry(OP)(x, 2.0) is NotImplemented
    with torch.no_grad():
        y = eager_entry(OP)(x, 2.0)
    assert y is not NotImplemented and not y.requires_grad and _autograd_calls == []


def test_tensor_subclasses_and_torch_function_modes_still_see_the_call() -> None:
    seen: list[str] = []

    class Logged(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001,ANN206
            seen.append(str(func))
            return super().__torch_function__(func, types, args, kwargs or {})

    x = torch.arange(4.0)
    assert eager_entry(OP)(x.as_subclass(Logged), 2.0) is NotImplemented
    call(OP, x.as_subclass(Logged), 2.0)
    assert any("scale" in s for s in seen), seen

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001,ANN206
            seen.append(f"mode {func}")
            return func(*args, **(kwargs or {}))

    seen.clear()
    with Mode():
        assert eager_entry(OP)(x, 2.0) is NotImplemented
        assert torch.equal(call(OP, x, 2.0), x * 2)
    assert any(s.startswith("mode") and "scale" in s for s in seen), seen


def test_dispatch_modes_and_the_profiler_see_eager_calls() -> None:
    from torch.utils._python_dispatch import TorchDispatchMode

    ops: list[str] = []

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001,ANN206
            ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.arange(4.0)
    with Mode():
        y = call(OP, x, 2.0)
    assert torch.equal(y, x * 2) and any("sk_dispatch_test.scale" in o for o in ops), ops
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        call(OP, x, 2.0)
    assert any(e.name == "sk_dispatch_test::scale" for e in prof.events())


def test_eager_errors_are_the_overloads_errors() -> None:
    x = torch.arange(4.0)
    with pytest.raises(Exception) as through_overload:
        FAIL = torch.ops.sk_dispatch_test.fail.default
        with torch._C._AutoDispatchBelowAutograd():
            FAIL(x, "boom")
    with pytest.raises(Exception) as eager:
        eager_entry(FAIL)(x, "boom")
    assert type(eager.value) is type(through_overload.value)
    assert "sk_dispatch_test fail: boom" in str(eager.value)
    # a C++ error of an mk op: the same type and message either way
    with pytest.raises(RuntimeError) as bad_group:
        eager_entry(torch.ops.mk.gemm_allreduce.default)(x.view(2, 2), x.view(2, 2), "no-such-group", 0)
    with pytest.raises(RuntimeError) as bad_group_overload:
        torch.ops.mk.gemm_allreduce.default(x.view(2, 2), x.view(2, 2), "no-such-group", 0)
    assert type(bad_group.value) is type(bad_group_overload.value)
    assert str(bad_group.value).splitlines()[0] == str(bad_group_overload.value).splitlines()[0]


def test_unknown_operator_is_an_error() -> None:
    from superkernel import _C

    with pytest.raises(RuntimeError, match="no operator sk_dispatch_test::nope"):
        _C.eager_call("sk_dispatch_test::nope")
