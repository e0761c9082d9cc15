#include "transport/providers/tcp.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cstddef>
#include <cstdio>
#include <cstring>

#include "transport/error.h"
#include "transport/host.h"

namespace mk {
namespace {

constexpr uint32_t kMagic = 0x4d4b5431;  // "MKT1"
// Version 2 added the RMA frame types, 3 the ABORT frame.
constexpr uint16_t kVersion = 3;
constexpr uint16_t kData = 1;
// RMA frames. Origin -> target: tag = region id, seq = operation id, total = byte offset in the region.
//   PUT: offset = notify tag (kNoNotify: none), payload = the bytes.
//   GET: offset = bytes wanted, no payload.
//   ACC: check = dtype | redop << 8, payload = the operand elements.
//   AMO: check = AmoOp, payload = two int64 (a, b).
// Target -> origin, REPLY: tag = status (0 ok, 1 failed), seq = the operation id, total = the old value
// (AMO), payload = the data (GET) or the error message (failed).
constexpr uint16_t kRmaPut = 2;
constexpr uint16_t kRmaGet = 3;
constexpr uint16_t kRmaAcc = 4;
constexpr uint16_t kRmaAmo = 5;
constexpr uint16_t kRmaReply = 6;
// ABORT: the sender aborted its communicator; payload = why (at most kAbortWhyBytes). It is the last frame on
// its socket, and goes only on a socket whose stream is between frames (abort cuts a frame short otherwise).
constexpr uint16_t kAbort = 7;
constexpr size_t kAbortWhyBytes = 1024;

struct Hello {
  uint32_t magic;
  uint16_t version;
  uint16_t index;  // which of the sockets to this peer
  int32_t rank;
  int32_t world;
  uint8_t secret[32];
};

struct WireHeader {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint64_t tag;
  uint64_t check;
  uint64_t seq;     // per (sender, receiver) message number
  uint64_t total;   // message length
  uint64_t offset;  // of this fragment
  uint64_t length;  // of this fragment
};

bool same_secret(const uint8_t* a, const uint8_t* b) {
  uint8_t diff = 0;
  for (int i = 0; i < 32; ++i) diff |= uint8_t(a[i] ^ b[i]);
  return diff == 0;
}

std::pair<std::string, int> split_addr(const std::string& addr) {
  auto colon = addr.rfind(':');
  if (colon == std::string::npos) throw Error(cat("mk tcp: malformed address '", addr, "'"));
  return {addr.substr(0, colon), std::stoi(addr.substr(colon + 1))};
}

// Read or write exactly n bytes on a blocking-mode socket, within the deadline.
void io_exact(int fd, void* buf, size_t n, bool writing, const Deadline& deadline, const std::string& what) {
  char* p = static_cast<char*>(buf);
  while (n > 0) {
    pollfd pfd{fd, short(writing ? POLLOUT : POLLIN), 0};
    int ms = int(std::min<long>(deadline.remaining().count(), 1000));
    if (deadline.expired()) throw TimeoutError(cat(what, ": timed out"));
    int r = ::poll(&pfd, 1, ms);
    if (r < 0 && errno != EINTR) throw_errno(cat(what, ": poll"));
    if (r <= 0) continue;
    ssize_t k = writing ? ::send(fd, p, n, MSG_NOSIGNAL) : ::recv(fd, p, n, 0);
    if (k == 0) throw PeerError(cat(what, ": connection closed by the other side"));
    if (k < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      throw_errno(what);
    }
    p += k;
    n -= size_t(k);
  }
}

void set_nodelay(int fd) {
  int one = 1;
  MK_SYSCHECK(setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)), "mk tcp: setsockopt(TCP_NODELAY)");
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Listener

TcpListener::TcpListener(const std::string& bind_addr) : ip_(bind_addr) {
  fd_ = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  MK_SYSCHECK(fd_, "mk tcp: socket");
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = 0;
  if (inet_pton(AF_INET, bind_addr.c_str(), &sa.sin_addr) != 1)
    throw Error(cat("mk tcp: invalid listen address '", bind_addr, "'"));
  if (::bind(fd_, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
    int e = errno;
    ::close(fd_);
    throw_errno(cat("mk tcp: bind(", bind_addr, ")"), e);
  }
  MK_SYSCHECK(::listen(fd_, 1024), "mk tcp: listen");
  socklen_t len = sizeof(sa);
  MK_SYSCHECK(getsockname(fd_, reinterpret_cast<sockaddr*>(&sa), &len), "mk tcp: getsockname");
  port_ = ntohs(sa.sin_port);
}

TcpListener::~TcpListener() { close(); }

void TcpListener::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

std::string TcpListener::address() const { return cat(ip_, ":", port_); }

// ---------------------------------------------------------------------------------------------------
// Provider state

struct TcpProvider::SendState {
  RequestPtr req;
  size_t len;
  int dst;
  std::atomic<int> remaining;
};

struct TcpProvider::Frame {
  WireHeader hdr;
  const char* data;
  size_t done = 0;  // bytes of header + payload written
  std::shared_ptr<SendState> msg;  // null for RMA frames (they finish with their reply)
  std::shared_ptr<void> keep;      // keeps `data` alive (an exposed region, an error message)
};

struct TcpProvider::Pending {
  RequestPtr req;
  int peer = -1;
  char* dst = nullptr;  // GET: where the reply's payload goes
  size_t dst_len = 0;
  std::shared_ptr<int64_t> result;  // AMO: the old value
  std::shared_ptr<void> keep;
};

struct TcpProvider::InMsg {
  Envelope env;
  size_t received = 0;
  ArrivalPtr arrival;
  bool early = false;  // payload started arriving before its turn to be matched: it lands in `buffer`
  std::vector<char> buffer;
};

struct TcpProvider::Conn {
  int peer = -1;
  int index = 0;
  int fd = -1;
  std::mutex mu;  // out queue and writes
  std::deque<Frame> out;
  bool want_write = false;
  // receive side, progress thread only
  WireHeader hdr{};
  size_t hdr_got = 0;
  InMsg* cur = nullptr;
  char* cur_dst = nullptr;
  size_t frag_left = 0;
  // an RMA frame being received (progress thread only)
  bool rma = false;
  std::shared_ptr<RmaRegion> region;        // target: the region the operation works on
  std::string rma_error;                    // target: why the operation is refused (payload dropped)
  std::vector<char> scratch;                // operands, dropped payloads, error messages
  std::unique_ptr<Pending> reply;           // origin: the operation this reply finishes
  bool closed = false;                      // the peer closed it cleanly, between frames (conn_closed)
};

struct TcpProvider::Peer {
  int rank = -1;
  std::string addr;
  std::vector<std::unique_ptr<Conn>> conns;
  std::atomic<bool> alive{true};
  std::mutex fail_mu;
  std::string failure;  // "rank <me>: <why>"
  std::string why;      // why the peer is gone (gone_reason)
  std::mutex seq_mu;
  uint64_t next_send_seq = 0;
  // progress thread only
  uint64_t next_match_seq = 0;
  std::map<uint64_t, std::unique_ptr<InMsg>> inbox;
  size_t conns_closed = 0;  // sockets the peer closed cleanly (conn_closed)
};

// ---------------------------------------------------------------------------------------------------
// Set-up

TcpProvider::TcpProvider(int rank, int world, const std::vector<int>& peers, const std::vector<std::string>& addrs,
                         TcpListener& listener, const Secret& secret, Matcher& matcher, const TcpOptions& opt,
                         const Deadline& deadline)
    : rank_(rank), world_(world), secret_(secret), matcher_(matcher), opt_(opt) {
  opt_.sockets_per_peer = std::max(1, std::min(opt_.sockets_per_peer, 16));
  peers_.resize(world);
  for (int p : peers) {
    peers_[p] = std::make_unique<Peer>();
    peers_[p]->rank = p;
    peers_[p]->addr = addrs.at(p);
    peers_[p]->conns.resize(opt_.sockets_per_peer);
  }
  epfd_ = epoll_create1(EPOLL_CLOEXEC);
  MK_SYSCHECK(epfd_, "mk tcp: epoll_create1");
  wakefd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  MK_SYSCHECK(wakefd_, "mk tcp: eventfd");
  epoll_event ev{};
  ev.events = EPOLLIN;
  ev.data.ptr = nullptr;
  MK_SYSCHECK(epoll_ctl(epfd_, EPOLL_CTL_ADD, wakefd_, &ev), "mk tcp: epoll_ctl(eventfd)");

  std::vector<int> lower, higher;
  for (int p : peers) (p < rank ? lower : higher).push_back(p);
  for (int p : lower) connect_peer(p, addrs.at(p), deadline);
  accept_peers(listener, higher, deadline);

  for (int p : peers)
    for (auto& c : peers_[p]->conns) {
      int fl = fcntl(c->fd, F_GETFL);
      MK_SYSCHECK(fl, "mk tcp: fcntl(F_GETFL)");
      MK_SYSCHECK(fcntl(c->fd, F_SETFL, fl | O_NONBLOCK), "mk tcp: fcntl(O_NONBLOCK)");
      epoll_event e{};
      e.events = EPOLLIN;
      e.data.ptr = c.get();
      MK_SYSCHECK(epoll_ctl(epfd_, EPOLL_CTL_ADD, c->fd, &e), "mk tcp: epoll_ctl(add)");
    }
  progress_ = std::thread([this] {
    name_this_thread("mk-tcp-progress");
    progress_loop();
  });
}

TcpProvider::~TcpProvider() {
  stop_.store(true);
  uint64_t one = 1;
  if (wakefd_ >= 0) (void)!::write(wakefd_, &one, sizeof(one));
  if (progress_.joinable()) progress_.join();
  for (auto& p : peers_)
    if (p)
      for (auto& c : p->conns)
        if (c && c->fd >= 0) ::close(c->fd);
  if (wakefd_ >= 0) ::close(wakefd_);
  if (epfd_ >= 0) ::close(epfd_);
}

void TcpProvider::connect_peer(int peer, const std::string& addr, const Deadline& deadline) {
  auto [ip, port] = split_addr(addr);
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(uint16_t(port));
  if (inet_pton(AF_INET, ip.c_str(), &sa.sin_addr) != 1) throw Error(cat("mk tcp: bad peer address ", addr));
  for (int index = 0; index < opt_.sockets_per_peer; ++index) {
    const std::string what = cat("mk tcp: rank ", rank_, " connecting to peer ", peer, " at ", addr);
    int fd = -1;
    while (true) {
      fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
      MK_SYSCHECK(fd, what + ": socket");
      if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) == 0) break;
      int e = errno;
      ::close(fd);
      if (deadline.expired()) throw TimeoutError(cat(what, ": timed out (last error: ", strerror(e), ")"));
      if (e != ECONNREFUSED && e != EINTR && e != ETIMEDOUT && e != EAGAIN) throw_errno(what, e);
      ::usleep(10000);
    }
    try {
      set_nodelay(fd);
      Hello h{kMagic, kVersion, uint16_t(index), rank_, world_, {}};
      std::memcpy(h.secret, secret_.data(), 32);
      io_exact(fd, &h, sizeof(h), true, deadline, what + ": sending hello");
      Hello r{};
      io_exact(fd, &r, sizeof(r), false, deadline, what + ": reading hello");
      if (r.magic != kMagic || r.version != kVersion || r.rank != peer || !same_secret(r.secret, secret_.data()))
        throw Error(cat(what, ": the listener is not rank ", peer, " of this job (bad hello or job secret)"));
    } catch (...) {
      ::close(fd);
      throw;
    }
    adopt(peer, index, fd);
  }
}

