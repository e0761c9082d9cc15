// TCP provider: between hosts (or on one host when SUPERKERNEL_TRANSPORT=tcp).
// Each connection starts with a Hello carrying the job secret (checked both ways; a connection without
// it is closed and logged). Messages travel as versioned frames; large ones are striped over several
// sockets per peer. One progress thread per provider (epoll) receives frames and finishes queued sends,
// so transfers complete whatever the user's threads are doing.
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

 private:
  struct Frame;
  struct Conn;
  struct InMsg;
  struct Peer;

  void connect_peer(int peer, const std::string& addr, const Deadline& deadline);
  void accept_peers(TcpListener& listener, const std::vector<int>& from, const Deadline& deadline);
  void adopt(int peer, int index, int fd);
  void progress_loop();
  void on_readable(Conn& c);
  struct SendState;
  // Write as much of c's queue as the socket takes (c.mu held); finished sends are appended to done.
  void flush_locked(Conn& c, std::vector<std::shared_ptr<SendState>>& done);
  void arm_write(Conn& c, bool on);
  void match_ready(Peer& p);
  void peer_failed(int peer, const std::string& why);

  const int rank_;
  const int world_;
  Secret secret_;
  Matcher& matcher_;
  TcpOptions opt_;
  int epfd_ = -1;
  int wakefd_ = -1;
  std::vector<std::unique_ptr<Peer>> peers_;  // indexed by rank; null for non-tcp peers
  std::atomic<bool> stop_{false};
  std::thread progress_;
};

}  // namespace mk
