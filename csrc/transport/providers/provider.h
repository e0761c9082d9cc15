// One interface for every way mk moves bytes between two ranks (shm, tcp, later ibverbs).
// A provider sends tagged messages; receiving goes through the communicator's Matcher, which every
// provider feeds, so matching rules (order, any-source, size checks) are the same everywhere.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

#include "transport/request.h"

namespace mk {

class Provider {
 public:
  virtual ~Provider() = default;
  virtual const char* name() const = 0;

  // Start sending `len` bytes to `peer`. `buf` must stay valid until the request completes; completion
  // means the buffer may be reused (not that the peer has received it).
  virtual RequestPtr isend(int peer, uint64_t tag, const void* buf, size_t len, uint64_t check) = 0;

  // One-sided access to a region the target registered (RDMA-shaped: put/get with a completion
  // notification at the target). Providers that cannot do it yet say so.
  virtual RequestPtr put(int peer, uint64_t region, size_t offset, const void* src, size_t len,
                         uint64_t notify);
  virtual RequestPtr get(int peer, uint64_t region, size_t offset, void* dst, size_t len);

  // Fail everything in flight, refuse new work, wake every waiter. Idempotent.
  virtual void abort(const std::string& why) = 0;

  // Is the peer still reachable? (false after its connection dropped or its process exited)
  virtual bool peer_alive(int peer) const = 0;
};

}  // namespace mk
