#include "kernels/eager_call.h"

#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/grad_mode.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <memory>
#include <utility>

namespace mk::kernels {
namespace {

constexpr const char* kCapsule = "superkernel.eager_call";

struct Entry {
  c10::OperatorHandle op;
};

// Appends `obj` as the IValue the schema argument `arg` takes; false when the generic path must handle it.
bool push_argument(PyObject* obj, const c10::Argument& arg, torch::jit::Stack& stack, bool& requires_grad) {
  const c10::Type& type = *arg.real_type();
  switch (type.kind()) {
    case c10::TypeKind::TensorType: {
      if (!THPVariable_CheckExact(obj)) return false;  // (a subclass's __torch_function__ must run)
      const at::Tensor& t = THPVariable_Unpack(obj);
      requires_grad = requires_grad || t.requires_grad();
      stack.emplace_back(t);
      return true;
    }
    case c10::TypeKind::StringType: {
      if (!PyUnicode_Check(obj)) return false;
      Py_ssize_t len = 0;
      const char* s = PyUnicode_AsUTF8AndSize(obj, &len);
      if (!s) {
        PyErr_Clear();
        return false;
      }
      stack.emplace_back(std::string(s, size_t(len)));
      return true;
    }
    case c10::TypeKind::IntType: {
      if (!PyLong_CheckExact(obj)) return false;  // (True is an int to Python, not to the schema)
      int overflow = 0;
      const long long v = PyLong_AsLongLongAndOverflow(obj, &overflow);
      if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return false;
      }
      stack.emplace_back(int64_t(v));
      return true;
    }
    case c10::TypeKind::BoolType:
      if (obj != Py_True && obj != Py_False) return false;
      stack.emplace_back(obj == Py_True);
      return true;
    case c10::TypeKind::FloatType:
      if (!PyFloat_CheckExact(obj)) return false;
      stack.emplace_back(PyFloat_AS_DOUBLE(obj));
      return true;
    case c10::TypeKind::OptionalType: {
      if (obj == Py_None) {
        stack.emplace_back();
        return true;
      }
      const auto& elem = *type.expectRef<c10::OptionalType>().getElementType();
      if (elem.kind() != c10::TypeKind::FloatType || !PyFloat_CheckExact(obj)) return false;
      stack.emplace_back(PyFloat_AS_DOUBLE(obj));
      return true;
    }
    default:
      return false;
  }
}

PyObject* wrap_result(c10::IValue&& v, const c10::OperatorHandle& op) {
  TORCH_CHECK(v.isTensor(), op.schema().name(), ": eager_call handles operators that return tensors only, got ",
              v.tagKind());
  return THPVariable_Wrap(std::move(v).toTensor());
}

PyObject* eager_call(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  HANDLE_TH_ERRORS
  auto* entry = static_cast<Entry*>(PyCapsule_GetPointer(self, kCapsule));
  if (!entry) return nullptr;
  if ((kwnames && PyTuple_GET_SIZE(kwnames) > 0) || at::impl::torch_function_mode_enabled()) Py_RETURN_NOTIMPLEMENTED;
  const c10::OperatorHandle& op = entry->op;
  const auto& params = op.schema().arguments();
  if (size_t(nargs) > params.size()) Py_RETURN_NOTIMPLEMENTED;
  torch::jit::Stack stack;
  stack.reserve(params.size());
  bool requires_grad = false;
  for (size_t i = 0; i < params.size(); ++i) {
    if (i < size_t(nargs)) {
      if (!push_argument(args[i], params[i], stack, requires_grad)) Py_RETURN_NOTIMPLEMENTED;
    } else if (params[i].default_value()) {
      stack.push_back(*params[i].default_value());
    } else {
      Py_RETURN_NOTIMPLEMENTED;  // (a missing argument: the OpOverload's error says which)
    }
  }
  if (requires_grad && at::GradMode::is_enabled()) Py_RETURN_NOTIMPLEMENTED;
  {
    pybind11::gil_scoped_release no_gil;
    at::AutoDispatchBelowAutograd below_autograd;
    op.callBoxed(stack);
  }
  if (stack.size() == 1) return wrap_result(std::move(stack[0]), op);
  PyObject* out = PyTuple_New(Py_ssize_t(stack.size()));
  if (!out) return nullptr;
  for (size_t i = 0; i < stack.size(); ++i) {
    PyObject* item = nullptr;
    try {
      item = wrap_result(std::move(stack[i]), op);
    } catch (...) {
      Py_DECREF(out);
      throw;
    }
    if (!item) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, Py_ssize_t(i), item);
  }
  return out;
  END_HANDLE_TH_ERRORS
}

PyMethodDef eager_call_def = {
    "eager_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&eager_call)),
    METH_FASTCALL | METH_KEYWORDS,
    "op(*args): the operator called below autograd, or NotImplemented when the generic path must take the call "
    "(superkernel.ops.dispatch.call)."};

}  // namespace

pybind11::object make_eager_call(const std::string& name, const std::string& overload) {
  auto handle = c10::Dispatcher::singleton().findSchema({name, overload});
  TORCH_CHECK(handle.has_value(), "superkernel eager_call: no operator ", name,
              overload.empty() ? "" : ".", overload, " is registered");
  auto entry = std::make_unique<Entry>(Entry{*handle});
  PyObject* cap = PyCapsule_New(entry.get(), kCapsule, [](PyObject* c) {
    std::unique_ptr<Entry>(static_cast<Entry*>(PyCapsule_GetPointer(c, kCapsule)));  // (freed here)
  });
  if (!cap) throw pybind11::error_already_set();
  entry.release();  // owned by the capsule now
  auto cap_obj = pybind11::reinterpret_steal<pybind11::object>(cap);
  PyObject* fn = PyCFunction_New(&eager_call_def, cap_obj.ptr());
  if (!fn) throw pybind11::error_already_set();
  return pybind11::reinterpret_steal<pybind11::object>(fn);
}

}  // namespace mk::kernels
