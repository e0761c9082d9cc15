#include "transport/request.h"

#include "transport/error.h"
#include "transport/futex.h"

namespace mk {

void Request::complete(size_t bytes, int source) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load(std::memory_order_relaxed) != kPending) return;
    bytes_ = bytes;
    source_ = source;
  }
  finish(kDone);
}

void Request::fail(const std::string& why) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load(std::memory_order_relaxed) != kPending) return;
    error_ = why;
  }
  finish(kFailed);
}

void Request::finish(uint32_t state) {
  std::function<void(Request&)> cb;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load(std::memory_order_relaxed) != kPending) return;
    state_.store(state, std::memory_order_seq_cst);
    cb.swap(callback_);
  }
  // The state store against the sleeper count (Dekker with wait()): either a sleeper that registered sees
  // the new state in futex_wait's own check, or we see it registered and wake it. Most requests finish with
  // nobody asleep on them, and then cost no system call.
  if (sleepers_.load(std::memory_order_seq_cst) != 0) futex_wake_all(&state_);
  if (cb) cb(*this);
}

void Request::on_finish(std::function<void(Request&)> cb) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (state_.load(std::memory_order_relaxed) == kPending) {
      callback_ = std::move(cb);
      return;
    }
  }
  cb(*this);
}

void Request::wait(const Deadline& deadline, const std::function<std::string()>& describe) {
  const uint64_t gen = cancel_generation().load(std::memory_order_acquire);
  for (int spin = 0; spin < 2000 && !test(); ++spin) cpu_relax();
  while (!test()) {
    if (cancel_generation().load(std::memory_order_acquire) != gen)
      throw CancelledError(cat(describe(), ": cancelled by an interrupt"));
    if (deadline.expired()) throw TimeoutError(cat(describe(), ": timed out"));
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    if (state_.load(std::memory_order_seq_cst) == kPending) futex_wait(&state_, kPending, std::chrono::microseconds(20000));
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }
  if (failed()) throw PeerError(cat(describe(), ": ", error_));
}

}  // namespace mk
