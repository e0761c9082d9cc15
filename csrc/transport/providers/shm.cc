#include "transport/providers/shm.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "transport/error.h"
#include "transport/futex.h"
#include "transport/host.h"

namespace mk {
namespace {

constexpr uint64_t kMagic = 0x6d6b2d73686d3031ull;  // "mk-shm01"
constexpr uint32_t kVersion = 3;  // 2: RingHeader::sleepers, sender_waiting; 3: Control::abort_why
constexpr int kMaxSlots = 16;
constexpr int kDescWords = 8;
constexpr size_t kAbortWhyBytes = 512;

struct alignas(64) Control {
  uint64_t magic;
  uint32_t version;
  int32_t rank;
  int32_t nlocal;
  int32_t pid;
  uint64_t chunk, slots, ring, total;
  alignas(64) std::atomic<uint64_t> step;
  alignas(64) std::atomic<uint32_t> step_word;
  std::atomic<uint32_t> step_sleepers;
  std::atomic<uint32_t> aborted;
  alignas(64) std::atomic<uint32_t> doorbell;
  std::atomic<uint32_t> doorbell_sleeping;
  alignas(64) std::atomic<uint64_t> desc[kMaxSlots][kDescWords];
  // Why this rank aborted (NUL-terminated, cut to fit): written once, before `aborted` is set, so a peer that
  // sees the flag can say why, not only that (a timeout names the rank that did not arrive).
  char abort_why[kAbortWhyBytes];
};

struct alignas(64) RingHeader {
  alignas(64) std::atomic<uint64_t> head;  // written by the sender
  alignas(64) std::atomic<uint64_t> tail;  // written by the receiver
  // Receiver threads asleep waiting for something this ring brings (ShmProvider::sleep). The sender rings
  // the receiver's progress thread only while there are some (or while its own send waits for ring space):
  // a thread that polls drains the ring itself, and a message nobody waits for yet is taken when somebody
  // does, so most messages cost no wake-up (on a VM, tens of microseconds for the waker).
  alignas(64) std::atomic<uint32_t> sleepers;
  // Set by the sender's progress thread before it sleeps with a send queued for lack of ring space; the
  // receiver that frees space clears it and rings the sender (flow control without a spinning thread).
  std::atomic<uint32_t> sender_waiting;
};

struct MsgHeader {
  uint64_t tag;
  uint64_t check;
  uint64_t len;
};

size_t round_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

struct Layout {
  size_t rings_off, ring_data_off, slots_off, total;
  Layout(int nlocal, const ShmOptions& o) {
    rings_off = round_up(sizeof(Control), 4096);
    ring_data_off = round_up(rings_off + sizeof(RingHeader) * size_t(nlocal), 4096);
    slots_off = round_up(ring_data_off + o.ring * size_t(nlocal), 4096);
    total = round_up(slots_off + o.chunk * size_t(o.slots), 4096);
  }
};

}  // namespace

// One mapped segment: ours (created) or a peer's (opened through /proc/<pid>/fd/<fd>).
class ShmSegment {
 public:
  ShmSegment(int nlocal, const ShmOptions& o, int rank) : layout_(nlocal, o) {
    fd_ = int(syscall(SYS_memfd_create, cat("mk-rank", rank).c_str(), MFD_CLOEXEC));
    MK_SYSCHECK(fd_, cat("mk shm: rank ", rank, ": memfd_create"));
    if (ftruncate(fd_, off_t(layout_.total)) != 0) {
      int e = errno;
      ::close(fd_);
      throw_errno(cat("mk shm: rank ", rank, ": ftruncate(", layout_.total, " bytes)"), e);
    }
    map(rank);
    Control* c = control();
    c->magic = kMagic;
    c->version = kVersion;
    c->rank = rank;
    c->nlocal = nlocal;
    c->pid = int32_t(getpid());
    c->chunk = o.chunk;
    c->slots = uint64_t(o.slots);
    c->ring = o.ring;
    c->total = layout_.total;
    opts_ = o;
  }
  ShmSegment(int nlocal, const ShmOptions& o, int my_rank, int peer_rank, const std::string& desc)
      : layout_(nlocal, o) {
    int pid = 0, fd = 0;
    unsigned long size = 0;
    if (std::sscanf(desc.c_str(), "%d:%d:%lu", &pid, &fd, &size) != 3)
      throw Error(cat("mk shm: rank ", my_rank, ": malformed segment descriptor '", desc, "' of peer ", peer_rank));
    const std::string path = cat("/proc/", pid, "/fd/", fd);
    fd_ = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd_ < 0)
      throw_errno(cat("mk shm: rank ", my_rank, " cannot open peer ", peer_rank, "'s segment ", path,
                      " (same user and ptrace access are needed; SUPERKERNEL_TRANSPORT=tcp avoids shared memory)"));
    if (size != layout_.total) {
      ::close(fd_);
      throw Error(cat("mk shm: rank ", my_rank, " and peer ", peer_rank,
                      " disagree on the segment layout (SUPERKERNEL_SHM_* settings differ between ranks)"));
    }
    map(my_rank);
    ::close(fd_);  // the mapping keeps it alive; the owner's fd is the only name
    fd_ = -1;
    Control* c = control();
    if (c->magic != kMagic || c->version != kVersion || c->rank != peer_rank || c->chunk != o.chunk ||
        c->ring != o.ring || c->slots != uint64_t(o.slots))
      throw Error(cat("mk shm: rank ", my_rank, ": peer ", peer_rank, "'s segment does not match this job"));
    opts_ = o;
  }
  ~ShmSegment() {
    if (base_ && base_ != MAP_FAILED) munmap(base_, layout_.total);
    if (fd_ >= 0) ::close(fd_);
  }
  ShmSegment(const ShmSegment&) = delete;
  ShmSegment& operator=(const ShmSegment&) = delete;