void TcpProvider::accept_peers(TcpListener& listener, const std::vector<int>& from, const Deadline& deadline) {
  size_t expected = from.size() * size_t(opt_.sockets_per_peer);
  size_t got = 0;
  while (got < expected) {
    const std::string what = cat("mk tcp: rank ", rank_, " accepting connections from peers");
    if (deadline.expired())
      throw TimeoutError(cat(what, ": timed out with ", got, " of ", expected, " connections"));
    pollfd pfd{listener.fd(), POLLIN, 0};
    int r = ::poll(&pfd, 1, int(std::min<long>(deadline.remaining().count(), 1000)));
    if (r < 0 && errno != EINTR) throw_errno(what + ": poll");
    if (r <= 0) continue;
    sockaddr_in sa{};
    socklen_t sl = sizeof(sa);
    int fd = ::accept4(listener.fd(), reinterpret_cast<sockaddr*>(&sa), &sl, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == ECONNABORTED) continue;
      throw_errno(what + ": accept");
    }
    char ip[INET_ADDRSTRLEN] = "?";
    inet_ntop(AF_INET, &sa.sin_addr, ip, sizeof(ip));
    Hello h{};
    std::string reject;
    try {
      // A stranger gets a few seconds to say hello, never the whole job timeout.
      Deadline hello_deadline = Deadline::after(std::chrono::milliseconds(std::min<long>(5000, deadline.remaining().count())));
      io_exact(fd, &h, sizeof(h), false, hello_deadline, what);
      if (h.magic != kMagic || h.version != kVersion)
        reject = "not an mk hello (wrong magic or protocol version)";
      else if (!same_secret(h.secret, secret_.data()))
        reject = "wrong job secret";
      else if (std::find(from.begin(), from.end(), h.rank) == from.end() || h.index >= opt_.sockets_per_peer ||
               peers_[h.rank]->conns[h.index])
        reject = cat("unexpected rank ", h.rank, " / socket ", h.index);
    } catch (const Error& e) {
      reject = e.what();
    }
    if (!reject.empty()) {
      std::fprintf(stderr, "mk tcp: rank %d rejected a connection from %s: %s\n", rank_, ip, reject.c_str());
      ::close(fd);
      continue;
    }
    try {
      set_nodelay(fd);
      Hello mine{kMagic, kVersion, h.index, rank_, world_, {}};
      std::memcpy(mine.secret, secret_.data(), 32);
      io_exact(fd, &mine, sizeof(mine), true, deadline, what + ": replying hello");
    } catch (...) {
      ::close(fd);
      throw;
    }
    adopt(h.rank, h.index, fd);
    ++got;
  }
}

