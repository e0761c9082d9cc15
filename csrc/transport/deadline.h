// Deadlines and cancellation: every blocking wait in mk takes a Deadline and polls the cancel flag.
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>

namespace mk {

using Clock = std::chrono::steady_clock;

struct Deadline {
  Clock::time_point at;
  static Deadline after(std::chrono::milliseconds ms) { return Deadline{Clock::now() + ms}; }
  bool expired() const { return Clock::now() >= at; }
  std::chrono::milliseconds remaining() const {
    auto r = std::chrono::duration_cast<std::chrono::milliseconds>(at - Clock::now());
    return r.count() < 0 ? std::chrono::milliseconds(0) : r;
  }
};

// Process-wide cancellation generation: cancel_all() makes every wait that started before it fail with
// CancelledError (used by the notebook worker on interrupt). Waits remember the generation they began in.
inline std::atomic<uint64_t>& cancel_generation() {
  static std::atomic<uint64_t> generation{0};
  return generation;
}
inline void cancel_all() { cancel_generation().fetch_add(1, std::memory_order_acq_rel); }

}  // namespace mk
