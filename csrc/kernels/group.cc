#include "kernels/group.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <sstream>

#include "transport/process_group.h"

namespace mk::kernels {

Comm& Group::comm() const {
  TORCH_CHECK(mk != nullptr, "mk: group ", name, " is not an mk group");
  return mk->comm();
}

std::string Group::backend_name() const { return backend ? backend->getBackendName() : std::string("?"); }

Group resolve_group(const std::string& group_name, const c10::Device& device, const char* op) {
  TORCH_CHECK(c10d::is_process_group_registered(group_name), "mk ", op, ": no process group named '", group_name,
              "' (pass pg.group_name of a group created by torch.distributed, or use the superkernel.ops wrappers)");
  Group g;
  g.name = group_name;
  g.pg = c10d::resolve_process_group(group_name);
  g.device = device;
  try {
    g.backend = g.pg->getBackend(device.type());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mk ", op, ": process group '", group_name, "' has no backend for ", device.type(),
                " tensors: ", e.what_without_backtrace());
  }
  g.rank = g.pg->getRank();
  g.size = g.pg->getSize();
  g.mk = dynamic_cast<ProcessGroupMK*>(g.backend.get());
  if (g.mk) {
    g.timeout = g.mk->comm().timeout();
  } else {
    try {
      g.timeout = g.backend->getBackendOptions()->timeout;
    } catch (const c10::Error&) {
      // Backends without options: keep the c10d default.
    }
  }
  return g;
}

int64_t dtype_code(at::ScalarType t) { return int64_t(t); }

namespace {

std::string value_text(const char* field, int64_t v) {
  if (std::string(field) == "dtype") return c10::toString(static_cast<at::ScalarType>(v));
  return std::to_string(v);
}

}  // namespace

std::vector<std::vector<int64_t>> agree(const Group& g, const char* op, const std::vector<Field>& fields,
                                        const std::string& local_error) {
  // Layout per rank: [ok, field values...]
  const int64_t width = int64_t(fields.size()) + 1;
  auto opts = at::TensorOptions().dtype(at::kLong).device(g.device);
  at::Tensor mine = at::empty({width}, at::TensorOptions().dtype(at::kLong));
  auto* p = mine.data_ptr<int64_t>();
  p[0] = local_error.empty() ? 1 : 0;
  for (size_t i = 0; i < fields.size(); ++i) p[i + 1] = fields[i].value;
  std::vector<std::vector<int64_t>> all(size_t(g.size), std::vector<int64_t>(fields.size()));
  if (g.size > 1) {
    at::Tensor in = mine.to(g.device);
    std::vector<at::Tensor> outs;
    for (int r = 0; r < g.size; ++r) outs.push_back(at::zeros({width}, opts));
    std::vector<std::vector<at::Tensor>> out_lists{outs};
    std::vector<at::Tensor> ins{in};
    try {
      auto work = g.backend->allgather(out_lists, ins, c10d::AllgatherOptions());
      work->wait(g.timeout);
    } catch (const c10::Error& e) {
      throw c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, uint32_t(__LINE__)},
                                  c10::str("mk ", op, ": rank ", g.rank, ": exchanging the argument descriptors with the ",
                                           g.size - 1, " other ranks failed: ", e.what_without_backtrace()));
    }
    std::vector<int64_t> oks(size_t(g.size));
    for (int r = 0; r < g.size; ++r) {
      at::Tensor t = out_lists[0][size_t(r)].cpu();
      const int64_t* q = t.data_ptr<int64_t>();
      oks[size_t(r)] = q[0];
      for (size_t i = 0; i < fields.size(); ++i) all[size_t(r)][i] = q[i + 1];
    }
    TORCH_CHECK(local_error.empty(), "mk ", op, ": rank ", g.rank, ": ", local_error);
    for (int r = 0; r < g.size; ++r)
      TORCH_CHECK(oks[size_t(r)] == 1, "mk ", op, ": rank ", r, " rejected its arguments (see rank ", r,
                  "'s error); no rank ran the op (this is rank ", g.rank, ")");
  } else {
    TORCH_CHECK(local_error.empty(), "mk ", op, ": rank ", g.rank, ": ", local_error);
    for (size_t i = 0; i < fields.size(); ++i) all[0][i] = fields[i].value;
  }
  std::ostringstream bad;
  for (size_t i = 0; i < fields.size(); ++i) {
    if (!fields[i].must_match) continue;
    bool same = true;
    for (int r = 1; r < g.size; ++r) same = same && all[size_t(r)][i] == all[0][i];
    if (same) continue;
    bad << (bad.tellp() > 0 ? "; " : "") << fields[i].name << " differs:";
    for (int r = 0; r < g.size; ++r) bad << " rank " << r << " has " << value_text(fields[i].name, all[size_t(r)][i]);
  }
  TORCH_CHECK(bad.tellp() == 0, "mk ", op, ": the ranks called it with different arguments (", bad.str(),
              "); every rank must pass matching shapes and dtypes (this is rank ", g.rank, " of ", g.size, ")");
  return all;
}

}  // namespace mk::kernels
