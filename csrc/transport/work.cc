#include "transport/work.h"

#include <c10/util/Exception.h>

#include "transport/deadline.h"

namespace mk {

WorkMK::WorkMK(int rank, c10d::OpType type, const char* title, std::vector<at::Tensor> outputs,
               std::chrono::milliseconds default_timeout)
    : c10d::Work(rank, type, title), outputs_(std::move(outputs)), default_timeout_(default_timeout),
      future_(c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()))) {}

void WorkMK::complete(std::exception_ptr eptr, int source_rank) {
  std::shared_ptr<void> sleeping;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    source_rank_ = source_rank;
    sleeping.swap(future_sleeping_);
  }
  finish(eptr);
  if (eptr)
    future_->setError(eptr);
  else
    future_->markCompleted(c10::IValue(outputs_));
}

bool WorkMK::wait(std::chrono::milliseconds timeout) {
  const uint64_t gen = cancel_generation().load();
  const auto start = std::chrono::steady_clock::now();
  if (timeout == kNoTimeout) timeout = default_timeout_;
  std::shared_ptr<void> sleeping;
  if (before_wait_ && !isCompleted()) {
    before_wait_();
    if (sleeping_ && !isCompleted()) sleeping = sleeping_();
  }
  std::unique_lock<std::mutex> lock(mutex_);
  while (!completed_) {
    cv_.wait_for(lock, std::chrono::milliseconds(20));
    if (completed_) break;
    if (cancel_generation().load() != gen)
      C10_THROW_ERROR(DistBackendError, c10::str("mk ", c10d::opTypeToString(opType_), ": rank ", rank_,
                                                 ": wait cancelled by an interrupt"));
    if (std::chrono::steady_clock::now() - start > timeout) {
      if (on_timeout_) {
        lock.unlock();
        on_timeout_();
        lock.lock();
        if (completed_ && !exception_) return true;  // it finished while we gave up
      }
      C10_THROW_ERROR(DistBackendError, c10::str("mk ", c10d::opTypeToString(opType_), ": rank ", rank_,
                                                 ": Work.wait timed out after ", timeout.count(), " ms"));
    }
  }
  if (exception_) std::rethrow_exception(exception_);
  return true;
}

bool WorkMK::isCompleted() {
  if (poll_ && !c10d::Work::isCompleted()) poll_();
  return c10d::Work::isCompleted();
}

c10::intrusive_ptr<c10::ivalue::Future> WorkMK::getFuture() {
  if (sleeping_) {
    std::shared_ptr<void> guard = sleeping_();  // outside mutex_: it may take the transport's locks
    std::lock_guard<std::mutex> lock(mutex_);
    if (!completed_ && !future_sleeping_) future_sleeping_ = std::move(guard);
  }
  return future_;
}

std::vector<at::Tensor> WorkMK::result() { return outputs_; }

int WorkMK::sourceRank() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return source_rank_;
}

}  // namespace mk
