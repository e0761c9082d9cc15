// A named thread that runs posted jobs one at a time, in posting order, and sleeps on a condition variable
// while there are none. Destroying it runs the jobs already posted, then joins the thread.
// Users: the fused ops' communication lanes (kernels/pipeline.cc) and the c10d Store worker (store_worker.cc).
#pragma once
#include <condition_variable>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace mk {

class JobThread {
 public:
  explicit JobThread(std::string name);
  ~JobThread();
  JobThread(const JobThread&) = delete;
  JobThread& operator=(const JobThread&) = delete;

  // Queue `job`; it must not throw (it keeps its outcome wherever its poster looks for it).
  void post(std::function<void()> job);

 private:
  void run();

  std::string name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  bool stop_ = false;
  std::thread thread_;  // last: starts once the members above exist
};

}  // namespace mk