void TcpProvider::adopt(int peer, int index, int fd) {
  auto c = std::make_unique<Conn>();
  c->peer = peer;
  c->index = index;
  c->fd = fd;
  peers_[peer]->conns[index] = std::move(c);
}

// ---------------------------------------------------------------------------------------------------
// Sending

RequestPtr TcpProvider::isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) {
  if (peer < 0 || peer >= world_ || !peers_[peer])
    throw Error(cat("mk tcp: rank ", rank_, " has no tcp connection to peer ", peer));
  Peer& p = *peers_[peer];
  auto req = std::make_shared<Request>();
  if (!p.alive.load()) {
    std::lock_guard<std::mutex> lock(p.fail_mu);
    req->fail(p.failure);
    return req;
  }
  const int k = (len >= opt_.stripe_threshold) ? opt_.sockets_per_peer : 1;
  auto st = std::make_shared<SendState>();
  st->req = req;
  st->len = len;
  st->dst = peer;
  st->remaining.store(k);
  uint64_t seq;
  {
    std::lock_guard<std::mutex> lock(p.seq_mu);
    seq = p.next_send_seq++;
  }
  // Fragments aligned to 4 KiB, the last takes the rest.
  size_t piece = (k == 1) ? len : ((len / size_t(k)) & ~size_t(4095));
  std::vector<std::shared_ptr<SendState>> done;
  for (int i = 0; i < k; ++i) {
    size_t off = size_t(i) * piece;
    size_t flen = (i == k - 1) ? len - off : piece;
    Frame f;
    f.hdr = WireHeader{kMagic, kVersion, kData, tag, check, seq, len, off, flen};
    f.data = static_cast<const char*>(buf) + off;
    f.msg = st;
    Conn& c = *p.conns[i];
    std::lock_guard<std::mutex> lock(c.mu);
    const bool idle = c.out.empty();
    c.out.push_back(f);
    // Write from this thread while the socket takes it; the progress thread finishes the rest.
    if (idle) flush_locked(c, done);
    if (!c.out.empty() && !c.want_write) arm_write(c, true);
  }
  for (auto& d : done) d->req->complete(d->len, rank_);
  return req;
}

