#include "kernels/exchange.h"

#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <map>
#include <mutex>
#include <thread>

#include "transport/comm.h"
#include "transport/error.h"
#include "transport/process_group.h"

namespace mk::kernels {
namespace {

// Per group, the number of fused-operator calls so far: the same on every rank of the group.
uint64_t next_call(const std::string& group_name) {
  static std::mutex mu;
  static std::map<std::string, uint64_t> calls;
  std::lock_guard<std::mutex> lock(mu);
  return calls[group_name]++;
}

std::chrono::milliseconds backend_timeout(const c10::intrusive_ptr<c10d::Backend>& b) {
  try {
    return b->getBackendOptions()->timeout;
  } catch (const c10::Error&) {
    return std::chrono::minutes(30);  // c10d's default
  }
}

}  // namespace

Exchange::Exchange(const std::string& group_name, const char* op, const at::Device& device) : op_(op) {
  pg_ = c10d::resolve_process_group(group_name);
  rank_ = pg_->getRank();
  size_ = pg_->getSize();
  backend_ = pg_->getBackend(device.type());
  if (auto* m = dynamic_cast<ProcessGroupMK*>(backend_.get())) comm_ = &m->comm();
  seq_ = next_call(group_name);
  timeout_ = comm_ ? comm_->timeout() : backend_timeout(backend_);
  start_ = std::chrono::steady_clock::now();
  cancel_gen_ = cancel_generation().load(std::memory_order_acquire);
  if (comm_) {
    try {
      comm_->check_usable(op_);
    } catch (const Error& e) {
      C10_THROW_ERROR(DistBackendError, e.what());
    }
  }
}

Exchange::~Exchange() {
  bool unfinished_send = false;
  for (auto& p : pending_) {
    if (p.done) continue;
    if (comm_ && p.req && !p.req->test()) {
      if (p.sending)
        unfinished_send = true;
      else
        comm_->matcher().cancel(p.req, cat("rank ", rank_, ": ", op_, " failed"));
    }
  }
  // A send still reading a tensor we are about to free: stop the communicator (as the process group does
  // after a timeout or a lost peer) so no provider touches the memory again.
  if (unfinished_send) comm_->abort(cat("mk ", op_, ": rank ", rank_, " failed with transfers in flight"));
}

at::Tensor Exchange::allgather(const at::Tensor& mine) {
  TORCH_INTERNAL_ASSERT(mine.dim() == 1 && mine.scalar_type() == at::kLong);
  at::Tensor in = mine.contiguous();
  std::vector<at::Tensor> outs;
  for (int r = 0; r < size_; ++r) outs.push_back(at::empty_like(in));
  std::vector<std::vector<at::Tensor>> outputs{outs};
  std::vector<at::Tensor> inputs{in};
  c10d::AllgatherOptions opts;
  auto work = backend_->allgather(outputs, inputs, opts);
  work->wait();
  at::Tensor all = at::empty({size_, in.numel()}, in.options());
  for (int r = 0; r < size_; ++r) all[r].copy_(outputs[0][size_t(r)]);
  return all;
}

size_t Exchange::post(int peer, const at::Tensor& t, uint32_t slot, bool sending) {
  TORCH_INTERNAL_ASSERT(t.is_contiguous() && peer != rank_ && peer >= 0 && peer < size_ && slot < (1u << 16));
  const size_t id = pending_.size();
  Pending p{peer, sending, t, nullptr, {}, false};
  const size_t bytes = size_t(t.numel()) * t.element_size();
  if (comm_) {
    // A tag space of its own (bit 62), apart from user send/recv tags and collective tags (bit 63).
    const uint64_t tag = (1ull << 62) | ((seq_ & 0xffffffffffull) << 20) | slot;
    try {
      p.req = sending ? comm_->isend(peer, tag, t.data_ptr(), bytes, bytes + 1)
                      : comm_->irecv(peer, tag, t.data_ptr(), bytes, bytes + 1);
    } catch (const Error& e) {
      C10_THROW_ERROR(DistBackendError, cat("mk ", op_, ": ", e.what()));
    }
  } else {
    const int tag = int((1u << 30) | ((seq_ & 0x3fff) << 16) | slot);
    std::vector<at::Tensor> ts{t};
    p.work = sending ? backend_->send(ts, peer, tag) : backend_->recv(ts, peer, tag);
  }
  pending_.push_back(std::move(p));
  return id;
}

size_t Exchange::send(int peer, const at::Tensor& t, uint32_t slot) { return post(peer, t, slot, true); }
size_t Exchange::recv(int peer, const at::Tensor& t, uint32_t slot) { return post(peer, t, slot, false); }

void Exchange::wait(size_t id) {
  Pending& p = pending_.at(id);
  if (p.done) return;
  const auto deadline = start_ + timeout_;
  const char* dir = p.sending ? "send to" : "recv from";
  if (comm_) {
    try {
      comm_->wait(p.req, Deadline{deadline}, op_, p.peer);
    } catch (const MismatchError& e) {
      C10_THROW_ERROR(DistBackendError, e.what());
    } catch (const Error& e) {
      // Timeouts, lost peers and interrupts leave the communicator unusable (as in ProcessGroupMK::run).
      comm_->abort(e.what());
      C10_THROW_ERROR(DistBackendError, cat(e.what(), " (", dir, " peer ", p.peer, ")"));
    }
  } else {
    // Poll the backend's Work so an interrupt or our deadline ends the wait (Work::wait would block for the
    // backend's own timeout and cannot be interrupted).
    auto pause = std::chrono::microseconds(20);
    while (!p.work->isCompleted()) {
      if (cancel_generation().load(std::memory_order_acquire) != cancel_gen_)
        C10_THROW_ERROR(DistBackendError, cat("mk ", op_, ": rank ", rank_, ": ", dir, " peer ", p.peer,
                                              " cancelled by an interrupt"));
      if (std::chrono::steady_clock::now() >= deadline)
        C10_THROW_ERROR(DistBackendError, cat("mk ", op_, ": rank ", rank_, ": ", dir, " peer ", p.peer,
                                              " timed out after ", timeout_.count(), " ms"));
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, std::chrono::microseconds(500));
    }
    p.work->wait();  // rethrows the backend's error, if any
  }
  p.done = true;
}

void Exchange::wait_all() {
  for (size_t i = 0; i < pending_.size(); ++i) wait(i);
}

}  // namespace mk::kernels
