// The c10d Work that ProcessGroupMK returns: completed by the group's worker thread (collectives) or by a
// provider's progress thread (send/recv); wait() honours the timeout and interrupts; getFuture() resolves
// to the output tensors, as Gloo's does.
#pragma once
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <vector>

namespace mk {

class WorkMK : public c10d::Work {
 public:
  // wait() without a timeout waits at most default_timeout (the group's timeout).
  WorkMK(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
         std::chrono::milliseconds default_timeout);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;

  // Called when wait() gives up, before it throws (a recv withdraws its posted buffer).
  void on_timeout(std::function<void()> fn) { on_timeout_ = std::move(fn); }
  // Called once by wait() before it sleeps (point-to-point: the waiting thread makes progress itself).
  void before_wait(std::function<void()> fn) { before_wait_ = std::move(fn); }

  // Mark done (eptr null) or failed; completes the future. Called once.
  void complete(std::exception_ptr eptr, int source_rank = -1);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int source_rank_ = -1;
  std::chrono::milliseconds default_timeout_;
  std::function<void()> on_timeout_;
  std::function<void()> before_wait_;
};

}  // namespace mk
