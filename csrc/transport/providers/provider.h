// One interface for every way mk moves bytes between two ranks (shm, tcp, later ibverbs).
// A provider sends tagged messages; receiving goes through the communicator's Matcher, which every
// provider feeds, so matching rules (order, any-source, size checks) are the same everywhere.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "transport/atomics.h"
#include "transport/reduce.h"
#include "transport/request.h"

namespace mk {

// A memory region this rank exposes for one-sided access (a window's local memory), by region id.
struct RmaRegion {
  char* base = nullptr;
  size_t bytes = 0;
  std::shared_ptr<void> keep;                 // keeps `base` mapped while an operation still uses it
  std::function<void(uint64_t tag)> notify;  // a put with a notify tag landed (its data is visible)
};

constexpr uint64_t kNoNotify = ~0ull;

class Provider {
 public:
  virtual ~Provider() = default;
  virtual const char* name() const = 0;

  // Start sending `len` bytes to `peer`. `buf` must stay valid until the request completes; completion
  // means the buffer may be reused (not that the peer has received it).
  virtual RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) = 0;

  // ---- one-sided access (RMA) ----
  // Serve (or stop serving) a local region to peers: the provider's progress thread executes peers'
  // operations on it without this rank's user threads. Default: the provider serves nothing (shm peers
  // map window memory directly, see window.h).
  virtual void expose(uint64_t region, RmaRegion r) {}
  virtual void withdraw(uint64_t region) {}
  // Operations on a region `peer` exposed. Offsets and lengths in bytes. Every request completes when the
  // target has executed the operation (remote completion: the data is visible at the target, the reply
  // is in dst/result), so waiting for all of them is a flush. Operations from one origin to one target
  // execute in the order they were issued. `src`/`dst` must stay valid until the request finishes.
  // put: notify != kNoNotify bumps the target's notify counter `notify` after the data is visible.
  virtual RequestPtr put(int peer, uint64_t region, size_t offset, const void* src, size_t len, uint64_t notify);
  virtual RequestPtr get(int peer, uint64_t region, size_t offset, void* dst, size_t len);
  // Element-wise atomic dst = op(dst, src) at the target (atomics.h).
  virtual RequestPtr accumulate(int peer, uint64_t region, size_t offset, const void* src, size_t len, DType t,
                                RedOp op);
  // int64 fetch_add / compare_swap at the target; the old value lands in *result.
  virtual RequestPtr atomic(int peer, uint64_t region, size_t offset, AmoOp op, int64_t a, int64_t b,
                            std::shared_ptr<int64_t> result);

  // Fail everything in flight, refuse new work, wake every waiter. Idempotent.
  virtual void abort(const std::string& why) = 0;

  // Is the peer still reachable? (false after its connection dropped or its process exited)
  virtual bool peer_alive(int peer) const = 0;
  // Why a peer that is not alive is gone, as a clause for an error message ("peer 3 aborted its communicator
  // (rank 3: mk all_reduce ... timed out waiting for peer 1)", "peer 2 (pid 77, same host) exited").
  virtual std::string gone_reason(int peer) const = 0;
};

}  // namespace mk
