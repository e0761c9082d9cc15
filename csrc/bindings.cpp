// superkernel._C: the backend creator for torch.distributed, and the transport's introspection hooks.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include "transport/deadline.h"
#include "transport/host.h"
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

struct PyWindow {
  c10::intrusive_ptr<c10d::Backend> backend;  // owns the communicator the window uses
  // Tensors of operations that were not known complete when their call returned (async, or a wait that
  // failed): the provider may still read or write them, so they live until the request finished.
  std::vector<std::pair<mk::RequestPtr, py::object>> held;
  std::unique_ptr<mk::Window> win;  // destroyed before `held` (it waits for its requests)
  c10::ScalarType dtype;
  mk::Window& w() const { return *win; }
  void hold(const mk::RequestPtr& r, py::object keep) {
    release_done();
    held.emplace_back(r, std::move(keep));
  }
  void release_done() {
    held.erase(std::remove_if(held.begin(), held.end(), [](const auto& h) { return h.first->test(); }), held.end());
  }
};
using PyWindowPtr = std::shared_ptr<PyWindow>;

// An operation started with async_op=True: wait() returns its value (None, or the old int64).
struct WindowFuture {
  PyWindowPtr owner;
  mk::RequestPtr req;  // null: completed at once
  std::shared_ptr<int64_t> result;
  py::object keep;  // the tensors the operation reads or writes
  const char* op;
  int target;
  py::object wait(std::optional<double> timeout) {
    window_call([&] {
      mk::Deadline d = window_deadline(owner->w(), timeout);
      py::gil_scoped_release nogil;
      owner->w().wait(req, d, op, target);
    });
    keep = py::none();
    if (result) return py::int_(*result);
    return py::none();
  }
  bool done() const { return !req || req->test(); }
};

// A contiguous CPU tensor of the window's dtype: its data pointer and element count.
std::pair<char*, size_t> window_buffer(const PyWindow& pw, const at::Tensor& t, const char* op, const char* arg) {
  if (!t.device().is_cpu())
    throw py::value_error(mk::cat("superkernel Window.", op, ": ", arg, " must be a CPU tensor, got ", t.device().str()));
  if (t.scalar_type() != pw.dtype)
    throw py::type_error(mk::cat("superkernel Window.", op, ": ", arg, " has dtype ", c10::toString(t.scalar_type()),
                                 " but the window holds ", c10::toString(pw.dtype)));
  if (!t.is_contiguous())
    throw py::value_error(mk::cat("superkernel Window.", op, ": ", arg, " must be contiguous"));
  return {static_cast<char*>(t.data_ptr()), size_t(t.numel())};
}

mk::RedOp window_redop(const std::string& op) {
  if (op == "sum") return mk::RedOp::sum;
  if (op == "min") return mk::RedOp::min;
  if (op == "max") return mk::RedOp::max;
  throw py::value_error("superkernel Window.accumulate: op must be 'sum', 'min' or 'max', got '" + op + "'");
}

