#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {

void shm_write_desc(Comm& c, int slot, const OpDesc& d) {
  auto* w = c.shm()->slot_desc(c.shm()->local_rank(), slot);
  w[1].store(uint64_t(d.kind), std::memory_order_relaxed);
  w[2].store(uint64_t(d.dtype), std::memory_order_relaxed);
  w[3].store(uint64_t(d.op), std::memory_order_relaxed);
  w[4].store(d.count, std::memory_order_relaxed);
  w[5].store(uint64_t(int64_t(d.root)), std::memory_order_relaxed);
  w[0].store(d.check(), std::memory_order_relaxed);  // published by the next step (release)
}

void shm_check_descs(Comm& c, int slot, const OpDesc& d) {
  ShmProvider& s = *c.shm();
  const uint64_t mine = d.check();
  for (int r = 0; r < s.local_size(); ++r) {
    auto* w = s.slot_desc(r, slot);
    if (w[0].load(std::memory_order_relaxed) == mine) continue;
    OpDesc theirs{Kind(w[1].load()), DType(w[2].load()), RedOp(w[3].load()), w[4].load(), int(int64_t(w[5].load()))};
    throw MismatchError(cat("mk ", kind_name(d.kind), ": rank ", c.rank(), " called ", d.describe(), " but rank ",
                    s.global_rank(r), " called ", theirs.describe(), ": every rank must pass matching arguments"));
  }
}

}  // namespace mk::coll

namespace mk::coll {

int shm_begin(Comm& c, const OpDesc& d, const Deadline& dl) {
  const int s = c.shm()->acquire_slot(dl, kind_name(d.kind));
  shm_write_desc(c, s, d);
  return s;
}

void shm_ready(Comm& c, int slot, const OpDesc& d, bool first, const Deadline& dl) {
  ShmProvider& s = *c.shm();
  s.wait_steps(s.publish(), dl, kind_name(d.kind));
  if (first) {
    try {
      shm_check_descs(c, slot, d);
    } catch (...) {
      shm_done(c, slot);  // every rank sees the mismatch at the same step, so all stay in step
      throw;
    }
  }
}

void shm_sync(Comm& c, const OpDesc& d, const Deadline& dl) {
  ShmProvider& s = *c.shm();
  s.wait_steps(s.publish(), dl, kind_name(d.kind));
}

void shm_done(Comm& c, int slot) {
  ShmProvider& s = *c.shm();
  s.release_slot(slot, s.publish());
}

void check_rows(const Comm& c, const char* op, size_t row_bytes, size_t pieces, size_t rows_per_chunk) {
  if (c.size() < 2 || !c.all_local())
    throw Error(cat("mk ", op, " (in place): rank ", c.rank(), ": needs a group of 2 or more ranks on one host with "
                    "shared memory"));
  const size_t most = shm_rows_per_chunk(c, row_bytes, pieces);
  if (rows_per_chunk == 0 || rows_per_chunk > most)
    throw Error(cat("mk ", op, " (in place): rank ", c.rank(), ": ", rows_per_chunk, " rows of ", row_bytes,
                    " bytes per chunk, but a staging slot holds ", most));
}

void sendrecv(Comm& c, const char* op, int dst, const void* sbuf, size_t sbytes, int src, void* rbuf,
              size_t rbytes, uint64_t tag, uint64_t check, const Deadline& dl) {
  RequestPtr r = c.irecv(src, tag, rbuf, rbytes, check);
  RequestPtr s = c.isend(dst, tag, sbuf, sbytes, check);
  c.wait(r, dl, op, src);
  c.wait(s, dl, op, dst);
}

}  // namespace mk::coll
