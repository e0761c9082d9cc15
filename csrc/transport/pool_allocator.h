// The TensorStore's allocator (python/superkernel/memory/tensor_store.py documents the design): every rank's
// free extents, kept in an int64 Window that every rank reads and writes one-sidedly under a lock word.
// This is the part of a put and a delete that touches only that window, done here in one call instead of a
// dozen Python-level window operations (about 20 us of a 1 MiB put on the same host).
//
// Window layout (int64 words), shared with tensor_store.py:
//   [kLock] 0, or the rank + 1 that holds the allocator lock
//   [kUsed] [kObjects] [kNfree] [kCapacity] [kFrees]  used bytes, objects, free extents, capacity, frees so far
//   [kHeader, kHeader + 2 * max_extents)  the free extents (offset, length), sorted by offset, coalesced
//   [versions, ...)  one version word per `align` bytes of data, indexed by an extent's first block: even at
//                    rest, odd while a put writes into the extent, with its writer's rank + 1 from bit kWriter
//
// Every wait (a lock held by another rank, an extent being written) has the deadline given, polls the
// cancellation generation (cancel_all), and checks every kProbe whether the rank it waits for is gone.
#pragma once
#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include "transport/deadline.h"
#include "transport/window.h"

namespace mk {

class PoolAllocator {
 public:
  static constexpr size_t kLock = 0, kUsed = 1, kObjects = 2, kNfree = 3, kCapacity = 4, kFrees = 5, kHeader = 8;
  static constexpr int kWriter = 48;
  // The extents read together with the header (a second read only when there are more).
  static constexpr size_t kGuess = 32;
  static constexpr std::chrono::milliseconds kProbe{50};

  struct Placement {
    int rank = -1;         // -1: no rank has a free extent of `need` bytes
    int64_t offset = 0;    // bytes into that rank's data
    int64_t version = 0;   // the extent's version word (even)
    int64_t frees = 0;     // the rank's free counter as read under its lock
    int64_t largest = 0;   // when nothing fits: the largest free extent of any candidate rank
  };
  struct Usage {
    int64_t capacity = 0, used = 0, objects = 0, free_extents = 0, largest_free = 0;
  };

  // `versions`: index of the first version word; `align`: data bytes per version word; `timeout` bounds each
  // wait for a lock or a writer.
  PoolAllocator(Window& meta, size_t versions, int64_t align, std::chrono::milliseconds timeout);

  // Reserve `need` bytes (a multiple of align): on rank `only` when >= 0, else on the rank with the most free
  // bytes first (ties: this rank, then lower ranks), best fit within a rank.
  Placement allocate(int64_t need, int only);
  // Return [offset, offset + length) to `rank`'s extents (after the extent's writer, if any, finished) and
  // drop `objects` from its count. Returns the rank's free counter as it was before.
  int64_t release(int rank, int64_t offset, int64_t length, int64_t objects);
  // A snapshot without the lock.
  Usage usage(int rank);

  static int writer_of(int64_t v) { return int(v >> kWriter) - 1; }
  static int64_t after_write(int64_t v) { return (v & ((int64_t(1) << kWriter) - 1)) + 1; }

 private:
  int64_t load(int rank, size_t word);
  void read(int rank, size_t word, int64_t* dst, size_t n);
  int64_t cas(int rank, size_t word, int64_t expected, int64_t desired);
  // (header words [0, kHeader), extents) of `rank`
  void state(int rank, std::vector<int64_t>& hdr, std::vector<int64_t>& ext);
  void write_state(int rank, const std::vector<int64_t>& hdr, int64_t used, int64_t objects,
                   const std::vector<int64_t>& ext, bool freed);
  void lock(int rank);
  void unlock(int rank);
  // Run f under `rank`'s lock; the lock is released whatever f does.
  template <typename F>
  auto locked(int rank, F&& f) -> decltype(f());
  void retire(int rank, int64_t offset);
  // Why `rank` is gone (the PeerError of a read of its window), or "" when it is alive or not a peer.
  std::string gone(int rank);
  void check_cancel(const char* what) const;
  void pause(std::chrono::microseconds& backoff) const;

  Window& meta_;
  const size_t versions_;
  const int64_t align_;
  const std::chrono::milliseconds timeout_;
  const uint64_t generation_;
  const int me_;
};

}  // namespace mk
