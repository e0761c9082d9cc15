#include "transport/window.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>

#include "transport/copy.h"
#include "transport/futex.h"

namespace mk {
namespace {

constexpr uint64_t kMagic = 0x6d6b2d77696e3031ull;  // "mk-win01"
constexpr uint32_t kVersion = 1;
constexpr uint64_t kTagBit = 1ull << 62;  // window-private message tags (collectives use bit 63)

struct alignas(64) WinHeader {
  uint64_t magic;
  uint32_t version;
  uint32_t dtype;
  uint64_t window_id;
  uint64_t count;
  int32_t rank;
  int32_t pid;
  alignas(64) std::atomic<uint32_t> notify_seq;  // futex word: bumped by every notification
  std::atomic<uint32_t> waiters;
  alignas(64) std::atomic<uint32_t> notify[Window::kNotifyTags];
};

constexpr size_t kDataOffset = (sizeof(WinHeader) + 4095) / 4096 * 4096;

// What one rank tells the others about its block.
struct Descriptor {
  uint64_t magic;
  uint64_t window_id;
  uint64_t count;
  int32_t pid;
  int32_t fd;
  uint32_t dtype;
  int32_t rank;
};

void notify_at(WinHeader* h, uint64_t tag) {
  h->notify[tag].fetch_add(1, std::memory_order_seq_cst);  // release: the put's data is visible first
  h->notify_seq.fetch_add(1, std::memory_order_seq_cst);
  if (h->waiters.load(std::memory_order_seq_cst) != 0) futex_wake_all(&h->notify_seq);
}

}  // namespace

// One rank's block: created (memfd) by its owner, mapped by same-host peers through /proc/<pid>/fd/<fd>.
class WindowSegment {
 public:
  // Owner.
  WindowSegment(uint64_t id, int rank, size_t count, DType t) : bytes_(kDataOffset + count * dtype_size(t)) {
    fd_ = int(syscall(SYS_memfd_create, cat("mk-window", id, "-rank", rank).c_str(), MFD_CLOEXEC));
    MK_SYSCHECK(fd_, cat("mk window #", id, ": rank ", rank, ": memfd_create"));
    if (ftruncate(fd_, off_t(bytes_)) != 0) {
      int e = errno;
      ::close(fd_);
      throw_errno(cat("mk window #", id, ": rank ", rank, ": ftruncate(", bytes_, " bytes)"), e);
    }
    map(id, rank);
    WinHeader* h = header();
    h->magic = kMagic;
    h->version = kVersion;
    h->dtype = uint32_t(t);
    h->window_id = id;
    h->count = count;
    h->rank = rank;
    h->pid = int32_t(getpid());
  }
  // Peer.
  WindowSegment(uint64_t id, int my_rank, const Descriptor& d) : bytes_(kDataOffset + d.count * dtype_size(DType(d.dtype))) {
    const std::string path = cat("/proc/", d.pid, "/fd/", d.fd);
    fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0)
      throw_errno(cat("mk window #", id, ": rank ", my_rank, " cannot open peer ", d.rank, "'s block ", path,
                      " (same user and ptrace access are needed; SUPERKERNEL_TRANSPORT=tcp avoids shared memory)"));
    map(id, my_rank);
    ::close(fd_);  // the mapping keeps the memory; the owner's fd is its only name
    fd_ = -1;
    const WinHeader* h = header();
    if (h->magic != kMagic || h->version != kVersion || h->window_id != id || h->rank != d.rank ||
        h->count != d.count || h->dtype != d.dtype)
      throw Error(cat("mk window #", id, ": rank ", my_rank, ": peer ", d.rank, "'s block does not match its descriptor"));
  }
  ~WindowSegment() {
    if (base_) munmap(base_, bytes_);
    close_fd();
  }
  WindowSegment(const WindowSegment&) = delete;
  WindowSegment& operator=(const WindowSegment&) = delete;

