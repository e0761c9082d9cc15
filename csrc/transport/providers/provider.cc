#include "transport/providers/provider.h"

#include "transport/error.h"

namespace mk {

namespace {
[[noreturn]] void unsupported(const char* op, int peer, const char* provider) {
  throw Error(cat("mk ", op, " with peer ", peer, ": one-sided ", op, " is not implemented by the ", provider,
                  " provider"));
}
}  // namespace

RequestPtr Provider::put(int peer, uint64_t, size_t, const void*, size_t, uint64_t) { unsupported("put", peer, name()); }
RequestPtr Provider::get(int peer, uint64_t, size_t, void*, size_t) { unsupported("get", peer, name()); }
RequestPtr Provider::accumulate(int peer, uint64_t, size_t, const void*, size_t, DType, RedOp) {
  unsupported("accumulate", peer, name());
}
RequestPtr Provider::atomic(int peer, uint64_t, size_t, AmoOp, int64_t, int64_t, std::shared_ptr<int64_t>) {
  unsupported("atomic", peer, name());
}

}  // namespace mk
