// mk::ring_attention: attention over a sequence sharded across the ranks of a group.
//
// Layout. Every rank holds s positions of a sequence of R·s. Contiguous (zigzag=False): rank r holds
// [r·s, (r+1)·s). Zigzag (zigzag=True, s even, meant for causal masks): the sequence is cut into 2R chunks
// of c = s/2 and rank r holds chunk r followed by chunk 2R−1−r, so every rank has the same amount of
// unmasked causal work.
//
// Algorithm. K and V (packed into one buffer, in the input dtype) travel around the ring r → r+1: at step i
// rank r holds the block of rank (r − i) mod R, sends it on and receives the next one while it computes
// attention of its queries against the block it has (so the transfer of block i+1 overlaps the compute of
// block i). Each block's partial result (output and log-sum-exp, fp32) is merged into the running one with
// the log-sum-exp rule: lse = logaddexp(lse, lse_b); out = out·e^(lse_old−lse) + out_b·e^(lse_b−lse).
// With a causal mask, every pair of (query chunk, key chunk) is classified by its global positions as fully
// visible, fully masked (skipped) or diagonal (masked element-wise).
// On mk with every peer on this host and no mask (CPU), the transfers would be copies on the cores the
// attention needs, so nothing can overlap: the op then gathers K/V with one mk allgather and makes one
// attention call over the whole sequence (R blocks in memory, as the unfused composition has).
// Small blocks (pipeline.h's CarryLimit: mk with a peer across hosts, or another backend on CPU; at most
// 64 KiB of K/V, which goes to every peer, as a gather sends it) travel inside the argument agreement, so
// every rank holds every block after that one exchange and makes one attention call over the whole sequence
// (causal: with a mask from the global positions, as the unfused composition does).
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/logaddexp.h>
#include <ATen/ops/logsumexp.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "kernels/group.h"
#include "kernels/pipeline.h"

