#include "transport/bootstrap.h"

#include <sys/random.h>
#include <unistd.h>

#include <cstdlib>
#include <map>
#include <thread>

#include "transport/error.h"
#include "transport/host.h"

namespace mk {

class Bootstrap {
 public:
  static std::unique_ptr<Comm> run(KeyValue& kv, int rank, int size, std::chrono::milliseconds timeout,
                                   const BootstrapOptions& opt);
};

namespace {

size_t env_size(const char* name, size_t dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  unsigned long long n = std::strtoull(v, &end, 10);
  size_t mult = 1;
  if (end && (*end == 'k' || *end == 'K')) mult = 1 << 10;
  if (end && (*end == 'm' || *end == 'M')) mult = 1 << 20;
  if (end == v) throw Error(cat("mk: ", name, "=", v, " is not a size"));
  return size_t(n) * mult;
}

std::string hex(const uint8_t* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    s += d[p[i] >> 4];
    s += d[p[i] & 15];
  }
  return s;
}

Secret unhex(const std::string& s) {
  Secret out{};
  if (s.size() != 64) throw Error("mk bootstrap: malformed job secret in the store");
  for (size_t i = 0; i < 32; ++i) out[i] = uint8_t(std::stoi(s.substr(2 * i, 2), nullptr, 16));
  return out;
}

}  // namespace

BootstrapOptions BootstrapOptions::from_env() {
  BootstrapOptions o;
  if (const char* t = std::getenv("SUPERKERNEL_TRANSPORT"); t && *t) {
    std::string s = t;
    if (s == "auto") o.mode = TransportMode::automatic;
    else if (s == "shm") o.mode = TransportMode::shm;
    else if (s == "tcp") o.mode = TransportMode::tcp;
    else throw Error(cat("mk: SUPERKERNEL_TRANSPORT must be shm, tcp or auto, not '", s, "'"));
  }
  o.shm.chunk = env_size("SUPERKERNEL_SHM_CHUNK", o.shm.chunk);
  o.shm.slots = int(env_size("SUPERKERNEL_SHM_SLOTS", size_t(o.shm.slots)));
  o.shm.ring = env_size("SUPERKERNEL_SHM_RING", o.shm.ring);
  o.tcp.sockets_per_peer = int(env_size("SUPERKERNEL_TCP_SOCKETS", size_t(o.tcp.sockets_per_peer)));
  o.tcp.stripe_threshold = env_size("SUPERKERNEL_TCP_STRIPE", o.tcp.stripe_threshold);
  return o;
}

std::unique_ptr<Comm> Bootstrap::run(KeyValue& kv, int rank, int size, std::chrono::milliseconds timeout,
                                     const BootstrapOptions& opt) {
  auto comm = std::make_unique<Comm>(rank, size, timeout);
  const Deadline deadline = Deadline::after(timeout);

  // 0. Which group of this store this is. A group made again under the same store prefix (the default group
  // after destroy_process_group and init_process_group, under torchrun's agent store, which outlives them)
  // found the keys of the group before it, and read a peer's old listen address or shared-memory segment
  // before the peer had replaced it ("rank 0 accepting connections from peers: timed out with 0 of 2
  // connections"; "cannot open peer 1's segment ... No such file"). Each rank counts its own bootstraps
  // under the prefix, so the n-th group of every rank reads only the n-th's keys.
  const std::string at = cat("mk/", kv.add(cat("mk/made/", rank), 1), "/");
  auto key = [&at](const char* what, int r) { return cat(at, what, "/", r); };

  // 1. Who is where.
  kv.set(key("host", rank), cat(host_identity(), "\n", host_name(), "\n", getpid()));
  if (rank == 0) {
    uint8_t secret[32];
    if (getrandom(secret, sizeof(secret), 0) != ssize_t(sizeof(secret))) throw_errno("mk bootstrap: getrandom");
    kv.set(at + "secret", hex(secret, 32));
  }
  for (int r = 0; r < size; ++r) {
    std::string v = r == rank ? cat(host_identity(), "\n", host_name(), "\n", getpid()) : kv.get(key("host", r));
    auto a = v.find('\n'), b = v.rfind('\n');
    comm->peers_[size_t(r)] = PeerInfo{v.substr(0, a), v.substr(a + 1, b - a - 1), std::atoi(v.c_str() + b + 1)};
  }
  const Secret secret = unhex(kv.get(at + "secret"));
  std::vector<int> locals, remotes;
  for (int r = 0; r < size; ++r)
    (comm->peers_[size_t(r)].host_id == comm->peers_[size_t(rank)].host_id ? locals : remotes).push_back(r);

  const bool use_shm = opt.mode != TransportMode::tcp && locals.size() > 1;
  if (opt.mode == TransportMode::shm && !remotes.empty())
    throw Error(cat("mk bootstrap: rank ", rank, ": SUPERKERNEL_TRANSPORT=shm but peer ", remotes.front(), " is on host ",
                    comm->peers_[size_t(remotes.front())].host_name, ", which shared memory cannot reach"));
  std::vector<int> tcp_peers = opt.mode == TransportMode::tcp ? std::vector<int>{} : remotes;
  if (opt.mode == TransportMode::tcp)
    for (int r = 0; r < size; ++r)
      if (r != rank) tcp_peers.push_back(r);

  // 2. Publish what peers need to reach us.
  std::unique_ptr<TcpListener> listener;
  if (use_shm) {
    comm->shm_ = std::make_unique<ShmProvider>(rank, locals, comm->matcher_, opt.shm);
    kv.set(key("shm", rank), comm->shm_->descriptor());
  }
  if (!tcp_peers.empty()) {
    listener = std::make_unique<TcpListener>(listen_address(/*loopback_only=*/remotes.empty(), opt.ifname));
    kv.set(key("tcp", rank), listener->address());
  }

  // 3. Connect.
  if (use_shm) {
    std::vector<std::string> descs;
    for (int r : locals) descs.push_back(r == rank ? std::string() : kv.get(key("shm", r)));
    comm->shm_->attach(descs, deadline);
    for (int r : locals)
      if (r != rank) comm->route_[size_t(r)] = comm->shm_.get();
  }
  if (!tcp_peers.empty()) {
    std::vector<std::string> addrs(static_cast<size_t>(size));
    for (int r : tcp_peers) addrs[size_t(r)] = kv.get(key("tcp", r));
    // Test hook: hold back the connecting side so a test can knock on the listener first.
    if (const char* d = std::getenv("SUPERKERNEL_TEST_CONNECT_DELAY_MS"); d && *d)
      std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(d)));
    comm->tcp_ = std::make_unique<TcpProvider>(rank, size, tcp_peers, addrs, *listener, secret, comm->matcher_,
                                               opt.tcp, deadline);
    listener->close();  // nothing of the job keeps listening once everyone is connected
    for (int r : tcp_peers) comm->route_[size_t(r)] = comm->tcp_.get();
  }
  return comm;
}

std::unique_ptr<Comm> bootstrap(KeyValue& kv, int rank, int size, std::chrono::milliseconds timeout,
                                const BootstrapOptions& opt) {
  return Bootstrap::run(kv, rank, size, timeout, opt);
}

}  // namespace mk
