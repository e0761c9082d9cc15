// A pending point-to-point operation: completed by a provider's progress thread, waited on by anyone.
#pragma once
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>

#include "transport/deadline.h"

namespace mk {

class Request {
 public:
  enum State : uint32_t { kPending = 0, kDone = 1, kFailed = 2 };

  // Exactly one of complete/fail takes effect; later calls are ignored.
  void complete(size_t bytes, int source);
  void fail(const std::string& why);

  bool test() const { return state_.load(std::memory_order_acquire) != kPending; }
  bool failed() const { return state_.load(std::memory_order_acquire) == kFailed; }
  const std::string& error() const { return error_; }
  size_t bytes() const { return bytes_; }
  int source() const { return source_; }

  // Block until done. Throws PeerError (failed), TimeoutError (deadline) or CancelledError (cancel_all),
  // each prefixed with describe().
  void wait(const Deadline& deadline, const std::function<std::string()>& describe);

  // Run cb once the request has finished (at once, on this thread, if it already has).
  void on_finish(std::function<void(Request&)> cb);

 private:
  void finish(uint32_t state);

  std::atomic<uint32_t> state_{kPending};
  std::atomic<uint32_t> sleepers_{0};  // threads in futex_wait on state_ (finish() wakes only when there are)
  std::mutex mu_;
  std::function<void(Request&)> callback_;
  std::string error_;
  size_t bytes_ = 0;
  int source_ = -1;
};

using RequestPtr = std::shared_ptr<Request>;

}  // namespace mk