void TcpProvider::flush_locked(Conn& c, std::vector<std::shared_ptr<SendState>>& done) {
  while (!c.out.empty()) {
    Frame& f = c.out.front();
    const size_t hlen = sizeof(WireHeader);
    const size_t total = hlen + f.hdr.length;
    iovec iov[2];
    int n = 0;
    if (f.done < hlen) {
      iov[n++] = {reinterpret_cast<char*>(&f.hdr) + f.done, hlen - f.done};
      if (f.hdr.length) iov[n++] = {const_cast<char*>(f.data), f.hdr.length};
    } else {
      iov[n++] = {const_cast<char*>(f.data) + (f.done - hlen), total - f.done};
    }
    msghdr mh{};
    mh.msg_iov = iov;
    mh.msg_iovlen = size_t(n);
    ssize_t w = ::sendmsg(c.fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EAGAIN || errno == EWOULDBLOCK) return;
      if (errno == EINTR) continue;
      // Broken connection: the progress thread sees the hang-up and fails everything for this peer.
      ::shutdown(c.fd, SHUT_RDWR);
      return;
    }
    f.done += size_t(w);
    if (f.done == total) {
      auto st = f.msg;
      c.out.pop_front();
      if (st && st->remaining.fetch_sub(1) == 1) done.push_back(std::move(st));
    }
  }
}

void TcpProvider::arm_write(Conn& c, bool on) {
  epoll_event e{};
  e.events = EPOLLIN | (on ? EPOLLOUT : 0u);
  e.data.ptr = &c;
  if (epoll_ctl(epfd_, EPOLL_CTL_MOD, c.fd, &e) == 0) c.want_write = on;
}

// ---------------------------------------------------------------------------------------------------
// Receiving (progress thread)

void TcpProvider::progress_loop() {
  epoll_event evs[64];
  while (!stop_.load(std::memory_order_acquire)) {
    int n = epoll_wait(epfd_, evs, 64, 200);
    if (n < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "mk tcp: rank %d: epoll_wait failed: %s; progress thread stops\n", rank_, strerror(errno));
      abort(cat("mk tcp: rank ", rank_, ": progress thread failed"));
      return;
    }
    std::lock_guard<std::mutex> pass(pass_mu_);
    if (aborted_.load(std::memory_order_acquire)) {
      // Nothing is read or sent any more (the requests' buffers may be gone): every peer fails (its sockets
      // leave epoll, its sends and one-sided operations fail) unless abort() did that already, and only the
      // wake-up and stop_ remain.
      uint64_t v;
      while (::read(wakefd_, &v, sizeof(v)) > 0) {
      }
      fail_every_peer();
      continue;
    }
    for (int i = 0; i < n; ++i) {
      if (evs[i].data.ptr == nullptr) {
        uint64_t v;
        while (::read(wakefd_, &v, sizeof(v)) > 0) {
        }
        continue;
      }
      Conn& c = *static_cast<Conn*>(evs[i].data.ptr);
      if (!peers_[c.peer]->alive.load()) continue;
      if (evs[i].events & (EPOLLIN | EPOLLHUP | EPOLLERR)) on_readable(c);
      if ((evs[i].events & EPOLLOUT) && peers_[c.peer]->alive.load()) {
        std::vector<std::shared_ptr<SendState>> done;
        {
          std::lock_guard<std::mutex> lock(c.mu);
          flush_locked(c, done);
          if (c.out.empty() && c.want_write) arm_write(c, false);
        }
        for (auto& d : done) d->req->complete(d->len, rank_);
      }
    }
  }
}

void TcpProvider::match_ready(Peer& p) {
  while (true) {
    auto it = p.inbox.find(p.next_match_seq);
    if (it == p.inbox.end() || it->second->arrival) return;
    InMsg& m = *it->second;
    m.arrival = matcher_.arrive(m.env);
    ++p.next_match_seq;
    if (m.received == m.env.len) {
      if (m.early && m.env.len) std::memcpy(m.arrival->dst, m.buffer.data(), m.env.len);
      matcher_.delivered(m.arrival);
      p.inbox.erase(it);
    }
  }
}

