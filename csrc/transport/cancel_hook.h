// Cancelling waits that sit inside a library mk does not own.
//
// mk's own waits poll cancel_generation() (deadline.h). A wait inside another backend cannot: a Gloo
// send/recv's Work::wait blocks in Gloo until the message arrives or the group timeout passes. While such a
// wait runs, a CancelHook holds how to cut it short (Work::abort), and cancel_waits(), which an interrupt
// calls (superkernel.backend.cancel_waits), bumps the generation and then runs every hook, on its own thread.
#pragma once
#include <cstdint>
#include <functional>

namespace mk {

class CancelHook {
 public:
  // `cut` must be safe to call from another thread while the wait runs, and more than once.
  explicit CancelHook(std::function<void()> cut);
  ~CancelHook();  // waits for a cut that is running now
  CancelHook(const CancelHook&) = delete;
  CancelHook& operator=(const CancelHook&) = delete;

  // Whether a cancellation came after `generation` (a wait that began in it should stop); checked after
  // registering too, since a cancellation just before registration ran no hook.
  static bool cancelled_since(uint64_t generation);

 private:
  uint64_t id_;
};

// cancel_all() (deadline.h), then every registered hook.
void cancel_waits();

}  // namespace mk
