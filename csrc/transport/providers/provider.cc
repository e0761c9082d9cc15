#include "transport/providers/provider.h"

#include "transport/error.h"

namespace mk {

RequestPtr Provider::put(int peer, uint64_t, size_t, const void*, size_t, uint64_t) {
  throw Error(cat("mk put to peer ", peer, ": one-sided put is not implemented by the ", name(), " provider"));
}

RequestPtr Provider::get(int peer, uint64_t, size_t, void*, size_t) {
  throw Error(cat("mk get from peer ", peer, ": one-sided get is not implemented by the ", name(), " provider"));
}

}  // namespace mk