void TcpProvider::on_readable(Conn& c) {
  Peer& p = *peers_[c.peer];
  // End of file inside a frame: an ABORT frame that did not fit whole still says the peer aborted.
  auto cut_short = [&] {
    const bool abort_frame = c.hdr_got >= offsetof(WireHeader, tag) && c.hdr.magic == kMagic && c.hdr.type == kAbort;
    if (abort_frame)
      return peer_failed(c.peer, cat("peer ", c.peer, " (", p.addr, ") aborted its communicator (its reason was cut short)"));
    return connection_failed(c, cat("peer ", c.peer, " (", p.addr, ") closed the connection in the middle of a frame"));
  };
  while (true) {
    if (c.cur == nullptr && !c.rma) {
      ssize_t k = ::recv(c.fd, reinterpret_cast<char*>(&c.hdr) + c.hdr_got, sizeof(WireHeader) - c.hdr_got, 0);
      if (k == 0 && c.hdr_got == 0) return conn_closed(c);
      if (k == 0) return cut_short();
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        return connection_failed(c, cat("connection to peer ", c.peer, " (", p.addr, ") failed: ", strerror(errno)));
      }
      c.hdr_got += size_t(k);
      if (c.hdr_got < sizeof(WireHeader)) continue;
      const WireHeader& h = c.hdr;
      if (h.magic == kMagic && h.version == kVersion && h.type != kData) {
        if (!rma_begin(c)) return;
        continue;
      }
      if (h.magic != kMagic || h.version != kVersion || h.type != kData || h.offset + h.length > h.total ||
          (h.seq < p.next_match_seq && !p.inbox.count(h.seq))) {
        return peer_failed(c.peer, cat("protocol error on the connection to peer ", c.peer, " (bad frame header)"));
      }
      auto& slot = p.inbox[h.seq];
      if (!slot) {
        slot = std::make_unique<InMsg>();
        slot->env = Envelope{c.peer, h.tag, size_t(h.total), h.check};
        if (h.seq == p.next_match_seq) match_ready(p);
      }
      InMsg* m = p.inbox.count(h.seq) ? p.inbox[h.seq].get() : nullptr;
      if (m == nullptr) {
        // Zero-length message already delivered by match_ready.
        c.hdr_got = 0;
        continue;
      }
      if (!m->arrival && !m->early) {
        m->early = true;
        m->buffer.resize(m->env.len);
      }
      c.cur = m;
      c.cur_dst = (m->early ? m->buffer.data() : m->arrival->dst) + h.offset;
      c.frag_left = h.length;
    }
    if (c.frag_left > 0) {
      ssize_t k = ::recv(c.fd, c.cur_dst, c.frag_left, 0);
      if (k == 0) return cut_short();
      if (k < 0) {
        if (errno == EAGAIN || errno == EWOULDBLOCK) return;
        if (errno == EINTR) continue;
        return connection_failed(c, cat("connection to peer ", c.peer, " (", p.addr, ") failed: ", strerror(errno)));
      }
      c.cur_dst += k;
      c.frag_left -= size_t(k);
      if (c.frag_left > 0) continue;
    }
    if (c.rma) {
      c.rma = false;
      c.hdr_got = 0;
      rma_end(c);
      if (!peers_[c.peer]->alive.load()) return;
      continue;
    }
    // Fragment complete.
    InMsg* m = c.cur;
    const uint64_t seq = c.hdr.seq;
    m->received += c.hdr.length;
    c.cur = nullptr;
    c.hdr_got = 0;
    if (m->received == m->env.len && m->arrival) {
      if (m->early && m->env.len) std::memcpy(m->arrival->dst, m->buffer.data(), m->env.len);
      matcher_.delivered(m->arrival);
      p.inbox.erase(seq);
    }
  }
}

void TcpProvider::unwatch(Conn& c) {
  if (epoll_ctl(epfd_, EPOLL_CTL_DEL, c.fd, nullptr) != 0)
    std::fprintf(stderr, "mk tcp: rank %d: epoll_ctl(DEL) of socket %d to peer %d failed: %s\n", rank_, c.index,
                 c.peer, strerror(errno));
}

void TcpProvider::conn_closed(Conn& c) {
  // A peer that leaves closes its sockets one after the other once its sends have completed, which means
  // once the kernel holds their data, not once we have read it: a large message striped over several
  // sockets may still be arriving on one socket when another reports end-of-file. So a clean end of file
  // (between frames) only retires this socket; the peer is failed when its last socket has closed, or at
  // once if frames still wait to go out on this socket (nobody will read them). Operations waiting for an
  // answer from the peer (RMA replies) fail with the peer.
  if (c.closed) return;
  c.closed = true;
  unwatch(c);
  Peer& p = *peers_[c.peer];
  // (an abort there shuts its sockets too: no frame says which, so say both)
  const std::string why = cat("peer ", c.peer, " (", p.addr, ") closed the connection (it exited, or aborted its communicator)");
  bool needed;
  {
    std::lock_guard<std::mutex> lock(c.mu);
    needed = !c.out.empty();
  }
  if (needed || ++p.conns_closed == p.conns.size()) connection_failed(c, why);
}

void TcpProvider::connection_failed(Conn& c, const std::string& why) {
  const std::string said = abort_waiting(c);
  peer_failed(c.peer, said.empty() ? why : said);
}

