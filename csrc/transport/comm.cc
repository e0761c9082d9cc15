#include "transport/comm.h"

#include <optional>

#include "transport/error.h"

namespace mk {

Comm::Comm(int rank, int size, std::chrono::milliseconds timeout)
    : rank_(rank), size_(size), timeout_(timeout), matcher_(rank), peers_(size_t(size)), route_(size_t(size), nullptr) {}

Comm::~Comm() {
  // Providers stop their progress threads before the matcher they feed goes away.
  tcp_.reset();
  shm_.reset();
}

const char* Comm::transport_of(int peer) const {
  if (peer == rank_) return "self";
  return route_.at(size_t(peer)) ? route_[size_t(peer)]->name() : "none";
}

void Comm::check_usable(const char* op) const {
  if (aborted_.load())
    throw PeerError(cat("mk ", op, ": rank ", rank_, ": the communicator was aborted earlier (", abort_reason(),
                        "); create a new process group (the default group: dist.destroy_process_group(), then "
                        "dist.init_process_group())"));
}

std::string Comm::abort_reason() const {
  std::lock_guard<std::mutex> lock(abort_mu_);
  return abort_reason_;
}

RequestPtr Comm::isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) {
  if (peer < 0 || peer >= size_ || peer == rank_)
    throw Error(cat("mk send: rank ", rank_, ": invalid destination rank ", peer, " (group size ", size_, ")"));
  return route_[size_t(peer)]->isend(peer, tag, buf, len, check);
}

RequestPtr Comm::irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t check, bool up_to) {
  if (peer != kAnySource && (peer < 0 || peer >= size_ || peer == rank_))
    throw Error(cat("mk recv: rank ", rank_, ": invalid source rank ", peer, " (group size ", size_, ")"));
  auto r = matcher_.post_recv(peer, tag, buf, len, check, up_to);
  if (peer != kAnySource && !route_[size_t(peer)]->peer_alive(peer))
    matcher_.fail_source(peer, cat("rank ", rank_, ": ", route_[size_t(peer)]->gone_reason(peer)));
  return r;
}

void Comm::wait(const RequestPtr& r, const Deadline& d, const char* op, int peer) {
  progress_while_pending(*r, peer);
  std::optional<Sleeping> sleeping;
  if (!r->test()) sleeping.emplace(*this, peer);
  try {
    r->wait(d, [&] {
      return peer == kAnySource ? cat("mk ", op, ": rank ", rank_, " (any source)")
                                : cat("mk ", op, ": rank ", rank_, ", peer ", peer);
    });
  } catch (const TimeoutError&) {
    // (said as the shm step wait says it: the rank that gave up, and the one it waited for)
    throw TimeoutError(peer == kAnySource ? cat("mk ", op, ": rank ", rank_, " timed out waiting for any peer")
                                          : cat("mk ", op, ": rank ", rank_, " timed out waiting for peer ", peer));
  }
}

void Comm::progress_while_pending(const Request& r, int peer) {
  if (!r.test() && shm_ && peer >= 0 && peer < size_ && route_[size_t(peer)] == shm_.get())
    shm_->progress_while_pending(r, peer);
}

Comm::Sleeping::Sleeping(Comm& c, int peer) {
  if (!c.shm_ || (peer != kAnySource && (peer < 0 || peer >= c.size_ || c.route_[size_t(peer)] != c.shm_.get())))
    return;
  token_ = c.shm_->sleep(peer);
}

void Comm::poll(int peer) {
  if (!shm_) return;
  if (peer == kAnySource || (peer >= 0 && peer < size_ && route_[size_t(peer)] == shm_.get())) shm_->poll(peer);
}

void Comm::abort(const std::string& why) {
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(abort_mu_);
    if (!aborted_.load()) {
      abort_reason_ = why;
      aborted_.store(true);
      first = true;
    }
  }
  // (again on a later call too: the providers' aborts return once no progress thread copies into a buffer of
  // a request they failed, which a later caller, on another thread, must also wait for before it frees its own)
  if (shm_) shm_->abort(why);
  if (tcp_) tcp_->abort(why);
  if (first) matcher_.fail_all(cat("rank ", rank_, ": communicator aborted: ", why));
}

}  // namespace mk
