// TCP provider: between hosts (or on one host when SUPERKERNEL_TRANSPORT=tcp).
// Each connection starts with a Hello carrying the job secret (checked both ways; a connection without
// it is closed and logged). Messages travel as versioned frames; large ones are striped over several
// sockets per peer. One progress thread per provider (epoll) receives frames and finishes queued sends,
// so transfers complete whatever the user's threads are doing.
//
// One-sided access (RMA): regions a window exposes are registered here by id; RMA frames (PUT, GET, ACC,
// AMO, each answered by a REPLY that carries the data, the old value or an error) travel on a peer's first
// socket, so one origin's operations reach a target in issue order, and the target's progress thread
// executes them (with the atomics of atomics.h) whatever its user threads are doing.
#pragma once
#include <array>
#include <atomic>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "transport/deadline.h"
#include "transport/matching.h"
#include "transport/providers/provider.h"

namespace mk {

using Secret = std::array<uint8_t, 32>;

// The listening socket, opened before addresses are published and closed once every peer connected.
class TcpListener {
 public:
  explicit TcpListener(const std::string& bind_addr);
  ~TcpListener();
  TcpListener(const TcpListener&) = delete;
  TcpListener& operator=(const TcpListener&) = delete;
  std::string address() const;  // "ip:port"
  int fd() const { return fd_; }
  void close();

 private:
  int fd_ = -1;
  std::string ip_;
  int port_ = 0;
};

struct TcpOptions {
  int sockets_per_peer = 2;           // SUPERKERNEL_TCP_SOCKETS
  size_t stripe_threshold = 1 << 20;  // messages at least this large are split across the sockets
};

class TcpProvider final : public Provider {
 public:
  // Connects to every peer in `peers` (addrs indexed by rank): lower ranks accept, higher ranks connect.
  TcpProvider(int rank, int world, const std::vector<int>& peers, const std::vector<std::string>& addrs,
              TcpListener& listener, const Secret& secret, Matcher& matcher, const TcpOptions& opt,
              const Deadline& deadline);
  ~TcpProvider() override;

  const char* name() const override { return "tcp"; }
  RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) override;
  void abort(const std::string& why) override;
  bool peer_alive(int peer) const override;
  std::string gone_reason(int peer) const override;

  void expose(uint64_t region, RmaRegion r) override;
  void withdraw(uint64_t region) override;
  RequestPtr put(int peer, uint64_t region, size_t offset, const void* src, size_t len, uint64_t notify) override;
  RequestPtr get(int peer, uint64_t region, size_t offset, void* dst, size_t len) override;
  RequestPtr accumulate(int peer, uint64_t region, size_t offset, const void* src, size_t len, DType t,
                        RedOp op) override;
  RequestPtr atomic(int peer, uint64_t region, size_t offset, AmoOp op, int64_t a, int64_t b,
                    std::shared_ptr<int64_t> result) override;

 private:
  struct Frame;
  struct Conn;
  struct InMsg;
  struct Peer;
  struct Pending;
  // Origin side: queue one RMA frame on the peer's first socket; the request finishes with its REPLY.
  RequestPtr rma_submit(int peer, uint16_t type, uint64_t region, uint64_t offset, uint64_t check, uint64_t aux,
                        const void* payload, size_t len, char* dst, size_t dst_len, std::shared_ptr<int64_t> result,
                        std::shared_ptr<void> keep);
  // Progress thread: an RMA frame's header arrived (decide where its payload goes; false: protocol
  // error, the peer was failed) / its payload is complete (execute, reply).
  bool rma_begin(Conn& c);
  void rma_end(Conn& c);
  void rma_reply(int peer, uint64_t op, uint64_t status, uint64_t value, const char* data, size_t len,
                 std::shared_ptr<void> keep);
  void fail_pending(int peer, const std::string& why);

  void connect_peer(int peer, const std::string& addr, const Deadline& deadline);
  void accept_peers(TcpListener& listener, const std::vector<int>& from, const Deadline& deadline);
  void adopt(int peer, int index, int fd);
  void progress_loop();
  void on_readable(Conn& c);
  struct SendState;
  // Write as much of c's queue as the socket takes (c.mu held); finished sends are appended to done.
  void flush_locked(Conn& c, std::vector<std::shared_ptr<SendState>>& done);
  void queue_rma_frame(Peer& p, Frame f);
  void arm_write(Conn& c, bool on);
  void match_ready(Peer& p);
  // Stop watching c's socket (epoll); a failure is reported on stderr.
  void unwatch(Conn& c);
  // Progress thread: the peer closed connection c between frames (end of file).
  void conn_closed(Conn& c);
  void peer_failed(int peer, const std::string& why);
  // Progress thread: connection c broke (reset, cut short, closed with frames due): the peer fails, with the
  // reason from an ABORT frame already waiting on another of its sockets if there is one (the sockets' events
  // come in no fixed order, and a reset on one can be seen before the ABORT frame sent earlier on another).
  void connection_failed(Conn& c, const std::string& why);
  // The text for an ABORT frame that has arrived, unread, on one of the failed connection's sibling sockets
  // ("" if none has).
  std::string abort_waiting(const Conn& failed) const;
  // abort(), first call: an ABORT frame with `why` on every socket whose stream is between frames, so the
  // peers can say why this rank left, not only that its connections closed.
  void announce_abort(const std::string& why);
  // After an abort (pass_mu_ held, or on the progress thread between batches): peer_failed for every live peer.
  void fail_every_peer();

  const int rank_;
  const int world_;
  Secret secret_;
  Matcher& matcher_;
  TcpOptions opt_;
  int epfd_ = -1;
  int wakefd_ = -1;
  std::vector<std::unique_ptr<Peer>> peers_;  // indexed by rank; null for non-tcp peers
  std::mutex regions_mu_;
  std::map<uint64_t, std::shared_ptr<RmaRegion>> regions_;
  std::mutex pending_mu_;
  std::map<uint64_t, std::unique_ptr<Pending>> pending_;  // by operation id
  uint64_t next_op_ = 1;
  std::atomic<bool> stop_{false};
  // Held by the progress thread while it handles one batch of events, the only time it reads or writes the
  // buffers of requests; abort() sets aborted_ and then takes it, so once abort returned the buffers of the
  // requests it failed are not touched any more and their owners may free them.
  std::mutex pass_mu_;
  std::atomic<bool> aborted_{false};
  std::thread progress_;
};

}  // namespace mk
