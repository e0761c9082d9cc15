// Reductions: allreduce, reduce, reduce_scatter.
//  - one host: every rank copies its chunk into its staging slot; small chunks are then reduced whole by
//    every rank (one synchronisation), large ones are split so each rank reduces its slice of all inputs
//    and then gathers the others' slices (two synchronisations, each byte read once per rank).
//  - across hosts: hierarchical when a host has several ranks (shm inside, leaders over the network); among
//    the network members recursive doubling for small power-of-two groups, else a ring (reduce-scatter
//    then allgather). fp16/bf16 accumulate as fp32 there, so every sum is accumulated in fp32 and rounded
//    once; only partial sums of two or more terms travel as fp32 (see p2p_allreduce_half, and
//    hier_allreduce_half for a host's partial sum).
#include <algorithm>
#include <cstring>
#include <functional>
#include <vector>

#include "transport/collectives/collective.h"
#include "transport/collectives/collectives.h"

namespace mk::coll {
namespace {

constexpr size_t kSmallBytes = 16 << 10;
constexpr uint32_t kMaxPieces = 64;

size_t align_elems(size_t n, size_t es) {
  const size_t a = std::max<size_t>(1, 64 / es);
  return (n + a - 1) / a * a;
}

// `fill(slot, off, n)` puts elements [off, off + n) of this rank's input into its staging slot (by default
// a copy of buf's); the sum lands in buf. Chunks of `per_chunk` elements (0: as many as a slot holds).
template <typename Fill>
void shm_allreduce_with(Comm& c, char* buf, size_t count, DType t, RedOp op, const OpDesc& d, const Deadline& dl,
                        size_t per_chunk, Fill fill) {
  ShmProvider& s = *c.shm();
  const int R = s.local_size(), me = s.local_rank();
  const size_t es = dtype_size(t);
  if (per_chunk == 0) per_chunk = s.chunk_bytes() / es;
  std::vector<const void*> srcs(static_cast<size_t>(R));
  auto drain = [&](int slot, size_t off, size_t n) {
    if (n * es <= kSmallBytes) {  // every rank reduces the whole chunk: one synchronisation
      for (int r = 0; r < R; ++r) srcs[size_t(r)] = s.slot(r, slot);
      reduce_many(buf + off * es, srcs.data(), R, n, t, op);
      return;
    }
    // each rank reduces its slice of every input in place, then everyone gathers the slices
    const size_t per = align_elems((n + size_t(R) - 1) / size_t(R), es);
    const size_t lo = std::min(n, per * size_t(me)), hi = std::min(n, lo + per);
    for (int r = 0; r < R; ++r) srcs[size_t(r)] = s.slot(r, slot) + lo * es;
    reduce_many(s.slot(me, slot) + lo * es, srcs.data(), R, hi - lo, t, op);
    shm_sync(c, d, dl);
    for (int r = 0; r < R; ++r) {
      const size_t rlo = std::min(n, per * size_t(r)), rhi = std::min(n, rlo + per);
      copy_bytes(buf + (off + rlo) * es, s.slot(r, slot) + rlo * es, (rhi - rlo) * es);
    }
  };
  shm_chunks(c, d, dl, count, per_chunk, true, fill, drain);
}

void shm_allreduce(Comm& c, char* buf, size_t count, DType t, RedOp op, const OpDesc& d, const Deadline& dl) {
  ShmProvider& s = *c.shm();
  const size_t es = dtype_size(t);
  shm_allreduce_with(c, buf, count, t, op, d, dl, 0, [&](int slot, size_t off, size_t n) {
    copy_bytes(s.slot(s.local_rank(), slot), buf + off * es, n * es);
  });
}

// One host: chunk [off, off + n) of every rank's block is written by `fill(slot, off, n)` into this rank's
// slot, laid out [R][n] (block r's piece at r * n elements); then each rank reduces its own block's pieces
// of every slot into out.
template <typename Fill>
void shm_reduce_scatter_with(Comm& c, char* out, size_t count, DType t, RedOp op, const OpDesc& d,
                             const Deadline& dl, size_t per_chunk, Fill fill) {
  ShmProvider& s = *c.shm();
  const int R = s.local_size(), lme = s.local_rank(), me = c.rank();
  const size_t es = dtype_size(t);
  if (per_chunk == 0) per_chunk = std::max<size_t>(1, s.chunk_bytes() / es / size_t(R));
  std::vector<const void*> srcs(static_cast<size_t>(R));
  shm_chunks(
      c, d, dl, count, per_chunk, true,
      [&](int slot, size_t off, size_t n) { fill(s.slot(lme, slot), off, n); },
      [&](int slot, size_t off, size_t n) {
        for (int r = 0; r < R; ++r) srcs[size_t(r)] = s.slot(r, slot) + size_t(me) * n * es;
        reduce_many(out + off * es, srcs.data(), R, n, t, op);
      });
}

// The ranks an algorithm runs over (all of the group, or one leader per host) and our index among them.
struct Members {
  std::vector<int> ranks;
  int me;
  static Members all(const Comm& c) {
    Members m{std::vector<int>(static_cast<size_t>(c.size())), c.rank()};
    for (int r = 0; r < c.size(); ++r) m.ranks[size_t(r)] = r;
    return m;
  }
  int size() const { return int(ranks.size()); }
  int at(int i) const { return ranks[size_t(i)]; }
};

// Ring over providers: after the reduce-scatter phase member i owns the reduced segment i.
void ring_allreduce(Comm& c, const Members& m, char* buf, size_t count, DType t, RedOp op, uint64_t seq,
                    uint64_t check, const Deadline& dl, bool gather_back) {
  const int R = m.size(), me = m.me;
  // (the op named in errors: reduce_scatter runs the ring without its allgather)
  const char* what = gather_back ? "allreduce" : "reduce_scatter";
  const size_t es = dtype_size(t);
  const size_t seg = (count + size_t(R) - 1) / size_t(R);
  auto lo = [&](int i) { return std::min(count, seg * size_t(i)); };
  auto len = [&](int i) { return std::min(count, lo(i) + seg) - lo(i); };
  std::vector<char> tmp(seg * es);
  const int right = m.at((me + 1) % R), left = m.at((me - 1 + R) % R);
  // Each step's segment travels in pieces, so reducing piece j overlaps with receiving piece j+1.
  const size_t piece = std::max<size_t>(std::max<size_t>(1, (256u << 10) / es), (seg + kMaxPieces - 1) / kMaxPieces);
  for (int k = 0; k < R - 1; ++k) {
    const int si = ((me - k - 1) % R + R) % R, ri = ((me - k - 2) % R + R) % R;
    std::vector<RequestPtr> recvs, sends;
    for (size_t p = 0, j = 0; p < std::max<size_t>(len(ri), 1); p += piece, ++j)
      recvs.push_back(c.irecv(left, coll_tag(seq, uint32_t(k) * kMaxPieces + uint32_t(j)), tmp.data() + p * es,
                              std::min(piece, len(ri) - std::min(len(ri), p)) * es, check));
    for (size_t p = 0, j = 0; p < std::max<size_t>(len(si), 1); p += piece, ++j)
      sends.push_back(c.isend(right, coll_tag(seq, uint32_t(k) * kMaxPieces + uint32_t(j)), buf + (lo(si) + p) * es,
                              std::min(piece, len(si) - std::min(len(si), p)) * es, check));
    for (size_t j = 0; j < recvs.size(); ++j) {
      c.wait(recvs[j], dl, what, left);
      const size_t p = j * piece, n = std::min(piece, len(ri) - std::min(len(ri), p));
      const void* srcs[2] = {buf + (lo(ri) + p) * es, tmp.data() + p * es};
      reduce_many(buf + (lo(ri) + p) * es, srcs, 2, n, t, op);
    }
    for (auto& q : sends) c.wait(q, dl, what, right);
  }
  if (!gather_back) return;
  for (int k = 0; k < R - 1; ++k) {
    const int si = ((me - k) % R + R) % R, ri = ((me - k - 1) % R + R) % R;
    sendrecv(c, what, right, buf + lo(si) * es, len(si) * es, left, buf + lo(ri) * es, len(ri) * es,
             coll_tag(seq, uint32_t(R + k) * kMaxPieces), check, dl);
  }
}

void doubling_allreduce(Comm& c, const Members& m, char* buf, size_t count, DType t, RedOp op, uint64_t seq,
                        uint64_t check, const Deadline& dl) {
  const size_t bytes = count * dtype_size(t);
  std::vector<char> tmp(bytes);
  uint32_t step = 0;
  for (int mask = 1; mask < m.size(); mask <<= 1, ++step) {
    const int partner = m.at(m.me ^ mask);
    sendrecv(c, "allreduce", partner, buf, bytes, partner, tmp.data(), bytes, coll_tag(seq, step), check, dl);
    const void* srcs[2] = {buf, tmp.data()};
    reduce_many(buf, srcs, 2, count, t, op);
  }
}

bool is_half(DType t) { return t == DType::f16 || t == DType::bf16; }

// The network algorithms for fp16/bf16 when every member holds its own term (not a host's partial sum): the
// sum is formed in fp32 and rounded once, as if the buffer were widened and reduced as fp32 (the same
// algorithm, order and bits: recursive doubling where the fp32 buffer would take it, else the ring), but a
// value that is exactly a half-type value travels as one. That is every member's own term on the first
// step (a sum of two or more terms stays fp32), and, in the ring's allgather, the reduced segments, rounded
// as every member would round them. At 2 members nothing travels as fp32, half the bytes of the widened
// buffer, and the two terms are summed and rounded in one pass (reduce_many of the half type: fp32 inside),
// with no fp32 buffer at all.
void doubling_allreduce_half(Comm& c, const Members& m, char* buf, size_t count, DType t, RedOp op, uint64_t seq,
                             uint64_t check, const Deadline& dl) {
  std::vector<uint16_t> tmp16(count);
  const int first = m.at(m.me ^ 1);
  sendrecv(c, "allreduce", first, buf, count * 2, first, tmp16.data(), count * 2, coll_tag(seq, 0), check, dl);
  if (m.size() == 2) {
    const void* srcs[2] = {buf, tmp16.data()};
    reduce_many(buf, srcs, 2, count, t, op);
    return;
  }
  std::vector<float> wide(count), tmp(count);
  to_f32(wide.data(), buf, count, t);
  to_f32(tmp.data(), tmp16.data(), count, t);
  uint32_t step = 0;
  for (int mask = 1; mask < m.size(); mask <<= 1, ++step) {
    if (step > 0) {
      const int partner = m.at(m.me ^ mask);
      sendrecv(c, "allreduce", partner, wide.data(), count * 4, partner, tmp.data(), count * 4, coll_tag(seq, step),
               check, dl);
    }
    const void* srcs[2] = {wide.data(), tmp.data()};
    reduce_many(wide.data(), srcs, 2, count, DType::f32, op);
  }
  from_f32(buf, wide.data(), count, t);
}

// The ring over `count` half values: `terms` this member's, `own_out` where its reduced segment lands, rounded
// (nullptr: that segment of `out`); with `out` (allreduce; may be `terms`) the allgather then fills every
// segment of it, without (reduce_scatter) the ring ends there. With `wide_terms` (then `terms` is unused)
// this member's term is an fp32 partial sum (a host's, see hier_allreduce_half): step 0 sends it as fp32,
// and the sums, their order and the rounding are those of the fp32 ring (ring_allreduce) over those terms.
void ring_allreduce_half(Comm& c, const Members& m, const char* terms, char* out, char* own_out, size_t count,
                         DType t, RedOp op, uint64_t seq, uint64_t check, const Deadline& dl,
                         const float* wide_terms = nullptr,
                         const std::function<void(size_t lo, size_t n)>& ensure = nullptr) {
  const int R = m.size(), me = m.me;
  const char* what = out != nullptr ? "allreduce" : "reduce_scatter";  // (the op named in errors)
  const size_t seg = (count + size_t(R) - 1) / size_t(R);
  auto lo = [&](int i) { return std::min(count, seg * size_t(i)); };
  auto len = [&](int i) { return std::min(count, lo(i) + seg) - lo(i); };
  if (own_out == nullptr) own_out = out + lo(me) * 2;
  const bool wide = wide_terms != nullptr;
  std::vector<uint16_t> tmp16(wide ? 0 : seg);  // step 0 receives the previous member's term
  // R > 2 or wide terms: the fp32 partial sums received (every step but a half-type step 0), and the segment
  // reduced at step k (sent at step k + 1) in sums[k % 2]
  const bool fp32_sums = R > 2 || wide;
  std::vector<float> tmp(fp32_sums ? seg : 0), sums[2];
  if (fp32_sums) sums[0].resize(seg), sums[1].resize(seg);
  const int right = m.at((me + 1) % R), left = m.at((me - 1 + R) % R);
  // (pieces of as many elements as the fp32 ring's; step 0 moves them in half the bytes)
  const size_t piece = std::max<size_t>((256u << 10) / 4, (seg + kMaxPieces - 1) / kMaxPieces);
  auto term_at = [&](size_t i) { return terms + i * 2; };
  for (int k = 0; k < R - 1; ++k) {
    const int si = ((me - k - 1) % R + R) % R, ri = ((me - k - 2) % R + R) % R;
    const bool last = k == R - 2;  // then ri == me: the segment reduced is final
    const size_t es = k == 0 && !wide ? 2 : 4;  // step 0: the own terms, as they are
    std::vector<RequestPtr> recvs, sends;
    for (size_t p = 0, j = 0; p < std::max<size_t>(len(ri), 1); p += piece, ++j) {
      char* into = es == 2 ? reinterpret_cast<char*>(tmp16.data() + p) : reinterpret_cast<char*>(tmp.data() + p);
      recvs.push_back(c.irecv(left, coll_tag(seq, uint32_t(k) * kMaxPieces + uint32_t(j)), into,
                              std::min(piece, len(ri) - std::min(len(ri), p)) * es, check));
    }
    for (size_t p = 0, j = 0; p < std::max<size_t>(len(si), 1); p += piece, ++j) {
      // (si at step k is the segment reduced at step k - 1)
      if (k == 0 && ensure) ensure(lo(si) + p, std::min(piece, len(si) - std::min(len(si), p)));
      const char* from = k > 0 ? reinterpret_cast<const char*>(sums[(k - 1) % 2].data() + p)
                         : wide  ? reinterpret_cast<const char*>(wide_terms + lo(si) + p)
                                 : term_at(lo(si) + p);
      sends.push_back(c.isend(right, coll_tag(seq, uint32_t(k) * kMaxPieces + uint32_t(j)), from,
                              std::min(piece, len(si) - std::min(len(si), p)) * es, check));
    }
    for (size_t j = 0; j < recvs.size(); ++j) {
      c.wait(recvs[j], dl, what, left);
      const size_t p = j * piece, n = std::min(piece, len(ri) - std::min(len(ri), p));
      // (each segment is reduced once here: this member's term plus what was received, the previous member's
      // term on step 0, a partial sum after)
      if (!fp32_sums) {  // two half-type terms: summed in fp32 and rounded once, in one pass
        const void* srcs[2] = {term_at(lo(ri) + p), tmp16.data() + p};
        reduce_many(own_out + p * 2, srcs, 2, n, t, op);
        continue;
      }
      float* acc = sums[k % 2].data() + p;
      const float* own = acc;
      if (wide) {
        if (ensure) ensure(lo(ri) + p, n);
        own = wide_terms + lo(ri) + p;
      } else {
        to_f32(acc, term_at(lo(ri) + p), n, t);
      }
      if (k == 0 && !wide) to_f32(tmp.data() + p, tmp16.data() + p, n, t);
      const void* srcs[2] = {own, tmp.data() + p};
      reduce_many(acc, srcs, 2, n, DType::f32, op);
      if (last) from_f32(own_out + p * 2, acc, n, t);  // this member's reduced segment, rounded once
    }
    for (auto& q : sends) c.wait(q, dl, what, right);
  }
  if (out == nullptr) return;
  // (after the reduce-scatter: every term this member reads has been read, so `out` may be `terms`)
  auto out_at = [&](size_t i) { return out + i * 2; };
  for (int k = 0; k < R - 1; ++k) {
    const int si = ((me - k) % R + R) % R, ri = ((me - k - 1) % R + R) % R;
    sendrecv(c, what, right, out_at(lo(si)), len(si) * 2, left, out_at(lo(ri)), len(ri) * 2,
             coll_tag(seq, uint32_t(R + k) * kMaxPieces), check, dl);
  }
}

// Allreduce of fp16/bf16 terms, one per member (see ring_allreduce_half). The algorithm is the one the fp32
// buffer of the same count would take.
void p2p_allreduce_half(Comm& c, const Members& m, char* buf, size_t count, DType t, RedOp op, uint64_t seq,
                        uint64_t check, const Deadline& dl) {
  if (m.size() == 1) return;
  const bool pow2 = (m.size() & (m.size() - 1)) == 0;
  if (pow2 && count * sizeof(float) <= (64u << 10))
    doubling_allreduce_half(c, m, buf, count, t, op, seq, check, dl);
  else
    ring_allreduce_half(c, m, buf, buf, nullptr, count, t, op, seq, check, dl);
}

void p2p_allreduce(Comm& c, const Members& m, char* buf, size_t count, DType t, RedOp op, uint64_t seq,
                   uint64_t check, const Deadline& dl) {
  const bool pow2 = (m.size() & (m.size() - 1)) == 0;
  if (m.size() == 1) return;
  if (pow2 && count * dtype_size(t) <= (64u << 10))
    doubling_allreduce(c, m, buf, count, t, op, seq, check, dl);
  else
    ring_allreduce(c, m, buf, count, t, op, seq, check, dl, true);
}

// Local broadcast of the leader's (local rank 0's) buffer through the staging slots.
void shm_bcast_from_leader(Comm& c, char* buf, size_t bytes, const OpDesc& d, const Deadline& dl) {
  ShmProvider& s = *c.shm();
  const bool leader = s.local_rank() == 0;
  shm_chunks(
      c, d, dl, bytes, s.chunk_bytes(), false,
      [&](int slot, size_t off, size_t n) { if (leader) copy_bytes(s.slot(0, slot), buf + off, n); },
      [&](int slot, size_t off, size_t n) { if (!leader) copy_bytes(buf + off, s.slot(0, slot), n); });
}

// One member per host, its first rank (local rank 0, the host's leader); `me` is the index of this rank's host.
Members host_leaders(const Comm& c) {
  Members leaders{{}, 0};
  const auto& peers = c.peers();
  for (int r = 0; r < c.size(); ++r) {
    bool first_on_host = true;
    for (int q = 0; q < r; ++q) first_on_host &= peers[size_t(q)].host_id != peers[size_t(r)].host_id;
    if (!first_on_host) continue;
    if (peers[size_t(r)].host_id == peers[size_t(c.rank())].host_id) leaders.me = leaders.size();
    leaders.ranks.push_back(r);
  }
  return leaders;
}

// A host's partial sums of fp16/bf16 terms, in fp32 on its leader: every local rank stages its terms in its
// slot as they are and the leader sums them (in local rank order, as the fp32 shm reduction sums) into
// `wide`. Chunk by chunk, on demand: the leader's ring asks for the elements it is about to send or reduce
// (`ensure`), so the host's reduction of one piece overlaps the network moving the previous ones. Every rank
// of the host runs the same chunks in the same order: segment h - 1, h - 2, ... of the ring's H segments (h
// the host's index), the order in which ring_allreduce_half first reads them; the others only stage theirs.
class HostPartials {
 public:
  HostPartials(Comm& c, const char* buf, size_t count, DType t, RedOp op, const OpDesc& d, const Deadline& dl,
               const Members& hosts)
      : c_(c), s_(*c.shm()), buf_(buf), t_(t), op_(op), d_(d), dl_(dl),
        wide_(s_.local_rank() == 0 ? count : 0), srcs_(size_t(s_.local_size())) {
    const int H = hosts.size();
    const size_t seg = (count + size_t(H) - 1) / size_t(H), per = s_.chunk_bytes() / 2;
    for (int i = 1; i <= H; ++i) {
      const size_t lo = std::min(count, seg * size_t(((hosts.me - i) % H + H) % H)), hi = std::min(count, lo + seg);
      for (size_t off = lo; off < hi; off += per) chunks_.push_back({off, std::min(per, hi - off)});
    }
    if (chunks_.empty()) chunks_.push_back({0, 0});  // (one step even when empty: every rank meets the others)
  }
  float* wide() { return wide_.data(); }
  // The first chunk, whose step compares every local rank's descriptor: run before the leader posts anything
  // to the network, so that a mismatch throws on every local rank with no receive left posted.
  void start() {
    if (next_ == 0) run(chunks_[next_++]);
  }
  // Elements [lo, lo + n) of the leader's partial sums are ready after this.
  void ensure(size_t lo, size_t n) {
    while (next_ < chunks_.size() && !covered(lo, n)) run(chunks_[next_++]);
  }
  void finish() {
    while (next_ < chunks_.size()) run(chunks_[next_++]);
  }

