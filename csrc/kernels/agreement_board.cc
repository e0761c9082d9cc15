#include "kernels/agreement_board.h"

#include <fcntl.h>
#include <sched.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>

#include "transport/error.h"
#include "transport/futex.h"
#include "transport/host.h"

namespace mk::kernels {

namespace {

constexpr uint64_t kMagic = 0x6d6b626f61726431;  // "mkboard1"

struct alignas(64) Header {
  uint64_t magic;
  int64_t token;
  int32_t rank, size, pid;
  uint32_t words;
  std::atomic<uint32_t> word;      // futex: bumped after every publish
  std::atomic<uint32_t> sleepers;  // readers sleeping on `word`
};

struct alignas(64) SlotHead {
  std::atomic<uint64_t> seq_plus1;  // call number + 1 of the descriptor in this slot (0: none yet)
};

size_t slot_bytes(size_t words) { return sizeof(SlotHead) + words * sizeof(int64_t); }
size_t total_bytes(size_t words) { return (sizeof(Header) + 2 * slot_bytes(words) + 4095) / 4096 * 4096; }

}  // namespace

struct AgreementBoard::Segment {
  int fd = -1;
  char* base = nullptr;
  size_t bytes = 0;
  size_t words = 0;

  Segment() = default;
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;
  ~Segment() {
    if (base) munmap(base, bytes);
    if (fd >= 0) ::close(fd);
  }
  Header* header() const { return reinterpret_cast<Header*>(base); }
  SlotHead* slot(uint64_t seq) const {
    return reinterpret_cast<SlotHead*>(base + sizeof(Header) + (seq % 2) * slot_bytes(words));
  }
  int64_t* slot_words(uint64_t seq) const { return reinterpret_cast<int64_t*>(slot(seq) + 1); }
  // Map `fd` (taking ownership); false when it cannot be mapped at `bytes` (the caller then gives up).
  bool map(int owned_fd, size_t nbytes) {
    fd = owned_fd;
    bytes = nbytes;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) return false;
    base = static_cast<char*>(p);
    return true;
  }
};

AgreementBoard::AgreementBoard(int rank, int size, size_t words)
    : rank_(rank), size_(size), words_(words), spin_(spin_time(size)), own_(std::make_unique<Segment>()) {
  const int fd = int(syscall(SYS_memfd_create, cat("mk-agree-rank", rank).c_str(), MFD_CLOEXEC));
  MK_SYSCHECK(fd, cat("mk ops: rank ", rank, ": memfd_create for the agreement board"));
  own_->words = words;
  const size_t bytes = total_bytes(words);
  if (ftruncate(fd, off_t(bytes)) != 0) {
    const int e = errno;
    ::close(fd);
    throw_errno(cat("mk ops: rank ", rank, ": ftruncate of the agreement board (", bytes, " bytes)"), e);
  }
  if (!own_->map(fd, bytes))
    throw_errno(cat("mk ops: rank ", rank, ": mmap of the agreement board (", bytes, " bytes)"));
  uint64_t t = 0;
  if (getrandom(&t, sizeof(t), 0) != ssize_t(sizeof(t)))
    throw_errno(cat("mk ops: rank ", rank, ": getrandom for the agreement board"));
  token_ = int64_t(t & 0x7fffffffffffffffull) | 1;  // never 0 (0 means "no board" in a descriptor)
  Header* h = own_->header();
  h->magic = kMagic;
  h->token = token_;
  h->rank = rank;
  h->size = size;
  h->pid = int32_t(getpid());
  h->words = uint32_t(words);
}

AgreementBoard::~AgreementBoard() {
  for (int fd : pidfds_)
    if (fd >= 0) ::close(fd);
}

int64_t AgreementBoard::pid() const { return own_->header()->pid; }
int64_t AgreementBoard::fd() const { return own_->fd; }

