// The c10d Work that ProcessGroupMK returns: completed by the group's worker thread (collectives) or by a
// provider's progress thread (send/recv); wait() honours the timeout and interrupts; getFuture() resolves
// to the output tensors, as Gloo's does.
#pragma once
#include <ATen/core/ivalue.h>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <functional>
#include <memory>
#include <vector>

namespace mk {

class WorkMK : public c10d::Work {
 public:
  // wait() without a timeout waits at most default_timeout (the group's timeout).
  WorkMK(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
         std::chrono::milliseconds default_timeout);

  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  // Point-to-point works drive their transfer (the poll hook) before answering, as MPI_Test does.
  bool isCompleted() override;
  // Point-to-point works hold their sleeping hook's guard until they complete once a future is taken (a
  // thread may block on it where wait() cannot see).
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;
  std::vector<at::Tensor> result() override;
  int sourceRank() const override;

  // Called when wait() gives up, before it throws (a recv withdraws its posted buffer).
  void on_timeout(std::function<void()> fn) { on_timeout_ = std::move(fn); }
  // Point-to-point progress (set before the work is handed out):
  //   before_wait  called once by wait() before it sleeps: the waiting thread makes progress itself;
  //   poll         one non-blocking progress pass (isCompleted);
  //   sleeping     what must be held while a thread sleeps waiting for this work (Comm::Sleeping).
  void progress_hooks(std::function<void()> before_wait, std::function<void()> poll,
                      std::function<std::shared_ptr<void>()> sleeping) {
    before_wait_ = std::move(before_wait);
    poll_ = std::move(poll);
    sleeping_ = std::move(sleeping);
  }

  // Mark done (eptr null) or failed; completes the future. Called once.
  void complete(std::exception_ptr eptr, int source_rank = -1);

 private:
  std::vector<at::Tensor> outputs_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
  int source_rank_ = -1;
  std::chrono::milliseconds default_timeout_;
  std::function<void()> on_timeout_;
  std::function<void()> before_wait_;
  std::function<void()> poll_;
  std::function<std::shared_ptr<void>()> sleeping_;
  std::shared_ptr<void> future_sleeping_;  // held from getFuture() until complete()
};

}  // namespace mk
