// Exchange: the point-to-point transfers of one fused-operator call (MoE dispatch/combine, ring attention).
// On the mk backend the transfers go straight to the transport (Comm::isend/irecv in a tag space of their
// own, waits on the transport's Deadline and cancel generation); on any other backend (gloo, nccl) they use
// the backend's asynchronous send/recv Works, polled so that an interrupt (mk::cancel_all) or the group's
// timeout ends the wait. Every rank of the group must create its Exchanges in the same order (like
// collectives): the call's sequence number picks the tags.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "transport/request.h"

namespace mk {
class Comm;
}

namespace mk::kernels {

class Exchange {
 public:
  // `op` names the operator in every error ("mk moe_dispatch_gemm: rank 1, peer 0: ...").
  Exchange(const std::string& group_name, const char* op, const at::Device& device);
  ~Exchange();  // withdraws what is still posted (after an error) so no transfer writes into freed memory
  Exchange(const Exchange&) = delete;
  Exchange& operator=(const Exchange&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  bool on_mk() const { return comm_ != nullptr; }
  const char* op() const { return op_; }

  // Every rank's 1-d int64 `mine` (the same length on every rank), as [size, n], through the group's own
  // all_gather. Used to agree on shapes before any data moves, so disagreement fails on every rank.
  at::Tensor allgather(const at::Tensor& mine);

  // Start a transfer of a contiguous tensor; the returned id is for wait(). The tensor must stay alive
  // (the Exchange keeps a reference) and must not be touched until the wait. `slot` (< 2^16) names the
  // message between this pair of ranks within this call: a send matches the peer's recv with the same slot.
  size_t send(int peer, const at::Tensor& t, uint32_t slot);
  size_t recv(int peer, const at::Tensor& t, uint32_t slot);
  void wait(size_t id);
  void wait_all();

 private:
  struct Pending {
    int peer;
    bool sending;
    at::Tensor tensor;
    RequestPtr req;                    // mk
    c10::intrusive_ptr<c10d::Work> work;  // other backends
    bool done = false;
  };
  size_t post(int peer, const at::Tensor& t, uint32_t slot, bool sending);

  const char* op_;
  c10::intrusive_ptr<c10d::ProcessGroup> pg_;
  c10::intrusive_ptr<c10d::Backend> backend_;
  Comm* comm_ = nullptr;
  int rank_ = 0, size_ = 1;
  uint64_t seq_ = 0;
  std::chrono::milliseconds timeout_;
  std::chrono::steady_clock::time_point start_;
  uint64_t cancel_gen_ = 0;
  std::vector<Pending> pending_;
};

}  // namespace mk::kernels
