// Tag matching shared by every provider of one communicator (so a recv from any source works across
// shm and tcp peers). Messages from one source are matched in the order they were sent (MPI's
// non-overtaking rule); a message that arrives before its recv waits in an unexpected queue.
#pragma once
#include <cstdint>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/request.h"

namespace mk {

constexpr int kAnySource = -1;

struct Envelope {
  int src = 0;
  uint64_t tag = 0;
  size_t len = 0;
  uint64_t check = 0;  // describes the operation on both sides; a mismatch fails the recv
};

// One arriving message: the provider writes its payload to `dst`, then calls Matcher::delivered.
struct Arrival {
  Envelope env;
  char* dst = nullptr;
  std::vector<char> storage;  // used when no matching recv was posted (or the recv was wrong)
  RequestPtr req;             // the matched recv, if any
  void* user_buf = nullptr;   // where to copy when matched after arrival
  bool delivered = false;
};
using ArrivalPtr = std::shared_ptr<Arrival>;

class Matcher {
 public:
  explicit Matcher(int rank) : rank_(rank) {}

  // Called by a provider when a message's envelope arrives, in per-source send order.
  ArrivalPtr arrive(const Envelope& env);
  // Called by a provider when the payload of `a` is completely in a->dst.
  void delivered(const ArrivalPtr& a);
  // Post a receive; src may be kAnySource. With `up_to`, `len` is the buffer's capacity and any message of at
  // most `len` bytes matches (the request's bytes() says how many came); otherwise the sizes must be equal.
  RequestPtr post_recv(int src, uint64_t tag, void* buf, size_t len, uint64_t check, bool up_to = false);
  // The provider lost a message mid-payload (peer died): fail the recv it was matched to, if any.
  void abandon(const ArrivalPtr& a, const std::string& why);
  // Withdraw a posted recv that has not matched yet (its waiter gave up): it fails with `why`.
  void cancel(const RequestPtr& req, const std::string& why);
  // Fail every pending recv that could only be satisfied by `src` (and any-source recvs).
  void fail_source(int src, const std::string& why);
  // Fail everything (communicator aborted).
  void fail_all(const std::string& why);

 private:
  struct Posted {
    int src;
    uint64_t tag;
    void* buf;
    size_t len;
    uint64_t check;
    bool up_to;
    RequestPtr req;
  };
  std::string mismatch(const Envelope& env, size_t len, uint64_t check, bool up_to) const;

  const int rank_;
  std::mutex mu_;
  std::list<Posted> posted_;
  std::list<ArrivalPtr> unexpected_;
};

}  // namespace mk
