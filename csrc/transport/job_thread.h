// A named thread that runs posted jobs one at a time, in posting order, and sleeps on a condition variable
// while there are none; with a `linger`, it first polls for the next job that long after each one (a post
// then needs no wake-up, which costs tens of microseconds on a VM). Destroying it runs the jobs already
// posted, then joins the thread.
// Users: the fused ops' communication lanes (kernels/pipeline.cc) and the c10d Store worker (store_worker.cc).
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace mk {

class JobThread {
 public:
  explicit JobThread(std::string name, std::chrono::microseconds linger = std::chrono::microseconds(0));
  ~JobThread();
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  // Queue `job`; it must not throw (it keeps its outcome wherever its poster looks for it).
  void post(std::function<void()> job);
  // Change the linger; a thread polling now re-reads it at once. Returns the previous one.
  std::chrono::microseconds set_linger(std::chrono::microseconds linger);

 private:
  void run();

  std::string name_;
  std::atomic<int64_t> linger_us_;
  std::atomic<size_t> queued_{0};  // jobs_.size(), for polling without the lock
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace mk