namespace mk::kernels {
namespace {

constexpr const char* kOp = "ring_attention";

// A run of consecutive sequence positions held by one rank: global start, offset in the local block, length.
struct Chunk {
  int64_t pos, off, len;
};

std::vector<Chunk> chunks_of(int rank, int R, int64_t s, bool zigzag) {
  if (!zigzag) return {{int64_t(rank) * s, 0, s}};
  const int64_t c = s / 2;
  return {{int64_t(rank) * c, 0, c}, {int64_t(2 * R - 1 - rank) * c, c, c}};
}

enum class Vis { full, none, partial };

Vis visibility(const Chunk& q, const Chunk& k, bool causal) {
  if (!causal || q.len == 0 || k.len == 0) return q.len && k.len ? Vis::full : Vis::none;
  if (k.pos + k.len - 1 <= q.pos) return Vis::full;
  if (k.pos > q.pos + q.len - 1) return Vis::none;
  return Vis::partial;
}

// Positions where key > query: the causal mask of a partial pair, [q.len, k.len].
at::Tensor causal_mask(const Chunk& q, const Chunk& k) {
  auto opts = at::TensorOptions().dtype(at::kLong);
  at::Tensor qp = at::arange(q.pos, q.pos + q.len, opts).unsqueeze(1);
  at::Tensor kp = at::arange(k.pos, k.pos + k.len, opts).unsqueeze(0);
  return kp.gt(qp);
}

// Replace -inf (rows that saw no key yet) by 0 so that exp(x - m) stays 0 instead of NaN.
at::Tensor finite_or_zero(const at::Tensor& m) { return m.masked_fill(m.isneginf(), 0.0); }

// Merge a block's partial result (bout [b, hkv, g, sq, d], blse [b, hkv, g, sq]) into the running one (views
// into the fp32 accumulators) with the log-sum-exp rule.
void merge(const at::Tensor& bout, const at::Tensor& blse, at::Tensor out, at::Tensor lse) {
  at::Tensor merged = at::logaddexp(lse, blse);
  at::Tensor m = finite_or_zero(merged);
  // (addcmul_: one pass over the output and no temporary of its size; bout may be in the half type)
  out.mul_(at::exp(lse - m).unsqueeze(-1)).addcmul_(bout, at::exp(blse - m).unsqueeze(-1));
  lse.copy_(merged);
}

// Attention of q [b, hkv, g, sq, d] against k, v [b, hkv, sk, d] (all fp32) with an optional element mask
// (true = masked): the block's output and log-sum-exp, by plain ATen ops (any device).
std::pair<at::Tensor, at::Tensor> attend_generic(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                 const std::optional<at::Tensor>& mask, double scale) {
  at::Tensor scores = at::matmul(q, k.unsqueeze(2).transpose(-1, -2)).mul_(scale);  // [b, hkv, g, sq, sk]
  if (mask) scores.masked_fill_(*mask, -std::numeric_limits<double>::infinity());
  at::Tensor blse = at::logsumexp(scores, -1);
  at::Tensor p = at::exp(scores.sub_(finite_or_zero(blse).unsqueeze(-1)));
  return {at::matmul(p, v.unsqueeze(2)), blse};
}

// The same through ATen's fused CPU flash-attention kernel (tiled, never materialises the score matrix;
// returns the log-sum-exp too). k, v are [b, hq, sk, d] here (kv heads already repeated for GQA); `diagonal`:
// query i sees keys 0..i (the pair covers the same positions).
std::pair<at::Tensor, at::Tensor> attend_cpu(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                             bool diagonal, double scale) {
  const auto b = q.size(0), hkv = q.size(1), g = q.size(2), sq = q.size(3), d = q.size(4);
  auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(q.reshape({b, hkv * g, sq, d}), k, v, 0.0, diagonal,
                                                                 std::nullopt, scale);
  return {o.reshape({b, hkv, g, sq, d}), l.reshape({b, hkv, g, sq})};
}

std::tuple<at::Tensor, at::Tensor> ring_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                  c10::string_view group_name, bool causal, std::optional<double> scale,
                                                  bool zigzag) {
  const Group grp = resolve_group(std::string(group_name), q.device(), kOp);
  Pipeline p(grp, kOp);
  const int R = p.size(), me = p.rank();
  // Same verdict on every rank (same backend and device type everywhere), so no rank waits for another.
  TORCH_CHECK(p.exchange_supported(), "mk ", kOp, ": rank ", me, ": on ", q.device(), " the ", grp.backend_name(),
              " backend cannot batch point-to-point calls (Backend::supportsCoalescing() is false), and its "
              "unbatched ring of send/recv could deadlock on a stream-ordered device; use mk, nccl, or CPU tensors");

  // Every rank checks its own arguments and every rank's description, so a bad or mismatched call fails on
  // every rank at the same point, before any data moves.
  std::string local_problem;
  if (q.dim() != 4 || k.dim() != 4 || v.dim() != 4)
    local_problem = c10::str("q, k, v must be 4-d [batch, heads, seq, head_dim]; got ", q.sizes(), ", ", k.sizes(), ", ", v.sizes());
  else if (k.sizes() != v.sizes())
    local_problem = c10::str("k ", k.sizes(), " and v ", v.sizes(), " differ in shape");
  else if (q.size(0) != k.size(0) || q.size(2) != k.size(2) || q.size(3) != k.size(3))
    local_problem = c10::str("q ", q.sizes(), " and k ", k.sizes(), " disagree in batch, sequence or head_dim");
  else if (k.size(1) == 0 || q.size(1) % k.size(1) != 0)
    local_problem = c10::str("query heads (", q.size(1), ") must be a multiple of key/value heads (", k.size(1), ")");
  else if (q.scalar_type() != k.scalar_type() || q.scalar_type() != v.scalar_type())
    local_problem = c10::str("q, k, v dtypes differ: ", q.scalar_type(), ", ", k.scalar_type(), ", ", v.scalar_type());
  else if (!(q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kHalf))
    local_problem = c10::str("dtype ", q.scalar_type(), " is not supported (float32, bfloat16, float16)");
  else if (zigzag && q.size(2) % 2 != 0)
    local_problem = c10::str("zigzag layout needs an even local sequence length, got ", q.size(2));
  const CarryLimit cl = carry_limit(p, CarryTotal::every_peer);
  if (local_problem.empty()) local_problem = cl.problem;
  // mk across hosts, CPU: the ring needs blocks of at least SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ positions
  // (256) to pay for its per-block attention calls and merges; below it K/V is gathered after the agreement and
  // one attention call covers the sequence, as unfused does. 2 namespace hosts at 1 Gbit/s, fused/unfused,
  // ring against gather (bench/README.md): s=64x2 0.72x/0.92x (causal 0.74x/0.89x), s=128x2 0.80x/0.91x
  // (0.92x/0.96x), s=256x2 0.89x/0.93x (causal 1.25x/0.91x: the zigzag ring skips the masked blocks).
  // Every rank must pass the same value (part of the agreement).
  const bool may_ring = R > 1 && grp.is_mk() && p.over_tcp() && q.device().is_cpu();
  int64_t ring_min = 0;
  bool ring_min_set = false;
  if (may_ring) {
    std::string bad;
    ring_min = env_integer("SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ", 256, 1, bad, &ring_min_set);
    if (local_problem.empty()) local_problem = bad;
  }
  const bool ok = local_problem.empty();
  // Without a mask the ring hides at most the K/V transfer and adds a merge of the output per block (and a
  // smaller attention call per block): where the transfer is short next to the attention, gathering K/V and
  // one call is faster (2 namespace hosts at 1 Gbit/s, fp32, b=1 hq=8 hkv=2 s=512x2 d=64: the ring 0.93x of
  // unfused, comm 1.2 ms against 12.5 ms of attention; hkv=8 s=1024x2: 1.31x). So across hosts, with the
  // default threshold, unmasked blocks at or above it take the ring or the gather as the chunk tuner finds
  // faster on the calls themselves (Pipeline::chunks with the ring as its one chunk count and the gather as
  // the op's plain path, kPlainPath; rank 0's proposal is used on every rank). With
  // SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ set, they always ring.
  // Causal blocks always ring: the zigzag layout skips the masked ones (1.34x and 1.94x there).
  const bool tune_path = may_ring && !causal && !ring_min_set && ok && q.size(2) >= ring_min;
  int64_t path_proposal = 1;  // (the ring)
  if (tune_path) {
    ChunkModel model;
    model.comm_bytes = double(R - 1) * 2.0 * double(k.numel()) * double(k.element_size());
    model.flops = 4.0 * double(q.numel()) * double(R) * double(q.size(2));  // 2 GEMMs: s x R s x d per head
    model.max_chunks = 1;
    model.plain_too = true;
    model.dtype = q.scalar_type();
    path_proposal = p.chunks(0, model);
  }
  const double sc = scale.value_or(ok && q.size(3) > 0 ? 1.0 / std::sqrt(double(q.size(3))) : 1.0);
  int64_t sc_bits = 0;
  static_assert(sizeof(double) == sizeof(int64_t));
  std::memcpy(&sc_bits, &sc, sizeof sc_bits);
  auto dim = [&](const at::Tensor& t, int64_t i) { return ok ? t.size(i) : -1; };
  // A small K/V block ([2, b, hkv, s, d], the same to every peer) travels inside the agreement: every rank
  // then holds every block after one exchange, instead of the agreement's round trip and R - 1 ring steps.
  at::Tensor mine;  // this rank's packed K/V, once made
  Carried carried;
  const int64_t kv_bytes = ok ? 2 * k.size(0) * k.size(1) * k.size(2) * k.size(3) * int64_t(k.element_size()) : 0;
  if (ok && R > 1 && q.device().is_cpu() && q.size(2) > 0 && cl.fits(R, kv_bytes)) {
    mine = at::stack({k, v}).contiguous();
    carried.bytes = size_t(mine.nbytes());
    carried.data = [&mine](int) { return mine.data_ptr(); };
  }
  std::vector<Field> fields{{"batch", dim(q, 0)}, {"query heads", dim(q, 1)}, {"kv heads", dim(k, 1)},
                            {"local sequence", dim(q, 2)}, {"head_dim", dim(q, 3)},
                            {"dtype", dtype_code(q.scalar_type())}, {"causal", causal}, {"zigzag", zigzag},
                            {"scale (bits of the double)", sc_bits},
                            {"SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ", ok ? ring_min : -1},
                            {"SUPERKERNEL_OPS_ATTENTION_RING_MIN_SEQ set", int64_t(ring_min_set)}};
  for (const Field& f : p.tuner_fields()) fields.push_back(f);
  fields.push_back({"path (tuned)", path_proposal, false});
  Agreement agreement = p.start_agree(std::move(fields), local_problem, std::move(carried));
  const std::vector<std::vector<int64_t>> agreed = agreement.result();
  const bool have_all = agreement.carried();
  const bool tuned_gather = tune_path && !have_all && agreed[0].back() == kPlainPath;  // rank 0's proposal
  // (a call whose K/V came with the agreement ran neither path: its time tunes nothing)
  if (tune_path) p.use_chunks(have_all ? 0 : agreed[0].back(), agreed, agreed[0].size() - 3);
  // Rank src's packed K/V when it came with the agreement (this rank's own: `mine`).
  auto carried_block = [&](int src) {
    if (src == me) return mine;
    const size_t got = agreement.carried_bytes(src);
    TORCH_CHECK(got == mine.nbytes(), "mk ", kOp, ": rank ", me, ": rank ", src, " carried ", got,
                " bytes of K/V in the argument agreement, expected ", mine.nbytes());
    return at::from_blob(const_cast<void*>(agreement.carried_from(src)), mine.sizes(), mine.options());
  };

  const int64_t b = q.size(0), hq = q.size(1), hkv = k.size(1), s = q.size(2), d = q.size(3), g = hq / hkv;
  auto f32 = q.options().dtype(at::kFloat);
  const bool one_host_cpu = grp.is_mk() && !p.over_tcp() && q.device().is_cpu();
  // ATen's fused kernel runs in the input dtype where ATen's GEMM is fast on it, as the unfused SDPA does (fp32
  // inside, the output rounded once, the log-sum-exp fp32): bf16 made in fp32 was 0.98x of unfused at s=2048x2
  // on one host here. A half type widened elsewhere (native_half_gemm, as the GEMM ops and the backward
  // decide) goes in fp32. The ring merges its blocks' outputs in fp32 (a convex combination: a block's output
  // rounded to the half type moves the result by at most that rounding).
  const at::ScalarType ct = native_half_gemm(q.scalar_type(), q.device()) ? q.scalar_type() : at::kFloat;
  const bool short_blocks = may_ring && s < ring_min;  // (every rank alike: s and the threshold were agreed)
  if (R > 1 && s > 0 && ((!causal && one_host_cpu) || have_all || short_blocks || tuned_gather)) {
    // Every block already here, blocks too short for the ring across hosts, or no mask and every peer on
    // this host: one attention call over the whole sequence. On one host the blocks would travel over shared
    // memory, i.e. as copies on the cores the attention needs, so nothing overlaps; one mk allgather of the
    // packed K/V and one call cost less than R calls and R-1 merges (memory: R blocks, as unfused). Keys in
    // rank order: without a mask their order does not matter; a causal mask is built from the global
    // positions of the queries and of every rank's keys.
    // K and V of the whole sequence, [2, b, hkv, R·s, d], keys in rank order: carried blocks are copied
    // straight into their place; a gather's output [R, 2, b, hkv, s, d] is reordered in one copy.
    at::Tensor kv;
    if (have_all) {
      kv = at::empty({2, b, hkv, R * s, d}, k.options());
      for (int src = 0; src < R; ++src) kv.narrow(3, src * s, s).copy_(carried_block(src));
    } else {
      at::Tensor all = at::empty({R, 2, b, hkv, s, d}, k.options());
      mine = at::stack({k, v}).contiguous();  // [2, b, hkv, s, d]
      p.on_caller([&] { return p.allgather(mine, all); }).wait();
      kv = all.permute({1, 2, 3, 0, 4, 5}).reshape({2, b, hkv, R * s, d});
    }
    auto whole = [&](int64_t i) {  // [b, hq, R·s, d] in ct, kv heads repeated for GQA
      at::Tensor t = kv.select(0, i).to(ct).unsqueeze(2);
      return t.expand({b, hkv, g, R * s, d}).reshape({b, hq, R * s, d});
    };
    std::optional<at::Tensor> mask;  // additive: -inf where a key comes after the query
    if (causal) {
      auto positions = [&](int rank) {  // global position of each of rank's s local positions
        std::vector<at::Tensor> parts;
        for (const Chunk& c : chunks_of(rank, R, s, zigzag))
          parts.push_back(at::arange(c.pos, c.pos + c.len, at::kLong));
        return at::cat(parts);
      };
      std::vector<at::Tensor> keys;
      for (int src = 0; src < R; ++src) keys.push_back(positions(src));
      const at::Tensor later = at::cat(keys).unsqueeze(0).gt(positions(me).unsqueeze(1)).to(q.device());  // [s, R·s]
      mask = at::zeros({1, 1, s, R * s}, q.options().dtype(ct))
                 .masked_fill_(later.view({1, 1, s, R * s}), -std::numeric_limits<double>::infinity());
    }
    auto [o, l] = at::_scaled_dot_product_flash_attention_for_cpu(q.to(ct), whole(0), whole(1), 0.0, false, mask, sc);
    p.trace(have_all ? "carried" : short_blocks ? "short blocks" : tuned_gather ? "tuned gather" : "one host",
            causal ? ", causal" : ", no mask",
            ": one attention call over ", R * s, " keys (K/V ", kv_bytes, " B a rank)");
    // (the kernel returns [b, s, h]-ordered strides; the op's outputs are contiguous, as its fake kernel says)
    return {o.to(q.scalar_type()).contiguous(), l.contiguous()};
  }
  p.trace("ring: ", R, " blocks");
  // q in fp32 for the generic products, made on first use; in ct for the fused kernel.
  at::Tensor q32;
  auto q_f32 = [&]() -> const at::Tensor& {
    if (!q32.defined()) q32 = q.to(at::kFloat).reshape({b, hkv, g, s, d});
    return q32;
  };
  const at::Tensor qct = ct == at::kFloat ? q_f32() : q.reshape({b, hkv, g, s, d});
  // The fp32 accumulators: a query chunk's first block is copied in, the later ones merged.
  at::Tensor out = at::empty({b, hkv, g, s, d}, f32);
  at::Tensor lse = at::empty({b, hkv, g, s}, f32);
  const auto my_chunks = chunks_of(me, R, s, zigzag);
  std::vector<bool> started(my_chunks.size(), false);
  const bool on_cpu = q.device().is_cpu();

  // Double-buffered K/V blocks; block i+1 arrives while block i is computed.
  at::Tensor cur = at::stack({k, v}).contiguous();  // [2, b, hkv, s, d], input dtype
  at::Tensor nxt = R > 1 ? at::empty_like(cur) : at::Tensor();
  const int right = (me + 1) % R, left = (me - 1 + R) % R;
  for (int step = 0; step < R; ++step) {
    const int src = (me - step + R) % R;
    std::vector<Pending> moving;  // this step's send to the right and receive from the left
    if (step + 1 < R && s > 0) {
      p.publish(cur);
      moving = p.exchange(cur, right, nxt, left, uint32_t(step));
    }
    const auto their_chunks = chunks_of(src, R, s, zigzag);
    // This block as each path needs it, made on first use: in fp32 for the generic products; in ct with kv
    // heads repeated for the fused kernel (a view when there is no grouping).
    at::Tensor kb, vb, kx, vx;
    for (size_t qi = 0; qi < my_chunks.size(); ++qi) {
      const Chunk& qc = my_chunks[qi];
      for (const Chunk& kc : their_chunks) {
        const Vis vis = visibility(qc, kc, causal);
        if (vis == Vis::none) continue;
        const bool diagonal = vis == Vis::partial && qc.pos == kc.pos && qc.len == kc.len;
        std::pair<at::Tensor, at::Tensor> part;
        if (on_cpu && (vis == Vis::full || diagonal)) {
          if (!kx.defined()) {
            const at::Tensor kt = cur[0].to(ct), vt = cur[1].to(ct);
            kx = g == 1 ? kt : kt.unsqueeze(2).expand({b, hkv, g, s, d}).reshape({b, hq, s, d});
            vx = g == 1 ? vt : vt.unsqueeze(2).expand({b, hkv, g, s, d}).reshape({b, hq, s, d});
          }
          part = attend_cpu(qct.narrow(3, qc.off, qc.len), kx.narrow(2, kc.off, kc.len), vx.narrow(2, kc.off, kc.len),
                            diagonal, sc);
        } else {
          if (!kb.defined()) {
            kb = cur[0].to(at::kFloat);
            vb = cur[1].to(at::kFloat);
          }
          std::optional<at::Tensor> mask;
          if (vis == Vis::partial) mask = causal_mask(qc, kc);
          part = attend_generic(q_f32().narrow(3, qc.off, qc.len), kb.narrow(2, kc.off, kc.len),
                                vb.narrow(2, kc.off, kc.len), mask, sc);
        }
        if (started[qi]) {
          merge(part.first, part.second, out.narrow(3, qc.off, qc.len), lse.narrow(3, qc.off, qc.len));
        } else {
          out.narrow(3, qc.off, qc.len).copy_(part.first);
          lse.narrow(3, qc.off, qc.len).copy_(part.second);
          started[qi] = true;
        }
      }
    }
    if (!moving.empty()) {
      for (Pending& m : moving) m.wait();
      std::swap(cur, nxt);
    }
  }
  for (size_t qi = 0; qi < my_chunks.size(); ++qi)  // (every chunk sees its own positions, so none stays unwritten)
    TORCH_CHECK(started[qi] || my_chunks[qi].len == 0, "mk ", kOp, ": rank ", me, ": query chunk ", qi,
                " received no key block (internal error)");
  return {out.reshape({b, hq, s, d}).to(q.scalar_type()), lse.reshape({b, hq, s})};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(mk, m) {
  m.def(
      "ring_attention(Tensor q, Tensor k, Tensor v, str group_name, bool causal=False, float? scale=None, "
      "bool zigzag=False) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mk, CompositeExplicitAutograd, m) { m.impl("ring_attention", &ring_attention); }

}  // namespace mk::kernels