  std::string descriptor() const { return cat(getpid(), ":", fd_, ":", layout_.total); }
  Control* control() const { return reinterpret_cast<Control*>(base_); }
  RingHeader* ring_header(int sender) const {
    return reinterpret_cast<RingHeader*>(base_ + layout_.rings_off) + sender;
  }
  char* ring_data(int sender) const { return base_ + layout_.ring_data_off + opts_.ring * size_t(sender); }
  char* slot(int s) const { return base_ + layout_.slots_off + opts_.chunk * size_t(s); }
  int pid() const { return control()->pid; }

 private:
  void map(int rank) {
    void* p = mmap(nullptr, layout_.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p == MAP_FAILED) {
      int e = errno;
      ::close(fd_);
      fd_ = -1;
      throw_errno(cat("mk shm: rank ", rank, ": mmap of ", layout_.total, " bytes"), e);
    }
    base_ = static_cast<char*>(p);
  }
  Layout layout_;
  ShmOptions opts_;
  int fd_ = -1;
  char* base_ = nullptr;
};

struct OutMsg {
  MsgHeader hdr;
  const char* data;
  size_t done = 0;
  RequestPtr req;
};

struct ShmProvider::Outgoing {
  std::mutex mu;
  std::deque<OutMsg> q;
};

struct InState {
  std::mutex mu;  // one drainer at a time: the progress thread or a waiting thread (try_lock, never blocks)
  MsgHeader hdr{};
  size_t hdr_got = 0;
  ArrivalPtr cur;
  size_t got = 0;
};

namespace {
// The ring this thread drains now (drain_ring), if any: an abort called from a completion the drain delivers
// must not wait for that drain, its own caller's.
thread_local const InState* tls_draining = nullptr;
}  // namespace

