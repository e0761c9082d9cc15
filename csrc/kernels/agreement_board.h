// A shared-memory board for the fused ops' argument agreement when every rank of the group runs on this
// host, on any backend.
//
// Elsewhere the agreement is one more exchange per op call. On Gloo an exchange of its own: an alltoall of
// 384 B took 270-320 us on 2 ranks of this 2-core VM (its worker thread and TCP loopback), as long as a
// 256^3 product (it is a send/recv to and from each peer now, group.h); on NCCL it would copy the
// descriptor to the device and back (a stream synchronisation every call). On mk it is one point-to-point
// message to and from each peer through the shm rings (a fused call after a barrier took 8.7 us median, 16.8
// us p90 with them; 7.1 and 8.6 us on the board). On the board each rank writes its descriptor into a small
// segment of its own and reads its peers'.
//
// Each rank owns one segment: a memfd (nothing is ever left in /dev/shm), which its peers map through
// /proc/<pid>/fd/<fd>, as the shm transport does (transport/providers/shm.cc). It holds two descriptor slots,
// used by call number parity: a rank writes call s's descriptor only after its agreement of call s-1 saw
// every peer's, and a peer writes that one only after it has read call s-2's, so a slot is never rewritten
// while a peer still needs it. Waits spin briefly, then sleep on a futex word in the writer's segment, and
// look at the deadline, interrupts (cancel_all), the writer's liveness (a pidfd) and, on mk, whether either
// communicator was aborted, every 5 ms.
//
// How a group gets there (Pipeline::start_agree and Agreement): the first agreements still travel the usual
// way and carry each rank's segment address (pid, fd, a random token); once one of them shows every rank on
// this host, each rank maps its peers' segments; the next carries "mapped" from every rank, and from the
// call after that on, every rank uses the board. Every rank decides from the same exchanged words, so they
// switch at the same call; a rank that cannot map a segment (no ptrace access to /proc/<pid>/fd,
// SUPERKERNEL_OPS_BOARD=0) never says "mapped", and the group keeps the usual exchange.
#pragma once
#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "transport/deadline.h"

namespace mk::kernels {

class AgreementBoard {
 public:
  // Creates this rank's segment for descriptors of `words` int64 values. Throws mk::Error on failure.
  AgreementBoard(int rank, int size, size_t words);
  ~AgreementBoard();
  AgreementBoard(const AgreementBoard&) = delete;
  AgreementBoard& operator=(const AgreementBoard&) = delete;

  // Where peers find this rank's segment (sent in the descriptors of the collective agreements).
  int64_t pid() const;
  int64_t fd() const;
  int64_t token() const { return token_; }

  // Map every peer's segment from the (pid, fd, token) each sent; this rank's own entry is skipped. Returns
  // false (and maps nothing) when one cannot be opened or is not the segment that rank announced.
  bool map_peers(const std::vector<int64_t>& pids, const std::vector<int64_t>& fds, const std::vector<int64_t>& tokens);
  bool mapped() const { return mapped_; }

  // Every rank said "mapped" in one agreement: from the next call on, agreements use the board.
  void activate() { active_ = true; }
  bool active() const { return active_; }
  // Not every rank is on this host, or one could not map its peers: the group keeps the collective and the
  // pipeline drops this board.
  void retire() { retired_ = true; }
  bool retired() const { return retired_; }

  // Write this rank's descriptor of call `seq` (words() values) and wake the peers waiting for it.
  void publish(uint64_t seq, const int64_t* words);
  // Wait for rank q's descriptor of call `seq` and copy it to `out`. Throws mk::TimeoutError,
  // mk::CancelledError (an interrupt) or mk::PeerError (rank q exited), naming `op` and both ranks. `check`,
  // when given, runs before each sleep and may throw too (on mk: a communicator aborted here or by rank q).
  void collect(int q, uint64_t seq, int64_t* out, const Deadline& deadline, const char* op,
               const std::function<void()>& check = {}) const;

  size_t words() const { return words_; }

 private:
  struct Segment;
  int rank_, size_;
  size_t words_;
  std::chrono::microseconds spin_;  // before a wait sleeps (every rank of the group is on this host)
  int64_t token_ = 0;
  bool mapped_ = false, active_ = false, retired_ = false;
  std::unique_ptr<Segment> own_;
  std::vector<std::unique_ptr<Segment>> peers_;  // by rank (null for this rank)
  std::vector<int> pidfds_;                      // by rank (-1: none; liveness by kill(pid, 0) then)
};

}  // namespace mk::kernels
