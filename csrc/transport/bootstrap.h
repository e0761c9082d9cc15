// Builds a Comm through an existing key-value store (torch's c10d Store: the adapter wraps it); never a
// home-made rendezvous. Ranks publish their host identity, then shm segment descriptors and TCP listen
// addresses as needed, and share a random job secret that every TCP connection must present.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "transport/comm.h"

namespace mk {

class KeyValue {
 public:
  virtual ~KeyValue() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists (within the store's own timeout).
  virtual std::string get(const std::string& key) = 0;
  // Adds `delta` to the integer at `key` (0 when absent) and returns the sum, atomically.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
};

struct BootstrapOptions {
  TransportMode mode = TransportMode::automatic;  // SUPERKERNEL_TRANSPORT
  ShmOptions shm;
  TcpOptions tcp;
  std::string ifname;  // the interface TCP listens on (empty: SUPERKERNEL_SOCKET_IFNAME, else the first up)
  static BootstrapOptions from_env();
};

std::unique_ptr<Comm> bootstrap(KeyValue& kv, int rank, int size, std::chrono::milliseconds timeout,
                                const BootstrapOptions& opt);

}  // namespace mk
