// superkernel._C: the backend creator for torch.distributed, and the transport's introspection hooks.
#include <pybind11/chrono.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/utils/pybind.h>

#include "transport/deadline.h"
#include "transport/host.h"
#include "transport/process_group.h"

namespace py = pybind11;

namespace {

mk::ProcessGroupMK& as_mk(const c10::intrusive_ptr<c10d::Backend>& b) {
  auto* pg = dynamic_cast<mk::ProcessGroupMK*>(b.get());
  TORCH_CHECK(pg != nullptr, "superkernel: the backend is ", b->getBackendName(), ", not mk");
  return *pg;
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
}
