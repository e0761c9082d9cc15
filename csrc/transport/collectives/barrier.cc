// Barrier: one step of the shm protocol on one host; a dissemination barrier across hosts.
#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {

void barrier(Comm& c) {
  c.check_usable("barrier");
  const OpDesc d{Kind::barrier, DType::u8, RedOp::sum, 0, -1};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  if (c.size() == 1) return;
  if (c.all_local()) {
    const int slot = shm_begin(c, d, dl);
    shm_ready(c, slot, d, true, dl);
    shm_done(c, slot);
    return;
  }
  char none = 0;
  uint32_t step = 0;
  for (int dist = 1; dist < c.size(); dist <<= 1, ++step) {
    const int to = (c.rank() + dist) % c.size(), from = (c.rank() - dist + c.size()) % c.size();
    sendrecv(c, "barrier", to, &none, 0, from, &none, 0, coll_tag(seq, step), d.check(), dl);
  }
}

}  // namespace mk::coll
