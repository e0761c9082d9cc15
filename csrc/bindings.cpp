// superkernel._C: the backend creator for torch.distributed, and the transport's introspection hooks.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <utility>

#include "kernels/eager_call.h"
#include "kernels/packed_gemm.h"
#include "kernels/pipeline.h"
#include "store_worker.h"
#include "transport/cancel_hook.h"
#include "transport/copy.h"
#include "transport/deadline.h"
#include "transport/host.h"
#include "transport/pool_allocator.h"
#include "transport/process_group.h"
#include "transport/window.h"

namespace py = pybind11;

namespace {

mk::ProcessGroupMK& as_mk(const c10::intrusive_ptr<c10d::Backend>& b) {
  auto* pg = dynamic_cast<mk::ProcessGroupMK*>(b.get());
  TORCH_CHECK(pg != nullptr, "superkernel: the backend is ", b->getBackendName(), ", not mk");
  return *pg;
}

// ---- one-sided windows (superkernel.memory.Window wraps these) ----

py::handle py_peer_error, py_cancelled_error;  // owned by the module (attributes PeerError, CancelledError)

// Run f (which releases the GIL itself) and turn mk errors into Python exceptions of fitting types.
template <typename F>
auto window_call(F&& f) -> decltype(f()) {
  try {
    return f();
  } catch (const mk::RangeError& e) {
    throw py::index_error(e.what());
  } catch (const mk::ArgumentError& e) {
    throw py::value_error(e.what());
  } catch (const mk::TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
    throw py::error_already_set();
  } catch (const mk::MismatchError& e) {
    throw py::value_error(e.what());
  } catch (const mk::PeerError& e) {
    PyErr_SetString(py_peer_error.ptr(), e.what());
    throw py::error_already_set();
  } catch (const mk::CancelledError& e) {
    PyErr_SetString(py_cancelled_error.ptr(), e.what());
    throw py::error_already_set();
  }
}

mk::DType window_dtype(c10::ScalarType t) {
  switch (t) {
    case at::kFloat: return mk::DType::f32;
    case at::kDouble: return mk::DType::f64;
    case at::kHalf: return mk::DType::f16;
    case at::kBFloat16: return mk::DType::bf16;
    case at::kChar: return mk::DType::i8;
    case at::kByte: return mk::DType::u8;
    case at::kShort: return mk::DType::i16;
    case at::kInt: return mk::DType::i32;
    case at::kLong: return mk::DType::i64;
    default: throw py::type_error(std::string("superkernel Window: unsupported dtype ") + c10::toString(t));
  }
}

mk::Deadline window_deadline(const mk::Window& w, std::optional<double> timeout) {
  if (!timeout) return w.comm().deadline();
  if (*timeout < 0) throw py::value_error("superkernel Window: timeout must be >= 0 seconds");
  return mk::Deadline::after(std::chrono::milliseconds(int64_t(*timeout * 1000.0)));
}

mk::CopyUse copy_use(const std::string& use) {
  if (use == "window") return mk::CopyUse::window;
  if (use == "collective") return mk::CopyUse::collective;
  throw py::value_error("copy_bytes: use must be 'window' or 'collective', got '" + use + "'");
}

std::chrono::milliseconds pool_timeout(double seconds) {
  if (!(seconds >= 0)) throw py::value_error("superkernel TensorStore: timeout must be >= 0 seconds");
  return std::chrono::milliseconds(int64_t(std::min(seconds, 1e9) * 1000.0));
}

struct PyWindow : std::enable_shared_from_this<PyWindow> {
  c10::intrusive_ptr<c10d::Backend> backend;  // owns the communicator the window uses
  // Tensors of operations that were not known complete when their call returned (async, or a wait that
  // failed): the provider may still read or write them, so they live until the request finished.
  std::vector<std::pair<mk::RequestPtr, at::Tensor>> held;
  std::unique_ptr<mk::Window> win;  // destroyed before `held` (it waits for its requests)
  c10::ScalarType dtype;
  size_t esize = 1;
  mk::Window& w() const { return *win; }
  void hold(const mk::RequestPtr& r, const at::Tensor& keep) {
    release_done();
    held.emplace_back(r, keep);
  }
  void release_done() {
    if (held.empty()) return;
    held.erase(std::remove_if(held.begin(), held.end(), [](const auto& h) { return h.first->test(); }), held.end());
  }
};
using PyWindowPtr = std::shared_ptr<PyWindow>;

// An operation started with async_op=True: wait() returns its value (None, or the old int64).
struct WindowFuture {
  PyWindowPtr owner;
  mk::RequestPtr req;  // null: completed at once
  std::shared_ptr<int64_t> result;
  at::Tensor keep;  // the tensor the operation reads or writes (undefined when none or completed)
  const char* op;
  int target;
  py::object wait(std::optional<double> timeout) {
    if (req) {
      window_call([&] {
        mk::Deadline d = window_deadline(owner->w(), timeout);
        py::gil_scoped_release nogil;
        owner->w().wait(req, d, op, target);
      });
    }
    keep = at::Tensor();
    if (result) return py::int_(*result);
    return py::none();
  }
  bool done() const { return !req || req->test(); }
};

// Direct (same-host mapped) operations up to this many bytes run without releasing the GIL: releasing and
// re-acquiring it costs more than copying them. Accumulate does an atomic read-modify-write per element,
// far slower per byte than a copy, so it keeps the GIL only for small sizes.
constexpr size_t kKeepGilBytes = size_t(64) << 10;
constexpr size_t kKeepGilAccumulateBytes = size_t(4) << 10;

// A CPU tensor of the window's dtype (ValueError / TypeError otherwise).
void window_check_tensor(const PyWindow& pw, const at::Tensor& t, const char* op, const char* arg) {
  if (!t.device().is_cpu())
    throw py::value_error(mk::cat("superkernel Window.", op, ": ", arg, " must be a CPU tensor, got ", t.device().str()));
  if (t.scalar_type() != pw.dtype)
    throw py::type_error(mk::cat("superkernel Window.", op, ": ", arg, " has dtype ", c10::toString(t.scalar_type()),
                                 " but the window holds ", c10::toString(pw.dtype)));
}

// A contiguous CPU tensor of the window's dtype: its data pointer and element count.
std::pair<char*, size_t> window_buffer(const PyWindow& pw, const at::Tensor& t, const char* op, const char* arg) {
  window_check_tensor(pw, t, op, arg);
  if (!t.is_contiguous())
    throw py::value_error(mk::cat("superkernel Window.", op, ": ", arg, " must be contiguous"));
  return {static_cast<char*>(t.data_ptr()), size_t(t.numel())};
}

mk::RedOp window_redop(std::string_view op) {
  if (op == "sum") return mk::RedOp::sum;
  if (op == "min") return mk::RedOp::min;
  if (op == "max") return mk::RedOp::max;
  throw py::value_error(mk::cat("superkernel Window.accumulate: op must be 'sum', 'min' or 'max', got '", op, "'"));
}

void window_check_offset(int64_t offset, const char* op) {
  if (offset < 0) throw py::index_error(mk::cat("superkernel Window.", op, ": offset must be >= 0"));
}

// Start an operation on the window: `f` performs it (on the caller's thread when `target` is mapped here
// and the operation is small; else with the GIL released) and returns its request or null.
template <typename F>
mk::RequestPtr window_start(PyWindow& p, int target, size_t bytes, size_t keep_gil_bytes, F&& f) {
  return window_call([&] {
    if (bytes <= keep_gil_bytes && p.w().direct(target)) return f();
    py::gil_scoped_release nogil;
    return f();
  });
}

// Finish an operation: blocking -> wait and return value; async -> a WindowFuture. `keep` (or null): the
// tensor the operation reads or writes, kept alive until it completed.
py::object window_finish(PyWindow& pw, mk::RequestPtr req, std::shared_ptr<int64_t> result, const at::Tensor* keep,
                         const char* op, int target, bool async_op) {
  if (!req && !async_op) {  // completed synchronously (direct access): nothing to keep, nothing to wait for
    if (result) return py::int_(*result);
    return py::none();
  }
  at::Tensor kept = keep && req ? *keep : at::Tensor();
  if (kept.defined() && (async_op || !req->test())) pw.hold(req, kept);
  auto f = WindowFuture{pw.shared_from_this(), std::move(req), std::move(result), std::move(kept), op, target};
  if (async_op) return py::cast(std::move(f));
  return f.wait(std::nullopt);
}

// The operations, shared by the pybind methods of _C.Window and the vectorcall fast paths below.
py::object window_put(PyWindow& p, int target, int64_t offset, const at::Tensor& src_in, std::optional<int64_t> notify,
                      bool async_op) {
  window_check_tensor(p, src_in, "put", "src");
  c10::MaybeOwned<at::Tensor> src = src_in.expect_contiguous();  // a non-contiguous src is copied first
  window_check_offset(offset, "put");
  if (notify && *notify < 0) throw py::index_error("superkernel Window.put: notify tag must be >= 0");
  const void* ptr = src->const_data_ptr();
  const size_t n = size_t(src->numel());
  const uint64_t tag = notify ? uint64_t(*notify) : mk::kNoNotify;
  mk::RequestPtr r = window_start(p, target, n * p.esize, kKeepGilBytes,
                                  [&] { return p.w().put(target, size_t(offset), ptr, n, tag); });
  return window_finish(p, std::move(r), nullptr, &*src, "put", target, async_op);
}

py::object window_get(PyWindow& p, int target, int64_t offset, const at::Tensor& out, bool async_op) {
  auto [ptr, n] = window_buffer(p, out, "get", "out");
  window_check_offset(offset, "get");
  mk::RequestPtr r = window_start(p, target, n * p.esize, kKeepGilBytes,
                                  [&, ptr = ptr, n = n] { return p.w().get(target, size_t(offset), ptr, n); });
  return window_finish(p, std::move(r), nullptr, &out, "get", target, async_op);
}

py::object window_accumulate(PyWindow& p, int target, int64_t offset, const at::Tensor& src_in, std::string_view op,
                             bool async_op) {
  window_check_tensor(p, src_in, "accumulate", "src");
  c10::MaybeOwned<at::Tensor> src = src_in.expect_contiguous();
  const mk::RedOp rop = window_redop(op);
  window_check_offset(offset, "accumulate");
  const void* ptr = src->const_data_ptr();
  const size_t n = size_t(src->numel());
  mk::RequestPtr r = window_start(p, target, n * p.esize, kKeepGilAccumulateBytes,
                                  [&] { return p.w().accumulate(target, size_t(offset), ptr, n, rop); });
  return window_finish(p, std::move(r), nullptr, &*src, "accumulate", target, async_op);
}

py::object window_atomic(PyWindow& p, int target, int64_t offset, bool cas, int64_t a, int64_t b, bool async_op) {
  window_check_offset(offset, cas ? "compare_swap" : "fetch_add");
  if (p.dtype != at::kLong)
    throw py::type_error(mk::cat("superkernel Window.", cas ? "compare_swap" : "fetch_add",
                                 ": needs an int64 window, this one holds ", c10::toString(p.dtype)));
  auto result = std::make_shared<int64_t>(0);
  const mk::AmoOp op = cas ? mk::AmoOp::compare_swap : mk::AmoOp::fetch_add;
  mk::RequestPtr r = window_start(p, target, 8, kKeepGilBytes,
                                  [&] { return p.w().atomic(target, size_t(offset), op, a, b, result); });
  return window_finish(p, std::move(r), std::move(result), nullptr, cas ? "compare_swap" : "fetch_add", target, async_op);
}

// flush(target), or flush_all() when `all`: the fence alone when nothing of this rank is in flight, else
// wait for the requests with the GIL released.
void window_flush(PyWindow& p, bool all, int target, std::optional<double> timeout) {
  if (timeout && *timeout < 0) throw py::value_error("superkernel Window: timeout must be >= 0 seconds");
  window_call([&] {
    if (all ? p.w().flush_all_direct() : p.w().flush_direct(target)) return;
    mk::Deadline d = window_deadline(p.w(), timeout);
    py::gil_scoped_release nogil;
    if (all)
      p.w().flush_all(d);
    else
      p.w().flush(target, d);
  });
  p.release_done();
}

// ---- vectorcall fast paths: Python's Window binds these as instance attributes, so win.put(...) reaches C++
// without a Python frame or pybind's generic dispatcher. Same signatures and semantics as the methods.
constexpr const char* kFastCapsule = "superkernel._C.Window";

PyWindow& fast_self(PyObject* self) {
  return *static_cast<PyWindow*>(PyCapsule_GetPointer(self, kFastCapsule));
}

// Match positional and keyword arguments against `names` (the first `required` must be given); `out`
// receives borrowed references, null for an omitted optional argument.
template <size_t N>
void fast_args(const char* fn, const char* const (&names)[N], size_t required, PyObject* const* args, Py_ssize_t nargs,
               PyObject* kwnames, PyObject* (&out)[N]) {
  const size_t npos = size_t(PyVectorcall_NARGS(nargs));
  if (npos > N) throw py::type_error(mk::cat(fn, "() takes at most ", N, " arguments (", npos, " given)"));
  for (size_t i = 0; i < N; ++i) out[i] = i < npos ? args[i] : nullptr;
  if (kwnames) {
    const Py_ssize_t nkw = PyTuple_GET_SIZE(kwnames);
    for (Py_ssize_t k = 0; k < nkw; ++k) {
      PyObject* key = PyTuple_GET_ITEM(kwnames, k);
      size_t i = 0;
      while (i < N && PyUnicode_CompareWithASCIIString(key, names[i]) != 0) ++i;
      if (i == N)
        throw py::type_error(mk::cat(fn, "() got an unexpected keyword argument '", py::str(key).cast<std::string>(), "'"));
      if (out[i]) throw py::type_error(mk::cat(fn, "() got multiple values for argument '", names[i], "'"));
      out[i] = args[npos + size_t(k)];
    }
  }
  for (size_t i = 0; i < required; ++i)
    if (!out[i]) throw py::type_error(mk::cat(fn, "() missing required argument '", names[i], "' (pos ", i + 1, ")"));
}

int64_t fast_int(PyObject* o) {  // an int, or anything with __index__ (not a float), as pybind's int64_t
  const long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return int64_t(v);
}

int fast_rank(PyObject* o, const char* op) {
  const int64_t v = fast_int(o);
  if (v < INT_MIN || v > INT_MAX) throw py::index_error(mk::cat("superkernel Window.", op, ": rank ", v, " is out of range"));
  return int(v);
}

int64_t fast_value(PyObject* o) {  // Python's int(o), as Window.fetch_add / compare_swap did
  if (PyLong_Check(o)) return fast_int(o);
  py::object v = py::reinterpret_steal<py::object>(PyNumber_Long(o));
  if (!v) throw py::error_already_set();
  return fast_int(v.ptr());
}

bool fast_bool(PyObject* o) {
  if (!o) return false;
  const int v = PyObject_IsTrue(o);
  if (v < 0) throw py::error_already_set();
  return v != 0;
}

const at::Tensor& fast_tensor(PyObject* o, const char* op, const char* arg) {
  if (!THPVariable_Check(o))
    throw py::type_error(mk::cat("superkernel Window.", op, ": ", arg, " must be a tensor, got ", Py_TYPE(o)->tp_name));
  return THPVariable_Unpack(o);
}

std::optional<double> fast_timeout(PyObject* o) {
  if (!o || o == Py_None) return std::nullopt;
  const double v = PyFloat_AsDouble(o);
  if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

template <typename F>
PyObject* fast_call(F&& f) {
  try {
    return f().release().ptr();
  } catch (...) {
    py::detail::try_translate_exceptions();
    return nullptr;
  }
}

PyObject* fast_put(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"rank", "offset", "src", "notify", "async_op"};
    PyObject* a[5];
    fast_args("put", names, 3, args, nargs, kwnames, a);
    std::optional<int64_t> notify;
    if (a[3] && a[3] != Py_None) notify = fast_int(a[3]);
    return window_put(fast_self(self), fast_rank(a[0], "put"), fast_int(a[1]), fast_tensor(a[2], "put", "src"), notify,
                      fast_bool(a[4]));
  });
}

