// Many to one / all: allgather and gather.
//  - one host: every rank stages its part in its slot; everyone (allgather) or the root (gather) copies.
//  - across hosts: ring (allgather); direct sends to the root (gather).
#include <algorithm>
#include <cstring>
#include <vector>

#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {
namespace {

// Shared by allgather and gather: only `readers` copy the staged parts out.
void shm_gather(Comm& c, const OpDesc& d, const char* src, char* dst, size_t bytes, int root, const Deadline& dl) {
  ShmProvider& s = *c.shm();
  const int R = c.size();
  const bool reader = root < 0 || c.rank() == root;
  shm_chunks(
      c, d, dl, bytes, s.chunk_bytes(), true,
      [&](int slot, size_t off, size_t n) { copy_bytes(s.slot(s.local_rank(), slot), src + off, n); },
      [&](int slot, size_t off, size_t n) {
        if (reader)
          for (int r = 0; r < R; ++r) copy_bytes(dst + size_t(r) * bytes + off, s.slot(r, slot), n);
      });
}

}  // namespace

void allgather(Comm& c, const void* in, void* out, size_t bytes) {
  c.check_usable("allgather");
  const OpDesc d{Kind::allgather, DType::u8, RedOp::sum, bytes, -1};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  const int R = c.size(), me = c.rank();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (R == 1) {
    copy_bytes(dst, src, bytes);
    return;
  }
  if (c.all_local()) return shm_gather(c, d, src, dst, bytes, -1, dl);
  copy_bytes(dst + size_t(me) * bytes, src, bytes);
  const int right = (me + 1) % R, left = (me - 1 + R) % R;
  for (int k = 0; k < R - 1; ++k) {
    const int si = ((me - k) % R + R) % R, ri = ((me - k - 1) % R + R) % R;
    sendrecv(c, "allgather", right, dst + size_t(si) * bytes, bytes, left, dst + size_t(ri) * bytes, bytes,
             coll_tag(seq, uint32_t(k)), d.check(), dl);
  }
}

void gather(Comm& c, const void* in, void* out, size_t bytes, int root) {
  c.check_usable("gather");
  if (root < 0 || root >= c.size())
    throw Error(cat("mk gather: rank ", c.rank(), ": invalid root ", root, " (group size ", c.size(), ")"));
  const OpDesc d{Kind::gather, DType::u8, RedOp::sum, bytes, root};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  const int R = c.size();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (R == 1) {
    copy_bytes(dst, src, bytes);
    return;
  }
  if (c.all_local()) return shm_gather(c, d, src, dst, bytes, root, dl);
  if (c.rank() == root) {
    std::vector<std::pair<int, RequestPtr>> recvs;
    for (int r = 0; r < R; ++r)
      if (r != root) recvs.emplace_back(r, c.irecv(r, coll_tag(seq, 0), dst + size_t(r) * bytes, bytes, d.check()));
    copy_bytes(dst + size_t(root) * bytes, src, bytes);
    for (auto& [r, q] : recvs) c.wait(q, dl, "gather", r);
  } else {
    c.wait(c.isend(root, coll_tag(seq, 0), src, bytes, d.check()), dl, "gather", root);
  }
}

void shm_allgather_rows(Comm& c, size_t rows, size_t row_bytes, size_t rows_per_chunk,
                        const std::function<void(char* dst, size_t row, size_t nrows)>& fill,
                        const std::function<void(int rank, const char* src, size_t row, size_t nrows)>& use) {
  c.check_usable("allgather");
  check_rows(c, "allgather", row_bytes, 1, rows_per_chunk);
  const OpDesc d{Kind::allgather, DType::u8, RedOp::sum, rows * row_bytes, -1};
  c.next_seq();
  ShmProvider& s = *c.shm();
  const int R = c.size();
  shm_chunks(
      c, d, c.deadline(), rows * row_bytes, rows_per_chunk * row_bytes, true,
      [&](int slot, size_t off, size_t n) { fill(s.slot(s.local_rank(), slot), off / row_bytes, n / row_bytes); },
      [&](int slot, size_t off, size_t n) {
        for (int r = 0; r < R; ++r) use(r, s.slot(r, slot), off / row_bytes, n / row_bytes);
      });
}

}  // namespace mk::coll