std::string TcpProvider::abort_waiting(const Conn& failed) const {
  const Peer& p = *peers_[failed.peer];
  for (const auto& c : p.conns) {
    // Only a socket between frames can hold an ABORT frame next (its header possibly begun).
    if (c.get() == &failed || c->closed || c->cur != nullptr || c->rma) continue;
    char buf[sizeof(WireHeader) + kAbortWhyBytes];
    std::memcpy(buf, &c->hdr, c->hdr_got);
    const ssize_t k = ::recv(c->fd, buf + c->hdr_got, sizeof(buf) - c->hdr_got, MSG_PEEK | MSG_DONTWAIT);
    if (k <= 0) continue;
    const size_t have = c->hdr_got + size_t(k);
    if (have < offsetof(WireHeader, tag)) continue;
    WireHeader h{};
    std::memcpy(&h, buf, std::min(have, sizeof(h)));
    if (h.magic != kMagic || h.version != kVersion || h.type != kAbort) continue;
    const bool whole = have >= sizeof(h) && h.length <= kAbortWhyBytes && have - sizeof(h) >= h.length;
    return cat("peer ", failed.peer, " (", p.addr, ") aborted its communicator (",
               whole ? std::string(buf + sizeof(h), size_t(h.length)) : std::string("its reason was cut short"), ")");
  }
  return {};
}

void TcpProvider::peer_failed(int peer, const std::string& why) {
  Peer& p = *peers_[peer];
  const std::string msg = cat("rank ", rank_, ": ", why);
  {
    std::lock_guard<std::mutex> lock(p.fail_mu);
    if (!p.alive.load()) return;
    p.failure = msg;
    p.why = why;
    p.alive.store(false);
  }
  std::vector<std::shared_ptr<SendState>> sends;
  for (auto& c : p.conns) {
    std::lock_guard<std::mutex> lock(c->mu);
    for (auto& f : c->out)
      if (f.msg) sends.push_back(f.msg);
    c->out.clear();
    if (!c->closed) unwatch(*c);
    // Write side only: a socket shut for reading answers the peer's next bytes with a reset, which takes our
    // unsent bytes (an ABORT frame) with it and can reach the peer before the ABORT frame on another socket.
    ::shutdown(c->fd, SHUT_WR);
    c->cur = nullptr;
  }
  for (auto& s : sends) s->req->fail(msg);
  for (auto& c : p.conns)
    if (c->reply) {
      c->reply->req->fail(msg);
      c->reply.reset();
    }
  fail_pending(peer, msg);
  for (auto& [seq, m] : p.inbox)
    if (m->arrival) matcher_.abandon(m->arrival, msg);
  p.inbox.clear();
  matcher_.fail_source(peer, msg);
}

void TcpProvider::abort(const std::string& why) {
  if (!aborted_.exchange(true, std::memory_order_acq_rel)) announce_abort(why);
  for (auto& p : peers_)
    if (p)
      for (auto& c : p->conns)
        if (c && c->fd >= 0) ::shutdown(c->fd, SHUT_WR);  // (after the ABORT frame; see peer_failed)
  uint64_t one = 1;
  if (wakefd_ >= 0) (void)!::write(wakefd_, &one, sizeof(one));
  // The batch of events the progress thread handles now ends before this returns (see pass_mu_), then every
  // peer fails here, so that waiters on one-sided operations hear of it at once (the progress thread reads no
  // more, so it no longer finds the sockets closed). On the progress thread itself (from inside a batch, or
  // between batches), its next turn of the loop does that.
  if (std::this_thread::get_id() != progress_.get_id()) {
    std::lock_guard<std::mutex> passed(pass_mu_);
    fail_every_peer();
  }
}

void TcpProvider::announce_abort(const std::string& why) {
  const std::string text = why.substr(0, kAbortWhyBytes);
  for (auto& p : peers_) {
    if (!p || !p->alive.load()) continue;
    for (auto& c : p->conns) {
      if (!c || c->fd < 0) continue;
      std::lock_guard<std::mutex> lock(c->mu);
      // (a frame started and not finished: whatever follows would be read as its rest)
      if (c->closed || (!c->out.empty() && c->out.front().done > 0)) continue;
      WireHeader h{kMagic, kVersion, kAbort, 0, 0, 0, text.size(), 0, text.size()};
      iovec iov[2] = {{&h, sizeof(h)}, {const_cast<char*>(text.data()), text.size()}};
      msghdr mh{};
      mh.msg_iov = iov;
      mh.msg_iovlen = text.empty() ? 1 : 2;
      // Once, without waiting: a full socket buffer, or a broken connection, leaves the peer to find the
      // socket closed (or the frame cut short, which it reports as an abort without the reason).
      (void)::sendmsg(c->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    }
  }
}

void TcpProvider::fail_every_peer() {
  for (int peer = 0; peer < world_; ++peer)
    if (peers_[size_t(peer)] && peers_[size_t(peer)]->alive.load()) peer_failed(peer, "the communicator was aborted");
}

bool TcpProvider::peer_alive(int peer) const {
  return peer >= 0 && peer < world_ && peers_[peer] && peers_[peer]->alive.load();
}

std::string TcpProvider::gone_reason(int peer) const {
  if (peer < 0 || peer >= world_ || !peers_[peer]) return cat("rank ", peer, " has no tcp connection here");
  Peer& p = *peers_[peer];
  std::lock_guard<std::mutex> lock(p.fail_mu);
  return p.alive.load() ? cat("peer ", peer, " is connected") : p.why;
}

}  // namespace mk