PyObject* fast_get(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"rank", "offset", "out", "async_op"};
    PyObject* a[4];
    fast_args("get", names, 3, args, nargs, kwnames, a);
    return window_get(fast_self(self), fast_rank(a[0], "get"), fast_int(a[1]), fast_tensor(a[2], "get", "out"),
                      fast_bool(a[3]));
  });
}

PyObject* fast_accumulate(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"rank", "offset", "src", "op", "async_op"};
    PyObject* a[5];
    fast_args("accumulate", names, 3, args, nargs, kwnames, a);
    std::string_view op = "sum";
    if (a[3]) {
      Py_ssize_t len = 0;
      const char* s = PyUnicode_Check(a[3]) ? PyUnicode_AsUTF8AndSize(a[3], &len) : nullptr;
      if (!s) {
        if (PyErr_Occurred()) throw py::error_already_set();
        throw py::type_error(mk::cat("superkernel Window.accumulate: op must be a str, got ", Py_TYPE(a[3])->tp_name));
      }
      op = std::string_view(s, size_t(len));
    }
    return window_accumulate(fast_self(self), fast_rank(a[0], "accumulate"), fast_int(a[1]),
                             fast_tensor(a[2], "accumulate", "src"), op, fast_bool(a[4]));
  });
}

PyObject* fast_fetch_add(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"rank", "offset", "value", "async_op"};
    PyObject* a[4];
    fast_args("fetch_add", names, 3, args, nargs, kwnames, a);
    return window_atomic(fast_self(self), fast_rank(a[0], "fetch_add"), fast_int(a[1]), false, fast_value(a[2]), 0,
                         fast_bool(a[3]));
  });
}

