// All to all with uneven splits.
//  - one host: in rounds, every rank stages for each destination the next piece of the block it sends
//    there; each destination copies its pieces out of every sender's slot (one copy in, one copy out).
//    The first round's slot starts with the sender's table of block sizes, so a receiver that expects a
//    different size from some sender finds out (and every rank learns it at the same step).
//  - across hosts: every pair exchanges directly; each message carries the pair's byte count.
#include <algorithm>
#include <cstring>
#include <vector>

#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {
namespace {

void shm_alltoall(Comm& c, const OpDesc& d, const char* src, char* dst, const std::vector<size_t>& sb,
                  const std::vector<size_t>& so, const std::vector<size_t>& rb, const std::vector<size_t>& ro,
                  const Deadline& dl) {
  ShmProvider& s = *c.shm();
  const int R = c.size(), me = c.rank();
  const size_t table = sizeof(uint64_t) * size_t(R);
  const size_t piece = ((s.chunk_bytes() - table) / size_t(R)) & ~size_t(63);
  const size_t my_max = std::max(*std::max_element(sb.begin(), sb.end()), *std::max_element(rb.begin(), rb.end()));
  size_t rounds = 1;  // known after the first ready step: the largest block anywhere decides
  for (size_t k = 0; k < rounds; ++k) {
    const int slot = shm_begin(c, d, dl);
    char* mine = s.slot(me, slot);
    copy_bytes(mine, std::vector<uint64_t>(sb.begin(), sb.end()).data(), table);
    for (int to = 0; to < R; ++to) {
      const size_t off = std::min(sb[size_t(to)], k * piece), n = std::min(piece, sb[size_t(to)] - off);
      copy_bytes(mine + table + size_t(to) * piece, src + so[size_t(to)] + off, n);
    }
    s.slot_desc(me, slot)[6].store(my_max, std::memory_order_relaxed);
    shm_ready(c, slot, d, k == 0, dl);
    if (k == 0) {
      size_t global_max = 0;
      std::string bad;
      for (int from = 0; from < R; ++from) {
        global_max = std::max<size_t>(global_max, s.slot_desc(from, slot)[6].load(std::memory_order_relaxed));
        uint64_t theirs[1];
        for (int to = 0; to < R; ++to) {
          copy_bytes(theirs, s.slot(from, slot) + sizeof(uint64_t) * size_t(to), sizeof(uint64_t));
          // Every rank checks every pair, so all ranks agree on whether to fail.
          if (to == me && theirs[0] != rb[size_t(from)] && bad.empty())
            bad = cat("rank ", me, " expects ", rb[size_t(from)], " bytes from rank ", from, ", which sends ", theirs[0]);
        }
      }
      rounds = std::max<size_t>(1, (global_max + piece - 1) / piece);
      // A mismatch seen by any rank must stop all of them: publish it in our descriptor and look again.
      s.slot_desc(me, slot)[7].store(bad.empty() ? 0 : 1, std::memory_order_relaxed);
      shm_sync(c, d, dl);
      bool any_bad = false;
      for (int from = 0; from < R; ++from) any_bad |= s.slot_desc(from, slot)[7].load(std::memory_order_relaxed) != 0;
      if (any_bad) {
        shm_done(c, slot);
        throw MismatchError(bad.empty() ? cat("mk alltoall: rank ", me, ": another rank's split sizes disagree with its peers'")
                                        : cat("mk alltoall: ", bad, ": split sizes must agree pairwise"));
      }
    }
    for (int from = 0; from < R; ++from) {
      const size_t off = std::min(rb[size_t(from)], k * piece), n = std::min(piece, rb[size_t(from)] - off);
      copy_bytes(dst + ro[size_t(from)] + off, s.slot(from, slot) + table + size_t(me) * piece, n);
    }
    shm_done(c, slot);
  }
}

}  // namespace

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
  if (R > 1 && c.all_local()) return shm_alltoall(c, d, src, dst, send_bytes, send_off, recv_bytes, recv_off, dl);
  std::vector<std::pair<int, RequestPtr>> reqs;
  for (int k = 1; k < R; ++k) {
    const int from = (me - k + R) % R;
    reqs.emplace_back(from, c.irecv(from, coll_tag(seq, 0), dst + recv_off[size_t(from)], recv_bytes[size_t(from)], d.check()));
  }
  for (int k = 1; k < R; ++k) {
    const int to = (me + k) % R;
    reqs.emplace_back(to, c.isend(to, coll_tag(seq, 0), src + send_off[size_t(to)], send_bytes[size_t(to)], d.check()));
  }
  copy_bytes(dst + recv_off[size_t(me)], src + send_off[size_t(me)], send_bytes[size_t(me)]);
  for (auto& [peer, r] : reqs) c.wait(r, dl, "alltoall", peer);
}

}  // namespace mk::coll
