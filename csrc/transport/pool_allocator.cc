#include "transport/pool_allocator.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <thread>
#include <type_traits>

namespace mk {
namespace {

std::string seconds(std::chrono::milliseconds t) { return cat(double(t.count()) / 1000.0); }

}  // namespace

PoolAllocator::PoolAllocator(Window& meta, size_t versions, int64_t align, std::chrono::milliseconds timeout)
    : meta_(meta),
      versions_(versions),
      align_(align),
      timeout_(timeout),
      generation_(cancel_generation().load(std::memory_order_acquire)),
      me_(meta.rank()) {
  if (meta.dtype() != DType::i64 || align <= 0 || versions < kHeader)
    throw Error(cat("TensorStore allocator: rank ", me_, ": window #", meta.id(), " is not an allocator window"));
}

// ---- window access: blocking operations, complete at the target when they return -------------------------

void PoolAllocator::read(int rank, size_t word, int64_t* dst, size_t n) {
  meta_.wait(meta_.get(rank, word, dst, n), meta_.comm().deadline(), "get", rank);
}

int64_t PoolAllocator::load(int rank, size_t word) {
  int64_t v = 0;
  read(rank, word, &v, 1);
  return v;
}

int64_t PoolAllocator::cas(int rank, size_t word, int64_t expected, int64_t desired) {
  auto old = std::make_shared<int64_t>(0);
  meta_.wait(meta_.atomic(rank, word, AmoOp::compare_swap, expected, desired, old), meta_.comm().deadline(),
             "compare_swap", rank);
  return *old;
}

void PoolAllocator::state(int rank, std::vector<int64_t>& hdr, std::vector<int64_t>& ext) {
  const size_t max_extents = (versions_ - kHeader) / 2;
  std::vector<int64_t> buf(std::min(meta_.count(rank), kHeader + 2 * kGuess));
  read(rank, 0, buf.data(), buf.size());
  const int64_t nfree = buf[kNfree];
  if (nfree < 0 || size_t(nfree) > max_extents)
    throw Error(cat("TensorStore: rank ", me_, " read ", nfree, " free extents in rank ", rank,
                    "'s allocator (at most ", max_extents, "): the allocator window is corrupt"));
  hdr.assign(buf.begin(), buf.begin() + kHeader);
  const size_t words = 2 * size_t(nfree);
  if (kHeader + words <= buf.size()) {
    ext.assign(buf.begin() + kHeader, buf.begin() + kHeader + words);
  } else {
    ext.assign(buf.begin() + kHeader, buf.end());
    const size_t have = ext.size();
    ext.resize(words);
    read(rank, kHeader + have, ext.data() + have, words - have);
  }
}

void PoolAllocator::write_state(int rank, const std::vector<int64_t>& hdr, int64_t used, int64_t objects,
                                const std::vector<int64_t>& ext, bool freed) {
  // one put from the header's second word to the last extent
  std::vector<int64_t> vals{used, objects, int64_t(ext.size() / 2), hdr[kCapacity], hdr[kFrees] + (freed ? 1 : 0)};
  vals.insert(vals.end(), hdr.begin() + kFrees + 1, hdr.begin() + kHeader);
  vals.insert(vals.end(), ext.begin(), ext.end());
  meta_.wait(meta_.put(rank, kUsed, vals.data(), vals.size()), meta_.comm().deadline(), "put", rank);
}

// ---- waiting ------------------------------------------------------------------------------------------------

void PoolAllocator::check_cancel(const char* what) const {
  if (cancel_generation().load(std::memory_order_acquire) != generation_)
    throw CancelledError(cat("TensorStore: rank ", me_, " ", what, ": cancelled by an interrupt"));
}

void PoolAllocator::pause(std::chrono::microseconds& backoff) const {
  if (backoff.count()) std::this_thread::sleep_for(backoff);
  backoff = backoff.count() ? std::min(backoff * 2, std::chrono::microseconds(1000)) : std::chrono::microseconds(20);
}

std::string PoolAllocator::gone(int rank) {
  if (rank == me_ || rank < 0 || rank >= meta_.world()) return "";
  try {
    load(rank, kLock);
  } catch (const PeerError& e) {
    return e.what();
  }
  return "";
}

void PoolAllocator::lock(int rank) {
  const auto start = Clock::now();
  auto probe = start + kProbe;
  std::chrono::microseconds backoff{0};
  for (;;) {
    const int64_t holder = cas(rank, kLock, 0, me_ + 1);
    if (holder == 0) return;
    const auto now = Clock::now();
    if (now > probe) {  // held for a while: is the holder still there?
      const std::string why = gone(int(holder - 1));
      if (!why.empty())
        throw PeerError(cat("TensorStore: rank ", me_, " cannot allocate or free in rank ", rank,
                            "'s memory: its allocator lock is held by rank ", holder - 1, ", which is gone (", why,
                            "). The lock stays taken (the allocator may be half-updated): nothing can be placed in "
                            "or freed from rank ", rank, "'s memory any more in this job; stored tensors stay readable"));
      probe = now + kProbe;
    }
    if (now - start > timeout_)
      throw TimeoutError(cat("TensorStore: rank ", me_, " could not take rank ", rank, "'s allocator lock within ",
                             seconds(timeout_), " s (held by rank ", holder - 1, ")"));
    check_cancel("waiting for an allocator lock");
    pause(backoff);
  }
}

void PoolAllocator::unlock(int rank) {
  const int64_t prev = cas(rank, kLock, me_ + 1, 0);
  if (prev != me_ + 1)
    throw Error(cat("TensorStore: rank ", me_, " released rank ", rank, "'s allocator lock but it was held by ",
                    prev ? cat("rank ", prev - 1) : std::string("nobody")));
}

template <typename F>
auto PoolAllocator::locked(int rank, F&& f) -> decltype(f()) {
  lock(rank);
  try {
    if constexpr (std::is_void_v<decltype(f())>) {
      f();
      unlock(rank);
      return;
    } else {
      auto result = f();
      unlock(rank);
      return result;
    }
  } catch (...) {
    try {  // release it if f failed (after a failed unlock this finds it not ours and changes nothing)
      cas(rank, kLock, me_ + 1, 0);
    } catch (...) {  // f's error is the one to report
    }
    throw;
  }
}

void PoolAllocator::retire(int rank, int64_t offset) {
  const size_t word = versions_ + size_t(offset / align_);
  const auto start = Clock::now();
  auto probe = start + kProbe;
  for (;;) {
    const int64_t v = load(rank, word);
    if (v % 2 == 0 && cas(rank, word, v, v + 2) == v) return;
    const auto now = Clock::now();
    if (v % 2 && now > probe) {
      if (!gone(writer_of(v)).empty()) {  // it will never finish: end its write for it
        cas(rank, word, v, after_write(v));
        continue;
      }
      probe = now + kProbe;
    }
    if (now - start > timeout_)
      throw TimeoutError(cat("TensorStore: rank ", me_, " frees rank ", rank, "'s extent at byte ", offset,
                             ", but a put writing into it in place did not finish within ", seconds(timeout_), " s"));
    check_cancel("waiting for a put to finish writing an extent it frees");
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

// ---- the allocator --------------------------------------------------------------------------------------------

PoolAllocator::Placement PoolAllocator::allocate(int64_t need, int only) {
  const int world = meta_.world();
  if (need <= 0 || need % align_ != 0)
    throw ArgumentError(cat("TensorStore allocator: rank ", me_, ": cannot reserve ", need, " bytes (a positive "
                            "multiple of ", align_, ")"));
  if (only >= world)
    throw RangeError(cat("TensorStore allocator: rank ", me_, ": rank ", only, " is not in the group (size ", world, ")"));
  std::vector<int> order;
  std::vector<int64_t> free(size_t(world), 0);
  if (only >= 0) {
    order.push_back(only);
    free[size_t(only)] = std::numeric_limits<int64_t>::max();  // pinned: go straight to the lock
  } else {
    int64_t hdr[kHeader];
    for (int r = 0; r < world; ++r) {
      read(r, 0, hdr, kHeader);
      free[size_t(r)] = hdr[kCapacity] - hdr[kUsed];
      order.push_back(r);
    }
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      if (free[size_t(a)] != free[size_t(b)]) return free[size_t(a)] > free[size_t(b)];
      if ((a == me_) != (b == me_)) return a == me_;
      return a < b;
    });
  }
  Placement out;
  std::vector<int64_t> hdr, ext;
  for (int r : order) {
    if (free[size_t(r)] < need) continue;
    const bool placed = locked(r, [&] {
      state(r, hdr, ext);
      size_t best = ext.size();
      for (size_t i = 0; i < ext.size(); i += 2) {
        out.largest = std::max(out.largest, ext[i + 1]);
        if (ext[i + 1] >= need && (best == ext.size() || ext[i + 1] < ext[best + 1])) best = i;
      }
      if (best == ext.size()) return false;
      out.offset = ext[best];
      if (ext[best + 1] == need) {
        ext.erase(ext.begin() + long(best), ext.begin() + long(best) + 2);
      } else {
        ext[best] += need;
        ext[best + 1] -= need;
      }
      write_state(r, hdr, hdr[kUsed] + need, hdr[kObjects] + 1, ext, false);
      // nobody else knows the new extent yet: its version is at rest, and the counter read under the lock
      // (before the record becomes current) is valid for get's fast path
      out.version = load(r, versions_ + size_t(out.offset / align_));
      out.frees = hdr[kFrees];
      return true;
    });
    if (placed) {
      out.rank = r;
      return out;
    }
  }
  for (int r : order) {
    if (free[size_t(r)] >= need) continue;
    state(r, hdr, ext);
    for (size_t i = 1; i < ext.size(); i += 2) out.largest = std::max(out.largest, ext[i]);
  }
  return out;
}

int64_t PoolAllocator::release(int rank, int64_t offset, int64_t length, int64_t objects) {
  return locked(rank, [&] {
    std::vector<int64_t> hdr, ext;
    state(rank, hdr, ext);
    size_t i = 0;  // the first extent at or after offset (in extents)
    while (2 * i < ext.size() && ext[2 * i] < offset) ++i;
    // a range outside the data, or overlapping a free extent, is not allocated: refuse it before anything
    // changes (freeing it would let two tensors share bytes later)
    const bool before = i > 0 && ext[2 * (i - 1)] + ext[2 * (i - 1) + 1] > offset;
    const bool after = 2 * i < ext.size() && ext[2 * i] < offset + length;
    if (offset < 0 || length <= 0 || offset + length > hdr[kCapacity] || before || after ||
        hdr[kUsed] < length || hdr[kObjects] < objects)
      throw Error(cat("TensorStore: rank ", me_, " frees bytes [", offset, ", ", offset + length, ") of rank ", rank,
                      "'s memory, which ", before || after ? "overlap a free extent (a double free)" : "are not allocated",
                      " (used ", hdr[kUsed], " B in ", hdr[kObjects], " objects, capacity ", hdr[kCapacity],
                      " B): a bug; nothing was freed"));
    retire(rank, offset);
    int64_t start = offset, len = length;
    if (i > 0 && ext[2 * (i - 1)] + ext[2 * (i - 1) + 1] == offset) {  // merge with the previous extent
      --i;
      start = ext[2 * i];
      len += ext[2 * i + 1];
      ext.erase(ext.begin() + long(2 * i), ext.begin() + long(2 * i) + 2);
    }
    if (2 * i < ext.size() && start + len == ext[2 * i]) {  // merge with the next extent
      len += ext[2 * i + 1];
      ext.erase(ext.begin() + long(2 * i), ext.begin() + long(2 * i) + 2);
    }
    ext.insert(ext.begin() + long(2 * i), {start, len});
    if (ext.size() / 2 > (versions_ - kHeader) / 2)
      throw Error(cat("TensorStore: rank ", rank, "'s free-extent table overflowed (a bug)"));
    write_state(rank, hdr, hdr[kUsed] - length, hdr[kObjects] - objects, ext, true);
    return hdr[kFrees];
  });
}

PoolAllocator::Usage PoolAllocator::usage(int rank) {
  std::vector<int64_t> hdr, ext;
  state(rank, hdr, ext);
  Usage u{hdr[kCapacity], hdr[kUsed], hdr[kObjects], hdr[kNfree], 0};
  for (size_t i = 1; i < ext.size(); i += 2) u.largest_free = std::max(u.largest_free, ext[i]);
  return u;
}

}  // namespace mk