ShmProvider::ShmProvider(int rank, const std::vector<int>& locals, Matcher& matcher, const ShmOptions& opt)
    : rank_(rank), locals_(locals), matcher_(matcher), opt_(opt), alive_(locals.size()) {
  if (opt_.slots < 2 || opt_.slots > kMaxSlots)
    throw Error(cat("mk shm: SUPERKERNEL_SHM_SLOTS must be within 2..", kMaxSlots));
  if (opt_.chunk < 4096 || opt_.chunk % 64) throw Error("mk shm: SUPERKERNEL_SHM_CHUNK must be a multiple of 64, >= 4096");
  if (opt_.ring < 4096) throw Error("mk shm: SUPERKERNEL_SHM_RING must be >= 4096");
  me_ = int(std::find(locals.begin(), locals.end(), rank) - locals.begin());
  own_ = std::make_shared<ShmSegment>(int(locals.size()), opt_, rank);
  peers_.resize(locals.size());
  pidfds_.assign(locals.size(), -1);
  for (size_t i = 0; i < locals.size(); ++i) {
    out_.push_back(std::make_unique<Outgoing>());
    in_.push_back(std::make_unique<InState>());
    alive_[i].store(true);
  }
  slot_release_.assign(size_t(opt_.slots), 0);
  // Spin less when the ranks of this host outnumber its cores: the peer we wait for needs our core.
  // Spin for a few tens of microseconds (peers in step arrive within that), then yield, then sleep.
  oversubscribed_ = int(locals.size()) > online_cpus();
  spin_ = spin_time(int(locals.size()));
}

ShmProvider::~ShmProvider() {
  stop_.store(true);
  own_->control()->doorbell.fetch_add(1);
  futex_wake_all(&own_->control()->doorbell);
  if (progress_.joinable()) progress_.join();
  for (int fd : pidfds_)
    if (fd >= 0) ::close(fd);
}

std::string ShmProvider::descriptor() const { return own_->descriptor(); }

void ShmProvider::attach(const std::vector<std::string>& descriptors, const Deadline& deadline) {
  for (int j = 0; j < local_size(); ++j) {
    if (j == me_) continue;
    peers_[j] = std::make_unique<ShmSegment>(local_size(), opt_, rank_, locals_[j], descriptors.at(size_t(j)));
    pidfds_[j] = open_pidfd(peers_[j]->pid());
  }
  (void)deadline;
  progress_ = std::thread([this] {
    name_this_thread("mk-shm-progress");
    progress_loop();
  });
}

char* ShmProvider::slot(int r, int s) const { return (r == me_ ? own_.get() : peers_[r].get())->slot(s); }

std::atomic<uint64_t>* ShmProvider::slot_desc(int r, int s) const {
  return (r == me_ ? own_.get() : peers_[r].get())->control()->desc[s];
}

uint64_t ShmProvider::publish() {
  Control* c = own_->control();
  const uint64_t v = c->step.load(std::memory_order_relaxed) + 1;
  c->step.store(v, std::memory_order_seq_cst);
  c->step_word.store(uint32_t(v), std::memory_order_seq_cst);
  if (c->step_sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&c->step_word);
  return v;
}

void ShmProvider::check_peer_usable(int peer, const char* op) {
  const auto it = std::find(locals_.begin(), locals_.end(), peer);
  if (it == locals_.end() || *it == rank_) throw Error(cat("mk ", op, ": rank ", rank_, ": rank ", peer, " is not a peer on this host"));
  check_peer(int(it - locals_.begin()), op);
}

void ShmProvider::check_peer(int j, const char* op) {
  if (aborted_.load()) {
    std::lock_guard<std::mutex> lock(abort_mu_);
    throw PeerError(cat("mk ", op, ": rank ", rank_, ": communicator aborted: ", abort_reason_));
  }
  // A peer that aborted or exited: fail what waits on it too (receives posted before; its queued sends). The
  // progress thread's periodic check is how a rank that is not in a collective step learns of it; a receive
  // from an aborted peer on this host waited for the group timeout (the kernel's "left alone" test, 3 of 3).
  if (peers_[j]->control()->aborted.load() || process_exited(pidfds_[j], peers_[j]->pid())) {
    const std::string why = gone_reason(locals_[j]);
    fail_peer(j, cat("rank ", rank_, ": ", why));
    throw PeerError(cat("mk ", op, ": rank ", rank_, ": ", why));
  }
}

