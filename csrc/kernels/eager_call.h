// A direct Python entry into one torch.ops.mk operator, for eager calls that autograd has nothing to record.
//
// `torch.ops.mk.<op>.default(...)` goes through OpOverload.__call__, torch's generic schema-driven argument
// parser (createStackForSchema) and IValue-to-Python conversion of the results: on 2 ranks that Python and
// boxing work was a sizeable share of a small fused op's fixed cost (bench/README.md). The entry made here
// takes the positional arguments of the op's schema, converts them itself (Tensor, str, int, bool,
// float, float?), and calls the operator through the dispatcher below the autograd keys with the GIL
// released, as superkernel.ops.dispatch.call did through the OpOverload. Everything the dispatcher does
// still happens (profiler records, dispatch modes, inference mode, device kernels).
//
// It returns NotImplemented, and the caller takes the OpOverload, whenever the generic path could behave
// differently: keyword arguments, an argument of an unexpected type (the OpOverload raises the proper
// error), a Tensor subclass or a torch-function mode (whose __torch_function__ must run), or an input that
// requires grad while grad mode is on (autograd must record the call).
#pragma once
#include <pybind11/pybind11.h>

#include <string>

namespace mk::kernels {

// The entry for operator `name` ("mk::gemm_allreduce"), overload `overload` ("" = default), as a Python
// builtin taking the op's arguments positionally. Raises if no such operator is registered.
pybind11::object make_eager_call(const std::string& name, const std::string& overload);

}  // namespace mk::kernels