namespace mk {

// ---------------------------------------------------------------------------------------------------
// One-sided access

void TcpProvider::expose(uint64_t region, RmaRegion r) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  regions_[region] = std::make_shared<RmaRegion>(std::move(r));
}

void TcpProvider::withdraw(uint64_t region) {
  std::lock_guard<std::mutex> lock(regions_mu_);
  regions_.erase(region);  // an operation still being served holds its own reference
}
// RMA frames all go on a peer's first socket, so one origin's operations reach the target in issue order.
void TcpProvider::queue_rma_frame(Peer& p, Frame f) {
  std::vector<std::shared_ptr<SendState>> done;
  {
    Conn& c = *p.conns[0];
    std::lock_guard<std::mutex> lock(c.mu);
    const bool idle = c.out.empty();
    c.out.push_back(std::move(f));
    if (idle) flush_locked(c, done);
    if (!c.out.empty() && !c.want_write) arm_write(c, true);
  }
  for (auto& d : done) d->req->complete(d->len, rank_);
}


RequestPtr TcpProvider::rma_submit(int peer, uint16_t type, uint64_t region, uint64_t offset, uint64_t check,
                                   uint64_t aux, const void* payload, size_t len, char* dst, size_t dst_len,
                                   std::shared_ptr<int64_t> result, std::shared_ptr<void> keep) {
  if (peer < 0 || peer >= world_ || !peers_[peer])
    throw Error(cat("mk tcp: rank ", rank_, " has no tcp connection to peer ", peer));
  Peer& p = *peers_[peer];
  auto req = std::make_shared<Request>();
  auto fail_now = [&] {
    std::lock_guard<std::mutex> lock(p.fail_mu);
    req->fail(p.failure);
  };
  if (!p.alive.load()) {
    fail_now();
    return req;
  }
  uint64_t id;
  {
    auto pend = std::make_unique<Pending>();
    pend->req = req;
    pend->peer = peer;
    pend->dst = dst;
    pend->dst_len = dst_len;
    pend->result = std::move(result);
    pend->keep = keep;
    std::lock_guard<std::mutex> lock(pending_mu_);
    id = next_op_++;
    pending_[id] = std::move(pend);
  }
  Frame f;
  f.hdr = WireHeader{kMagic, kVersion, type, region, check, id, offset, aux, len};
  f.data = static_cast<const char*>(payload);
  f.keep = std::move(keep);
  queue_rma_frame(p, std::move(f));
  if (!p.alive.load()) {  // the peer failed while we queued: nobody will answer
    std::string why;
    {
      std::lock_guard<std::mutex> lock(p.fail_mu);
      why = p.failure;
    }
    fail_pending(peer, why);
  }
  return req;
}

RequestPtr TcpProvider::put(int peer, uint64_t region, size_t offset, const void* src, size_t len, uint64_t notify) {
  return rma_submit(peer, kRmaPut, region, offset, 0, notify, src, len, nullptr, 0, nullptr, nullptr);
}

RequestPtr TcpProvider::get(int peer, uint64_t region, size_t offset, void* dst, size_t len) {
  return rma_submit(peer, kRmaGet, region, offset, 0, len, nullptr, 0, static_cast<char*>(dst), len, nullptr, nullptr);
}

RequestPtr TcpProvider::accumulate(int peer, uint64_t region, size_t offset, const void* src, size_t len, DType t,
                                   RedOp op) {
  check_accumulate(t, op, "mk tcp accumulate");
  return rma_submit(peer, kRmaAcc, region, offset, uint64_t(t) | (uint64_t(op) << 8), 0, src, len, nullptr, 0,
                    nullptr, nullptr);
}

RequestPtr TcpProvider::atomic(int peer, uint64_t region, size_t offset, AmoOp op, int64_t a, int64_t b,
                               std::shared_ptr<int64_t> result) {
  auto operands = std::make_shared<std::array<int64_t, 2>>(std::array<int64_t, 2>{a, b});
  const void* payload = operands->data();
  return rma_submit(peer, kRmaAmo, region, offset, uint64_t(op), 0, payload, 16, nullptr, 0, std::move(result),
                    std::move(operands));
}