void ShmProvider::wait_steps(uint64_t target, const Deadline& deadline, const char* op, const std::vector<int>& who) {
  const uint64_t gen = cancel_generation().load(std::memory_order_acquire);
  auto wait_one = [&](int j) {
    if (j == me_) return;
    Control* c = peers_[j]->control();
    const auto spin_until = Clock::now() + spin_;
    for (int i = 1;; ++i) {
      if (c->step.load(std::memory_order_acquire) >= target) return;
      cpu_relax();
      if ((i & 63) == 0 && Clock::now() >= spin_until) break;
    }
    int round = 0;
    while (c->step.load(std::memory_order_acquire) < target) {
      if (round < (oversubscribed_ ? 16 : 4)) {  // let a peer sharing our core run before we sleep
        ++round;
        sched_yield();
        continue;
      }
      check_peer(j, op);
      if (cancel_generation().load(std::memory_order_acquire) != gen)
        throw CancelledError(cat("mk ", op, ": rank ", rank_, ": cancelled by an interrupt while waiting for peer ", locals_[j]));
      if (deadline.expired())
        throw TimeoutError(cat("mk ", op, ": rank ", rank_, " timed out waiting for peer ", locals_[j],
                               " (it has not reached this operation)"));
      c->step_sleepers.fetch_add(1, std::memory_order_seq_cst);
      const uint32_t w = c->step_word.load(std::memory_order_seq_cst);
      if (c->step.load(std::memory_order_seq_cst) < target) futex_wait(&c->step_word, w, std::chrono::microseconds(10000));
      c->step_sleepers.fetch_sub(1, std::memory_order_seq_cst);
    }
  };
  if (who.empty()) {
    for (int j = 0; j < local_size(); ++j) wait_one(j);
  } else {
    for (int j : who) wait_one(j);
  }
}

int ShmProvider::acquire_slot(const Deadline& deadline, const char* op) {
  const int s = next_slot_;
  next_slot_ = (next_slot_ + 1) % opt_.slots;
  wait_steps(slot_release_[size_t(s)], deadline, op);
  return s;
}

void ShmProvider::release_slot(int s, uint64_t step_when_done) { slot_release_[size_t(s)] = step_when_done; }

// ---- point to point ----

RequestPtr ShmProvider::isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) {
  const int j = int(std::find(locals_.begin(), locals_.end(), peer) - locals_.begin());
  if (j >= local_size() || j == me_) throw Error(cat("mk shm: rank ", rank_, ": peer ", peer, " is not on this host"));
  auto req = std::make_shared<Request>();
  if (aborted_.load()) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(abort_mu_);
      why = abort_reason_;
    }
    req->fail(cat("rank ", rank_, ": communicator aborted: ", why));
    return req;
  }
  if (!alive_[size_t(j)].load()) {
    req->fail(cat("rank ", rank_, ": ", gone_reason(peer)));
    return req;
  }
  {
    std::lock_guard<std::mutex> lock(out_[j]->mu);
    out_[j]->q.push_back(OutMsg{MsgHeader{tag, check, len}, static_cast<const char*>(buf), 0, req});
  }
  pump_sends(j);  // eager: usually the whole message fits in the ring right away
  bool pending;
  {
    std::lock_guard<std::mutex> lock(out_[j]->mu);
    pending = !out_[j]->q.empty();
  }
  if (pending) wake_progress();  // our progress thread finishes it as the receiver frees ring space
  return req;
}

void ShmProvider::ring_doorbell(int j) {
  Control* c = peers_[j]->control();
  c->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (c->doorbell_sleeping.load(std::memory_order_seq_cst)) futex_wake_all(&c->doorbell);
}

