// A communicator: who the ranks are, which provider reaches each peer, and the shared Matcher.
// Built by bootstrap.h from a key-value store; used by the collectives and the torch adapter.
#pragma once
#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "transport/deadline.h"
#include "transport/matching.h"
#include "transport/providers/provider.h"
#include "transport/providers/shm.h"
#include "transport/providers/tcp.h"

namespace mk {

enum class TransportMode { automatic, shm, tcp };

struct PeerInfo {
  std::string host_id;
  std::string host_name;
  int pid = 0;
};

class Comm {
 public:
  Comm(int rank, int size, std::chrono::milliseconds timeout);
  ~Comm();
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  int rank() const { return rank_; }
  int size() const { return size_; }
  std::chrono::milliseconds timeout() const { return timeout_; }
  void set_timeout(std::chrono::milliseconds t) { timeout_ = t; }
  Deadline deadline() const { return Deadline::after(timeout_); }
  Matcher& matcher() { return matcher_; }

  // True when every rank is on this host and reachable through shared memory: the collectives then use
  // the shm segment algorithms.
  bool all_local() const { return shm_ && shm_->local_size() == size_; }
  ShmProvider* shm() const { return shm_.get(); }
  const std::vector<PeerInfo>& peers() const { return peers_; }
  // "self", "shm" or "tcp"
  const char* transport_of(int peer) const;
  // The provider that reaches `peer` (null for this rank itself).
  Provider* route(int peer) const { return route_.at(size_t(peer)); }
  // Ids of one-sided windows: every rank creates the windows of a communicator in the same order.
  uint64_t next_window_id() { return window_ids_.fetch_add(1); }

  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check);
  // up_to: `len` is a capacity; any message of at most `len` bytes matches (Request::bytes() tells its size).
  RequestPtr irecv(int peer, uint64_t tag, void* buf, size_t len, uint64_t check, bool up_to = false);
  // Wait for a request; errors name this rank, the op and the peer.
  void wait(const RequestPtr& r, const Deadline& d, const char* op, int peer);
  // Before sleeping on request `r` with `peer`: over shm, drain and push that peer's traffic on this thread
  // for a few tens of microseconds (ShmProvider::progress_while_pending); nothing for other routes.
  void progress_while_pending(const Request& r, int peer);
  // While alive: a thread of this rank sleeps waiting for point-to-point traffic from `peer` (kAnySource: any
  // peer), so shared-memory peers announce what they write (ShmProvider::sleep). Every sleeping wait on
  // a point-to-point request holds one; without it a message over shared memory may wait for the progress
  // thread's periodic pass. Nothing for peers over tcp (its progress thread always listens).
  class Sleeping {
   public:
    Sleeping(Comm& c, int peer);

   private:
    std::shared_ptr<void> token_;  // ShmProvider::sleep's (valid after the communicator is gone)
  };
  // One non-blocking progress pass over the shared-memory traffic with `peer` (kAnySource: every peer).
  void poll(int peer);

  // Collective sequence number (same on every rank as long as they call the same collectives).
  uint64_t next_seq() { return seq_++; }

  // Fail everything in flight and refuse new operations; peers notice (connections drop, shm flag).
  void abort(const std::string& why);
  bool aborted() const { return aborted_.load(); }
  std::string abort_reason() const;
  void check_usable(const char* op) const;

 private:
  friend class Bootstrap;
  const int rank_;
  const int size_;
  std::chrono::milliseconds timeout_;
  Matcher matcher_;
  std::vector<PeerInfo> peers_;
  std::unique_ptr<ShmProvider> shm_;
  std::unique_ptr<TcpProvider> tcp_;
  std::vector<Provider*> route_;
  uint64_t seq_ = 0;
  std::atomic<uint64_t> window_ids_{1};
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
};

}  // namespace mk
