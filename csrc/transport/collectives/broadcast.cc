// One to many: broadcast and scatter.
//  - one host: the root stages chunks in its slot, the others copy them out.
//  - across hosts: binomial tree (broadcast); direct sends from the root (scatter).
#include <algorithm>
#include <cstring>
#include <vector>

#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {
namespace {

void check_root(Comm& c, const char* op, int root) {
  if (root < 0 || root >= c.size())
    throw Error(cat("mk ", op, ": rank ", c.rank(), ": invalid root ", root, " (group size ", c.size(), ")"));
}

}  // namespace

void broadcast(Comm& c, void* buf, size_t bytes, int root) {
  c.check_usable("broadcast");
  check_root(c, "broadcast", root);
  const OpDesc d{Kind::broadcast, DType::u8, RedOp::sum, bytes, root};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  char* p = static_cast<char*>(buf);
  const int R = c.size();
  if (R == 1) return;
  if (c.all_local()) {
    ShmProvider& s = *c.shm();
    const int lroot = root;  // all_local: local ranks are the group's ranks in order
    size_t off = 0;
    bool first = true;
    do {
      const size_t n = std::min(s.chunk_bytes(), bytes - off);
      const int slot = shm_begin(c, d, dl);
      if (c.rank() == root) std::memcpy(s.slot(s.local_rank(), slot), p + off, n);
      shm_ready(c, slot, d, first, dl);
      if (c.rank() != root) std::memcpy(p + off, s.slot(lroot, slot), n);
      shm_done(c, slot);
      off += n;
      first = false;
    } while (off < bytes);
    return;
  }
  const int vr = (c.rank() - root + R) % R;
  int mask = 1;
  while (mask < R) {
    if (vr & mask) {
      const int src = (vr - mask + root) % R;
      c.wait(c.irecv(src, coll_tag(seq, 0), p, bytes, d.check()), dl, "broadcast", src);
      break;
    }
    mask <<= 1;
  }
  std::vector<std::pair<int, RequestPtr>> sends;
  for (mask >>= 1; mask > 0; mask >>= 1) {
    if (vr + mask < R) {
      const int dst = (vr + mask + root) % R;
      sends.emplace_back(dst, c.isend(dst, coll_tag(seq, 0), p, bytes, d.check()));
    }
  }
  for (auto& [dst, r] : sends) c.wait(r, dl, "broadcast", dst);
}

void scatter(Comm& c, const void* in, void* out, size_t bytes, int root) {
  c.check_usable("scatter");
  check_root(c, "scatter", root);
  const OpDesc d{Kind::scatter, DType::u8, RedOp::sum, bytes, root};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  const int R = c.size();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (R == 1) {
    std::memmove(dst, src, bytes);
    return;
  }
  if (c.all_local()) {
    ShmProvider& s = *c.shm();
    const size_t per_chunk = std::max<size_t>(1, s.chunk_bytes() / size_t(R));
    size_t off = 0;
    bool first = true;
    do {
      const size_t n = std::min(per_chunk, bytes - off);
      const int slot = shm_begin(c, d, dl);
      if (c.rank() == root)
        for (int r = 0; r < R; ++r) std::memcpy(s.slot(s.local_rank(), slot) + size_t(r) * n, src + size_t(r) * bytes + off, n);
      shm_ready(c, slot, d, first, dl);
      std::memcpy(dst + off, s.slot(root, slot) + size_t(c.rank()) * n, n);
      shm_done(c, slot);
      off += n;
      first = false;
    } while (off < bytes);
    return;
  }
  if (c.rank() == root) {
    std::vector<std::pair<int, RequestPtr>> sends;
    for (int r = 0; r < R; ++r)
      if (r != root) sends.emplace_back(r, c.isend(r, coll_tag(seq, 0), src + size_t(r) * bytes, bytes, d.check()));
    std::memmove(dst, src + size_t(root) * bytes, bytes);
    for (auto& [r, q] : sends) c.wait(q, dl, "scatter", r);
  } else {
    c.wait(c.irecv(root, coll_tag(seq, 0), dst, bytes, d.check()), dl, "scatter", root);
  }
}

}  // namespace mk::coll
