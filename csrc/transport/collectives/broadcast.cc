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
    // all_local: the group's ranks are the host's local ranks, in order
    const bool is_root = c.rank() == root;
    shm_chunks(
        c, d, dl, bytes, s.chunk_bytes(), true,
        [&](int slot, size_t off, size_t n) { if (is_root) copy_bytes(s.slot(root, slot), p + off, n); },
        [&](int slot, size_t off, size_t n) { if (!is_root) copy_bytes(p + off, s.slot(root, slot), n); });
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
    copy_bytes(dst, src, bytes);
    return;
  }
  if (c.all_local()) {
    ShmProvider& s = *c.shm();
    const size_t per_chunk = std::max<size_t>(1, s.chunk_bytes() / size_t(R));
    shm_chunks(
        c, d, dl, bytes, per_chunk, true,
        [&](int slot, size_t off, size_t n) {
          if (c.rank() == root)
            for (int r = 0; r < R; ++r) copy_bytes(s.slot(root, slot) + size_t(r) * n, src + size_t(r) * bytes + off, n);
        },
        [&](int slot, size_t off, size_t n) { copy_bytes(dst + off, s.slot(root, slot) + size_t(c.rank()) * n, n); });
    return;
  }
  if (c.rank() == root) {
    std::vector<std::pair<int, RequestPtr>> sends;
    for (int r = 0; r < R; ++r)
      if (r != root) sends.emplace_back(r, c.isend(r, coll_tag(seq, 0), src + size_t(r) * bytes, bytes, d.check()));
    copy_bytes(dst, src + size_t(root) * bytes, bytes);
    for (auto& [r, q] : sends) c.wait(q, dl, "scatter", r);
  } else {
    c.wait(c.irecv(root, coll_tag(seq, 0), dst, bytes, d.check()), dl, "scatter", root);
  }
}

}  // namespace mk::coll
