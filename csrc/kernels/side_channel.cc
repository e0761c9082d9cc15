#include "kernels/side_channel.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/group.h"
#include "transport/bootstrap.h"
#include "transport/comm.h"
#include "transport/error.h"

namespace mk::kernels {

namespace {

// The bootstrap's key-value store: the group's store, whose gets wait at most `timeout` (not the store's own,
// often the job's 30 minutes) for a peer that may never publish.
class BoundedStoreKV final : public KeyValue {
 public:
  BoundedStoreKV(c10::intrusive_ptr<c10d::Store> store, std::chrono::milliseconds timeout)
      : store_(c10::make_intrusive<c10d::PrefixStore>("superkernel/agree", std::move(store))), timeout_(timeout) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    store_->wait({key}, timeout_);
    auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
  std::chrono::milliseconds timeout_;
};

// The interface to listen on: SUPERKERNEL_SOCKET_IFNAME, else the first of GLOO_SOCKET_IFNAME's list (where
// the backend's own connections go), else empty (listen_address's choice).
std::string side_ifname() {
  if (const char* v = std::getenv("SUPERKERNEL_SOCKET_IFNAME"); v && *v) return v;
  if (const char* v = std::getenv("GLOO_SOCKET_IFNAME"); v && *v) {
    std::string s = v;
    return s.substr(0, s.find(','));
  }
  return {};
}

void warn_not_opened(const Group& g, const char* why) {
  std::fprintf(stderr,
               "superkernel: rank %d: the fused ops' agreement channel of group %s (%s) could not be opened: %s; "
               "their agreements stay on %s\n",
               g.rank, g.name.c_str(), g.backend_name().c_str(), why, g.backend_name().c_str());
}

}  // namespace

bool side_channel_possible(const Group& g) {
  static const bool wanted = [] {
    const char* v = std::getenv("SUPERKERNEL_OPS_SIDE_CHANNEL");
    return !(v && std::string(v) == "0");
  }();
  return wanted && !g.is_mk() && g.device.is_cpu() && g.size > 1 && g.pg && g.pg->getStore();
}

std::shared_ptr<Comm> open_side_channel(const Group& g) {
  // (a quarter of the group's timeout at most: a rank that failed at once waits for this one in the next
  // agreement, on the backend, for up to the group's timeout)
  const auto open_timeout = std::min<std::chrono::milliseconds>(g.timeout / 4, kSideOpenTimeout);
  try {
    BoundedStoreKV kv(g.pg->getStore(), open_timeout);
    BootstrapOptions opt = BootstrapOptions::from_env();
    opt.mode = TransportMode::automatic;  // (SUPERKERNEL_TRANSPORT is the mk backend's choice, not this one's)
    opt.ifname = side_ifname();
    std::shared_ptr<Comm> comm = bootstrap(kv, g.rank, g.size, open_timeout, opt);
    comm->set_timeout(g.timeout);
    return comm;
  } catch (const c10::Error& e) {
    warn_not_opened(g, e.what_without_backtrace());
  } catch (const std::exception& e) {
    warn_not_opened(g, e.what());
  }
  return nullptr;
}

}  // namespace mk::kernels
