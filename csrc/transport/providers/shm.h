// Shared-memory provider: the ranks of one host map each other's segments.
//
// Each rank owns one segment (a memfd, so nothing is ever left in /dev/shm, even after kill -9; peers map
// it through /proc/<pid>/fd). A segment holds:
//   - a step counter with a futex word: the collectives' synchronisation (collectives/shm_*.cc),
//   - one descriptor per collective slot (what each rank thinks the operation is: checked by the others),
//   - one byte ring per sending peer for tagged point-to-point messages (isend; recv via the Matcher),
//   - `slots` staging buffers of `chunk` bytes that the collectives fill and their peers read.
// Waits spin briefly (less when ranks outnumber cores), then sleep on a futex in shared memory.
#pragma once
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/deadline.h"
#include "transport/matching.h"
#include "transport/providers/provider.h"

namespace mk {

struct ShmOptions {
  size_t chunk = 1 << 20;   // SUPERKERNEL_SHM_CHUNK: bytes per collective staging slot
  int slots = 4;            // SUPERKERNEL_SHM_SLOTS: pipeline depth
  size_t ring = 1 << 20;    // SUPERKERNEL_SHM_RING: bytes per point-to-point ring
};

class ShmSegment;

class ShmProvider final : public Provider {
 public:
  // Creates this rank's segment. `locals` are the global ranks on this host in order; me is among them.
  ShmProvider(int rank, const std::vector<int>& locals, Matcher& matcher, const ShmOptions& opt);
  ~ShmProvider() override;

  // "pid:fd:size" for the store; attach() maps every peer's segment from these.
  std::string descriptor() const;
  void attach(const std::vector<std::string>& descriptors, const Deadline& deadline);

  const char* name() const override { return "shm"; }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) override;
  void abort(const std::string& why) override;
  bool peer_alive(int peer) const override;
  std::string gone_reason(int peer) const override;
  // A thread about to sleep on request `r` of point-to-point traffic with `peer` makes progress itself: it
  // drains that peer's ring and pushes our queued sends to it, so a message that arrives meanwhile completes
  // without waking the progress thread (on a VM a wake-up costs tens of microseconds, and a transfer larger
  // than the ring needs one per ring-full). Returns when `r` finished, when nothing moved for the spin time,
  // or after kMaxActiveSpin of continuous copying; never blocks on another thread.
  void progress_while_pending(const Request& r, int peer);
  // A thread of this rank goes to sleep waiting for traffic from `peer` (kAnySource: from any peer on this
  // host) until the returned token is released. Peers ring this rank's progress thread for each message they
  // write only while such a thread is counted (see RingHeader::sleepers in shm.cc), so every sleeping wait
  // for point-to-point traffic must hold one (Comm::Sleeping does it). The token stays valid after the
  // provider is gone.
  std::shared_ptr<void> sleep(int peer);
  // One non-blocking pass: drain what `peer` (kAnySource: every peer) wrote, push our queued sends to it.
  void poll(int peer);
  // Throws PeerError when this communicator or `peer`'s was aborted, or `peer` (a global rank on this host)
  // exited: for waits outside the transport (the fused ops' agreement board) that must end as its own do.
  void check_peer_usable(int peer, const char* op);

  // ---- the collectives' view (called by one thread at a time: the group's worker) ----
  int local_rank() const { return me_; }
  int local_size() const { return int(locals_.size()); }
  int global_rank(int local) const { return locals_[local]; }
  size_t chunk_bytes() const { return opt_.chunk; }
  // Staging slot `s` of local rank `r` (r == local_rank() for our own).
  char* slot(int r, int s) const;
  // Descriptor words of slot s of rank r: [0] is the operation hash, the rest free for the algorithm.
  std::atomic<uint64_t>* slot_desc(int r, int s) const;
  // Advance our step counter by one and wake sleepers. Returns the new value.
  uint64_t publish();
  // Wait until every local rank in `who` (all when empty) has step >= target.
  void wait_steps(uint64_t target, const Deadline& deadline, const char* op, const std::vector<int>& who = {});
  // Next slot index in the ring of slots, and the step every peer must reach before we may overwrite it.
  int acquire_slot(const Deadline& deadline, const char* op);
  void release_slot(int s, uint64_t step_when_done);

 private:
  struct Outgoing;
  void progress_loop();
  bool pump_sends(int peer_local);
  bool drain_ring(int peer_local);
  void ring_doorbell(int peer_local);
  void wake_progress();  // wake this rank's own progress thread if it sleeps
  void check_peer(int peer_local, const char* op);
  void fail_peer(int peer_local, const std::string& why);

  const int rank_;
  const std::vector<int> locals_;
  int me_ = 0;
  Matcher& matcher_;
  ShmOptions opt_;
  std::shared_ptr<ShmSegment> own_;  // shared with sleep() tokens, which may outlive the provider
  std::vector<std::unique_ptr<ShmSegment>> peers_;  // by local rank; own slot null
  std::vector<int> pidfds_;
  std::vector<std::unique_ptr<Outgoing>> out_;       // by local rank
  std::vector<std::unique_ptr<struct InState>> in_;  // by local rank
  std::vector<std::atomic<bool>> alive_;
  int next_slot_ = 0;
  std::vector<uint64_t> slot_release_;
  bool oversubscribed_ = false;
  std::chrono::microseconds spin_{50};
  // progress_while_pending keeps a waiter copying at most this long while data flows (then it sleeps).
  static constexpr std::chrono::milliseconds kMaxActiveSpin{20};
  std::atomic<bool> stop_{false};
  std::atomic<bool> aborted_{false};
  mutable std::mutex abort_mu_;
  std::string abort_reason_;
  std::thread progress_;
};

}  // namespace mk
