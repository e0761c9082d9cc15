// Small pieces every collective algorithm uses: message tags, operation checks, the shm step protocol.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>

#include "transport/comm.h"
#include "transport/error.h"
#include "transport/reduce.h"

namespace mk::coll {

enum class Kind : uint8_t { allreduce = 1, reduce, reduce_scatter, broadcast, allgather, gather, scatter, alltoall, barrier };

inline const char* kind_name(Kind k) {
  switch (k) {
    case Kind::allreduce: return "allreduce";
    case Kind::reduce: return "reduce";
    case Kind::reduce_scatter: return "reduce_scatter";
    case Kind::broadcast: return "broadcast";
    case Kind::allgather: return "allgather";
    case Kind::gather: return "gather";
    case Kind::scatter: return "scatter";
    case Kind::alltoall: return "alltoall";
    case Kind::barrier: return "barrier";
  }
  return "?";
}

// Tags of collective-internal messages: top bit set, then the collective's sequence number and a step.
inline uint64_t coll_tag(uint64_t seq, uint32_t step) { return (1ull << 63) | (seq << 24) | (step & 0xffffff); }

// memcpy/memmove that accept the null pointers of empty tensors (n == 0), and a buffer onto itself (an in-place
// allgather's own part: nothing to move).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n && dst != src) std::memmove(dst, src, n);
}

inline uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

// What the operation is, as every rank must see it (kind, element type, op, count, root).
struct OpDesc {
  Kind kind;
  DType dtype = DType::u8;
  RedOp op = RedOp::sum;
  uint64_t count = 0;
  int root = -1;
  uint64_t check() const {
    uint64_t h = mix(0x6d6b, uint64_t(kind));
    h = mix(h, uint64_t(dtype));
    h = mix(h, uint64_t(op));
    h = mix(h, count);
    h = mix(h, uint64_t(int64_t(root)));
    return h | 1;  // never 0 (0 marks "no descriptor")
  }
  std::string describe() const {
    std::string s = cat(kind_name(kind), " of ", count, " x ", dtype_name(dtype));
    if (kind == Kind::allreduce || kind == Kind::reduce || kind == Kind::reduce_scatter) s += cat(" (", redop_name(op), ")");
    if (root >= 0) s += cat(" root ", root);
    return s;
  }
};

// Slot descriptor words: [0] check, [1] kind, [2] dtype, [3] op, [4] count, [5] root (for the message).
void shm_write_desc(Comm& c, int slot, const OpDesc& d);
// After the ready step: every rank's descriptor must equal ours; otherwise throw (on every rank).
void shm_check_descs(Comm& c, int slot, const OpDesc& d);

}  // namespace mk::coll

namespace mk::coll {

// The shm step protocol for one chunk of a segment collective:
//   s = shm_begin(...)        take the next staging slot (waits until peers finished with its last use)
//   ... fill slot s ...
//   shm_ready(..., s, ...)    publish, wait for every rank, and on the first chunk compare descriptors
//   ... read peers' slots (optionally shm_sync() between two phases) ...
//   shm_done(..., s)          publish that we are finished reading; the slot may be reused after that
int shm_begin(Comm& c, const OpDesc& d, const Deadline& dl);
void shm_ready(Comm& c, int slot, const OpDesc& d, bool first, const Deadline& dl);
void shm_sync(Comm& c, const OpDesc& d, const Deadline& dl);
void shm_done(Comm& c, int slot);

// A segment collective in chunks of at most `per_chunk` units of `total`: for each chunk [off, off + n)
// take a slot, fill(slot, off, n) our part of it, ready (descriptors compared on the first chunk when
// `check`), drain(slot, off, n) what we need from the peers' slots, done. Runs once even when total is 0,
// so every rank meets the others and a size mismatch is still seen.
template <typename Fill, typename Drain>
void shm_chunks(Comm& c, const OpDesc& d, const Deadline& dl, size_t total, size_t per_chunk, bool check, Fill fill,
                Drain drain) {
  size_t off = 0;
  bool first = true;
  do {
    const size_t n = std::min(per_chunk, total - off);
    const int slot = shm_begin(c, d, dl);
    fill(slot, off, n);
    shm_ready(c, slot, d, first && check, dl);
    drain(slot, off, n);
    shm_done(c, slot);
    off += n;
    first = false;
  } while (off < total);
}

// The in-place shm variants' precondition (see collectives.h): one host with shm, and chunks of
// [1, shm_rows_per_chunk] rows. Throws Error naming the op and rank otherwise.
void check_rows(const Comm& c, const char* op, size_t row_bytes, size_t pieces, size_t rows_per_chunk);

// Point-to-point helpers for the ring/tree algorithms.
void sendrecv(Comm& c, const char* op, int dst, const void* sbuf, size_t sbytes, int src, void* rbuf,
              size_t rbytes, uint64_t tag, uint64_t check, const Deadline& dl);

}  // namespace mk::coll