bool TcpProvider::rma_begin(Conn& c) {
  const WireHeader& h = c.hdr;
  c.rma = true;
  c.region.reset();
  c.rma_error.clear();
  c.reply.reset();
  c.cur_dst = nullptr;
  c.frag_left = h.length;
  auto to_scratch = [&] {
    c.scratch.resize(size_t(h.length));
    c.cur_dst = c.scratch.data();
  };
  if (h.type == kAbort) {
    if (h.length > kAbortWhyBytes) {
      peer_failed(c.peer, cat("protocol error on the connection to peer ", c.peer, " (oversized ABORT frame)"));
      return false;
    }
    to_scratch();
    return true;
  }
  if (h.type == kRmaReply) {
    {
      std::lock_guard<std::mutex> lock(pending_mu_);
      auto it = pending_.find(h.seq);
      if (it != pending_.end()) {
        c.reply = std::move(it->second);
        pending_.erase(it);
      }
    }
    if (!c.reply || (h.tag == 0 && h.length != (c.reply->dst ? c.reply->dst_len : 0))) {
      peer_failed(c.peer, cat("protocol error on the connection to peer ", c.peer, " (unexpected RMA reply)"));
      return false;
    }
    if (h.tag == 0 && c.reply->dst) c.cur_dst = c.reply->dst;
    else to_scratch();
    return true;
  }
  if (h.type < kRmaPut || h.type > kRmaAmo || (h.type == kRmaAmo && h.length != 16) ||
      (h.type == kRmaGet && h.length != 0)) {
    peer_failed(c.peer, cat("protocol error on the connection to peer ", c.peer, " (bad RMA frame)"));
    return false;
  }
  {
    std::lock_guard<std::mutex> lock(regions_mu_);
    auto it = regions_.find(h.tag);
    if (it != regions_.end()) c.region = it->second;
  }
  const uint64_t n = h.type == kRmaGet ? h.offset : h.type == kRmaAmo ? 8 : h.length;
  if (!c.region)
    c.rma_error = cat("rank ", rank_, " exposes no window #", h.tag, " (freed, or never created there)");
  else if (h.total > c.region->bytes || n > c.region->bytes - h.total)
    c.rma_error = cat("bytes [", h.total, ", ", h.total + n, ") are outside the ", c.region->bytes, " bytes rank ",
                      rank_, " exposes in window #", h.tag);
  if (h.type == kRmaPut && c.rma_error.empty()) c.cur_dst = c.region->base + h.total;
  else to_scratch();
  return true;
}

void TcpProvider::rma_end(Conn& c) {
  const WireHeader h = c.hdr;
  if (h.type == kAbort) {
    const Peer& p = *peers_[c.peer];
    return peer_failed(c.peer, cat("peer ", c.peer, " (", p.addr, ") aborted its communicator (",
                                   std::string(c.scratch.data(), size_t(h.length)), ")"));
  }
  if (h.type == kRmaReply) {
    std::unique_ptr<Pending> pend = std::move(c.reply);
    if (h.tag == 0) {
      if (pend->result) *pend->result = int64_t(h.total);
      pend->req->complete(size_t(h.length), c.peer);
    } else {
      pend->req->fail(std::string(c.scratch.data(), size_t(h.length)));
    }
    return;
  }
  std::shared_ptr<RmaRegion> region = std::move(c.region);
  std::string error = std::move(c.rma_error);
  uint64_t value = 0;
  if (error.empty()) {
    char* at = region->base + h.total;
    try {
      switch (h.type) {
        case kRmaPut:
          // The payload was received straight into the region; the notification comes after it.
          if (h.offset != kNoNotify && region->notify) region->notify(h.offset);
          break;
        case kRmaGet:
          return rma_reply(c.peer, h.seq, 0, 0, at, size_t(h.offset), region);
        case kRmaAcc: {
          const DType t = DType(h.check & 0xff);
          const RedOp op = RedOp((h.check >> 8) & 0xff);
          const size_t es = dtype_size(t);
          if (h.total % es || h.length % es) throw Error(cat("accumulate on bytes not aligned to ", dtype_name(t)));
          atomic_accumulate(at, c.scratch.data(), size_t(h.length) / es, t, op);
          break;
        }
        case kRmaAmo: {
          if (h.total % 8) throw Error("fetch_add/compare_swap on an offset that is not 8-byte aligned");
          int64_t ab[2];
          std::memcpy(ab, c.scratch.data(), 16);
          value = uint64_t(atomic_i64(at, AmoOp(h.check), ab[0], ab[1]));
          break;
        }
      }
    } catch (const std::exception& e) {
      error = cat("rank ", rank_, ": ", e.what());
    }
  }
  if (!error.empty()) {
    auto msg = std::make_shared<std::string>(std::move(error));
    return rma_reply(c.peer, h.seq, 1, 0, msg->data(), msg->size(), msg);
  }
  rma_reply(c.peer, h.seq, 0, value, nullptr, 0, nullptr);
}

void TcpProvider::rma_reply(int peer, uint64_t op, uint64_t status, uint64_t value, const char* data, size_t len,
                            std::shared_ptr<void> keep) {
  Peer& p = *peers_[peer];
  Frame f;
  f.hdr = WireHeader{kMagic, kVersion, kRmaReply, status, 0, op, value, 0, len};
  f.data = data;
  f.keep = std::move(keep);
  queue_rma_frame(p, std::move(f));
}

void TcpProvider::fail_pending(int peer, const std::string& why) {
  std::vector<std::unique_ptr<Pending>> failed;
  {
    std::lock_guard<std::mutex> lock(pending_mu_);
    for (auto it = pending_.begin(); it != pending_.end();) {
      if (it->second->peer == peer) {
        failed.push_back(std::move(it->second));
        it = pending_.erase(it);
      } else {
        ++it;
      }
    }
  }
  for (auto& f : failed) f->req->fail(why);
}

}  // namespace mk
