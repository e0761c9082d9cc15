// One-sided windows ("RAM as a service"): every rank of a communicator exposes a block of memory, and any
// rank reads, writes and atomically updates any rank's block without the target's user threads taking
// part. Semantics follow MPI-3 passive-target RMA (MPI_Win_lock_all epochs: put/get/accumulate,
// fetch_and_op, compare_and_swap, flush, flush_all) and OpenSHMEM (shmem_fence, shmem_quiet, put with
// signal):
//
//   - Memory: each rank's block is a memfd segment (a header page, then the elements). Peers on the same
//     host map it (through /proc/<pid>/fd) and access it directly with loads, stores and atomic
//     instructions; peers on other hosts go through the tcp provider, whose progress thread at the target
//     executes the operation with the same atomics (atomics.h). Nothing is left in /dev/shm, even after
//     kill -9.
//   - put/get are not atomic: concurrent puts to, or a put and a get of, the same element race (MPI's
//     rules for conflicting accesses). accumulate is atomic per element against other accumulates,
//     fetch_add and compare_swap (on int64) against each other and against accumulates, from any rank.
//   - Completion: a blocking operation returns when it is complete at the target (shm: the stores are
//     done; tcp: the target acknowledged). A non-blocking operation (a request) is complete when its
//     request finishes; flush(rank) completes every operation this rank issued to `rank`, flush_all() to
//     everyone (OpenSHMEM quiet). fence(rank) orders: operations issued before it are performed at the
//     target before those issued after it (OpenSHMEM fence; one origin's operations to one tcp target
//     already execute in issue order, so fence never waits).
//   - Notification: put(..., notify = tag) increments the target's counter `tag` (0 <= tag < 1024) after
//     the put's data is visible there (release ordering); wait_notify(tag) at the target waits until the
//     counter is non-zero and consumes one arrival (acquire ordering: the data of the put is visible).
//   - Creation and free are collective over the communicator (every rank, same order); free first
//     completes this rank's outstanding operations, then waits for every rank to reach free (timeout ->
//     TimeoutError naming the ranks that did not come), then stops serving its block.
//
// Offsets and counts are in elements of the window's dtype. No torch types here: bindings.cpp wraps the
// local block as a tensor.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/atomics.h"
#include "transport/comm.h"
#include "transport/error.h"
#include "transport/reduce.h"

namespace mk {

// A rank, offset or notify tag outside what the window has (Python: IndexError).
class RangeError : public Error {
 public:
  using Error::Error;
};
// An operation the window's dtype does not support, e.g. accumulate with an unsupported op (Python: ValueError).
class ArgumentError : public Error {
 public:
  using Error::Error;
};

class WindowSegment;

class Window {
 public:
  static constexpr uint64_t kNotifyTags = 1024;

  // Collective: every rank of `comm` calls it (in the same order as its other windows) with the number of
  // elements it exposes (ranks may differ) and the same dtype.
  // `init` (count elements, or null for zeros) is copied in before any peer can see the block.
  Window(Comm& comm, size_t count, DType dtype, const Deadline& deadline, const void* init = nullptr);
  // Without free(): waits briefly for this rank's own unfinished operations (their buffers), then stops
  // serving and unmaps at once (peers' later operations on this rank fail or go nowhere). Prefer free().
  ~Window();
  Window(const Window&) = delete;
  Window& operator=(const Window&) = delete;

  uint64_t id() const { return id_; }
  int rank() const { return comm_.rank(); }
  int world() const { return comm_.size(); }
  DType dtype() const { return dtype_; }
  size_t count(int rank) const;
  bool freed() const { return freed_.load(); }
  Comm& comm() const { return comm_; }
  // This rank's elements, and a handle that keeps them mapped (also after free) while it lives.
  char* local_data() const;
  std::shared_ptr<void> local_keepalive() const;
  // How `target` is reached: "self", "shm" (direct) or the provider's name.
  const char* transport_of(int target) const;
  // True when `target`'s block is mapped here (self or same host, window not freed): its operations are
  // performed on the caller's thread with loads and stores and complete before they return. Never throws.
  bool direct(int target) const {
    return target >= 0 && size_t(target) < base_.size() && base_[size_t(target)] != nullptr;
  }

  // Start an operation. Returns null when it already completed (direct access), else a request that
  // finishes at remote completion (wait() it, or flush). Buffers must stay valid until then.
  RequestPtr put(int target, size_t offset, const void* src, size_t count, uint64_t notify = kNoNotify);
  RequestPtr get(int target, size_t offset, void* dst, size_t count);
  RequestPtr accumulate(int target, size_t offset, const void* src, size_t count, RedOp op);
  // int64 windows only; the old value is written to *result when the operation completes.
  RequestPtr atomic(int target, size_t offset, AmoOp op, int64_t a, int64_t b, const std::shared_ptr<int64_t>& result);

  // Wait for a request returned above (null: nothing to wait for). Errors name the window, op and target.
  void wait(const RequestPtr& r, const Deadline& d, const char* op, int target);
  void flush(int target, const Deadline& d);
  void flush_all(const Deadline& d);
  // The part of flush(target) / flush_all() that never waits: checks, then makes this thread's direct
  // stores complete (a full fence). Returns true when that was all (no request of this rank is tracked);
  // false: call flush / flush_all to wait for the requests.
  bool flush_direct(int target);
  bool flush_all_direct();
  void fence(int target);
  // Wait for (and consume) one notified put with `tag` at this rank. TimeoutError / CancelledError.
  void wait_notify(uint64_t tag, const Deadline& d);
  // Non-blocking: consume one arrival if there is one.
  bool test_notify(uint64_t tag);
  // Collective. Idempotent on one rank (a second call does nothing).
  void free(const Deadline& d);

 private:
  // Allgather `len` bytes per rank over the communicator's tagged messages (window-private tags).
  std::vector<char> exchange(uint32_t phase, const void* mine, size_t len, const Deadline& d, const char* what);
  void check(int target, size_t offset, size_t count, const char* op) const;
  void check_target(int target, const char* op) const;
  void track(int target, const RequestPtr& r);
  void release();

  Comm& comm_;
  const uint64_t id_;
  const DType dtype_;
  const size_t esize_;
  std::shared_ptr<WindowSegment> own_;
  std::vector<std::shared_ptr<WindowSegment>> mapped_;  // by rank: own and same-host peers; null otherwise
  std::vector<char*> base_;                             // by rank: directly addressable elements, or null
  std::vector<Provider*> remote_;                        // by rank: the provider serving it, or null
  std::vector<size_t> counts_;
  std::vector<Provider*> exposed_on_;
  std::atomic<bool> freed_{false};
  std::mutex inflight_mu_;
  std::vector<std::vector<RequestPtr>> inflight_;  // by rank: requests not yet known complete
  std::atomic<size_t> tracked_{0};                  // their total (read without the lock by flush_direct)
};

}  // namespace mk
