#include "transport/job_thread.h"

#include <utility>

#include "transport/futex.h"
#include "transport/host.h"

namespace mk {

JobThread::JobThread(std::string name, std::chrono::microseconds linger)
    : name_(std::move(name)), linger_us_(linger.count()), thread_([this] { run(); }) {}

std::chrono::microseconds JobThread::set_linger(std::chrono::microseconds linger) {
  return std::chrono::microseconds(linger_us_.exchange(linger.count(), std::memory_order_relaxed));
}

JobThread::~JobThread() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  thread_.join();
}

void JobThread::post(std::function<void()> job) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    queued_.fetch_add(1, std::memory_order_release);
  }
  cv_.notify_one();
}

void JobThread::run() {
  name_this_thread(name_.c_str());
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    cv_.wait(lock, [this] { return !jobs_.empty() || stop_; });
    if (jobs_.empty()) return;  // stopping, nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    queued_.fetch_sub(1, std::memory_order_relaxed);
    lock.unlock();
    job();
    job = nullptr;
    // linger: poll for the next job (re-reading the linger, which set_linger may change meanwhile)
    for (const auto done = std::chrono::steady_clock::now();
         queued_.load(std::memory_order_acquire) == 0 &&
         std::chrono::steady_clock::now() - done < std::chrono::microseconds(linger_us_.load(std::memory_order_relaxed));)
      cpu_relax();
    lock.lock();
  }
}

}  // namespace mk