bool ShmProvider::pump_sends(int j) {
  std::vector<RequestPtr> done;
  bool moved = false;
  bool blocked = false;  // a send is left waiting for ring space: the receiver must drain, waiting or not
  {
    std::lock_guard<std::mutex> lock(out_[j]->mu);
    auto& q = out_[j]->q;
    if (q.empty() || !peers_[j]) return false;
    RingHeader* rh = peers_[j]->ring_header(me_);
    char* data = peers_[j]->ring_data(me_);
    const size_t cap = opt_.ring;
    uint64_t head = rh->head.load(std::memory_order_relaxed);
    while (!q.empty()) {
      OutMsg& m = q.front();
      const size_t total = sizeof(MsgHeader) + m.hdr.len;
      const uint64_t tail = rh->tail.load(std::memory_order_acquire);
      size_t space = cap - size_t(head - tail);
      if (space == 0) break;
      while (space > 0 && m.done < total) {
        const char* src;
        size_t n;
        if (m.done < sizeof(MsgHeader)) {
          src = reinterpret_cast<const char*>(&m.hdr) + m.done;
          n = sizeof(MsgHeader) - m.done;
        } else {
          src = m.data + (m.done - sizeof(MsgHeader));
          n = total - m.done;
        }
        const size_t pos = size_t(head % cap);
        n = std::min({n, space, cap - pos});
        std::memcpy(data + pos, src, n);
        head += n;
        m.done += n;
        space -= n;
      }
      moved = true;
      rh->head.store(head, std::memory_order_release);
      if (m.done < total) break;
      done.push_back(m.req);
      q.pop_front();
    }
    blocked = !q.empty();
  }
  if (moved) {
    // The head store above against the sleeper count (Dekker with sleep()): either a thread that is
    // about to sleep sees the new head, or we see it counted and ring.
    std::atomic_thread_fence(std::memory_order_seq_cst);
    if (blocked || peers_[j]->ring_header(me_)->sleepers.load(std::memory_order_relaxed) != 0) ring_doorbell(j);
  }
  for (auto& r : done) r->complete(0, rank_);
  return moved;
}

void ShmProvider::progress_while_pending(const Request& r, int peer) {
  const int j = int(std::find(locals_.begin(), locals_.end(), peer) - locals_.begin());
  if (j >= local_size() || j == me_) return;
  // The spin time counts from the last time data moved: while a large message streams through the ring,
  // the waiter keeps copying it (both sides of a transfer larger than the ring drive it this way, with no
  // wake-ups between ring-fulls), and sleeps only once the peer has been idle for the spin time. Capped, so
  // the request's deadline and interrupts (checked by the sleeping wait) are never far away.
  const auto start = Clock::now();
  const auto cap = start + kMaxActiveSpin;
  auto until = start + spin_;
  for (int i = 1; !r.test(); ++i) {
    if (!alive_[size_t(j)].load() || aborted_.load()) return;
    const bool drained = drain_ring(j);
    if (pump_sends(j) || drained) {
      const auto now = Clock::now();
      if (now >= cap) return;
      until = now + spin_;
      continue;
    }
    cpu_relax();
    if ((i & 15) == 0 && Clock::now() >= until) return;
  }
}

std::shared_ptr<void> ShmProvider::sleep(int peer) {
  std::vector<int> rings;
  for (int j = 0; j < local_size(); ++j) {
    if (j == me_ || (peer != kAnySource && locals_[size_t(j)] != peer)) continue;
    RingHeader* rh = own_->ring_header(j);
    rh->sleepers.fetch_add(1, std::memory_order_seq_cst);
    rings.push_back(j);
    // What the peer wrote before it could see us counted was not announced: take it now, or let the
    // progress thread take it when another thread holds the ring (and may have read its head before).
    if (rh->head.load(std::memory_order_seq_cst) != rh->tail.load(std::memory_order_seq_cst)) {
      drain_ring(j);
      if (rh->head.load(std::memory_order_seq_cst) != rh->tail.load(std::memory_order_seq_cst)) wake_progress();
    }
  }
  std::shared_ptr<ShmSegment> seg = own_;
  return std::shared_ptr<void>(seg.get(), [seg, rings](void*) {
    for (int j : rings) seg->ring_header(j)->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  });
}

void ShmProvider::poll(int peer) {
  for (int j = 0; j < local_size(); ++j) {
    if (j == me_ || (peer != kAnySource && locals_[size_t(j)] != peer) || !alive_[size_t(j)].load()) continue;
    drain_ring(j);
    pump_sends(j);
  }
}