  WinHeader* header() const { return reinterpret_cast<WinHeader*>(base_); }
  char* data() const { return base_ + kDataOffset; }
  int fd() const { return fd_; }
  void close_fd() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  void map(uint64_t id, int rank) {
    void* p = mmap(nullptr, bytes_, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw_errno(cat("mk window #", id, ": rank ", rank, ": mmap of ", bytes_, " bytes"), e);
    }
    base_ = static_cast<char*>(p);
  }
  size_t bytes_;
  int fd_ = -1;
  char* base_ = nullptr;
};

Window::Window(Comm& comm, size_t count, DType dtype, const Deadline& deadline, const void* init)
    : comm_(comm), id_(comm.next_window_id()), dtype_(dtype), esize_(dtype_size(dtype)) {
  comm_.check_usable("window create");
  const int n = comm_.size(), me = comm_.rank();
  own_ = std::make_shared<WindowSegment>(id_, me, count, dtype);
  if (init && count) std::memcpy(own_->data(), init, count * esize_);
  mapped_.assign(size_t(n), nullptr);
  base_.assign(size_t(n), nullptr);
  remote_.assign(size_t(n), nullptr);
  counts_.assign(size_t(n), 0);
  inflight_.resize(size_t(n));
  mapped_[size_t(me)] = own_;
  base_[size_t(me)] = own_->data();
  counts_[size_t(me)] = count;

  // Serve our block to remote peers before anyone can know it exists (they learn it in the exchange).
  for (int p = 0; p < n; ++p) {
    Provider* pr = p == me ? nullptr : comm_.route(p);
    if (!pr || std::string(comm_.transport_of(p)) == "shm") continue;
    remote_[size_t(p)] = pr;
    if (std::find(exposed_on_.begin(), exposed_on_.end(), pr) != exposed_on_.end()) continue;
    WinHeader* h = own_->header();
    pr->expose(id_, RmaRegion{own_->data(), count * esize_, own_, [h](uint64_t tag) {
                                if (tag < kNotifyTags) notify_at(h, tag);
                              }});
    exposed_on_.push_back(pr);
  }
  try {
    Descriptor mine{kMagic, id_, count, int32_t(getpid()), own_->fd(), uint32_t(dtype), me};
    std::vector<char> all = exchange(0, &mine, sizeof(mine), deadline, "create");
    for (int p = 0; p < n; ++p) {
      Descriptor d;
      std::memcpy(&d, all.data() + size_t(p) * sizeof(d), sizeof(d));
      if (d.magic != kMagic || d.window_id != id_ || d.rank != p)
        throw Error(cat("mk window create: rank ", me, ": peer ", p, " sent a malformed descriptor for window #", id_));
      if (DType(d.dtype) != dtype)
        throw MismatchError(cat("mk window #", id_, " create: rank ", me, " exposes ", dtype_name(dtype),
                                " but rank ", p, " exposes ", dtype_name(DType(d.dtype)),
                                " (every rank must use the same dtype)"));
      counts_[size_t(p)] = size_t(d.count);
      if (p != me && std::string(comm_.transport_of(p)) == "shm") {
        mapped_[size_t(p)] = std::make_shared<WindowSegment>(id_, me, d);
        base_[size_t(p)] = mapped_[size_t(p)]->data();
      }
    }
  } catch (...) {
    release();
    throw;
  }
}

Window::~Window() {
  if (!freed_.load()) {
    try {  // our requests may still write into the caller's buffers: give them a moment
      flush_all(Deadline::after(std::chrono::milliseconds(1000)));
    } catch (const std::exception&) {
    }
  }
  release();
}

void Window::release() {
  freed_.store(true);
  for (Provider* pr : exposed_on_) pr->withdraw(id_);
  exposed_on_.clear();
  std::fill(base_.begin(), base_.end(), nullptr);
  mapped_.clear();
  if (own_) own_->close_fd();
  own_.reset();
}

