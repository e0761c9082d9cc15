#include "transport/cancel_hook.h"

#include <map>
#include <mutex>
#include <utility>

#include "transport/deadline.h"

namespace mk {

namespace {

struct Hooks {
  std::mutex mu;  // held while hooks run: a hook's owner cannot go away during its cut
  uint64_t next = 0;
  std::map<uint64_t, std::function<void()>> cuts;
};

Hooks& hooks() {
  static Hooks h;
  return h;
}

}  // namespace

CancelHook::CancelHook(std::function<void()> cut) {
  Hooks& h = hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  id_ = h.next++;
  h.cuts.emplace(id_, std::move(cut));
}

CancelHook::~CancelHook() {
  Hooks& h = hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  h.cuts.erase(id_);
}

bool CancelHook::cancelled_since(uint64_t generation) {
  return cancel_generation().load(std::memory_order_acquire) != generation;
}

void cancel_waits() {
  cancel_all();
  Hooks& h = hooks();
  std::lock_guard<std::mutex> lock(h.mu);
  for (auto& [id, cut] : h.cuts) {
    try {
      cut();
    } catch (...) {
      // a backend whose work cannot be aborted: the wait ends at its timeout, as before
    }
  }
}

}  // namespace mk
