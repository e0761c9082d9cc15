// mk::moe_dispatch_gemm and mk::moe_combine: expert-parallel mixture-of-experts layers.
//
// Experts. E = R·E_r experts; rank r owns the contiguous block [r·E_r, (r+1)·E_r) and holds their weights
// w [E_r, h, f].
//
// Dispatch. Every (token i, choice j) of this rank goes only to the rank that owns expert topk_ids[i, j].
// The sender orders its rows by (global expert, token, choice) (a stable sort of the flattened ids), so the
// rows for one destination are contiguous and already grouped by that destination's local expert. The
// ranks first agree on shapes and exchange their per-expert counts (two small all_gathers), so every rank
// knows every pair's row count; then exactly the routed rows move (nothing where the count is 0):
//   mk      uneven point-to-point transfers straight to the transport, in pieces of ~512 KiB;
//   other   (gloo; nccl on CUDA) the backend's alltoall_base with uneven splits, in P steps (P from the
//           gathered counts, the same on every rank; pieces of ~4 MiB on CPU, ~512 KiB on accelerators),
//           step j carrying piece j of every pair.
// As rows arrive (this rank's own block first, then the others), each per-expert segment is multiplied by
// that expert's weight (fp32 accumulation) straight into its place in the output, so the products of one
// piece overlap the transfers of the next.
// Small calls (pipeline.h's CarryLimit: mk with a peer across hosts, or another backend on CPU; at most 64 KiB
// sent to any one peer) carry their counts and routed rows inside the agreement's messages (to each rank its own
// rows, after the counts), so the whole dispatch is one exchange; combine carries the rows going back the same
// way. On 2 namespace hosts at 1 Gbit/s this took dispatch from 1.08x/0.96x of unfused to 1.88x/1.52x and
// combine from 0.72x to 1.03x/0.97x over mk; over Gloo 1.58x/1.54x and 0.91x/0.88x, combine 1.14-1.20x since
// its weighted sum reads the rows in place (bench/README.md).
//
// Output order of y [n_recv, f]: by local expert, then source rank, then token index, then choice.
//
// Handle (int64, 1-d), everything combine needs to send the rows back and weight them:
//   [0] kMagic  [1] R  [2] rank  [3] E_r  [4] t  [5] k  [6] n_recv  [7] h
//   [8, 8 + R·E_r)                  recv counts: rows from source s for local expert e, at 8 + s·E_r + e
//   [8 + R·E_r, 8 + 2·R·E_r)        send counts: rows this rank sent to each global expert
//   [8 + 2·R·E_r, 8 + 2·R·E_r + t·k) send order: token·k + choice of each row sent, in sending order
//
// Combine. The reverse exchange (mk: one point-to-point message per (peer, expert segment) straight from y;
// other backends: one alltoall_base): each rank returns to every source its rows (segments (e, s) for every
// local expert e, which is the order the source sent them in), and the home rank receives them in place, in
// its sending order. Then the rows are weighted by topk_weights and summed over k in a fixed order (fp32),
// whatever order the blocks arrived in: on CPU in one pass that reads each row where it is
// (weighted_sum_on_host), elsewhere by one gather into (token, choice) order and one batched product
// [t, 1, k] x [t, k, f]. (Weighting each block as it arrives cost more than it overlapped: a gather, a
// temporary product and a scatter per block, 4-5x the time of the batched form at t=2048, f=1024.)
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/argsort.h>
#include <ATen/ops/bincount.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/scatter.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "kernels/group.h"
#include "kernels/pipeline.h"
#include "transport/copy.h"