std::vector<char> Window::exchange(uint32_t phase, const void* mine, size_t len, const Deadline& d, const char* what) {
  const int n = comm_.size(), me = comm_.rank();
  const uint64_t tag = kTagBit | (id_ << 8) | phase;
  const uint64_t check = (id_ << 16) ^ (uint64_t(phase) << 8) ^ len ^ 0x77696e;
  std::vector<char> all(len * size_t(n));
  std::memcpy(all.data() + len * size_t(me), mine, len);
  auto out = std::make_shared<std::vector<char>>(static_cast<const char*>(mine), static_cast<const char*>(mine) + len);
  std::vector<RequestPtr> recvs(static_cast<size_t>(n));
  auto cancel_recvs = [&](const std::string& why) {
    for (auto& r : recvs)
      if (r && !r->test()) comm_.matcher().cancel(r, why);
  };
  try {
    for (int p = 0; p < n; ++p)
      if (p != me) recvs[size_t(p)] = comm_.irecv(p, tag, all.data() + len * size_t(p), len, check);
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      RequestPtr s = comm_.isend(p, tag, out->data(), len, check);
      s->on_finish([out](Request&) {});  // the payload lives until the send finished
    }
    for (int p = 0; p < n; ++p) {
      if (p == me) continue;
      comm_.progress_while_pending(*recvs[size_t(p)], p);
      Comm::Sleeping sleeping(comm_, p);
      recvs[size_t(p)]->wait(d, [&] {
        return cat("mk window #", id_, " ", what, ": rank ", me, " waiting for peer ", p, " (", what,
                   " is collective: every rank of the group must call it, in the same order)");
      });
    }
  } catch (const std::exception& e) {
    cancel_recvs(e.what());  // a late message must not land in our (gone) buffer
    throw;
  }
  return all;
}

size_t Window::count(int rank) const {
  if (rank < 0 || rank >= comm_.size())
    throw RangeError(cat("mk window #", id_, ": rank ", rank, " is out of range (group size ", comm_.size(), ")"));
  return counts_[size_t(rank)];
}

char* Window::local_data() const {
  if (!own_) throw Error(cat("mk window #", id_, ": rank ", comm_.rank(), ": the window was freed"));
  return own_->data();
}

std::shared_ptr<void> Window::local_keepalive() const { return own_; }

const char* Window::transport_of(int target) const {
  check_target(target, "transport_of");
  return comm_.transport_of(target);
}

void Window::check_target(int target, const char* op) const {
  if (freed_.load())
    throw Error(cat("mk window #", id_, " ", op, ": rank ", comm_.rank(), ": the window was freed"));
  if (target < 0 || target >= comm_.size())
    throw RangeError(cat("mk window #", id_, " ", op, ": rank ", comm_.rank(), ": target rank ", target,
                         " is out of range (group size ", comm_.size(), ")"));
}

void Window::check(int target, size_t offset, size_t count, const char* op) const {
  check_target(target, op);
  const size_t have = counts_[size_t(target)];
  if (offset > have || count > have - offset)
    throw RangeError(cat("mk window #", id_, " ", op, ": rank ", comm_.rank(), ": elements [", offset, ", ",
                         offset + count, ") are outside the ", have, " elements rank ", target, " exposes"));
  if (comm_.aborted())
    throw PeerError(cat("mk window #", id_, " ", op, ": rank ", comm_.rank(), ": the communicator was aborted (",
                        comm_.abort_reason(), ")"));
  if (base_[size_t(target)] && target != comm_.rank() && !comm_.route(target)->peer_alive(target))
    throw PeerError(cat("mk window #", id_, " ", op, ": rank ", comm_.rank(), ": target ",
                        comm_.route(target)->gone_reason(target)));
}