void ShmProvider::wake_progress() {
  Control* c = own_->control();
  c->doorbell.fetch_add(1, std::memory_order_seq_cst);
  if (c->doorbell_sleeping.load(std::memory_order_seq_cst)) futex_wake_all(&c->doorbell);
}

bool ShmProvider::drain_ring(int j) {
  std::unique_lock<std::mutex> drainer(in_[j]->mu, std::try_to_lock);
  if (!drainer.owns_lock()) return false;  // another thread is draining this ring right now
  if (aborted_.load(std::memory_order_acquire)) return false;  // (the receives' buffers may be gone: see abort)
  struct Draining {  // (see abort)
    const InState* before = tls_draining;
    explicit Draining(const InState* s) { tls_draining = s; }
    ~Draining() { tls_draining = before; }
  } draining(in_[j].get());
  RingHeader* rh = own_->ring_header(j);
  char* data = own_->ring_data(j);
  const size_t cap = opt_.ring;
  uint64_t tail = rh->tail.load(std::memory_order_relaxed);
  const uint64_t head = rh->head.load(std::memory_order_acquire);
  if (head == tail) return false;
  InState& st = *in_[j];
  auto take = [&](char* dst, size_t n) {
    while (n > 0) {
      const size_t pos = size_t(tail % cap);
      const size_t k = std::min(n, cap - pos);
      std::memcpy(dst, data + pos, k);
      dst += k;
      tail += k;
      n -= k;
    }
  };
  while (tail < head) {
    if (st.hdr_got < sizeof(MsgHeader)) {
      size_t n = std::min(size_t(head - tail), sizeof(MsgHeader) - st.hdr_got);
      take(reinterpret_cast<char*>(&st.hdr) + st.hdr_got, n);
      st.hdr_got += n;
      if (st.hdr_got < sizeof(MsgHeader)) break;
      st.cur = matcher_.arrive(Envelope{locals_[j], st.hdr.tag, size_t(st.hdr.len), st.hdr.check});
      st.got = 0;
    }
    size_t n = std::min(size_t(head - tail), size_t(st.hdr.len) - st.got);
    take(st.cur->dst + st.got, n);
    st.got += n;
    if (st.got == st.hdr.len) {
      ArrivalPtr a = std::move(st.cur);
      st.hdr_got = 0;
      st.got = 0;
      rh->tail.store(tail, std::memory_order_release);
      matcher_.delivered(a);
    }
  }
  rh->tail.store(tail, std::memory_order_release);
  // The tail store against the sender's flag (Dekker with progress_loop): a sender whose progress thread went
  // to sleep for lack of space is rung; otherwise it saw the space itself (or a thread of it polls the ring).
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (rh->sender_waiting.load(std::memory_order_relaxed) != 0) {
    rh->sender_waiting.store(0, std::memory_order_relaxed);
    ring_doorbell(j);
  }
  return true;
}