bool AgreementBoard::map_peers(const std::vector<int64_t>& pids, const std::vector<int64_t>& fds,
                               const std::vector<int64_t>& tokens) {
  if (mapped_) return true;
  std::vector<std::unique_ptr<Segment>> peers(static_cast<size_t>(size_));
  std::vector<int> pidfds(static_cast<size_t>(size_), -1);
  auto close_pidfds = [&pidfds] {
    for (int fd : pidfds)
      if (fd >= 0) ::close(fd);
  };
  const size_t bytes = total_bytes(words_);
  for (int q = 0; q < size_; ++q) {
    if (q == rank_) continue;
    if (pids[size_t(q)] <= 0 || tokens[size_t(q)] == 0) {
      close_pidfds();
      return false;
    }
    const std::string path = cat("/proc/", pids[size_t(q)], "/fd/", fds[size_t(q)]);
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) {
      close_pidfds();
      return false;
    }
    struct stat st {};
    auto seg = std::make_unique<Segment>();
    seg->words = words_;
    if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
      ::close(fd);
      close_pidfds();
      return false;
    }
    // (pid namespaces that differ would make /proc/<pid> another process: the token tells.)
    if (!seg->map(fd, bytes) || seg->header()->magic != kMagic || seg->header()->token != tokens[size_t(q)] ||
        seg->header()->rank != q || seg->header()->size != size_ || seg->header()->words != uint32_t(words_)) {
      close_pidfds();
      return false;
    }
    ::close(seg->fd);  // the mapping keeps the segment; the owner's fd stays its only name
    seg->fd = -1;
    pidfds[size_t(q)] = open_pidfd(pid_t(pids[size_t(q)]));
    peers[size_t(q)] = std::move(seg);
  }
  peers_ = std::move(peers);
  pidfds_ = std::move(pidfds);
  mapped_ = true;
  return true;
}

void AgreementBoard::publish(uint64_t seq, const int64_t* words) {
  std::memcpy(own_->slot_words(seq), words, words_ * sizeof(int64_t));
  own_->slot(seq)->seq_plus1.store(seq + 1, std::memory_order_release);
  Header* h = own_->header();
  h->word.fetch_add(1, std::memory_order_seq_cst);
  if (h->sleepers.load(std::memory_order_seq_cst) != 0) futex_wake_all(&h->word);
}

void AgreementBoard::collect(int q, uint64_t seq, int64_t* out, const Deadline& deadline, const char* op,
                             const std::function<void()>& check) const {
  const Segment& s = *peers_.at(size_t(q));
  Header* h = s.header();
  SlotHead* slot = s.slot(seq);
  const uint64_t gen = cancel_generation().load(std::memory_order_acquire);
  auto ready = [&] { return slot->seq_plus1.load(std::memory_order_acquire) == seq + 1; };
  // Spin as the shm transport does before sleeping: on a VM, waking a sleeping rank costs tens of
  // microseconds, and a late wake here delays the op's first collective too.
  const auto spin_until = std::chrono::steady_clock::now() + spin_;
  for (int i = 0; !ready(); ++i) {
    cpu_relax();
    if ((i & 31) == 31) {
      if (std::chrono::steady_clock::now() >= spin_until) break;
      sched_yield();  // the writer may share this core
    }
  }
  while (!ready()) {
    if (cancel_generation().load(std::memory_order_acquire) != gen)
      throw CancelledError(cat("mk ", op, ": rank ", rank_, ": cancelled by an interrupt while waiting for rank ", q,
                               "'s argument descriptor"));
    if (deadline.expired())
      throw TimeoutError(cat("mk ", op, ": rank ", rank_, " timed out waiting for rank ", q,
                             "'s argument descriptor (it has not reached this fused-op call)"));
    if (process_exited(pidfds_[size_t(q)], h->pid) && !ready())
      throw PeerError(cat("mk ", op, ": rank ", rank_, ": rank ", q, " (pid ", h->pid,
                          ", same host) exited before sending its argument descriptor"));
    if (check) check();
    h->sleepers.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t w = h->word.load(std::memory_order_seq_cst);
    if (!ready()) futex_wait(&h->word, w, std::chrono::microseconds(5000));
    h->sleepers.fetch_sub(1, std::memory_order_seq_cst);
  }
  std::memcpy(out, s.slot_words(seq), words_ * sizeof(int64_t));
}

}  // namespace mk::kernels