void Window::track(int target, const RequestPtr& r) {
  std::lock_guard<std::mutex> lock(inflight_mu_);
  auto& v = inflight_[size_t(target)];
  if (v.size() >= 64) {
    const size_t before = v.size();
    v.erase(std::remove_if(v.begin(), v.end(), [](const RequestPtr& q) { return q->test(); }), v.end());
    tracked_.fetch_sub(before - v.size(), std::memory_order_relaxed);
  }
  v.push_back(r);
  tracked_.fetch_add(1, std::memory_order_release);
}

RequestPtr Window::put(int target, size_t offset, const void* src, size_t count, uint64_t notify) {
  check(target, offset, count, "put");
  if (notify != kNoNotify && notify >= kNotifyTags)
    throw RangeError(cat("mk window #", id_, " put: notify tag ", notify, " is out of range (0 <= tag < ", kNotifyTags, ")"));
  if (char* b = base_[size_t(target)]) {
    copy_bytes(b + offset * esize_, src, count * esize_, CopyUse::window);
    if (notify != kNoNotify) notify_at(mapped_[size_t(target)]->header(), notify);
    return nullptr;
  }
  RequestPtr r = remote_[size_t(target)]->put(target, id_, offset * esize_, src, count * esize_, notify);
  track(target, r);
  return r;
}

RequestPtr Window::get(int target, size_t offset, void* dst, size_t count) {
  check(target, offset, count, "get");
  if (char* b = base_[size_t(target)]) {
    copy_bytes(dst, b + offset * esize_, count * esize_, CopyUse::window);
    return nullptr;
  }
  RequestPtr r = remote_[size_t(target)]->get(target, id_, offset * esize_, dst, count * esize_);
  track(target, r);
  return r;
}

RequestPtr Window::accumulate(int target, size_t offset, const void* src, size_t count, RedOp op) {
  check(target, offset, count, "accumulate");
  try {  // (the window's name only goes into the message when there is one)
    check_accumulate(dtype_, op, "accumulate");
  } catch (const Error& e) {
    throw ArgumentError(cat("mk window #", id_, " ", e.what()));
  }
  if (char* b = base_[size_t(target)]) {
    atomic_accumulate(b + offset * esize_, src, count, dtype_, op);
    return nullptr;
  }
  RequestPtr r = remote_[size_t(target)]->accumulate(target, id_, offset * esize_, src, count * esize_, dtype_, op);
  track(target, r);
  return r;
}

RequestPtr Window::atomic(int target, size_t offset, AmoOp op, int64_t a, int64_t b,
                          const std::shared_ptr<int64_t>& result) {
  const char* name = op == AmoOp::fetch_add ? "fetch_add" : "compare_swap";
  if (dtype_ != DType::i64)
    throw Error(cat("mk window #", id_, " ", name, ": needs an int64 window, this one holds ", dtype_name(dtype_)));
  check(target, offset, 1, name);
  if (char* base = base_[size_t(target)]) {
    *result = atomic_i64(base + offset * esize_, op, a, b);
    return nullptr;
  }
  RequestPtr r = remote_[size_t(target)]->atomic(target, id_, offset * esize_, op, a, b, result);
  track(target, r);
  return r;
}

void Window::wait(const RequestPtr& r, const Deadline& d, const char* op, int target) {
  if (!r) return;
  r->wait(d, [&] { return cat("mk window #", id_, " ", op, ": rank ", comm_.rank(), ", target rank ", target); });
}

bool Window::flush_direct(int target) {
  check_target(target, "flush");
  // Direct stores are complete once globally visible: a full fence (not only release ordering) so that a
  // load this thread issues after flush cannot pass them (x86 store buffer); a few ns.
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return tracked_.load(std::memory_order_acquire) == 0;
}

bool Window::flush_all_direct() {
  if (freed_.load())
    throw Error(cat("mk window #", id_, " flush: rank ", comm_.rank(), ": the window was freed"));
  std::atomic_thread_fence(std::memory_order_seq_cst);
  return tracked_.load(std::memory_order_acquire) == 0;
}