// Finish an operation: blocking -> wait and return value; async -> a WindowFuture.
py::object window_finish(const PyWindowPtr& pw, mk::RequestPtr req, std::shared_ptr<int64_t> result, py::object keep,
                         const char* op, int target, bool async_op) {
  if (req && !keep.is_none() && (async_op || !req->test())) pw->hold(req, keep);
  auto f = WindowFuture{pw, std::move(req), std::move(result), std::move(keep), op, target};
  if (async_op) return py::cast(std::move(f));
  if (f.req) return f.wait(std::nullopt);
  if (f.result) return py::int_(*f.result);
  return py::none();
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  py::module_::import("torch.distributed");
  m.doc() = "superkernel C++ extension: the mk torch.distributed backend";

  m.def(
      "create_backend",
      [](const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::duration<float> timeout) {
        return mk::ProcessGroupMK::create(store, rank, size, timeout);
      },
      py::arg("store"), py::arg("rank"), py::arg("world_size"), py::arg("timeout"),
      py::call_guard<py::gil_scoped_release>(),
      "Create an mk backend (torch.distributed calls this through Backend.register_backend).");

  m.def("cancel_waits", &mk::cancel_all,
        "Make every mk wait in this process fail at once with 'cancelled by an interrupt' (the group is aborted).");

  m.def("host_identity", &mk::host_identity, "The identity mk uses to decide which ranks share memory.");

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
           [](const PyWindowPtr& p, int target, int64_t offset, const at::Tensor& src, std::optional<int64_t> notify,
              bool async_op) {
             auto [ptr, n] = window_buffer(*p, src, "put", "src");
             if (offset < 0) throw py::index_error("superkernel Window.put: offset must be >= 0");
             if (notify && *notify < 0) throw py::index_error("superkernel Window.put: notify tag must be >= 0");
             mk::RequestPtr r = window_call([&] {
               py::gil_scoped_release nogil;
               return p->w().put(target, size_t(offset), ptr, n, notify ? uint64_t(*notify) : mk::kNoNotify);
             });
             return window_finish(p, r, nullptr, py::cast(src), "put", target, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("src"), py::arg("notify") = py::none(),
           py::arg("async_op") = false)
      .def("get",
           [](const PyWindowPtr& p, int target, int64_t offset, const at::Tensor& out, bool async_op) {
             auto [ptr, n] = window_buffer(*p, out, "get", "out");
             if (offset < 0) throw py::index_error("superkernel Window.get: offset must be >= 0");
             mk::RequestPtr r = window_call([&] {
               py::gil_scoped_release nogil;
               return p->w().get(target, size_t(offset), ptr, n);
             });
             return window_finish(p, r, nullptr, py::cast(out), "get", target, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("out"), py::arg("async_op") = false)
      .def("accumulate",
           [](const PyWindowPtr& p, int target, int64_t offset, const at::Tensor& src, const std::string& op,
              bool async_op) {
             auto [ptr, n] = window_buffer(*p, src, "accumulate", "src");
             const mk::RedOp rop = window_redop(op);
             if (offset < 0) throw py::index_error("superkernel Window.accumulate: offset must be >= 0");
             mk::RequestPtr r = window_call([&] {
               py::gil_scoped_release nogil;
               try {
                 return p->w().accumulate(target, size_t(offset), ptr, n, rop);
               } catch (const mk::RangeError&) {
                 throw;
               } catch (const mk::PeerError&) {
                 throw;
               } catch (const mk::TimeoutError&) {
                 throw;
               } catch (const mk::Error& e) {
                 throw mk::MismatchError(e.what());  // unsupported dtype/op: a ValueError
               }
             });
             return window_finish(p, r, nullptr, py::cast(src), "accumulate", target, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("src"), py::arg("op") = "sum", py::arg("async_op") = false)
      .def("atomic",
           [](const PyWindowPtr& p, int target, int64_t offset, bool cas, int64_t a, int64_t b, bool async_op) {
             if (offset < 0) throw py::index_error("superkernel Window: offset must be >= 0");
             if (p->dtype != at::kLong)
               throw py::type_error(mk::cat("superkernel Window.", cas ? "compare_swap" : "fetch_add",
                                            ": needs an int64 window, this one holds ", c10::toString(p->dtype)));
             auto result = std::make_shared<int64_t>(0);
             const mk::AmoOp op = cas ? mk::AmoOp::compare_swap : mk::AmoOp::fetch_add;
             mk::RequestPtr r = window_call([&] {
               py::gil_scoped_release nogil;
               return p->w().atomic(target, size_t(offset), op, a, b, result);
             });
             return window_finish(p, r, result, py::none(), cas ? "compare_swap" : "fetch_add", target, async_op);
           },
           py::arg("rank"), py::arg("offset"), py::arg("cas"), py::arg("a"), py::arg("b"), py::arg("async_op") = false)
      .def("flush",
           [](PyWindow& p, int target, std::optional<double> timeout) {
             window_call([&] {
               mk::Deadline d = window_deadline(p.w(), timeout);
               py::gil_scoped_release nogil;
               p.w().flush(target, d);
             });
             p.release_done();
           },
           py::arg("rank"), py::arg("timeout") = py::none())
      .def("flush_all",
           [](PyWindow& p, std::optional<double> timeout) {
             window_call([&] {
               mk::Deadline d = window_deadline(p.w(), timeout);
               py::gil_scoped_release nogil;
               p.w().flush_all(d);
             });
             p.release_done();
           },
           py::arg("timeout") = py::none())
      .def("fence", [](const PyWindow& p, int target) { window_call([&] { p.w().fence(target); }); }, py::arg("rank"))
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