void ShmProvider::progress_loop() {
  Control* c = own_->control();
  int idle = 0;
  auto last_check = Clock::now();
  while (!stop_.load(std::memory_order_acquire)) {
    bool any = false;
    for (int j = 0; j < local_size(); ++j) {
      if (j == me_ || !alive_[size_t(j)].load()) continue;
      any |= drain_ring(j);
      any |= pump_sends(j);
    }
    if (any) {
      idle = 0;
      continue;
    }
    if (++idle < 200) {
      cpu_relax();
      continue;
    }
    const uint32_t bell = c->doorbell.load(std::memory_order_seq_cst);
    c->doorbell_sleeping.store(1, std::memory_order_seq_cst);
    bool work = false;
    for (int j = 0; j < local_size() && !work; ++j) {
      if (j == me_ || !alive_[size_t(j)].load()) continue;
      RingHeader* rh = own_->ring_header(j);
      work = rh->head.load() != rh->tail.load();
      bool queued;
      {
        std::lock_guard<std::mutex> lock(out_[j]->mu);
        queued = !out_[j]->q.empty();
      }
      if (queued && !work) {
        // A send waits for space in j's ring: sleep until j's receiver frees some (it rings us when it sees
        // the flag), instead of spinning on the cores the ranks compute on.
        RingHeader* out = peers_[j]->ring_header(me_);
        out->sender_waiting.store(1, std::memory_order_seq_cst);
        work = out->head.load(std::memory_order_seq_cst) - out->tail.load(std::memory_order_seq_cst) < opt_.ring;
      }
    }
    if (!work && c->doorbell.load(std::memory_order_seq_cst) == bell)
      futex_wait(&c->doorbell, bell, std::chrono::microseconds(100000));
    c->doorbell_sleeping.store(0, std::memory_order_seq_cst);
    if (Clock::now() - last_check > std::chrono::milliseconds(100)) {
      last_check = Clock::now();
      for (int j = 0; j < local_size(); ++j) {
        if (j == me_ || !alive_[size_t(j)].load()) continue;
        try {
          check_peer(j, "progress");
        } catch (const Error&) {
          // check_peer already failed everything that involved this peer
        }
      }
    }
    idle = work ? 0 : idle;
  }
}

void ShmProvider::fail_peer(int j, const std::string& why) {
  if (!alive_[size_t(j)].exchange(false)) return;
  std::deque<OutMsg> q;
  {
    std::lock_guard<std::mutex> lock(out_[j]->mu);
    q.swap(out_[j]->q);
  }
  for (auto& m : q) m.req->fail(why);
  matcher_.fail_source(locals_[j], why);
}

void ShmProvider::abort(const std::string& why) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (!aborted_.load()) {
      abort_reason_ = why;
      aborted_.store(true);
      first = true;
    }
  }
  if (first) {
    Control* c = own_->control();
    const size_t n = std::min(why.size(), kAbortWhyBytes - 1);
    std::memcpy(c->abort_why, why.data(), n);
    c->abort_why[n] = '\0';
    c->aborted.store(1);  // (seq_cst: a peer that sees it sees abort_why whole)
    c->step_word.fetch_add(1);
    futex_wake_all(&c->step_word);
    for (int j = 0; j < local_size(); ++j)
      if (j != me_) fail_peer(j, cat("rank ", rank_, ": communicator aborted: ", why));
  }
  // A drain under way copies into a receive's buffer (the progress thread's, or a waiting thread's): it ends
  // before abort returns, on every call, and none starts after (drain_ring checks aborted_), so the owner of a
  // failed receive may free its buffer (fail_peer already waited for a send being copied into a ring, under
  // out_[j]->mu). An op interrupted mid-transfer freed a buffer the progress thread was still filling (ASan).
  // (Not on a thread that drains now, from a completion it delivers: that drain is its own caller's.)
  for (int j = 0; j < local_size(); ++j)
    if (j != me_ && tls_draining != in_[size_t(j)].get()) std::lock_guard<std::mutex> drained(in_[size_t(j)]->mu);
}

bool ShmProvider::peer_alive(int peer) const {
  auto it = std::find(locals_.begin(), locals_.end(), peer);
  if (it == locals_.end()) return false;
  const size_t j = size_t(it - locals_.begin());
  // (an abort counts at once, before the progress thread's next check fails the peer)
  return alive_[j].load() && (int(j) == me_ || !peers_[j]->control()->aborted.load());
}

std::string ShmProvider::gone_reason(int peer) const {
  const auto it = std::find(locals_.begin(), locals_.end(), peer);
  if (it == locals_.end() || *it == rank_) return cat("rank ", peer, " is not a peer on this host");
  const ShmSegment& seg = *peers_[size_t(it - locals_.begin())];
  const Control* c = seg.control();
  if (c->aborted.load()) {
    const char* why = c->abort_why;
    return cat("peer ", peer, " aborted its communicator (", std::string(why, strnlen(why, kAbortWhyBytes)), ")");
  }
  return cat("peer ", peer, " (pid ", seg.pid(), ", same host) exited");
}
}  // namespace mk