void Window::flush(int target, const Deadline& d) {
  if (flush_direct(target)) return;
  std::vector<RequestPtr> v;
  {
    std::lock_guard<std::mutex> lock(inflight_mu_);
    v.swap(inflight_[size_t(target)]);
    tracked_.fetch_sub(v.size(), std::memory_order_relaxed);
  }
  try {
    for (auto& r : v) wait(r, d, "flush", target);
  } catch (...) {
    std::lock_guard<std::mutex> lock(inflight_mu_);  // keep the unfinished ones for a later flush
    for (auto& r : v)
      if (!r->test()) {
        inflight_[size_t(target)].push_back(r);
        tracked_.fetch_add(1, std::memory_order_relaxed);
      }
    throw;
  }
}

void Window::flush_all(const Deadline& d) {
  if (flush_all_direct()) return;
  for (int p = 0; p < comm_.size(); ++p) flush(p, d);
}

void Window::fence(int target) {
  check_target(target, "fence");
  // Direct accesses are performed in program order once this fence is passed; a tcp target executes one
  // origin's operations in issue order (one ordered connection, one progress thread).
  std::atomic_thread_fence(std::memory_order_seq_cst);
}

bool Window::test_notify(uint64_t tag) {
  check_target(comm_.rank(), "test_notify");
  if (tag >= kNotifyTags)
    throw RangeError(cat("mk window #", id_, " wait_notify: tag ", tag, " is out of range (0 <= tag < ", kNotifyTags, ")"));
  std::atomic<uint32_t>& c = own_->header()->notify[tag];
  uint32_t v = c.load(std::memory_order_acquire);
  while (v > 0)
    if (c.compare_exchange_weak(v, v - 1, std::memory_order_acq_rel, std::memory_order_acquire)) return true;
  return false;
}

void Window::wait_notify(uint64_t tag, const Deadline& d) {
  const uint64_t gen = cancel_generation().load(std::memory_order_acquire);
  WinHeader* h = own_ ? own_->header() : nullptr;
  for (int spin = 0;; ++spin) {
    if (test_notify(tag)) return;
    if (spin < 64) {
      cpu_relax();
      continue;
    }
    if (cancel_generation().load(std::memory_order_acquire) != gen)
      throw CancelledError(cat("mk window #", id_, " wait_notify(", tag, "): rank ", comm_.rank(), ": cancelled by an interrupt"));
    if (d.expired())
      throw TimeoutError(cat("mk window #", id_, " wait_notify(", tag, "): rank ", comm_.rank(),
                             ": timed out (no put with notify=", tag, " arrived)"));
    if (comm_.aborted())
      throw PeerError(cat("mk window #", id_, " wait_notify: rank ", comm_.rank(), ": the communicator was aborted (",
                          comm_.abort_reason(), ")"));
    const uint32_t seq = h->notify_seq.load(std::memory_order_seq_cst);
    h->waiters.fetch_add(1, std::memory_order_seq_cst);
    if (h->notify[tag].load(std::memory_order_seq_cst) == 0) {
      auto left = std::chrono::duration_cast<std::chrono::microseconds>(d.at - Clock::now());
      futex_wait(&h->notify_seq, seq, std::clamp(left, std::chrono::microseconds(1), std::chrono::microseconds(20000)));
    }
    h->waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void Window::free(const Deadline& d) {
  if (freed_.load()) return;
  const uint64_t me = uint64_t(comm_.rank());
  try {
    flush_all(d);
    exchange(1, &me, sizeof(me), d, "free");
  } catch (const PeerError& e) {
    // An aborted communicator or a lost rank: no later free could complete the collective, and no peer can
    // reach the block any more, so it is released here (a timeout, with every peer alive, leaves the window
    // for free to be called again).
    release();
    throw PeerError(cat("mk window #", id_, " free: rank ", me, ": released on this rank, but not every rank "
                        "could be told (", e.what(), ")"));
  }
  release();
}

}  // namespace mk
