// The process group a fused operator runs on: resolved from its `group_name` (c10d::resolve_process_group),
// with the backend for the tensors' device, and whether that backend is mk (the pipeline then drives the
// transport directly) or anything else (gloo, nccl: the pipeline uses that backend's async collectives).
// Also the cross-rank agreement check every op runs first: each rank contributes a small descriptor
// (shapes, dtype, options, its own argument-check verdict); every rank sees all of them and either every
// rank proceeds or every rank throws, naming the op and the ranks that differ. Never a hang or a wrong
// answer because ranks called an op with different shapes.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mk {
class ProcessGroupMK;
class Comm;
}  // namespace mk

namespace mk::kernels {

struct Group {
  std::string name;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Backend> backend;  // the backend for `device`
  ProcessGroupMK* mk = nullptr;               // non-null when backend is ProcessGroupMK
  c10::Device device = c10::Device(c10::kCPU);
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};

  bool is_mk() const { return mk != nullptr; }
  Comm& comm() const;  // only when is_mk()
  std::string backend_name() const;
};

// Resolve `group_name` for tensors on `device`. TORCH_CHECK with the op's name when the name is unknown or
// the group has no backend for that device.
Group resolve_group(const std::string& group_name, const c10::Device& device, const char* op);

// One field of an agreement descriptor.
struct Field {
  const char* name;  // as shown in errors: "m", "k", "dtype", ...
  int64_t value;
  bool must_match = true;  // every rank must pass the same value (otherwise it is only exchanged)
};

// Exchange descriptors (one allgather of R small int64 vectors over the group) and check them.
// `local_error` is this rank's own argument-check verdict ("" = fine): a rank with a local error throws it
// (prefixed with op and rank), the others throw "rank X rejected its arguments" — so a bad call on one rank
// is an error on every rank. Fields with must_match that differ throw on every rank, listing the values per
// rank. Returns all ranks' values: result[r][i] = rank r's fields[i].value.
std::vector<std::vector<int64_t>> agree(const Group& g, const char* op, const std::vector<Field>& fields,
                                        const std::string& local_error);

// A dtype as a small integer for descriptors, and back to its name for messages.
int64_t dtype_code(at::ScalarType t);

}  // namespace mk::kernels
