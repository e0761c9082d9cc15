// c10d Store calls run on a thread of their own, so the caller can overlap a Store round trip with its own
// work: TensorStore.put publishes the record of a new tensor while it copies the tensor's bytes.
//
// One worker thread per process, started at the first call. After a call it polls for the next one for
// kLinger (250 us), then sleeps on a condition variable: waking a sleeping thread costs 10-30 us on a VM (and
// the Store's server wakes slower while that core idles), so a run of puts pays it once, not per put
// (bench/memory.py's "asleep" column: the same puts with no linger). It never polls while a call is in
// flight, nor for longer: on 2 cores a worker that always polled took the CPU the Store's server needed, and
// the overlapped put got slower, not faster. The waiter polls for its answer for a short while (kWaitSpin)
// before it sleeps, because the answer usually arrives about then.
//
// Timeouts: the worker makes an ordinary blocking Store call, bounded by the Store's own timeout;
// StoreCall::wait takes a limit of its own on top (pass more than the Store's timeout), so a worker stuck past
// it is reported instead of waited for. A wait is not cut short by an interrupt: the call may already have
// changed the Store, and the caller must learn the outcome to stay consistent (the synchronous Store call it
// replaces cannot be interrupted either).
#pragma once
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace mk {

class StoreCall;

// How long the worker polls for the next call after one (then it sleeps).
constexpr std::chrono::microseconds kLinger{250};
// Change it (0: sleep at once); returns the previous value. For benchmarks and tests.
std::chrono::microseconds set_store_worker_linger(std::chrono::microseconds linger);
// store->compareSet(key, expected, desired) on the worker thread; the StoreCall yields its answer.
std::shared_ptr<StoreCall> store_compare_set_async(const c10::intrusive_ptr<c10d::Store>& store, std::string key,
                                                   std::vector<uint8_t> expected, std::vector<uint8_t> desired);

// The outcome of one Store call handed to the worker.
class StoreCall {
 public:
  // Block until the call finished and return the Store's answer, or rethrow the Store's error. Once: the
  // answer is moved out. Throws std::runtime_error naming the call when `limit` passes first.
  std::vector<uint8_t> wait(std::chrono::milliseconds limit);
  bool done() const;

 private:
  friend std::shared_ptr<StoreCall> store_compare_set_async(const c10::intrusive_ptr<c10d::Store>&, std::string,
                                                            std::vector<uint8_t>, std::vector<uint8_t>);
  std::mutex mu_;
  std::condition_variable cv_;
  std::atomic<bool> done_{false};
  std::vector<uint8_t> value_;
  std::exception_ptr error_;
  std::string what_;
};

}  // namespace mk
