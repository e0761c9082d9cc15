#include "store_worker.h"

#include <c10/util/Exception.h>

#include <stdexcept>
#include <utility>

#include "transport/futex.h"
#include "transport/job_thread.h"

namespace mk {
namespace {

using Clock = std::chrono::steady_clock;
// How long a waiter polls for its answer before it sleeps (about one Store round trip on an idle machine).
constexpr auto kWaitSpin = std::chrono::microseconds(50);

// One per process, started at the first call (see store_worker.h).
JobThread& worker() {
  static JobThread w("mk-store-calls", kLinger);
  return w;
}

}  // namespace

std::chrono::microseconds set_store_worker_linger(std::chrono::microseconds linger) {
  return worker().set_linger(linger);
}

bool StoreCall::done() const { return done_.load(std::memory_order_acquire); }

std::vector<uint8_t> StoreCall::wait(std::chrono::milliseconds limit) {
  const auto start = Clock::now();
  while (!done() && Clock::now() - start < kWaitSpin) cpu_relax();
  if (!done()) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!cv_.wait_until(lock, start + limit, [this] { return done(); }))
      throw std::runtime_error(what_ + ": no answer from the Store within " + std::to_string(limit.count()) +
                               " ms (the call is still running on the Store worker thread)");
  }
  if (error_) std::rethrow_exception(error_);
  return std::move(value_);
}

std::shared_ptr<StoreCall> store_compare_set_async(const c10::intrusive_ptr<c10d::Store>& store, std::string key,
                                                   std::vector<uint8_t> expected, std::vector<uint8_t> desired) {
  TORCH_CHECK(store, "store_compare_set_async: no Store");
  auto call = std::make_shared<StoreCall>();
  call->what_ = "Store compare_set of '" + key + "'";
  worker().post([call, store, key = std::move(key), expected = std::move(expected),
                 desired = std::move(desired)]() mutable {
    try {
      call->value_ = store->compareSet(key, expected, desired);
    } catch (...) {
      call->error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(call->mu_);
      call->done_.store(true, std::memory_order_release);
    }
    call->cv_.notify_all();
  });
  return call;
}

}  // namespace mk