namespace mk::kernels {
namespace {

constexpr int64_t kMagic = 0x6d6b6d6f65;  // "mkmoe"
constexpr int64_t kHeader = 8;
constexpr int64_t kPieceBytes = int64_t(512) << 10;  // dispatch transfers rows in pieces of about this size
// ... except through a CPU backend's alltoall_base (gloo), whose every call costs 0.1-0.3 ms on this 2-core VM
// and whose transfers take the cores the products need: 2 ranks, fused/unfused 0.82-0.94x with 512 KiB steps,
// 0.92-1.11x with 4 MiB steps (same-script A/B, two rounds of three shapes).
constexpr int64_t kCpuStepBytes = int64_t(4) << 20;

bool float_type(at::ScalarType t) { return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf; }

at::Tensor longs(const std::vector<int64_t>& v, const c10::Device& device = c10::Device(c10::kCPU)) {
  return at::tensor(v, at::TensorOptions().dtype(at::kLong)).to(device);
}

// Non-mk backends (gloo; nccl on CUDA) move the rows with the backend's alltoall_base with uneven splits:
// one collective per pipeline step that every rank issues in the same order, so it is correct on NCCL by
// construction (no unbatched point-to-point that NCCL would serialise on one stream). A backend without
// alltoall_base fails on every rank with an error naming it.
//
// One such step: rows of dim 0, uneven splits per peer (0 for this rank itself; its own rows never move).
Pending alltoall_step(Pipeline& p, const at::Tensor& in, const at::Tensor& out, std::vector<int64_t> out_splits,
                      std::vector<int64_t> in_splits) {
  const Group& g = p.group();
  try {
    return p.alltoall(in, out, std::move(out_splits), std::move(in_splits));
  } catch (const c10::DistBackendError&) {
    throw;
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mk ", p.op(), ": rank ", g.rank, ": the ", g.backend_name(), " backend cannot run "
                "alltoall_base with uneven splits on ", g.device, ", which this op needs on non-mk backends: ",
                e.what_without_backtrace());
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_dispatch_gemm(const at::Tensor& x, const at::Tensor& topk_ids,
                                                                 const at::Tensor& w, c10::string_view group_name) {
  const char* op = "moe_dispatch_gemm";
  const Group g = resolve_group(std::string(group_name), x.device(), op);
  Pipeline p(g, op);
  const int R = p.size(), me = p.rank();

  std::string problem;
  if (x.dim() != 2 || topk_ids.dim() != 2 || w.dim() != 3)
    problem = c10::str("expected x [t, h], topk_ids [t, k], w [E_r, h, f]; got ", x.sizes(), ", ", topk_ids.sizes(),
                       ", ", w.sizes());
  else if (x.size(0) != topk_ids.size(0))
    problem = c10::str("x has ", x.size(0), " tokens but topk_ids has ", topk_ids.size(0), " rows");
  else if (x.size(1) != w.size(1))
    problem = c10::str("x hidden size ", x.size(1), " differs from w's ", w.size(1), " (w is [E_r, h, f])");
  else if (!float_type(x.scalar_type()) || x.scalar_type() != w.scalar_type())
    problem = c10::str("x and w must share a dtype among float32, bfloat16, float16; got ", x.scalar_type(), " and ",
                       w.scalar_type());
  else if (topk_ids.scalar_type() != at::kLong && topk_ids.scalar_type() != at::kInt)
    problem = c10::str("topk_ids must be int64 or int32, got ", topk_ids.scalar_type());
  else if (w.size(0) == 0)
    problem = "this rank owns no experts (w has E_r = 0)";
  at::Tensor ids;
  const int64_t E = problem.empty() ? w.size(0) * R : 0;
  if (problem.empty()) {
    ids = topk_ids.reshape({-1}).to(at::kLong);
    if (ids.numel()) {
      const int64_t lo = ids.min().item<int64_t>(), hi = ids.max().item<int64_t>();
      if (lo < 0 || hi >= E) {
        problem = c10::str("expert id ", lo < 0 ? lo : hi, " is out of range [0, ", E, ") (", R, " ranks x ", w.size(0),
                           " experts each)");
      }
    }
  }
  const CarryLimit cl = carry_limit(p, CarryTotal::every_peer);
  if (problem.empty()) problem = cl.problem;
  const bool ok = problem.empty();

  // Route: rows in (global expert, token, choice) order, and how many go to each expert.
  at::Tensor perm, counts, routed;
  int64_t K = 0, Er = 0, h = 0;
  if (ok) {
    K = topk_ids.size(1), Er = w.size(0), h = x.size(1);
    perm = at::argsort(ids, /*stable=*/true);
    counts = at::bincount(ids, {}, E);
    routed = x.index_select(0, perm.div(K, "floor"));  // [t·K, h], contiguous
  }
  const int64_t row_bytes = std::max<int64_t>(1, h * x.element_size());  // (>= 1: pieces are counted in rows)
  const int64_t row_size = h * x.element_size();                          // what a carried row takes
  const int64_t header = E * int64_t(sizeof(int64_t));  // a carried message starts with the sender's counts

  // Small calls carry the counts and the routed rows inside the agreement: to each rank its rows (sizes per
  // pair), after the counts.
  std::vector<int> others;
  for (int i = 1; i < R; ++i) others.push_back((me + i) % R);
  Carried carried;
  at::Tensor outbox;
  std::vector<int64_t> out_at(size_t(R), 0), rows_to(size_t(R), 0), row_at(size_t(R), 0);
  int64_t largest = -1, sum = 0;  // what this rank would carry: the most to one peer, and to all (-1: not asked)
  if (ok && x.device().is_cpu() && cl.may_carry) {
    const int64_t* cnt = counts.data_ptr<int64_t>();
    for (int d = 0; d < R; ++d)
      for (int64_t e = 0; e < Er; ++e) rows_to[size_t(d)] += cnt[d * Er + e];
    for (int d = 1; d < R; ++d) row_at[size_t(d)] = row_at[size_t(d - 1)] + rows_to[size_t(d - 1)];
    largest = 0;
    for (int d : others) {
      largest = std::max(largest, header + rows_to[size_t(d)] * row_size);
      sum += header + rows_to[size_t(d)] * row_size;
    }
    if (cl.fits_routed(largest, sum)) {
      outbox = at::empty({sum}, x.options().dtype(at::kByte));
      auto* base = static_cast<char*>(outbox.data_ptr());
      const auto* rows = static_cast<const char*>(routed.data_ptr());
      int64_t at_byte = 0;
      for (int d : others) {
        out_at[size_t(d)] = at_byte;
        std::memcpy(base + at_byte, cnt, size_t(header));
        at_byte += header;
        const size_t n = size_t(rows_to[size_t(d)] * row_size);
        if (n) copy_bytes(base + at_byte, rows + row_at[size_t(d)] * row_size, n);
        at_byte += int64_t(n);
      }
      carried.bytes = size_t(largest);
      carried.data = [base, &out_at](int q) { return base + out_at[size_t(q)]; };
      carried.size = [&rows_to, header, row_size](int q) { return size_t(header + rows_to[size_t(q)] * row_size); };
    }
  }
  Agreement agreement =
      p.start_agree({{"experts per rank (w.size(0))", ok ? w.size(0) : -1}, {"hidden size", ok ? x.size(1) : -1},
                     {"expert output size (w.size(2))", ok ? w.size(2) : -1}, {"dtype", dtype_code(x.scalar_type())}},
                    problem, std::move(carried));
  agreement.result();

  const int64_t t = x.size(0), f = w.size(2);
  const at::Tensor C = at::empty({R, E}, counts.options());  // [R, E]: rows rank s sends to expert e
  // Where rank q's rows for this rank start in its carried message (after q's counts).
  std::vector<const char*> carried_rows(size_t(R), nullptr);
  if (agreement.carried()) {
    C[me].copy_(counts);
    for (int q : others) {
      const auto* msg = static_cast<const char*>(agreement.carried_from(q));
      const size_t got = agreement.carried_bytes(q);
      TORCH_CHECK(got >= size_t(header), "mk ", op, ": rank ", me, ": rank ", q, " carried ", got,
                  " bytes in the argument agreement, fewer than its ", E, " expert counts");
      std::memcpy(C[q].data_ptr(), msg, size_t(header));
      const auto* cq = reinterpret_cast<const int64_t*>(msg);  // (the message buffer is 8-byte aligned)
      int64_t mine_rows = 0;  // the rows q's counts send here
      for (int64_t e = 0; e < Er; ++e) {
        TORCH_CHECK(cq[me * Er + e] >= 0, "mk ", op, ": rank ", me, ": rank ", q, " carried a negative expert count");
        mine_rows += cq[me * Er + e];
      }
      TORCH_CHECK(size_t(header + mine_rows * row_size) <= got, "mk ", op, ": rank ", me, ": rank ", q, " carried ",
                  got, " bytes in the argument agreement, too few for the ", mine_rows, " rows its counts send here");
      carried_rows[size_t(q)] = msg + header;
    }
  } else {
    p.allgather(counts, C.view({-1})).wait();  // flat: Gloo splits the output like the input
  }
  p.trace("t=", t, " k=", K, " E_r=", Er, " h=", h, " f=", f, " ", x.scalar_type(),
          largest >= 0 ? c10::str(" sends ", largest, "/", sum) : "", agreement.carried() ? " carried" : "");
  const at::Tensor Chost = C.to(at::kCPU);   // on an accelerator: after the gather (stream-ordered copy)
  const auto Ca = Chost.accessor<int64_t, 2>();
  auto from = [&](int s, int64_t e) { return Ca[s][me * Er + e]; };  // rows from s for my expert e

  std::vector<int64_t> n_from(size_t(R), 0), n_to(size_t(R), 0), off_to(size_t(R), 0), col(size_t(Er), 0);
  for (int s = 0; s < R; ++s)
    for (int64_t e = 0; e < Er; ++e) {
      n_from[size_t(s)] += from(s, e);
      col[size_t(e)] += from(s, e);
      n_to[size_t(s)] += Ca[me][s * Er + e];
    }
  for (int d = 1; d < R; ++d) off_to[size_t(d)] = off_to[size_t(d - 1)] + n_to[size_t(d - 1)];
  int64_t n_recv = 0;
  for (int64_t c : col) n_recv += c;

  // Where the rows from source s for local expert e start in y (ordered by local expert, then source).
  std::vector<std::vector<int64_t>> seg(size_t(R), std::vector<int64_t>(size_t(Er), 0));
  for (int64_t e = 0, base = 0; e < Er; base += col[size_t(e)], ++e)
    for (int s = 0, at_row = base; s < R; at_row += from(s, e), ++s) seg[size_t(s)][size_t(e)] = at_row;

  // Multiply rows of source s for expert e (starting at `offset` among them) into their place in y.
  at::Tensor y = at::empty({n_recv, f}, x.options());
  // Half types are multiplied as they are where ATen's GEMM is fast on them (accumulating in fp32), else on
  // operands widened to fp32 (see native_half_gemm: fp16 on a CPU without oneDNN support is a plain loop).
  // When even a GEMM of every row received is small (small_half_gemm), a half type made as it is is made
  // widened and rounded instead: the same type and accumulation, without oneDNN's fixed cost per GEMM.
  const bool native = x.scalar_type() == at::kFloat ||
                      (native_half_gemm(x.scalar_type(), x.device()) &&
                       !small_half_gemm(x.scalar_type(), n_recv, h, f));
  // (widened expert by expert as first used: with few rows per expert, widening all of w would cost more
  // than the GEMMs; multiply runs on this thread only)
  const at::Tensor wk = native ? w.contiguous() : at::Tensor();
  std::vector<at::Tensor> wide(native ? 0 : size_t(Er));
  auto multiply = [&](int s, int64_t e, int64_t offset, const at::Tensor& rows) {
    if (rows.size(0) == 0) return;
    at::Tensor out = y.narrow(0, seg[size_t(s)][size_t(e)] + offset, rows.size(0));
    if (native) {
      at::mm_out(out, rows, wk[e]);
      return;
    }
    at::Tensor& we = wide[size_t(e)];
    if (!we.defined()) we = w[e].to(at::kFloat);
    out.copy_(at::mm(rows.to(at::kFloat), we));
  };
  // Rows [begin, end) of source s's block (sender order: grouped by this rank's local experts) that arrived
  // in `rows`: each expert's part of them is multiplied into its place.
  auto multiply_block = [&](int s, int64_t begin, int64_t end, const at::Tensor& rows) {
    for (int64_t e = 0, first = 0; e < Er && first < end; first += from(s, e), ++e) {
      const int64_t lo = std::max(begin, first), hi = std::min(end, first + from(s, e));
      if (lo < hi) multiply(s, e, lo - first, rows.narrow(0, lo - begin, hi - lo));
    }
  };

  std::vector<int64_t> off_from(size_t(R), 0);
  int64_t remote_rows = 0;
  for (int s = 0; s < R; ++s)
    if (s != me) {
      off_from[size_t(s)] = remote_rows;
      remote_rows += n_from[size_t(s)];
    }
  if (agreement.carried()) {
    // Every rank's rows for this one came along: our own first, then each source's from its message.
    multiply_block(me, 0, n_from[size_t(me)], routed.narrow(0, off_to[size_t(me)], n_from[size_t(me)]));
    for (int s : others)
      if (n_from[size_t(s)])
        multiply_block(s, 0, n_from[size_t(s)],
                       at::from_blob(const_cast<char*>(carried_rows[size_t(s)]), {n_from[size_t(s)], h}, x.options()));
  } else if (!g.is_mk()) {
    // The backend's alltoall_base, in P steps that every rank derives from the gathered counts (so every
    // rank issues the same collectives in the same order): step j moves piece j (chunk_range of P) of every
    // pair's rows. All steps are issued up front; the product of step j's rows overlaps steps j+1.. .
    int64_t max_pair = 0, moved = 0;
    for (int s = 0; s < R; ++s)
      for (int d = 0; d < R; ++d) {
        if (s == d) continue;
        int64_t n = 0;
        for (int64_t e = 0; e < Er; ++e) n += Ca[s][d * Er + e];
        max_pair = std::max(max_pair, n);
        moved += n;
      }
    const int64_t piece = g.device.is_cpu() ? kCpuStepBytes : kPieceBytes;
    const int64_t P = std::clamp<int64_t>((max_pair * row_bytes + piece - 1) / piece, 1,
                                          std::min<int64_t>(16, std::max<int64_t>(1, max_pair)));
    p.trace("alltoall_base path: ", moved, " rows cross ranks in ", moved ? P : 0, " steps");
    // Send buffer in (step, destination) order, gathered from routed in one index_select; the receive buffer
    // in (step, source) order.
    std::vector<int64_t> order;
    order.reserve(size_t(std::max<int64_t>(0, t * K - n_to[size_t(me)])));
    std::vector<std::vector<int64_t>> in_splits(size_t(P), std::vector<int64_t>(size_t(R), 0)),
        out_splits(size_t(P), std::vector<int64_t>(size_t(R), 0)), src_off(size_t(P), std::vector<int64_t>(size_t(R), 0));
    std::vector<int64_t> in_off(size_t(P) + 1, 0), out_off(size_t(P) + 1, 0);
    for (int64_t j = 0; j < P; ++j) {
      int64_t sent = 0, got = 0;
      for (int d = 0; d < R; ++d) {
        if (d == me) continue;
        auto [b, e] = chunk_range(n_to[size_t(d)], P, j);
        in_splits[size_t(j)][size_t(d)] = e - b;
        for (int64_t r = b; r < e; ++r) order.push_back(off_to[size_t(d)] + r);
        sent += e - b;
        auto [bs, es] = chunk_range(n_from[size_t(d)], P, j);
        out_splits[size_t(j)][size_t(d)] = es - bs;
        src_off[size_t(j)][size_t(d)] = got;
        got += es - bs;
      }
      in_off[size_t(j) + 1] = in_off[size_t(j)] + sent;
      out_off[size_t(j) + 1] = out_off[size_t(j)] + got;
    }
    std::vector<Pending> steps;
    at::Tensor inbox = at::empty({remote_rows, h}, x.options());
    if (moved > 0) {
      const at::Tensor outbox = routed.index_select(0, longs(order, x.device()));
      p.publish(outbox);
      for (int64_t j = 0; j < P; ++j)
        steps.push_back(alltoall_step(p, outbox.narrow(0, in_off[size_t(j)], in_off[size_t(j) + 1] - in_off[size_t(j)]),
                                      inbox.narrow(0, out_off[size_t(j)], out_off[size_t(j) + 1] - out_off[size_t(j)]),
                                      out_splits[size_t(j)], in_splits[size_t(j)]));
    }
    multiply_block(me, 0, n_from[size_t(me)], routed.narrow(0, off_to[size_t(me)], n_from[size_t(me)]));
    for (int64_t j = 0; j < int64_t(steps.size()); ++j) {
      steps[size_t(j)].wait();
      for (int s = 0; s < R; ++s) {
        if (s == me) continue;
        auto [b, e] = chunk_range(n_from[size_t(s)], P, j);
        if (e > b) multiply_block(s, b, e, inbox.narrow(0, out_off[size_t(j)] + src_off[size_t(j)][size_t(s)], e - b));
      }
    }
  } else {
    // mk: straight to the transport, in pieces of about kPieceBytes that never straddle two experts, so the
    // product of one piece overlaps the transfer of the next: receives into one buffer (a region per
    // source), then the sends of our routed rows. Both sides enumerate a pair's pieces the same way (expert
    // by expert, from the agreed counts and hidden size), so piece j travels in message slot j.
    auto piece_rows = [&](int64_t pair_rows) {
      return std::max<int64_t>({1, kPieceBytes / row_bytes, (pair_rows >> 19) + 1});  // slots stay < 2^20
    };
    at::Tensor inbox = at::empty({remote_rows, h}, x.options());
    struct Piece {
      int64_t expert, row, rows, offset;  // rows [row, row + rows) of the source's block: expert's rows from offset
      Pending pending;
    };
    std::vector<std::vector<Piece>> incoming(static_cast<size_t>(R));
    std::vector<Pending> outgoing;
    for (int i = 1; i < R; ++i) {
      const int s = (me - i + R) % R;
      const int64_t step = piece_rows(n_from[size_t(s)]);
      uint32_t slot = 0;
      for (int64_t e = 0, row = 0; e < Er; row += from(s, e), ++e)
        for (int64_t o = 0; o < from(s, e); o += step) {
          const int64_t m = std::min(step, from(s, e) - o);
          incoming[size_t(s)].push_back(
              {e, row + o, m, o, p.recv(inbox.narrow(0, off_from[size_t(s)] + row + o, m), s, slot++)});
        }
    }
    for (int i = 1; i < R; ++i) {
      const int d = (me + i) % R;
      const int64_t step = piece_rows(n_to[size_t(d)]);
      uint32_t slot = 0;
      for (int64_t e = 0, row = 0; e < Er; row += Ca[me][d * Er + e], ++e)
        for (int64_t o = 0; o < Ca[me][d * Er + e]; o += step) {
          const int64_t m = std::min(step, Ca[me][d * Er + e] - o);
          outgoing.push_back(p.send(routed.narrow(0, off_to[size_t(d)] + row + o, m), d, slot++));
        }
    }
    // Our own rows first (no transfer), then every piece as it arrives, nearest sources first.
    multiply_block(me, 0, n_from[size_t(me)], routed.narrow(0, off_to[size_t(me)], n_from[size_t(me)]));
    for (int i = 1; i < R; ++i) {
      const int s = (me - i + R) % R;
      for (Piece& pc : incoming[size_t(s)]) {
        pc.pending.wait();
        multiply(s, pc.expert, pc.offset, inbox.narrow(0, off_from[size_t(s)] + pc.row, pc.rows));
      }
    }
    for (auto& o : outgoing) o.wait();
  }

  std::vector<int64_t> head = {kMagic, R, me, Er, t, K, n_recv, h};
  at::Tensor handle = at::cat({longs(head, x.device()), C.narrow(1, me * Er, Er).reshape({-1}), counts, perm});
  return {y, longs(col, x.device()), handle};
}

// The routing a handle describes (after checking it belongs to this group and rank).
struct Routing {
  int64_t R, Er, t, K, n_recv;
  at::Tensor recv_counts;  // [R, E_r]
  at::Tensor sent;         // [R·E_r]
  at::Tensor perm;         // [t·K]
  std::vector<int64_t> row_of;  // its inverse: where (token·K + choice) is in the sending order
};

std::string parse_handle(const at::Tensor& handle, int R, int me, Routing& out) {
  if (handle.dim() != 1 || handle.scalar_type() != at::kLong || handle.numel() < kHeader)
    return c10::str("handle must be the int64 routing tensor moe_dispatch_gemm returned; got ", handle.scalar_type(),
                    " ", handle.sizes());
  const at::Tensor hd = handle.to(at::kCPU).contiguous();  // read on the host (a copy on an accelerator)
  const int64_t* p = hd.data_ptr<int64_t>();
  if (p[0] != kMagic) return "handle is not a moe_dispatch_gemm routing handle";
  if (p[1] != R || p[2] != me)
    return c10::str("handle was made by rank ", p[2], " of a group of ", p[1], ", not rank ", me, " of ", R);
  out.R = p[1];
  out.Er = p[3];
  out.t = p[4];
  out.K = p[5];
  out.n_recv = p[6];
  if (out.Er < 0 || out.t < 0 || out.K < 0 || out.n_recv < 0 ||
      handle.numel() != kHeader + 2 * out.R * out.Er + out.t * out.K)
    return "handle has the wrong length";
  // The combine reads and writes rows at the offsets these counts give (raw copies on CPU): they must add up to
  // the row counts, and the send order must be a permutation.
  int64_t received = 0, sent = 0;
  for (int64_t i = 0; i < out.R * out.Er; ++i) {
    const int64_t r = p[kHeader + i], s = p[kHeader + out.R * out.Er + i];
    if (r < 0 || s < 0) return c10::str("handle has a negative row count (entry ", i, ")");
    received += r;
    sent += s;
  }
  if (received != out.n_recv || sent != out.t * out.K)
    return c10::str("handle's counts add up to ", received, " rows received and ", sent, " sent, not ", out.n_recv,
                    " and t·k = ", out.t * out.K, "; was it modified?");
  const int64_t n = out.t * out.K;
  const int64_t* order = p + kHeader + 2 * out.R * out.Er;
  out.row_of.assign(size_t(n), -1);
  for (int64_t j = 0; j < n; ++j) {
    const int64_t pair = order[j];
    if (pair < 0 || pair >= n || out.row_of[size_t(pair)] >= 0)
      return c10::str("handle's send order is not a permutation of the ", n, " (token, choice) pairs (entry ", j,
                      " is ", pair, "); was it modified?");
    out.row_of[size_t(pair)] = j;
  }
  out.recv_counts = hd.narrow(0, kHeader, out.R * out.Er).view({out.R, out.Er});
  out.sent = hd.narrow(0, kHeader + out.R * out.Er, out.R * out.Er);
  out.perm = hd.narrow(0, kHeader + 2 * out.R * out.Er, n);
  return "";
}

// Rows [first, first + n) of a rank's sending order, contiguous at `base`.
struct RowRegion {
  const char* base;
  int64_t first, n;
};

// The weighted sum over the k choices on CPU, read where the rows are: out[i] = sum over c in 0..K-1, in that
// order, of topk_weights[i, c] · row of (token i, choice c), accumulated in fp32 and rounded once. row_at[j] is
// row j of this rank's sending order, whose (token, choice) is perm[j]. One pass over the rows, no gathered
// copy: the ATen form (index_select into token order, then a batched [t, 1, k] x [t, k, f] product) made the
// same sum with 8 more operator calls and two more passes over the data (bench/README.md: moe_combine).
template <typename T>
void weigh_rows(const std::vector<const char*>& row_at, const std::vector<int64_t>& row_of, const float* w,
                int64_t t, int64_t K, int64_t f, T* out) {
  const int64_t grain = std::max<int64_t>(1, (int64_t(1) << 15) / std::max<int64_t>(1, K * f));
  at::parallel_for(0, t, grain, [&](int64_t lo, int64_t hi) {
    std::vector<float> acc(static_cast<size_t>(f));
    for (int64_t i = lo; i < hi; ++i) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t c = 0; c < K; ++c) {
        const T* row = reinterpret_cast<const T*>(row_at[size_t(row_of[size_t(i * K + c)])]);
        const float wc = w[i * K + c];
        for (int64_t x = 0; x < f; ++x) acc[size_t(x)] += wc * static_cast<float>(row[x]);
      }
      T* o = out + i * f;
      for (int64_t x = 0; x < f; ++x) o[x] = static_cast<T>(acc[size_t(x)]);
    }
  });
}

// `regions` cover the t·K rows of the sending order (a later region wins where two overlap).
at::Tensor weighted_sum_on_host(const std::vector<RowRegion>& regions, const std::vector<int64_t>& row_of,
                                const at::Tensor& topk_weights, int64_t t, int64_t K, int64_t f, at::ScalarType dtype,
                                const char* op, int me) {
  const int64_t n = t * K;
  // fp16 is widened region by region first, and the sum rounded back at the end, by ATen's vectorised
  // conversions: c10::Half's scalar ones made the pass 1.4-2.2x slower than the ATen form (bfloat16's, a
  // shift, cost nothing measurable).
  const bool widen = dtype == at::kHalf;
  const int64_t row_bytes = f * int64_t(widen ? sizeof(float) : c10::elementSize(dtype));
  at::Tensor widened = widen ? at::empty({n, f}, at::TensorOptions().dtype(at::kFloat)) : at::Tensor();
  std::vector<const char*> row_at(size_t(n), nullptr);
  for (const RowRegion& r : regions) {
    if (r.n == 0) continue;
    TORCH_CHECK(r.first >= 0 && r.n > 0 && r.first + r.n <= n, "mk ", op, ": rank ", me, ": internal error: rows [",
                r.first, ", ", r.first + r.n, ") outside the ", n, " of the sending order");
    const char* base = r.base;
    if (widen) {
      at::Tensor dst = widened.narrow(0, r.first, r.n);
      dst.copy_(at::from_blob(const_cast<char*>(r.base), {r.n, f}, at::TensorOptions().dtype(at::kHalf)));
      base = static_cast<const char*>(dst.data_ptr());
    }
    for (int64_t i = 0; i < r.n; ++i) row_at[size_t(r.first + i)] = base + i * row_bytes;
  }
  for (int64_t j = 0; j < n && f > 0; ++j)  // (rows of no columns have no address)
    TORCH_CHECK(row_at[size_t(j)], "mk ", op, ": rank ", me, ": internal error: row ", j, " of ", n, " has no source");
  const at::Tensor w = topk_weights.to(at::kCPU, at::kFloat).contiguous();
  at::Tensor out = at::empty({t, f}, at::TensorOptions().dtype(widen ? at::kFloat : dtype));
  if (dtype == at::kBFloat16) {
    weigh_rows(row_at, row_of, w.data_ptr<float>(), t, K, f, out.data_ptr<c10::BFloat16>());
  } else {
    weigh_rows(row_at, row_of, w.data_ptr<float>(), t, K, f, out.data_ptr<float>());
  }
  return widen ? out.to(dtype) : out;
}

at::Tensor moe_combine(const at::Tensor& y, const at::Tensor& handle, const at::Tensor& topk_weights,
                       c10::string_view group_name) {
  const char* op = "moe_combine";
  const Group g = resolve_group(std::string(group_name), y.device(), op);
  Pipeline p(g, op);
  const int R = p.size(), me = p.rank();
  Routing rt{};
  std::string problem = parse_handle(handle, R, me, rt);
  if (problem.empty()) {
    if (y.dim() != 2 || y.size(0) != rt.n_recv)
      problem = c10::str("y must be [n_recv = ", rt.n_recv, ", f] as moe_dispatch_gemm returned it; got ", y.sizes());
    else if (!float_type(y.scalar_type()))
      problem = c10::str("y must be float32, bfloat16 or float16, got ", y.scalar_type());
    else if (topk_weights.dim() != 2 || topk_weights.size(0) != rt.t || topk_weights.size(1) != rt.K)
      problem = c10::str("topk_weights must be [t, k] = [", rt.t, ", ", rt.K, "] like the topk_ids of the dispatch; got ",
                         topk_weights.sizes());
    else if (!topk_weights.is_floating_point())
      problem = c10::str("topk_weights must be floating point, got ", topk_weights.scalar_type());
  }
  const CarryLimit cl = carry_limit(p, CarryTotal::every_peer);
  if (problem.empty()) problem = cl.problem;
  const bool ok = problem.empty();

  // The plan, from the handle alone (nothing in it when the arguments are wrong: the agreement then raises).
  const int64_t Er = ok ? rt.Er : 0, f = ok ? y.size(1) : 0, t = ok ? rt.t : 0, K = ok ? rt.K : 0;
  std::vector<int64_t> n_back(size_t(R), 0), n_home(size_t(R), 0), off_home(size_t(R), 0), col(size_t(Er), 0);
  const int64_t* rc = ok ? rt.recv_counts.data_ptr<int64_t>() : nullptr;  // [R, E_r]
  const int64_t* sent = ok ? rt.sent.data_ptr<int64_t>() : nullptr;       // [R·E_r]
  for (int s = 0; s < R; ++s)
    for (int64_t e = 0; e < Er; ++e) {
      n_back[size_t(s)] += rc[s * Er + e];
      col[size_t(e)] += rc[s * Er + e];
      n_home[size_t(s)] += sent[s * Er + e];
    }
  for (int d = 1; d < R; ++d) off_home[size_t(d)] = off_home[size_t(d - 1)] + n_home[size_t(d - 1)];
  const at::Tensor yc = ok ? y.contiguous() : y;  // sent in segments straight from it
  const int64_t row_bytes = f * (ok ? y.element_size() : 0);

  // Segments of y, per (source s, local expert e): where they start in y (ordered by expert, then source),
  // and where the rows this rank sent to d's expert e start in `home`.
  auto y_start = [&](int s, int64_t e) {
    int64_t start = 0;
    for (int64_t e2 = 0; e2 < e; ++e2) start += col[size_t(e2)];
    for (int s2 = 0; s2 < s; ++s2) start += rc[s2 * Er + e];
    return start;
  };
  auto home_start = [&](int d, int64_t e) {
    int64_t start = off_home[size_t(d)];
    for (int64_t e2 = 0; e2 < e; ++e2) start += sent[d * Er + e2];
    return start;
  };
  // y's rows in (destination, expert) order, destinations in `dests`: what a backend's alltoall_base sends.
  auto gather_rows = [&](const std::vector<int>& dests) {
    std::vector<int64_t> order;
    for (int s : dests)
      for (int64_t e = 0; e < Er; ++e)
        for (int64_t i = 0, at_row = y_start(s, e); i < rc[s * Er + e]; ++i) order.push_back(at_row + i);
    return yc.index_select(0, longs(order, y.device()));
  };

  // This rank's own rows stay: from y into their place in `home` (off the CPU).
  auto keep_own_rows = [&](const at::Tensor& home) {
    for (int64_t e = 0; e < Er; ++e)
      if (const int64_t n = rc[me * Er + e])
        home.narrow(0, home_start(me, e), n).copy_(yc.narrow(0, y_start(me, e), n));
  };

  // Small calls carry the rows going back inside the agreement: rank s's rows to rank s (sizes per pair).
  std::vector<int> others;
  for (int i = 1; i < R; ++i) others.push_back((me + i) % R);
  int64_t largest = 0, leaving = 0;
  for (int s : others) {
    largest = std::max(largest, n_back[size_t(s)] * row_bytes);
    leaving += n_back[size_t(s)] * row_bytes;
  }
  const bool offer = ok && y.device().is_cpu() && cl.fits_routed(largest, leaving);
  Carried carried;
  at::Tensor outbox;
  std::vector<int64_t> out_at(size_t(R), 0);  // byte offset of destination d's rows in `outbox`
  if (offer) {
    int64_t at_byte = 0;
    for (int s : others) {
      out_at[size_t(s)] = at_byte;
      at_byte += n_back[size_t(s)] * row_bytes;
    }
    if (leaving) {  // destination s's rows at byte out_at[s]: its segments (e, s) for every local expert e
      outbox = at::empty({leaving}, y.options().dtype(at::kByte));
      auto* dst = static_cast<char*>(outbox.data_ptr());
      const auto* from = static_cast<const char*>(yc.data_ptr());
      for (int s : others)
        for (int64_t e = 0; e < Er; ++e) {
          const int64_t bytes = rc[s * Er + e] * row_bytes;
          if (bytes) std::memcpy(dst, from + y_start(s, e) * row_bytes, size_t(bytes));
          dst += bytes;
        }
    }
    auto* base = leaving ? static_cast<char*>(outbox.data_ptr()) : nullptr;
    carried.bytes = size_t(largest);
    carried.data = [base, &out_at](int q) { return base ? base + out_at[size_t(q)] : nullptr; };
    carried.size = [&n_back, row_bytes](int q) { return size_t(n_back[size_t(q)] * row_bytes); };
  }
  Agreement agreement = p.start_agree({{"experts per rank", ok ? rt.Er : -1},
                                       {"expert output size (y.size(1))", ok ? y.size(1) : -1},
                                       {"dtype", dtype_code(y.scalar_type())}},
                                      problem, std::move(carried));
  agreement.result();
  p.trace("t=", t, " k=", K, " E_r=", Er, " f=", f, " ", y.scalar_type(),
          ok && y.device().is_cpu() && cl.may_carry ? c10::str(" sends ", largest, "/", leaving) : "",
          agreement.carried() ? " carried" : "");

  // Every (token, choice) comes back exactly once. On CPU the weighted sum reads each row where it is (`regions`
  // of this rank's sending order): in the agreement's messages when they carried the rows, this rank's own rows
  // in y, the rest in `home`. Otherwise every row lands in `home` first, in sending order (sorted by global
  // expert), so the rows from rank d are one contiguous region and are received in place.
  const bool on_host = y.device().is_cpu();
  std::vector<RowRegion> regions;
  at::Tensor home;
  auto own_rows_in_y = [&] {
    for (int64_t e = 0; e < Er; ++e)
      regions.push_back({static_cast<const char*>(yc.data_ptr()) + y_start(me, e) * row_bytes, home_start(me, e),
                         rc[me * Er + e]});
  };
  if (agreement.carried()) {  // (only on CPU: see `offer`)
    for (int q : others) {
      if (!n_home[size_t(q)]) continue;
      const size_t want = size_t(n_home[size_t(q)] * row_bytes), got = agreement.carried_bytes(q);
      TORCH_CHECK(want <= got, "mk ", op, ": rank ", me, ": rank ", q, " carried ", got,
                  " bytes in the argument agreement, too few for the ", n_home[size_t(q)],
                  " rows it owes this rank (do the ranks hold handles of the same dispatch?)");
      regions.push_back({static_cast<const char*>(agreement.carried_from(q)), off_home[size_t(q)], n_home[size_t(q)]});
    }
    own_rows_in_y();
  } else if (!g.is_mk()) {
    // One alltoall_base (see alltoall_step) that every rank issues, whatever its counts: a rank cannot know
    // from its handle whether the others move rows. Its own rows travel in it too (a local copy inside the
    // backend), so the output lands in `home` whole: the outbox is y's rows in (destination, expert) order,
    // gathered in one index_select.
    home = at::empty({t * K, f}, y.options());
    std::vector<int64_t> in_splits(size_t(R), 0), out_splits(size_t(R), 0);
    std::vector<int> everyone;
    for (int s = 0; s < R; ++s) {
      in_splits[size_t(s)] = n_back[size_t(s)];
      out_splits[size_t(s)] = n_home[size_t(s)];
      everyone.push_back(s);
    }
    const at::Tensor outbox = gather_rows(everyone);
    p.publish(outbox);
    p.trace("alltoall_base path: ", outbox.size(0) - n_back[size_t(me)], " rows out, ", t * K - n_home[size_t(me)],
            " rows in");
    alltoall_step(p, outbox, home, out_splits, in_splits).wait();
    if (on_host) regions.push_back({static_cast<const char*>(home.data_ptr()), 0, t * K});
  } else {
    // mk: one message per (peer, expert segment), straight from y into `home` (no staging copies).
    home = at::empty({t * K, f}, y.options());
    std::vector<Pending> rx, tx;
    for (int i = 1; i < R; ++i) {
      const int d = (me + i) % R;  // the ranks our rows went to send them back
      for (int64_t e = 0; e < Er; ++e)
        if (sent[d * Er + e]) rx.push_back(p.recv(home.narrow(0, home_start(d, e), sent[d * Er + e]), d, uint32_t(e)));
    }
    for (int i = 1; i < R; ++i) {
      const int s = (me - i + R) % R;
      for (int64_t e = 0; e < Er; ++e)
        if (rc[s * Er + e]) tx.push_back(p.send(yc.narrow(0, y_start(s, e), rc[s * Er + e]), s, uint32_t(e)));
    }
    if (on_host) {
      for (int q : others)
        regions.push_back({static_cast<const char*>(home.data_ptr()) + off_home[size_t(q)] * row_bytes,
                           off_home[size_t(q)], n_home[size_t(q)]});
      own_rows_in_y();
    } else {
      keep_own_rows(home);
    }
    for (auto& x : rx) x.wait();
    for (auto& x : tx) x.wait();
  }
  if (on_host) return weighted_sum_on_host(regions, rt.row_of, topk_weights, t, K, f, y.scalar_type(), op, me);
  // Back to token order (row token·K + choice is home's row inv[token·K + choice]), then the weighted sum
  // over the k choices as one batched product [t, 1, k] x [t, k, f], accumulated in fp32 in a fixed order.
  const at::Tensor perm = rt.perm.to(y.device());
  const at::Tensor inv = at::empty_like(perm).scatter_(0, perm, at::arange(t * K, perm.options()));
  at::Tensor rows = home.index_select(0, inv).view({t, K, f});
  const at::Tensor wts = topk_weights.reshape({t, 1, K}).to(y.device(), at::kFloat);
  if (rows.scalar_type() != at::kFloat) rows = rows.to(at::kFloat);
  return at::bmm(wts, rows).view({t, f}).to(y.scalar_type());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mk, m) {
  m.def("moe_dispatch_gemm(Tensor x, Tensor topk_ids, Tensor w, str group_name) -> (Tensor, Tensor, Tensor)");
  m.def("moe_combine(Tensor y, Tensor handle, Tensor topk_weights, str group_name) -> Tensor");
}

TORCH_LIBRARY_IMPL(mk, CompositeExplicitAutograd, m) {
  m.impl("moe_dispatch_gemm", &moe_dispatch_gemm);
  m.impl("moe_combine", &moe_combine);
}

}  // namespace mk::kernels