 private:
  struct Chunk {
    size_t off, n;
  };
  bool covered(size_t lo, size_t n) const {  // (the chunks of a segment run in order, so their ends suffice)
    size_t need = lo, end = lo + n;
    for (size_t i = 0; i < next_ && need < end; ++i)
      if (chunks_[i].off <= need && need < chunks_[i].off + chunks_[i].n) need = chunks_[i].off + chunks_[i].n;
    return need >= end;
  }
  void run(const Chunk& ch) {
    const int slot = shm_begin(c_, d_, dl_);
    copy_bytes(s_.slot(s_.local_rank(), slot), buf_ + ch.off * 2, ch.n * 2);
    shm_ready(c_, slot, d_, first_, dl_);
    first_ = false;
    if (s_.local_rank() == 0) {
      for (int r = 0; r < s_.local_size(); ++r) srcs_[size_t(r)] = s_.slot(r, slot);
      reduce_many_to_f32(wide_.data() + ch.off, srcs_.data(), s_.local_size(), ch.n, t_, op_);
    }
    shm_done(c_, slot);
  }
  Comm& c_;
  ShmProvider& s_;
  const char* buf_;
  DType t_;
  RedOp op_;
  const OpDesc& d_;
  const Deadline& dl_;
  std::vector<float> wide_;
  std::vector<const void*> srcs_;
  std::vector<Chunk> chunks_;
  size_t next_ = 0;
  bool first_ = true;
};

// fp16/bf16 across hosts with several ranks on this host. The host's terms reach the leader's fp32 partial
// sum through the staging slots as they are (half the bytes of widened terms, and no widening pass on any
// rank), chunk by chunk as the leaders' ring needs them (HostPartials); the ring sends those partial sums as
// fp32 on its first step (a sum of two or more terms) and the reduced segments, rounded, in its allgather;
// the result returns through the slots in the half type. The sums, their order and the one rounding are
// those of the buffer widened to fp32 and reduced by the fp32 path (the host's terms in local rank order,
// then the leaders' recursive doubling or ring), so the bits are the same; what crosses the network per
// leader is (H - 1) / H of the buffer as fp32 plus as much as the half type (3 bytes an element at 2 hosts,
// against 4 widened).
void hier_allreduce_half(Comm& c, char* buf, size_t count, DType t, RedOp op, uint64_t seq, const OpDesc& d,
                         const Deadline& dl) {
  const Members leaders = host_leaders(c);
  HostPartials host(c, buf, count, t, op, d, dl, leaders);
  host.start();
  const bool pow2 = (leaders.size() & (leaders.size() - 1)) == 0;
  if (c.shm()->local_rank() != 0 || (pow2 && count * sizeof(float) <= (64u << 10))) {
    host.finish();
    if (c.shm()->local_rank() == 0) {  // (p2p_allreduce's recursive doubling, on the fp32 sums)
      p2p_allreduce(c, leaders, reinterpret_cast<char*>(host.wide()), count, DType::f32, op, seq, d.check(), dl);
      from_f32(buf, host.wide(), count, t);
    }
  } else {
    ring_allreduce_half(c, leaders, nullptr, buf, nullptr, count, t, op, seq, d.check(), dl, host.wide(),
                        [&host](size_t lo, size_t n) { host.ensure(lo, n); });
    host.finish();
  }
  shm_bcast_from_leader(c, buf, count * 2, d, dl);
}

// Across hosts. With several ranks on this host: reduce inside the host over shared memory, allreduce
// among one leader per host over the network, broadcast back inside the host, so each byte crosses the
// network once per host instead of once per rank. fp16/bf16: with one rank per host every member's term
// travels as it is where it can (p2p_allreduce_half); with several, the host's partial sum travels as fp32
// and the result as the half type (hier_allreduce_half).
void multi_host_allreduce(Comm& c, char* buf, size_t count, DType t, RedOp op, uint64_t seq, const OpDesc& d,
                          const Deadline& dl) {
  ShmProvider* s = c.shm();
  const bool alone = s == nullptr || s->local_size() == 1;
  if (is_half(t)) {
    if (alone) return p2p_allreduce_half(c, Members::all(c), buf, count, t, op, seq, d.check(), dl);
    return hier_allreduce_half(c, buf, count, t, op, seq, d, dl);
  }
  if (alone) return p2p_allreduce(c, Members::all(c), buf, count, t, op, seq, d.check(), dl);
  shm_allreduce(c, buf, count, t, op, d, dl);
  if (s->local_rank() == 0) p2p_allreduce(c, host_leaders(c), buf, count, t, op, seq, d.check(), dl);
  shm_bcast_from_leader(c, buf, count * dtype_size(t), d, dl);
}

}  // namespace

void allreduce(Comm& c, void* buf, size_t count, DType t, RedOp op) {
  c.check_usable("allreduce");
  check_reducible(t, op, cat("mk allreduce (rank ", c.rank(), ")"));
  const OpDesc d{Kind::allreduce, t, op, count, -1};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  if (c.size() == 1) {
  } else if (c.all_local()) {
    shm_allreduce(c, static_cast<char*>(buf), count, t, op, d, dl);
  } else {
    multi_host_allreduce(c, static_cast<char*>(buf), count, t, op, seq, d, dl);
  }
  if (op == RedOp::avg) finish_avg(buf, count, t, c.size());
}

void reduce(Comm& c, void* buf, size_t count, DType t, RedOp op, int root) {
  c.check_usable("reduce");
  check_reducible(t, op, cat("mk reduce (rank ", c.rank(), ")"));
  if (root < 0 || root >= c.size())
    throw Error(cat("mk reduce: rank ", c.rank(), ": invalid root ", root, " (group size ", c.size(), ")"));
  const OpDesc d{Kind::reduce, t, op, count, root};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  const size_t bytes = count * dtype_size(t);
  std::vector<char> scratch;
  char* work = static_cast<char*>(buf);
  if (c.rank() != root) {  // leave non-root buffers untouched
    scratch.assign(work, work + bytes);
    work = scratch.data();
  }
  if (c.size() > 1) {
    if (c.all_local()) {
      shm_allreduce(c, work, count, t, op, d, dl);
    } else {
      multi_host_allreduce(c, work, count, t, op, seq, d, dl);
    }
  }
  if (c.rank() == root && op == RedOp::avg) finish_avg(buf, count, t, c.size());
}

void reduce_scatter(Comm& c, const void* in, void* out, size_t count, DType t, RedOp op) {
  c.check_usable("reduce_scatter");
  check_reducible(t, op, cat("mk reduce_scatter (rank ", c.rank(), ")"));
  const OpDesc d{Kind::reduce_scatter, t, op, count, -1};
  const uint64_t seq = c.next_seq();
  const Deadline dl = c.deadline();
  const int R = c.size(), me = c.rank();
  const size_t es = dtype_size(t);
  const char* src = static_cast<const char*>(in);
  char* dst = static_cast<char*>(out);
  if (R == 1) {
    copy_bytes(dst, src, count * es);
  } else if (c.all_local()) {
    shm_reduce_scatter_with(c, dst, count, t, op, d, dl, 0, [&](char* slot, size_t off, size_t n) {
      for (int r = 0; r < R; ++r) copy_bytes(slot + size_t(r) * n * es, src + (size_t(r) * count + off) * es, n * es);
    });
  } else if (is_half(t)) {  // (every member's term, sent as it is on the first step; summed in fp32)
    ring_allreduce_half(c, Members::all(c), src, nullptr, dst, count * size_t(R), t, op, seq, d.check(), dl);
  } else {
    // The ring leaves segment `me` reduced; segments are exactly the blocks when count*R splits evenly.
    std::vector<char> work(src, src + count * size_t(R) * es);
    ring_allreduce(c, Members::all(c), work.data(), count * size_t(R), t, op, seq, d.check(), dl, false);
    copy_bytes(dst, work.data() + size_t(me) * count * es, count * es);
  }
  if (op == RedOp::avg) finish_avg(out, count, t, R);
}

size_t shm_rows_per_chunk(const Comm& c, size_t row_bytes, size_t pieces) {
  if (c.size() < 2 || !c.all_local() || row_bytes == 0 || pieces == 0) return 0;
  return c.shm()->chunk_bytes() / (row_bytes * pieces);
}

void shm_allreduce_rows(Comm& c, void* out, size_t rows, size_t row_elems, DType t, size_t rows_per_chunk,
                        const std::function<void(char* dst, size_t row, size_t nrows)>& fill) {
  c.check_usable("allreduce");
  check_reducible(t, RedOp::sum, cat("mk allreduce (rank ", c.rank(), ")"));
  check_rows(c, "allreduce", row_elems * dtype_size(t), 1, rows_per_chunk);
  const size_t count = rows * row_elems;
  const OpDesc d{Kind::allreduce, t, RedOp::sum, count, -1};
  c.next_seq();
  ShmProvider& s = *c.shm();
  shm_allreduce_with(c, static_cast<char*>(out), count, t, RedOp::sum, d, c.deadline(), rows_per_chunk * row_elems,
                     [&](int slot, size_t off, size_t n) {
                       fill(s.slot(s.local_rank(), slot), off / row_elems, n / row_elems);
                     });
}

void shm_reduce_scatter_rows(Comm& c, void* out, size_t rows, size_t row_elems, DType t, size_t rows_per_chunk,
                             const std::function<void(char* dst, size_t row, size_t nrows)>& fill) {
  c.check_usable("reduce_scatter");
  check_reducible(t, RedOp::sum, cat("mk reduce_scatter (rank ", c.rank(), ")"));
  check_rows(c, "reduce_scatter", row_elems * dtype_size(t), size_t(c.size()), rows_per_chunk);
  const size_t count = rows * row_elems;
  const OpDesc d{Kind::reduce_scatter, t, RedOp::sum, count, -1};
  c.next_seq();
  shm_reduce_scatter_with(c, static_cast<char*>(out), count, t, RedOp::sum, d, c.deadline(),
                          rows_per_chunk * row_elems, [&](char* slot, size_t off, size_t n) {
                            fill(slot, off / row_elems, n / row_elems);
                          });
}

}  // namespace mk::coll
