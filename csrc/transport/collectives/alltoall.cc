// All to all with uneven splits: every pair exchanges directly (shm rings on one host, tcp between hosts).
// Each message carries the pair's byte count, so two ranks that disagree on a split get an error.
#include <cstring>
#include <vector>

#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {

void alltoall(Comm& c, const void* in, void* out, const std::vector<size_t>& send_bytes,
              const std::vector<size_t>& send_off, const std::vector<size_t>& recv_bytes,
              const std::vector<size_t>& recv_off) {
  c.check_usable("alltoall");
  const int R = c.size(), me = c.rank();
  const OpDesc d{Kind::alltoall, DType::u8, RedOp::sum, uint64_t(R), -1};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (send_bytes[size_t(me)] != recv_bytes[size_t(me)])
    throw Error(cat("mk alltoall: rank ", c.rank(), " sends ", send_bytes[size_t(me)], " bytes to itself but expects ",
                    recv_bytes[size_t(me)]));
  std::vector<std::pair<int, RequestPtr>> reqs;
  for (int k = 1; k < R; ++k) {
    const int from = (me - k + R) % R;
    reqs.emplace_back(from, c.irecv(from, coll_tag(seq, 0), dst + recv_off[size_t(from)], recv_bytes[size_t(from)], d.check()));
  }
  for (int k = 1; k < R; ++k) {
    const int to = (me + k) % R;
    reqs.emplace_back(to, c.isend(to, coll_tag(seq, 0), src + send_off[size_t(to)], send_bytes[size_t(to)], d.check()));
  }
  std::memmove(dst + recv_off[size_t(me)], src + send_off[size_t(me)], send_bytes[size_t(me)]);
  for (auto& [peer, r] : reqs) c.wait(r, dl, "alltoall", peer);
}

}  // namespace mk::coll