PyObject* fast_compare_swap(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"rank", "offset", "expected", "desired", "async_op"};
    PyObject* a[5];
    fast_args("compare_swap", names, 4, args, nargs, kwnames, a);
    return window_atomic(fast_self(self), fast_rank(a[0], "compare_swap"), fast_int(a[1]), true, fast_value(a[2]),
                         fast_value(a[3]), fast_bool(a[4]));
  });
}

PyObject* fast_flush(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"rank", "timeout"};
    PyObject* a[2];
    fast_args("flush", names, 1, args, nargs, kwnames, a);
    window_flush(fast_self(self), false, fast_rank(a[0], "flush"), fast_timeout(a[1]));
    return py::none();
  });
}

PyObject* fast_flush_all(PyObject* self, PyObject* const* args, Py_ssize_t nargs, PyObject* kwnames) {
  return fast_call([&] {
    static const char* const names[] = {"timeout"};
    PyObject* a[1];
    fast_args("flush_all", names, 0, args, nargs, kwnames, a);
    window_flush(fast_self(self), true, 0, fast_timeout(a[0]));
    return py::none();
  });
}

#define MK_FAST(name, doc) \
  PyMethodDef { #name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&fast_##name)), METH_FASTCALL | METH_KEYWORDS, doc }
PyMethodDef fast_methods[] = {
    MK_FAST(put, "put(rank, offset, src, notify=None, async_op=False): superkernel.memory.Window.put"),
    MK_FAST(get, "get(rank, offset, out, async_op=False): superkernel.memory.Window.get"),
    MK_FAST(accumulate, "accumulate(rank, offset, src, op='sum', async_op=False): superkernel.memory.Window.accumulate"),
    MK_FAST(fetch_add, "fetch_add(rank, offset, value, async_op=False): superkernel.memory.Window.fetch_add"),
    MK_FAST(compare_swap,
            "compare_swap(rank, offset, expected, desired, async_op=False): superkernel.memory.Window.compare_swap"),
    MK_FAST(flush, "flush(rank, timeout=None): superkernel.memory.Window.flush"),
    MK_FAST(flush_all, "flush_all(timeout=None): superkernel.memory.Window.flush_all"),
};
#undef MK_FAST

// {name: builtin function} bound to the window `self` (a capsule pointing at it keeps it alive).
py::dict window_fast_ops(const py::object& self) {
  PyWindow& p = self.cast<PyWindow&>();
  py::object cap = py::reinterpret_steal<py::object>(PyCapsule_New(&p, kFastCapsule, [](PyObject* c) {
    Py_XDECREF(static_cast<PyObject*>(PyCapsule_GetContext(c)));
  }));
  if (!cap) throw py::error_already_set();
  if (PyCapsule_SetContext(cap.ptr(), self.ptr()) != 0) throw py::error_already_set();
  self.inc_ref();  // released by the capsule's destructor
  py::dict ops;
  for (PyMethodDef& def : fast_methods) {
    py::object f = py::reinterpret_steal<py::object>(PyCFunction_New(&def, cap.ptr()));
    if (!f) throw py::error_already_set();
    ops[def.ml_name] = f;
  }
  return ops;
}

// A tuner that saw these calls (their durations per candidate, replayed in turn: the j-th call of every
// candidate, then the next), for tuner_pick and tuner_kept.
mk::kernels::Tuner replay_tuner(const std::vector<int64_t>& candidates, const std::vector<std::vector<double>>& seconds) {
  TORCH_CHECK(!candidates.empty() && seconds.size() == candidates.size(),
              "tuner_pick, tuner_kept: one list of timings per candidate");
  mk::kernels::Tuner t;
  t.start(candidates);
  size_t rounds = 0;
  for (const auto& s : seconds) rounds = std::max(rounds, s.size());
  for (size_t j = 0; j < rounds; ++j)
    for (size_t i = 0; i < seconds.size(); ++i)
      if (j < seconds[i].size()) t.record(candidates[i], seconds[i][j]);
  return t;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  py::module_::import("torch.distributed");
  m.doc() = "superkernel C++ extension: the mk torch.distributed backend";

  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::duration<float> timeout,
         const std::string& group_name) { return mk::ProcessGroupMK::create(store, rank, size, timeout, group_name); },
      py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("timeout"), py::arg("group_name") = "",
      py::call_guard<py::gil_scoped_release>(),
      "Create an mk backend (torch.distributed calls this through Backend.register_backend).");

  m.def("cancel_waits", &mk::cancel_waits,
        "Make every mk wait in this process fail at once with 'cancelled by an interrupt' (the group is aborted), "
        "and abort the Gloo send/recv works that fused ops are waiting for (transport/cancel_hook.h).");

  m.def("eager_call", &mk::kernels::make_eager_call, py::arg("name"), py::arg("overload") = "",
        "A direct entry into the torch.ops operator `name` for eager calls without autograd "
        "(superkernel.ops.dispatch.call; csrc/kernels/eager_call.h).");

  m.def("host_identity", &mk::host_identity, "The identity mk uses to decide which ranks share memory.");

  auto half_type = [](const std::string& dtype, const char* fn) {
    TORCH_CHECK(dtype == "bfloat16" || dtype == "float16", fn, ": bfloat16 or float16, not ", dtype);
    return dtype == "bfloat16" ? at::kBFloat16 : at::kHalf;
  };
  m.def(
      "half_gemm_native",
      [half_type](const std::string& dtype) {
        return mk::kernels::native_half_gemm(half_type(dtype, "half_gemm_native"), c10::Device("cpu"));
      },
      py::arg("dtype"),
      "Whether the ops multiply this half type as it is on this process's CPU (else on operands widened to fp32): "
      "oneDNN supports it and SUPERKERNEL_OPS_WIDEN_HALF does not name it (once per process; kernels/pipeline.h).");

  m.def(
      "small_half_limit",
      [half_type](const std::string& dtype) { return mk::kernels::small_half_limit(half_type(dtype, "small_half_limit")); },
      py::arg("dtype"),
      "The most multiply-adds of a GEMM of this half type that the ops, where they multiply it as it is, make on "
      "operands widened to fp32 and rounded instead: SUPERKERNEL_OPS_SMALL_HALF_GEMM, else measured on this CPU at "
      "the first call (kernels/pipeline.h); 0 where the type is widened anyway.");
  m.def(
      "small_half_gemm",
      [half_type](const std::string& dtype, int64_t rows, int64_t k, int64_t n, int64_t limit) {
        const at::ScalarType t = half_type(dtype, "small_half_gemm");
        return mk::kernels::small_half_gemm(rows, k, n, limit >= 0 ? limit : mk::kernels::small_half_limit(t));
      },
      py::arg("dtype"), py::arg("rows"), py::arg("k"), py::arg("n"), py::arg("limit") = -1,
      "Whether the GEMM ops make a [rows, k] x [k, n] product of a half type they multiply as it is on operands "
      "widened to fp32, rounded to the half type (a GEMM too small for oneDNN's fixed cost; kernels/pipeline.h), "
      "with this process's small_half_limit or `limit` (another process's, as a model of its products).");
  m.def("packed_gemm_present", &mk::kernels::packed_gemm_present,
        "Whether MKL's packed sgemm was found in this process's libtorch (kernels/packed_gemm.h).");
  m.def("packed_gemm_available", &mk::kernels::packed_gemm_available,
        "Whether the GEMM ops can pack an fp32 b once for their chunks' products (MKL's packed sgemm found in "
        "this process) and SUPERKERNEL_OPS_PACKED_B does not say 0 (kernels/packed_gemm.h).");
  m.def(
      "packed_gemm_probe",
      [] {
        const mk::kernels::PackProbe p = mk::kernels::packed_gemm_probe();
        py::dict d;
        d["plain_ms"] = p.plain_ms;
        d["packed_ms"] = p.packed_ms;
        d["pays"] = p.pays;
        d["ratio"] = mk::kernels::kPackedProbeRatio;
        return d;
      },
      "This process's timing of 512x1024x1024 in four row blocks, plain and from b packed once (ms, the best of "
      "four), and whether packing pays here (packed <= ratio x plain); timed on the first call "
      "(kernels/packed_gemm.h).");
  m.def("packed_gemm_offer", &mk::kernels::packed_gemm_offer,
        "What this process offers to a GEMM op's agreement on packing b: the probe's verdict, or what "
        "SUPERKERNEL_OPS_PACKED_B says (0: no; 1, all: yes).");
  m.def("packed_products", &mk::kernels::packed_products,
        "How many products this process made from a packed b (the probe's own not counted).");
  m.def(
      "chunked_mm",
      [](const at::Tensor& a, const at::Tensor& b, int64_t chunks, bool packed) {
        TORCH_CHECK(a.dim() == 2 && b.dim() == 2 && a.size(1) == b.size(0) && a.scalar_type() == at::kFloat &&
                        b.scalar_type() == at::kFloat && a.device().is_cpu() && b.device().is_cpu(),
                    "chunked_mm: fp32 CPU a [m, k] and b [k, n]");
        TORCH_CHECK(chunks >= 1, "chunked_mm: chunks must be >= 1");
        const int64_t m = a.size(0);
        at::Tensor out = at::empty({m, b.size(1)}, a.options());
        const int64_t rows = (m + chunks - 1) / chunks;
        std::optional<mk::kernels::PackedB> pb;
        if (packed) {
          pb.emplace(b, std::max<int64_t>(rows, 1));
          TORCH_CHECK(!pb->empty(), "chunked_mm: b could not be packed (packed_gemm_available() is False?)");
        }
        for (int64_t lo = 0; lo < m; lo += rows) {
          const int64_t r = std::min(rows, m - lo);
          at::Tensor dst = out.narrow(0, lo, r);
          if (!pb || !pb->into(dst, a.narrow(0, lo, r))) at::mm_out(dst, a.narrow(0, lo, r), b);
        }
        return out;
      },
      py::arg("a"), py::arg("b"), py::arg("chunks"), py::arg("packed"),
      "a @ b as the GEMM ops make it in `chunks` row blocks: each block with ATen's matmul, or from b packed once "
      "(packed=True); for bench/packed_gemm.py and the tests.");
  m.attr("HALF_GEMM_CALL") = int64_t(mk::kernels::kHalfGemmCall);  // (the tests' model of the in-place rule)
  m.def("small_half_setting", &mk::kernels::small_half_setting,
        "SUPERKERNEL_OPS_SMALL_HALF_GEMM as read, -1 when unset; raises when it is no non-negative integer.");

  m.def(
      "tuner_pick",
      [](const std::vector<int64_t>& candidates, const std::vector<std::vector<double>>& seconds) {
        const mk::kernels::Tuner t = replay_tuner(candidates, seconds);
        return std::make_pair(t.next(), t.done());
      },
      py::arg("candidates"), py::arg("seconds"),
      "(chunks, tuned): the chunk count the automatic tuner uses next after these calls (their durations per "
      "candidate, in call order, replayed in turn; each candidate's first is not timed), and whether tuning is "
      "over (kernels/pipeline.h, Tuner).");

  m.def(
      "tuner_kept",
      [](const std::vector<int64_t>& candidates, const std::vector<std::vector<double>>& seconds) {
        const mk::kernels::Tuner t = replay_tuner(candidates, seconds);
        std::vector<size_t> kept;
        for (const auto& s : t.seconds) kept.push_back(s.size());
        return kept;
      },
      py::arg("candidates"), py::arg("seconds"),
      "How many timings the tuner keeps per candidate after the calls tuner_pick takes (bounded however many).");

  m.def(
      "tuner_calls",
      [](const std::vector<int64_t>& candidates, const std::vector<double>& seconds, size_t calls) {
        TORCH_CHECK(!candidates.empty() && seconds.size() == candidates.size(),
                    "tuner_calls: one duration per candidate");
        mk::kernels::Tuner t;
        t.start(candidates);
        std::vector<int64_t> proposed;
        for (size_t i = 0; i < calls; ++i) {
          // as an op call does: propose (Pipeline::chunks), record the previous call in the agreement
          // (Pipeline::use_chunks), run, keep this call's time for the next (Pipeline::record_timing)
          const int64_t c = t.next();
          proposed.push_back(c);
          const mk::kernels::Tuner::Last last = t.take_last();
          if (last.chunks != 0) t.record(last.chunks, double(last.micros) * 1e-6);
          if (t.done()) continue;
          const size_t j = size_t(std::find(candidates.begin(), candidates.end(), c) - candidates.begin());
          TORCH_CHECK(j < candidates.size(), "tuner_calls: proposed ", c, ", not a candidate");
          t.last = {uint64_t(i), c, int64_t(std::llround(seconds[j] * 1e6))};
        }
        return std::make_pair(proposed, t.done());
      },
      py::arg("candidates"), py::arg("seconds"), py::arg("calls"),
      "(proposals, tuned): the chunk counts the tuner proposes over `calls` op calls whose durations are "
      "`seconds` per candidate, each recorded in the call after it, as Pipeline records the slowest rank's "
      "time (kernels/pipeline.h, Tuner), and whether tuning is over.");

  m.def(
      "descriptor_version_problem",
      [](int64_t word, int peer) { return mk::kernels::descriptor_version_problem(word, peer); },
      py::arg("word"), py::arg("peer"),
      "What this rank would report of rank `peer`'s argument descriptor starting with `word` (empty: this "
      "build's version); kernels/group.h.");

  m.def(
      "tuner_limits",
      [](size_t candidates) {
        using mk::kernels::Tuner;
        return py::dict(py::arg("trials") = Tuner::kTrials, py::arg("final_trials") = Tuner::kFinalTrials,
                        py::arg("drop_ratio") = Tuner::kDropRatio, py::arg("confidence_z") = Tuner::kConfidenceZ,
                        py::arg("most_calls") = Tuner::most_calls(candidates),
                        py::arg("plain_path") = mk::kernels::kPlainPath,
                        py::arg("most_candidates") = Tuner::kMostCandidates);
      },
      py::arg("candidates") = mk::kernels::Tuner::kMostCandidates,
      "The automatic chunk tuner's constants, the most calls tuning that many candidates takes (by default as "
      "many as Pipeline::chunks proposes at most, most_candidates: 4 chunk counts and an op's plain path), and "
      "the candidate that stands for the plain path.");

  m.def(
      "copy_bytes",
      [](const at::Tensor& dst, const at::Tensor& src, const std::string& use) {
        TORCH_CHECK(dst.device().is_cpu() && src.device().is_cpu() && dst.is_contiguous() && src.is_contiguous(),
                    "mk copy_bytes: dst and src must be contiguous CPU tensors");
        const size_t n = size_t(src.numel()) * src.element_size();
        TORCH_CHECK(size_t(dst.numel()) * dst.element_size() == n, "mk copy_bytes: dst holds ",
                    dst.numel() * dst.element_size(), " bytes, src ", n);
        const mk::CopyUse u = copy_use(use);
        py::gil_scoped_release nogil;
        mk::copy_bytes(dst.data_ptr(), src.data_ptr(), n, u);
      },
      py::arg("dst"), py::arg("src"), py::arg("use") = "window",
      "Copy src's bytes into dst the way windows ('window') or collectives ('collective') copy to and from "
      "mapped memory (bench/window_copy.py).");
  py::class_<mk::StoreCall, std::shared_ptr<mk::StoreCall>>(
      m, "StoreCall", "A c10d Store call running on superkernel's Store worker thread (csrc/store_worker.h).")
      .def(
          "wait",
          [](mk::StoreCall& c, double timeout) {
            std::vector<uint8_t> v;
            try {
              py::gil_scoped_release nogil;
              v = c.wait(std::chrono::milliseconds(int64_t(timeout * 1000)));
            } catch (const c10::Error& e) {  // the Store's own error (a timeout, a lost server)
              throw std::runtime_error(e.what_without_backtrace());
            }
            return py::bytes(reinterpret_cast<const char*>(v.data()), v.size());
          },
          py::arg("timeout"),
          "The Store's answer (bytes), once. RuntimeError: the Store's error, or no answer within `timeout` s.")
      .def("done", &mk::StoreCall::done, "Whether the answer (or an error) is there.");
  m.def(
      "store_compare_set_async",
      [](const c10::intrusive_ptr<c10d::Store>& store, const std::string& key, const std::string& expected,
         const std::string& desired) {
        return mk::store_compare_set_async(store, key, std::vector<uint8_t>(expected.begin(), expected.end()),
                                           std::vector<uint8_t>(desired.begin(), desired.end()));
      },
      py::arg("store"), py::arg("key"), py::arg("expected"), py::arg("desired"),
      "store.compare_set(key, expected, desired) on superkernel's Store worker thread: returns a StoreCall at once.");
  m.def(
      "set_store_worker_linger",
      [](int64_t microseconds) {
        if (microseconds < 0) throw py::value_error("set_store_worker_linger: microseconds must be >= 0");
        return int64_t(mk::set_store_worker_linger(std::chrono::microseconds(microseconds)).count());
      },
      py::arg("microseconds"),
      "How long the Store worker thread polls for its next call before it sleeps (default 250 us); returns the "
      "previous value.");
  m.def(
      "copy_method", [](int64_t nbytes, const std::string& use) { return mk::copy_method(size_t(nbytes), copy_use(use)); },
      py::arg("nbytes"), py::arg("use") = "window",
      "How copy_bytes copies that many bytes for `use` ('window' or 'collective'): 'memcpy', 'pieces' or 'stream'.");

  m.def(
      "transports",
      [](const c10::intrusive_ptr<c10d::Backend>& b) {
        auto& c = as_mk(b).comm();
        std::vector<std::string> out;
        for (int p = 0; p < c.size(); ++p) out.emplace_back(c.transport_of(p));
        return out;
      },
      py::arg("backend"), "Per peer rank: 'self', 'shm' or 'tcp'.");

  m.def(
      "collective_runs",
      [](const c10::intrusive_ptr<c10d::Backend>& b) { return as_mk(b).runs(); }, py::arg("backend"),
      "(on the caller, on the worker): how many of this group's collectives ran on the thread that issued them "
      "and how many on its worker thread.");

  m.def(
      "peer_hosts",
      [](const c10::intrusive_ptr<c10d::Backend>& b) {
        auto& c = as_mk(b).comm();
        std::vector<std::string> out;
        for (const auto& p : c.peers()) out.push_back(p.host_name);
        return out;
      },
      py::arg("backend"), "Per peer rank: its host name.");

  m.def(
      "aborted",
      [](const c10::intrusive_ptr<c10d::Backend>& b) {
        auto& c = as_mk(b).comm();
        return c.aborted() ? std::optional<std::string>(c.abort_reason()) : std::nullopt;
      },
      py::arg("backend"), "None while the communicator is usable, else why it was aborted.");

  // ---- one-sided windows ----
  py_peer_error = py::exception<mk::PeerError>(m, "PeerError", PyExc_RuntimeError).release();
  py_cancelled_error = py::exception<mk::CancelledError>(m, "CancelledError", PyExc_RuntimeError).release();

  py::class_<WindowFuture>(m, "WindowFuture", "A one-sided operation started with async_op=True.")
      .def("wait", &WindowFuture::wait, py::arg("timeout") = py::none(),
           "Wait until the operation completed at the target; returns None, or the old value of fetch_add / "
           "compare_swap.")
      .def("done", &WindowFuture::done)
      .def("is_completed", &WindowFuture::done, "torch.distributed Work's name for done().")
      .def("is_success", [](const WindowFuture& f) { return !f.req || (f.req->test() && !f.req->failed()); },
           "Completed without error (False while pending).");

  py::class_<PyWindow, PyWindowPtr>(m, "Window", "The C++ side of superkernel.memory.Window.")
      .def(py::init([](const c10::intrusive_ptr<c10d::Backend>& b, int64_t count, c10::ScalarType st,
                       std::optional<at::Tensor> init) {
             auto& pg = as_mk(b);
             auto pw = std::make_shared<PyWindow>();
             pw->backend = b;
             pw->dtype = st;
             pw->esize = size_t(c10::elementSize(st));
             if (count < 0) throw py::value_error("superkernel Window: the element count must be >= 0");
             const mk::DType t = window_dtype(st);
             const void* init_ptr = nullptr;
             if (init) {
               auto [ptr, n] = window_buffer(*pw, *init, "__init__", "tensor");
               if (int64_t(n) != count) throw py::value_error("superkernel Window: init has the wrong element count");
               init_ptr = ptr;
             }
             window_call([&] {
               py::gil_scoped_release nogil;
               pw->win = std::make_unique<mk::Window>(pg.comm(), size_t(count), t, pg.comm().deadline(), init_ptr);
             });
             return pw;
           }),
           py::arg("backend"), py::arg("count"), py::arg("dtype"), py::arg("init") = py::none(),
           "Collective: expose `count` elements of `dtype` on this rank (initialised from `init`, else zeros).")
      .def_property_readonly("id", [](const PyWindow& p) { return p.w().id(); })
      .def_property_readonly("rank", [](const PyWindow& p) { return p.w().rank(); })
      .def_property_readonly("world_size", [](const PyWindow& p) { return p.w().world(); })
      .def_property_readonly("freed", [](const PyWindow& p) { return p.w().freed(); })
      .def("size", [](const PyWindow& p, int rank) { return window_call([&] { return p.w().count(rank); }); })
      .def("transport", [](const PyWindow& p, int rank) { return window_call([&] { return std::string(p.w().transport_of(rank)); }); })
      .def("local_tensor",
           [](const PyWindow& p) {
             return window_call([&] {
               std::shared_ptr<void> keep = p.w().local_keepalive();
               const int64_t n = int64_t(p.w().count(p.w().rank()));
               return at::from_blob(p.w().local_data(), {n}, [keep](void*) {}, at::TensorOptions().dtype(p.dtype));
             });
           },
           "This rank's exposed elements as a 1-D tensor (it keeps the memory mapped, also after free).")
      .def("put",
           [](PyWindow& p, int target, int64_t offset, const at::Tensor& src, std::optional<int64_t> notify,
              bool async_op) { return window_put(p, target, offset, src, notify, async_op); },
           py::arg("rank"), py::arg("offset"), py::arg("src"), py::arg("notify") = py::none(),
           py::arg("async_op") = false)
      .def("get",
           [](PyWindow& p, int target, int64_t offset, const at::Tensor& out, bool async_op) {
             return window_get(p, target, offset, out, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("out"), py::arg("async_op") = false)
      .def("accumulate",
           [](PyWindow& p, int target, int64_t offset, const at::Tensor& src, const std::string& op, bool async_op) {
             return window_accumulate(p, target, offset, src, op, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("src"), py::arg("op") = "sum", py::arg("async_op") = false)
      .def("atomic",
           [](PyWindow& p, int target, int64_t offset, bool cas, int64_t a, int64_t b, bool async_op) {
             return window_atomic(p, target, offset, cas, a, b, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("cas"), py::arg("a"), py::arg("b"), py::arg("async_op") = false)
      .def("flush",
           [](PyWindow& p, int target, std::optional<double> timeout) { window_flush(p, false, target, timeout); },
           py::arg("rank"), py::arg("timeout") = py::none())
      .def("flush_all", [](PyWindow& p, std::optional<double> timeout) { window_flush(p, true, 0, timeout); },
           py::arg("timeout") = py::none())
      .def("fast_ops", &window_fast_ops,
           "{name: function}: put, get, accumulate, fetch_add, compare_swap, flush and flush_all of this window as "
           "vectorcall builtins with the signatures of superkernel.memory.Window's methods (no Python frame, no "
           "pybind dispatch).")
      .def("fence", [](const PyWindow& p, int target) { window_call([&] { p.w().fence(target); }); }, py::arg("rank"))
      // TensorStore's allocator on this (int64 allocator) window: csrc/transport/pool_allocator.h
      .def("pool_allocate",
           [](PyWindow& p, int64_t need, int only, int64_t versions, int64_t align, double timeout) {
             return window_call([&] {
               py::gil_scoped_release nogil;
               auto a = mk::PoolAllocator(p.w(), size_t(versions), align, pool_timeout(timeout)).allocate(need, only);
               return std::make_tuple(a.rank, a.offset, a.version, a.frees, a.largest);
             });
           },
           py::arg("need"), py::arg("only"), py::arg("versions"), py::arg("align"), py::arg("timeout"),
           "(rank, offset, version, frees, largest): `need` bytes reserved on rank `only` (>= 0) or by free capacity; "
           "rank -1 when nothing fits (largest: the largest free extent).")
      .def("pool_release",
           [](PyWindow& p, int rank, int64_t offset, int64_t length, int64_t objects, int64_t versions, int64_t align,
              double timeout) {
             return window_call([&] {
               py::gil_scoped_release nogil;
               return mk::PoolAllocator(p.w(), size_t(versions), align, pool_timeout(timeout))
                   .release(rank, offset, length, objects);
             });
           },
           py::arg("rank"), py::arg("offset"), py::arg("length"), py::arg("objects"), py::arg("versions"),
           py::arg("align"), py::arg("timeout"),
           "Free [offset, offset + length) of `rank`'s data; returns its free counter as it was before.")
      .def("pool_usage",
           [](PyWindow& p, int rank, int64_t versions, int64_t align) {
             return window_call([&] {
               py::gil_scoped_release nogil;
               auto u = mk::PoolAllocator(p.w(), size_t(versions), align, std::chrono::milliseconds(0)).usage(rank);
               return std::make_tuple(u.capacity, u.used, u.objects, u.free_extents, u.largest_free);
             });
           },
           py::arg("rank"), py::arg("versions"), py::arg("align"),
           "(capacity, used, objects, free extents, largest free extent) of `rank` (a snapshot, no lock).")
      .def("wait_notify",
           [](const PyWindow& p, int64_t tag, std::optional<double> timeout) {
             if (tag < 0) throw py::index_error("superkernel Window.wait_notify: tag must be >= 0");
             window_call([&] {
               mk::Deadline d = window_deadline(p.w(), timeout);
               py::gil_scoped_release nogil;
               p.w().wait_notify(uint64_t(tag), d);
             });
           },
           py::arg("tag"), py::arg("timeout") = py::none())
      .def("test_notify",
           [](const PyWindow& p, int64_t tag) {
             if (tag < 0) throw py::index_error("superkernel Window.test_notify: tag must be >= 0");
             return window_call([&] { return p.w().test_notify(uint64_t(tag)); });
           },
           py::arg("tag"))
      .def("free",
           [](PyWindow& p, std::optional<double> timeout) {
             window_call([&] {
               mk::Deadline d = window_deadline(p.w(), timeout);
               py::gil_scoped_release nogil;
               p.w().free(d);
             });
             p.release_done();
           },
           py::arg("timeout") = py::none());
}
