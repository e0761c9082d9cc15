// GEMM fused with a collective, on the pipeline scheduler:
//   mk::allgather_gemm(a, b, group_name, return_gathered=False, chunks=0) -> (c, gathered)
//       c = cat_r(a_r) @ b, [R*m, n]. On mk across hosts a ring over the transport: each step forwards the
//       shard part just received to the next rank while multiplying it (no staging copies: parts land in
//       `gathered`), or, when the chunk tuner times it faster, one allgather and one GEMM. On mk on one
//       host: every rank stages its shard in its shared-memory slots once, and each rank multiplies every
//       shard straight from the slots, chunk by chunk as they are staged (no copy out).
//       On other backends: one allgather then one GEMM with one chunk, else the allgather of row part i+1
//       while part i is multiplied.
//       `gathered` is cat_r(a_r) [R*m, k] when return_gathered, else [0, k] (always a tuple, so the schema
//       and the fake kernel do not depend on a flag's value).
//   mk::gemm_allreduce(a, b, group_name, chunks=0) -> c
//       c = sum_r a_r @ b_r, [m, n] on every rank. On mk on one host: the products are written straight into
//       the shared-memory staging slots, chunk by chunk, and reduced from there (no copy in). On mk across
//       hosts (tcp) with R dividing m: the reduce-scatter ring below, then the reduced blocks ring on to every
//       rank, each chunk as soon as it is final (or, when the chunk tuner times it faster, the plain path
//       below with one chunk). Otherwise row chunks: chunk i's partial product is allreduced
//       while chunk i+1 is multiplied (mk: ProcessGroupMK's allreduce issued from the group's lane thread).
//   mk::gemm_reducescatter(a, b, group_name, chunks=0) -> c
//       rows [r*m/R, (r+1)*m/R) of sum_r a_r @ b_r (R divides m). On mk across hosts a ring of partial sums
//       over the transport (see ring_reducescatter), or the tuner's plain path (the GEMM, then mk's
//       reduce-scatter). On mk on one host, the products of every block are
//       written straight into the staging slots and each rank reduces its block from them. On other
//       backends each chunk takes the same rows from every rank's block: on CPU (Gloo) an alltoall brings
//       this rank its rows of that chunk from every rank, summed here in rank order; on accelerators the
//       backend's reduce-scatter leaves them; chunk i's exchange overlaps the products of chunk i+1.
// The rings across hosts need blocks of at least SUPERKERNEL_OPS_RING_MIN_ROWS rows (64; m for allgather_gemm,
// m / R for the other two): below that the ops take the collective path (one GEMM, then mk's collective).
// Smaller still (see CarryLimit: at most 64 KiB to a peer on mk, 256 KiB on other CPU backends, 4 MiB for
// allgather_gemm's shard there, which its own rows' product then hides, 512 KiB on two ranks for
// gemm_allreduce's product and gemm_reducescatter's block, kPairCarryBytes; in all, that for gemm_allreduce,
// whose direct sends to more than one peer cost more than its ring, and R - 1 times that for the other two,
// whose direct sends are what their collective sends), with an automatic chunk count, the payload travels
// inside the argument agreement's messages (allgather_gemm its shard, the other two their partial products,
// computed first), so the call makes one exchange, not two.
// The in-place paths on one host need a row to fit in a staging slot (SUPERKERNEL_SHM_CHUNK, 1 MiB); wider
// rows use ProcessGroupMK's collectives as other backends use theirs. They save the staging copy an unfused
// composition makes (measured on 2 ranks: see bench/README.md).
// Every op first agrees with the other ranks on shapes, dtype and chunk count (group.h's Agreement). When one
// chunk is planned outside the in-place paths, gemm_allreduce and gemm_reducescatter compute the whole product
// while that exchange travels, so it costs nothing on the critical path.
// Half types (bf16, fp16): products use ATen's mm (fp32 accumulation inside; on the CPU in the input type, see
// Products); partial sums that cross ranks are fp32 (carried products travel in the type they were made in)
// and rounded to the input type once at the end. `chunks` = 0 picks the count automatically (one
// chunk when every peer is on this host: see Pipeline::chunks; the in-place paths then chunk by slot).
#include <ATen/Parallel.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/group.h"
#include "kernels/packed_gemm.h"
#include "kernels/pipeline.h"
#include "transport/collectives/collectives.h"
#include "transport/copy.h"
#include "transport/reduce.h"

namespace mk::kernels {
namespace {

// Argument checks shared by the three ops; "" when fine (agree() turns a message into an error on every rank).
std::string check_operands(const at::Tensor& a, const at::Tensor& b, const char* a_shape, const char* b_shape) {
  // (messages are formatted only when a check fails: this runs on every call)
  if (a.dim() != 2 || b.dim() != 2)
    return c10::str("a must be 2-D ", a_shape, " and b 2-D ", b_shape, ", got a ", a.sizes(), " and b ", b.sizes());
  if (a.size(1) != b.size(0))
    return c10::str("inner dimensions differ: a is ", a.sizes(), ", b is ", b.sizes(), " (a ", a_shape, ", b ",
                    b_shape, ")");
  if (a.scalar_type() != b.scalar_type()) return c10::str("a is ", a.scalar_type(), " but b is ", b.scalar_type());
  if (a.scalar_type() != at::kFloat && a.scalar_type() != at::kBFloat16 && a.scalar_type() != at::kHalf)
    return c10::str("dtype ", a.scalar_type(), " is not supported (float32, bfloat16, float16)");
  if (a.device() != b.device()) return c10::str("a is on ", a.device(), " but b is on ", b.device());
  return {};
}

int64_t dim_or(const at::Tensor& t, int64_t d) { return t.dim() == 2 ? t.size(d) : -1; }

// The most rows of any [lo, hi) range.
int64_t most_rows(const std::vector<std::pair<int64_t, int64_t>>& ranges) {
  int64_t most = 0;
  for (const auto& [lo, hi] : ranges) most = std::max(most, hi - lo);
  return most;
}

// How the ops multiply. A half type (bf16, fp16) is multiplied as it is where ATen's GEMM is fast on it
// (native_half_gemm: accumulated in fp32 inside, rounded once, as the unfused matmul does), else on operands
// widened to fp32 (b once per call). A product goes into a destination of any float type: gemm_allreduce and
// gemm_reducescatter sum partial products across ranks in fp32, allgather_gemm writes the input type.
// Off the CPU, `exact` (the partial sums) widens half types (cuBLAS may reduce fp16 in fp16); allgather_gemm,
// whose products are its output, multiplies them as they are, as the unfused matmul does.
struct Products {
  at::Tensor b;       // as multiplied: as given (strides too, see allgather_gemm), or widened to fp32
  at::Tensor b_wide;  // a half type made as it is, in small GEMMs (small_half_gemm): b widened, else undefined
  bool widen = false;
  mutable std::shared_ptr<const PackedB> packed;  // b packed for several fp32 products (pack_for), else null
  bool may_pack = true;  // every rank offered to pack (agreed, packed_gemm_offer); the ops set it after agreeing
  // The dtype of a product as made: the input type, or fp32 for a half type widened.
  static at::ScalarType type(const at::Tensor& a, bool exact) {
    const at::ScalarType t = a.scalar_type();
    if (t == at::kFloat) return t;
    if (!a.device().is_cpu()) return exact ? at::kFloat : t;
    return native_half_gemm(t, a.device()) ? t : at::kFloat;
  }
  // `max_rows`: the most rows one GEMM of the call multiplies; when even that GEMM is small, a half type made
  // as it is is made on widened operands and rounded (small_half_gemm with `small_limit`; -1: this process's
  // small_half_limit), the same type as made.
  // (`widen_anyway`: widen a half type even where it would be multiplied as it is; see allgather_gemm)
  Products(const at::Tensor& a, const at::Tensor& b_in, bool exact, int64_t max_rows, bool widen_anyway = false,
           int64_t small_limit = -1)
      : widen(type(a, exact) != a.scalar_type() || (widen_anyway && a.scalar_type() != at::kFloat)) {
    b = widen ? b_in.to(at::kFloat) : b_in;
    if (!widen && b.scalar_type() != at::kFloat && b.device().is_cpu() && b.dim() == 2 && max_rows > 0 &&
        small_half_gemm(max_rows, b.size(0), b.size(1),
                        small_limit >= 0 ? small_limit : small_half_limit(b.scalar_type())))
      b_wide = b_in.to(at::kFloat);
  }
  // dst = rows @ b, whatever dst's float type.
  void into(at::Tensor dst, const at::Tensor& rows) const {
    if (b_wide.defined()) {  // (an fp32 dst gets the product as made: rounded, then widened)
      dst.copy_(dst.scalar_type() == b.scalar_type() ? small_product(rows) : made_small(rows));
      return;
    }
    const at::Tensor lhs = widen ? rows.to(at::kFloat) : rows;
    if (packed && packed->into(dst, lhs)) return;
    if (dst.scalar_type() == b.scalar_type())
      at::mm_out(dst, lhs, b);
    else
      dst.copy_(at::mm(lhs, b));
  }
  // Before `gemms` products of at most `rows` rows each (a ring or a chunked pipeline): b packed once for them
  // where that pays (fp32 products, MKL present, every rank offering it; packed_gemm.h). Every rank decides
  // alike from agreed sizes and offers.
  // (const: the packed copy is a cache of b; called before the products start, never during)
  void pack_for(int64_t gemms, int64_t rows) const {
    if (packed || !may_pack || b_wide.defined() || b.scalar_type() != at::kFloat || !b.device().is_cpu() ||
        b.dim() != 2)
      return;
    if (!packed_gemm_pays(gemms, rows, b.size(0), b.size(1))) return;
    auto pb = std::make_shared<const PackedB>(b, rows);
    if (!pb->empty()) packed = std::move(pb);
  }
  // rows @ b in type(): into `acc` when that is its type, else a new tensor.
  at::Tensor made(const at::Tensor& rows, at::Tensor& acc) const {
    if (acc.defined() && acc.scalar_type() == b.scalar_type()) {
      into(acc, rows);
      return acc;
    }
    if (b_wide.defined()) return made_small(rows);
    return at::mm(widen ? rows.to(at::kFloat) : rows, b);
  }

 private:
  // (b_wide defined) the small GEMM in fp32, and that product as made: rounded to the half type
  at::Tensor small_product(const at::Tensor& rows) const { return at::mm(rows.to(at::kFloat), b_wide); }
  at::Tensor made_small(const at::Tensor& rows) const { return small_product(rows).to(b.scalar_type()); }
};

// The sum over ranks of `part(q)` (each [rows, n], the product type) in fp32 (`acc`'s type), in rank order, so
// every rank gets the same bits.
template <class Part>
void sum_in_rank_order(at::Tensor& acc, int R, Part part) {
  if (part(0).scalar_type() == acc.scalar_type() && part(1).scalar_type() == acc.scalar_type()) {
    at::add_out(acc, part(0), part(1));
  } else {  // widened first: adding two half tensors would round their sum to the half type
    acc.copy_(part(0));
    acc.add_(part(1));
  }
  for (int q = 2; q < R; ++q) acc.add_(part(q));
}

// mk's element type of a float tensor type.
DType mk_float(at::ScalarType t) {
  return t == at::kHalf ? DType::f16 : t == at::kBFloat16 ? DType::bf16 : DType::f32;
}

// `out` (bf16/fp16, [rows, n]) = the fp32 sum over ranks of `part(q)` (each [rows, n] in out's type), in
// rank order, rounded once: the bits of sum_in_rank_order into fp32 followed by .to(out's type), made in one
// pass by mk's reduction (transport/reduce.h, checked bit for bit against torch's rounding in the collective
// suite) instead of three ATen passes through an fp32 buffer (Gloo, 2 ranks, fp16 512x512: 0.92 ms). Returns
// false, doing nothing, where that does not apply (fp32 parts, or not contiguous CPU tensors).
template <class Part>
bool sum_half_in_rank_order(const at::Tensor& out, int R, Part part) {
  const at::ScalarType t = out.scalar_type();
  if ((t != at::kHalf && t != at::kBFloat16) || !out.device().is_cpu() || !out.is_contiguous()) return false;
  std::vector<at::Tensor> parts(static_cast<size_t>(R));
  std::vector<const void*> srcs(static_cast<size_t>(R));
  for (int q = 0; q < R; ++q) {
    parts[size_t(q)] = part(q);
    const at::Tensor& x = parts[size_t(q)];
    if (x.scalar_type() != t || !x.device().is_cpu() || !x.is_contiguous() || x.numel() != out.numel()) return false;
    srcs[size_t(q)] = x.data_ptr();
  }
  const DType dt = mk_float(t);
  auto* dst = static_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, out.numel(), int64_t(1) << 16, [&](int64_t lo, int64_t hi) {
    std::vector<const void*> from(srcs.size());
    for (size_t q = 0; q < srcs.size(); ++q) from[q] = static_cast<const uint16_t*>(srcs[q]) + lo;
    reduce_many(dst + lo, from.data(), R, size_t(hi - lo), dt, RedOp::sum);
  });
  return true;
}

// Other backends sum a collective's terms in the tensor's type, so half-type partial sums went to them widened
// to fp32: twice the bytes of the unfused allreduce / reduce-scatter of the half type (Gloo between 2
// namespace hosts at 1 Gbit/s, bf16 1024^3: gemm_allreduce 0.67x and gemm_reducescatter 0.63x of unfused,
// bench/README.md). Where the product is made in the half type (oneDNN on CPU), its terms travel as made and
// are summed here in fp32, in rank order: gemm_reducescatter sends each rank its block by alltoall ((R - 1)
// blocks either way, in half the bytes), gemm_allreduce gathers every rank's product ((R - 1) m n half
// elements against a ring's 2 (R - 1) / R m n fp32 ones: no more up to 4 ranks, `most_ranks`).
// In a cluster whose processors differ (oneDNN bf16/fp16 on some hosts, operands widened on others, or
// SUPERKERNEL_OPS_WIDEN_HALF set on some ranks), a rank that widens makes fp32 products: the agreement carries
// every rank's product type ("half_products"), and if any rank does not sum here, none does (an allgather on
// some ranks against an allreduce on others would hang): gemm_allreduce then allreduces fp32 everywhere, and
// gemm_reducescatter (which sums fp32 products here too) sends fp32 blocks everywhere.
// Two ranks summing here (gemm_allreduce): chunks of products at least this large are summed by the backend's
// allreduce in the half type, smaller ones are gathered (see gemm_allreduce).
constexpr size_t kPairAllreduceBytes = size_t(1) << 20;
// Two ranks: gemm_allreduce's whole product to the one peer is what a ring allreduce sends (m n each way), and
// gemm_reducescatter's block what its reduce-scatter sends, so up to this size they travel inside the agreement
// on other backends (larger groups keep kCarryMaxOther; for gemm_allreduce, CarryTotal::one_peer): one exchange
// instead of the agreement's and then the collective's. gemm_reducescatter fp32 512^3 (a 512 KiB block):
// 5.86, 5.49 ms against 10.47, 9.92 with one chunk through Gloo's reduce-scatter (unfused 8.85), and 5.84
// against 6.54 through the alltoall that replaced it (fp16 1024x512x512: 7.19 against 8.69). Gloo between
// 2 namespace hosts at 1 Gbit/s, medians of 40 interleaved calls in one process, two runs, ms (unfused;
// carried; one chunk after the agreement): fp16 512^3 4.58, 6.08; 4.05, 4.99; 4.82, 5.68. bf16 7.47, 6.20;
// 6.19, 6.24; 7.10, 7.83. fp32 256x512x512 3.73, 4.05; 4.13, 4.25; 4.88, 4.59. At 1 MiB carrying lost (fp16
// 1024x512x512: 11.43, 11.58 against one chunk's 11.42, 11.03; fp32 512^3: 9.84, 9.70 against 9.45, 9.59).
constexpr size_t kPairCarryBytes = size_t(512) << 10;

bool sums_here(const Group& g, at::ScalarType acc_t, at::ScalarType made_t, int most_ranks = 1 << 30) {
  return !g.is_mk() && g.device.is_cpu() && made_t != acc_t && g.size > 1 && g.size <= most_ranks;
}

// mk's collectives sum bf16/fp16 in fp32 and round once (transport/reduce.h): on one host every rank's term in
// rank order (shm, reduce_many), the sum_in_rank_order of the terms followed by .to(half) bit for bit; across
// hosts in the order and to the bits of the widened fp32 buffer, what the op did with fp32 terms. So on mk
// half-type products travel as made (when every rank makes them so: "half_products" in the agreement), not
// widened into fp32 terms: half the bytes through the staging slots, no widening pass before the collective
// and no rounding pass after it. 2 ranks, one host, medians of 300 interleaved calls, fp16 512x256x512:
// gemm_allreduce 2.36 ms with fp32 terms against 1.74 unfused; after, 1.49 against 1.54 (bench/README.md).
bool mk_sums_half(const Group& g, at::ScalarType acc_t, at::ScalarType made_t) {
  return g.is_mk() && g.device.is_cpu() && made_t != acc_t && g.size > 1;
}

// Fewest rows per GEMM for which the rings over the transport (mk, a peer across hosts) are taken. A ring
// multiplies one block of rows per step, and every GEMM packs b again: with few rows the product is that
// packing, so splitting it R ways costs up to R times the product (2 namespace hosts at 1 Gbit/s, 8x1024x1024:
// 4-row blocks made gemm_allreduce 0.65x and allgather_gemm 0.68x of unfused, bench/README.md). Below it the
// op runs one GEMM and mk's collective, as unfused does. SUPERKERNEL_OPS_RING_MIN_ROWS sets it (every rank
// alike: the choice is part of the argument agreement); tests set 1 to run the rings on small shapes. Read at
// every call that may ring (as SUPERKERNEL_OPS_IN_PLACE). Above it, with an automatic chunk count, the ops
// also time their plain path (one GEMM and mk's collective, as below it) as a tuner candidate, unless the
// variable is set (then they always ring).
struct RingRows {
  bool may_ring = false;  // mk with a peer across hosts, R > 1
  bool set = false;       // SUPERKERNEL_OPS_RING_MIN_ROWS is set (not empty)
  int64_t least = 0;      // the threshold (0: not read, or invalid)
  std::string problem;    // the argument error when the variable is invalid (reported through the agreement,
                          // so every rank raises instead of this one alone leaving the others waiting)
  // Whether a ring whose GEMMs have `rows` rows (a block, or a shard) pays for packing b once each.
  bool pays(int64_t rows) const { return may_ring && least > 0 && rows >= least; }
};


RingRows ring_rows(const Group& g, const Pipeline& p) {
  RingRows rr;
  rr.may_ring = g.size > 1 && g.is_mk() && p.over_tcp();
  if (rr.may_ring) {
    rr.least = env_integer("SUPERKERNEL_OPS_RING_MIN_ROWS", 64, 1, rr.problem, &rr.set);
  }
  return rr;
}


// The step every GEMM op starts with: this rank's chunk proposal, and the agreement on the shapes (plus
// `extra` fields) started. chunks() finishes it: either every rank proceeds with rank 0's chunk count or every
// rank raises. In between an op may compute what does not depend on the agreed count (see `early` in the ops):
// the exchange of descriptors then costs nothing on the critical path.
class GemmAgreement {
 public:
  // `may_ride`: the call may ride an armed group's folded agreement (Pipeline::fold_rides; see rides()).
  GemmAgreement(Pipeline& p, const at::Tensor& a, const char* k_name, bool k_must_match, int64_t m, int64_t k,
                int64_t n, bool n_must_match, int64_t requested, ChunkModel model, const std::string& err,
                std::vector<Field> extra = {}, Carried carried = {}, bool may_ride = false)
      : p_(p), dtype_(a.scalar_type()), k_name_(k_name), m_(m), k_(k), n_(n), requested_(requested) {
    model.dtype = a.scalar_type();
    // (a call that carries its payload has no chunks: 1 if it falls back, without consulting the tuner)
    proposal_ = err.empty() && carried.bytes == 0 ? p.chunks(requested, model) : 1;
    std::vector<Field> fields{{"m", m}, {k_name, k, k_must_match}, {"n", n, n_must_match},
                              {"dtype", dtype_code(a.scalar_type())}};
    fields.insert(fields.end(), extra.begin(), extra.end());
    fields.push_back({"SUPERKERNEL_OPS_IN_PLACE", int64_t(p.in_place_allowed()), true});
    for (const Field& f : p.tuner_fields()) fields.push_back(f);
    fields.push_back({"chunks", proposal_, false});
    if (Pipeline::tracing())  // (only for the trace line: formatting them took ~2.5 us per call)
      for (const auto& f : extra)
        if (std::strncmp(f.name, "SUPERKERNEL_", 12) != 0) extra_ += c10::str(" ", f.name, "=", f.value);
    if (may_ride && err.empty() && carried.bytes == 0) {
      std::vector<int64_t> values;
      values.reserve(fields.size());
      for (const Field& f : fields) values.push_back(f.value);
      if (p.fold_rides(ride_key(p.op(), p.rank(), std::move(values)), &plan_)) {
        fields_ = std::move(fields);  // (for agree_now(), should a rank not ride)
        return;
      }
    }
    agreement_.emplace(p.start_agree(std::move(fields), err, std::move(carried)));
  }
  // This call rides the group's folded agreement: no agreement is in flight; the op sends fold_plan()'s
  // allreduce with Pipeline::fold_buffer's header, and after Pipeline::fold_landed is false, agree_now().
  bool rides() const { return !agreement_.has_value(); }
  const Pipeline::FoldPlan& fold_plan() const { return plan_; }
  void agree_now() {
    TORCH_INTERNAL_ASSERT(rides(), "mk ", p_.op(), ": agree_now() on a call that agreed");
    agreement_.emplace(p_.start_agree(std::move(fields_), ""));
  }
  void trace_ride() const {
    p_.trace("m=", m_, " ", k_name_, "=", k_, " n=", n_, " ", dtype_, " chunks=1 (proposed ", chunks_name(proposal_),
             requested_ > 0 ? c10::str(", requested ", requested_) : std::string(", automatic"), ")", extra_,
             " agreement=fold");
  }
  // After chunks(): every rank's descriptor hash (ride_key of its fields), for Pipeline::fold_note.
  std::vector<uint64_t> fold_keys() const {
    std::vector<uint64_t> keys;
    keys.reserve(all_.size());
    for (size_t q = 0; q < all_.size(); ++q) keys.push_back(ride_key(p_.op(), int(q), all_[q]));
    return keys;
  }
  // The hash a rank's call rides on: its descriptor's values, without the last three (the tuner's two and the
  // chunk proposal) on ranks other than 0, whose proposal never decides the path (rank 0's does): a count such a
  // rank requests may change call to call (so did its tuner fields while its tuner, timing other candidates than
  // rank 0's, never finished: mk, 2 namespace hosts, bench/README.md; Tuner::follow_first), which would keep the
  // group from arming. Rank 0's stay in: while its tuner times calls, they change, and the group does not arm.
  static uint64_t ride_key(const char* op, int rank, std::vector<int64_t> values) {
    if (rank != 0) values.resize(values.size() - std::min<size_t>(values.size(), 3));
    return Pipeline::fold_key(op, values);
  }
  // This rank's own proposal (the agreed count is rank 0's; they differ only when ranks request different ones).
  int64_t proposal() const { return proposal_; }
  // After chunks(): the largest value any rank passed for k (i = 1) or n (i = 2).
  int64_t max_over_ranks(size_t i) const {
    int64_t v = 0;
    for (const auto& r : all_) v = std::max(v, r.at(i));
    return v;
  }
  // After chunks(): the smallest and the largest value any rank passed for extra field j.
  int64_t extra_min(size_t j) const {
    int64_t v = all_.at(0).at(kFirstExtra + j);
    for (const auto& r : all_) v = std::min(v, r.at(kFirstExtra + j));
    return v;
  }
  int64_t extra_max(size_t j) const {
    int64_t v = all_.at(0).at(kFirstExtra + j);
    for (const auto& r : all_) v = std::max(v, r.at(kFirstExtra + j));
    return v;
  }
  // After chunks(): what rank 0 passed for extra field j.
  int64_t extra_of_rank0(size_t j) const { return all_.at(0).at(kFirstExtra + j); }
  // What chunks() returns: the path every rank takes, as rank 0 proposed it.
  struct Agreed {
    bool plain;     // the op's plain path (kPlainPath: one collective and one GEMM), not its overlapped one
    int64_t count;  // the chunk count (1 on the plain path)
  };
  Agreed chunks() {
    all_ = agreement_->result();
    const int64_t C = all_[0].back();
    // (a carried call has no chunks: its time says nothing about the chunk count the tuner proposed)
    p_.use_chunks(carried() ? 0 : C, all_, all_[0].size() - 3);
    p_.trace("m=", m_, " ", k_name_, "=", k_, " n=", n_, " ", dtype_, " chunks=", chunks_name(C), " (proposed ",
             chunks_name(proposal_),
             requested_ > 0 ? c10::str(", requested ", requested_) : std::string(", automatic"), ")", extra_,
             agreement_->on_board() ? " agreement=board" : agreement_->on_side() ? " agreement=side" : "", carried() ? " carried" : "");
    return {C == kPlainPath, C == kPlainPath ? 1 : C};
  }
  // After chunks(): every rank's payload came inside the agreement (see CarryLimit).
  bool carried() const { return agreement_->carried(); }
  // ... and rank q's part of it (q != this rank): `bytes`, as this rank carried (the agreed shapes make them
  // alike; anything else is an error, not a read past the message).
  const void* carried_from(int q, size_t bytes) const {
    const size_t got = agreement_->carried_bytes(q);
    TORCH_CHECK(got == bytes, "mk ", p_.op(), ": rank ", p_.rank(), ": rank ", q, " carried ", got,
                " bytes in the argument agreement, expected ", bytes);
    return agreement_->carried_from(q);
  }
  // ... as a [rows, cols] product: fp32 or the input type, as its size says (a rank whose processor has no
  // fast GEMM for a half type makes, and carries, fp32 products; see Products).
  at::Tensor carried_product(int q, int64_t rows, int64_t cols, const at::TensorOptions& opts) const {
    const size_t elems = size_t(rows * cols);
    const at::ScalarType t = agreement_->carried_bytes(q) == elems * sizeof(float) ? at::kFloat : dtype_;
    return at::from_blob(const_cast<void*>(carried_from(q, elems * c10::elementSize(t))), {rows, cols},
                         opts.dtype(t));
  }

 private:
  static constexpr size_t kFirstExtra = 4;  // after m, k, n and dtype
  Pipeline& p_;
  std::vector<Field> fields_;  // (riding: kept for agree_now())
  Pipeline::FoldPlan plan_;    // (riding)
  at::ScalarType dtype_;
  const char* k_name_;
  int64_t m_, k_, n_, requested_, proposal_ = 1;
  std::string extra_;
  std::optional<Agreement> agreement_;
  std::vector<std::vector<int64_t>> all_;
};

// A call riding the armed group's folded agreement (GemmAgreement::rides), for an op whose armed call was one
// GEMM of `a` ([m, k], rows split evenly over the plan's blocks) and one collective of `kind` over the products:
// the products made into the plan's payloads (one GEMM where they follow each other), that collective on this
// thread (as the armed call's last one), and this rank's result as `out_t` when every rank rode; nullopt when
// one did not (the op then agrees as usual).
std::optional<at::Tensor> ride_products(Pipeline& p, const GemmAgreement& ga, const Products& prod,
                                        const at::Tensor& a, int64_t n, Pipeline::FoldPlan::Kind kind,
                                        at::ScalarType out_t) {
  const Pipeline::FoldPlan& plan = ga.fold_plan();
  const int R = p.size();
  const int64_t m = a.size(0), rows = m / plan.blocks(R);
  TORCH_INTERNAL_ASSERT(plan.kind == kind && plan.elems == rows * n, "mk ", p.op(), ": rank ", p.rank(),
                        ": the folded call's block has ", plan.elems, " elements, this call's ", rows * n);
  at::Tensor buf = p.fold_buffer(plan, a.options());
  if (plan.one_payload(R)) {
    prod.into(rows_of(buf, plan.payload_at(0, R), m, n), a);
  } else {  // (one GEMM per block: a header sits between them)
    for (int q = 0; q < R; ++q)
      prod.into(rows_of(buf, plan.payload_at(q, R), rows, n), a.narrow(0, q * rows, rows));
  }
  p.publish(buf);
  at::Tensor got = buf;  // (what the collective leaves here: the allreduced buffer, or this rank's block)
  if (kind == Pipeline::FoldPlan::Kind::reduce_scatter) {
    got = at::empty({plan.block(R)}, buf.options());
    p.on_caller([&] { return p.reduce_scatter(buf, got); }).wait();
  } else {
    p.on_caller([&] { return p.allreduce(buf); }).wait();
  }
  if (!p.fold_landed(got, plan)) return std::nullopt;
  ga.trace_ride();
  const at::Tensor mine = p.fold_payload(got, plan, rows, n);
  return plan.dtype == out_t ? mine : mine.to(out_t);
}

// gemm_reducescatter on mk: a ring of partial sums straight over the transport. At step s rank r works on
// block (r - s - 1) mod R: it multiplies its own part of that block, adds the running sum received from the
// previous rank and sends it on to the next; at the last step the block is r's own and the sum is final.
// The products of a part are computed before its receive is waited for, so the transfer of part i overlaps
// the products of part i+1 (and the next step's). Running sums are in the accumulation type (fp32 for half
// types). All receives are posted up front into distinct buffers.
// With `all` (gemm_allreduce): `out` is rows [r*mb, (r+1)*mb) of *all, and the reduced blocks then travel the
// same ring once more (an allgather into the other blocks of *all): each chunk of this rank's block is sent
// on the moment it is final, so that transfer overlaps the products still to come; ranks beyond the next
// forward what they receive after the last product (R > 2).
// Half types travel in half the bytes where that changes no bit of the result:
// - `first_as_made` (every rank multiplies the half type as it is, agreed): step 0 sends one product, not a
//   sum, so it travels as made and is widened on arrival (exactly what the widened product was);
// - `rounded` (gemm_allreduce of a half type: the [m, n] result in that type): each reduced block is rounded
//   before its allgather, as every rank would round the fp32 sum it received, and the ring gathers into it.
// At 2 ranks the ring then moves only half-type elements, half the bytes of fp32 terms.
void ring_reducescatter(Pipeline& p, const at::Tensor& a, const Products& prod, at::Tensor& out, int64_t mb,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges, bool first_as_made,
                        const at::Tensor* all = nullptr, const at::Tensor* rounded = nullptr) {
  const int R = p.size(), r = p.rank();
  const int next = (r + 1) % R, prev = (r - 1 + R) % R;
  const int64_t n = prod.b.size(1), C = int64_t(ranges.size());
  auto opts = out.options();
  const bool as_made = first_as_made && prod.b.scalar_type() != out.scalar_type();
  at::Tensor incoming = at::empty({R - 1, mb, n}, opts);  // step s (>= 1) receives into incoming[s - 1] ...
  // ... except step 1 when step 0's products travel as made (incoming[0] then holds step 1's sum)
  at::Tensor first_in = as_made ? at::empty({mb, n}, opts.dtype(prod.b.scalar_type())) : at::Tensor();
  at::Tensor first = at::empty({mb, n}, as_made ? first_in.options() : opts);  // step 0's products, sent
  at::Tensor scratch = at::empty({mb, n}, opts);
  const at::Tensor* gathered = rounded ? rounded : all;  // what the allgather moves
  auto received = [&](int s) { return s == 1 && as_made ? first_in : incoming.select(0, s - 1); };
  prod.pack_for(int64_t(R) * C, most_rows(ranges));
  std::vector<Pending> recvs;
  for (int s = 1; s < R; ++s)
    for (int64_t i = 0; i < C; ++i) {
      auto [lo, hi] = ranges[size_t(i)];
      recvs.push_back(p.recv(received(s).narrow(0, lo, hi - lo), prev, uint32_t((s - 1) * C + i)));
    }
  // allgather step t brings block (r - t - 1) mod R from prev (message slots after the reduce-scatter's)
  const uint32_t ag = uint32_t(R * C);
  std::vector<Pending> ag_recvs;
  if (all)
    for (int t = 0; t + 1 < R; ++t) {
      const int64_t blk = ((r - t - 1) % R + R) % R;
      for (int64_t i = 0; i < C; ++i) {
        auto [lo, hi] = ranges[size_t(i)];
        ag_recvs.push_back(p.recv(gathered->narrow(0, blk * mb + lo, hi - lo), prev, ag + uint32_t(t * C + i)));
      }
    }
  std::vector<Pending> sends;
  for (int s = 0; s < R; ++s) {
    const int64_t blk = ((r - s - 1) % R + R) % R;
    for (int64_t i = 0; i < C; ++i) {
      auto [lo, hi] = ranges[size_t(i)];
      const int64_t rows = hi - lo;
      at::Tensor src = a.narrow(0, blk * mb + lo, rows);
      if (s == 0) {
        at::Tensor dst = first.narrow(0, lo, rows);
        prod.into(dst, src);
        if (R > 1) sends.push_back(p.send(dst, next, uint32_t(i)));
        if (R == 1) out.narrow(0, lo, rows).copy_(dst);
        continue;
      }
      at::Tensor mine = s + 1 < R ? scratch.narrow(0, lo, rows) : out.narrow(0, lo, rows);
      prod.into(mine, src);
      recvs[size_t((s - 1) * C + i)].wait();
      at::Tensor sum = received(s).narrow(0, lo, rows);
      if (s + 1 < R) {
        at::Tensor total = incoming.select(0, s - 1).narrow(0, lo, rows);
        if (total.scalar_type() == sum.scalar_type())
          total.add_(mine);
        else
          at::add_out(total, sum, mine);  // (the product as made, widened: the same sum)
        sends.push_back(p.send(total, next, uint32_t(s * C + i)));
      } else {
        mine.add_(sum);
        if (all) {
          at::Tensor final_rows = mine;
          if (rounded) {
            final_rows = rounded->narrow(0, int64_t(r) * mb + lo, rows);
            final_rows.copy_(mine);
          }
          sends.push_back(p.send(final_rows, next, ag + uint32_t(i)));
        }
      }
    }
  }
  if (all) {
    for (int t = 1; t + 1 < R; ++t) {
      const int64_t blk = ((r - t) % R + R) % R;  // received at step t - 1, passed on now
      for (int64_t i = 0; i < C; ++i) {
        auto [lo, hi] = ranges[size_t(i)];
        ag_recvs[size_t((t - 1) * C + i)].wait();
        sends.push_back(p.send(gathered->narrow(0, blk * mb + lo, hi - lo), next, ag + uint32_t(t * C + i)));
      }
    }
    for (auto& x : ag_recvs) x.wait();
  }
  for (auto& x : sends) x.wait();
}

// Rows per chunk of an in-place shm collective (pipeline.h's in_place_shm): what a staging slot holds (a
// chunk holds `slot_pieces` row ranges), or fewer when a chunk count above one was agreed; 0 when a row does
// not fit in a slot (the op then uses the backend's collectives).
size_t in_place_rows(Pipeline& p, int64_t rows, size_t row_bytes, size_t slot_pieces, int64_t chunks) {
  if (!p.in_place_shm() || rows <= 0 || row_bytes == 0) return 0;
  const size_t most = coll::shm_rows_per_chunk(p.group().comm(), row_bytes, slot_pieces);
  return std::min<size_t>(most, size_t((rows + chunks - 1) / std::max<int64_t>(chunks, 1)));
}

// Whether splitting into the in-place path's GEMMs pays: each GEMM packs b ([k, n]) again, so its
// `gemms_per_chunk` x chunks GEMMs read (G - 1) k n more elements than one GEMM over all rows, against `saved`
// elements of staging copy they avoid. In place when (G - 1) k n <= 2 saved, or when a chunk count above one
// was asked for (the GEMM is split on either path). Arguments that may differ between ranks (gemm_allreduce's
// k, allgather_gemm's n) must be the agreed maxima, so every rank decides alike. Measured on 2 ranks, one
// host (2026-11-25, in place at every size): gemm_reducescatter 1024x128x1024 (G = 8) 1.11x of unfused, but
// 1024^3 (G = 8) 0.92x and 2048x512x2048 (G = 32) 0.86x; gemm_allreduce 2048x512x2048 (G = 16) 0.94x.
// A GEMM oneDNN makes in a half type (`half_products`, agreed: every rank's) also costs a fixed ~0.02 ms per
// call, counted as kHalfGemmCall elements of copy. Intel VM (AVX512-BF16/FP16, 2026-11-27): 8 rows of a 64x64
// bf16 b took 0.023 ms, fp32 0.002 ms; allgather_gemm's two 64-row GEMMs of 64^3 in place were 0.66-0.71x of
// unfused, one GEMM after a copy 0.92-0.94x; 131072 then. AMD EPYC VM (AVX512-BF16, 2026-11-28): a second bf16
// GEMM over the same b costs 0.020-0.026 ms more than one over all rows (fp32 0.006-0.016). allgather_gemm
// on 2 ranks in place against one GEMM after the copy (medians of 300-400 interleaved calls; copy / in
// place): 192x256x256 0.93, 256^3 0.93-0.97, 384x256x256 0.96, 512x128x128 0.94, 512x256x256 0.97,
// 768x128x128 1.00, 1024x128x128 0.99, 1.01 and 1.16 (three runs), 1024x256x256 1.00, 256x512x512 1.01, 512^3
// 1.03-1.08 (bench/README.md); 2^19 picks the faster form in each but the one 1024x128x128 run. A larger
// term only leans toward one GEMM after a copy, which costs at most that copy.
// A GEMM that small_half_gemm widens does not pay that cost, but the term applies to every half-type op (the
// tests model the rule as it is, with kHalfGemmCall from superkernel._C).
bool in_place_pays(int64_t rows, size_t per_chunk, int64_t gemms_per_chunk, int64_t chunks, int64_t k, int64_t n,
                   double saved, bool half_products) {
  if (per_chunk == 0) return false;
  if (chunks > 1) return true;
  const double gemms = double((size_t(rows) + per_chunk - 1) / per_chunk) * double(gemms_per_chunk);
  return (gemms - 1) * (double(k) * double(n) + (half_products ? kHalfGemmCall : 0.0)) <= 2 * saved;
}

// A tensor over staging-slot memory (valid only inside the collective's callback).
at::Tensor slot_tensor(const char* p, int64_t rows, int64_t cols, const at::TensorOptions& o) {
  return at::from_blob(const_cast<char*>(p), {rows, cols}, o);
}

// This rank's word on packing b (Products::may_pack): packed_gemm_offer (whose probe runs then, once per process)
// where this rank's fp32 products could come from a packed b at all; 0 where it never packs (no MKL,
// SUPERKERNEL_OPS_PACKED_B=0); 1 where its b is too small to pack or its products are half-type, which leaves the
// decision to the ranks that would pack. Each op packs only where every rank offered (the smallest, agreed):
// allgather_gemm's blocks are then made alike on every rank; gemm_allreduce's and gemm_reducescatter's terms
// would not need it (a sum's bytes do not depend on how its terms were made), but one rule is one to test.
int64_t pack_offer(const at::Tensor& a, const at::Tensor& b, bool made_half) {
  if (made_half || !a.device().is_cpu() || b.dim() != 2) return 1;
  if (!packed_gemm_available()) return 0;
  if (!packed_gemm_pays(kPackedMinGemms, 1, b.size(0), b.size(1))) return 1;
  return packed_gemm_offer() ? 1 : 0;
}

}  // namespace

std::tuple<at::Tensor, at::Tensor> allgather_gemm(const at::Tensor& a_in, const at::Tensor& b_in,
                                                  c10::string_view group_name, bool return_gathered, int64_t chunks) {
  const char* op = "allgather_gemm";
  Group g = resolve_group(std::string(group_name), a_in.device(), op);
  Pipeline p(g, op);
  std::string err = check_operands(a_in, b_in, "[m, k]", "[k, n]");
  if (err.empty() && chunks < 0) err = "chunks must be >= 0 (0 = automatic)";
  const int64_t m = dim_or(a_in, 0), k = dim_or(a_in, 1), n = dim_or(b_in, 1);
  const int R = g.size, r = g.rank;
  ChunkModel model;
  model.comm_bytes = double(R - 1) * double(std::max<int64_t>(m, 0)) * double(std::max<int64_t>(k, 0)) * a_in.element_size();
  model.flops = 2.0 * R * double(std::max<int64_t>(m, 0)) * std::max<int64_t>(k, 0) * std::max<int64_t>(n, 0);
  model.max_chunks = std::max<int64_t>(1, m);
  // mk across hosts: a ring over the transport, when a shard has rows enough for a GEMM of its own. With an
  // automatic chunk count the tuner also times the plain path (kPlainPath: one allgather, then one GEMM, as
  // unfused): where the link's transfer is short next to the product, or where more GEMM threads than cores
  // run (the ranks' teams and the transport's threads then preempt each other; which of them costs is not
  // isolated), the ring's overlap costs more than it hides. 2 namespace hosts at 1 Gbit/s, bf16
  // 1024x128x1024 (bench/README.md): with two threads per rank on two shared cores the ring was 0.32x of
  // unfused, the plain path kept by the tuner 0.99x; with one, the ring 0.82-0.95x over five runs and
  // 0.89-0.94x over four since (the two time alike there, and the tuner keeps either); with each rank pinned
  // to a core of its own, the rings kept paying where they paid unpinned.
  const RingRows rr = ring_rows(g, p);
  if (err.empty()) err = rr.problem;
  const bool may_ring = err.empty() && rr.pays(m);
  model.plain_too = may_ring && !rr.set;
  const CarryLimit cl = carry_limit(p, CarryTotal::every_peer, kCarryMaxGather);
  if (err.empty()) err = cl.problem;
  // (b is only multiplied, never sent: a strided b, such as the transposed view a backward passes, is used
  // as it is; mm reads it in place, where a copy of a 1024^2 transpose cost milliseconds)
  at::Tensor a, c;
  std::optional<Products> prod;  // (fp16 without a fast CPU GEMM: on widened operands, see Products)
  auto prepare = [&] {
    if (a.defined()) return;
    a = a_in.contiguous();
    prod.emplace(a_in, b_in, /*exact=*/false, R * m);
    c = at::empty({R * m, n}, a.options());
  };
  // A half type made as it is: which GEMMs are small enough to make widened is measured per process
  // (small_half_limit) and may differ between ranks; every rank uses rank 0's limit, so that each block is
  // multiplied alike everywhere.
  const bool made_half = Products::type(a_in, /*exact=*/false) != at::kFloat;
  const int64_t small_limit = made_half && a_in.device().is_cpu() ? small_half_limit(a_in.scalar_type()) : 0;
  // A small shard travels inside the agreement (its bytes to every peer): up to 64 KiB per peer on mk; up to
  // 4 MiB on other backends (kCarryMaxGather), where those sends are what the allgather would send, and the
  // exchange then hides this rank's own rows' product (early_own) and saves a second exchange. Gloo between
  // 2 namespace hosts at 1 Gbit/s, 2 ranks, medians of 60 interleaved calls against the allgather after the
  // agreement (chunks=1): fp16 512^3 (512 KiB shard) 6.5-6.9 ms against 7.7-8.3 (unfused 6.7-6.8), fp32
  // 512^3 (1 MiB) 11.3 against 13.1 (unfused 12.4), fp16 1024^3 (2 MiB) 38.0 against 53.7 (unfused 50.5).
  Carried carried;
  const bool offer = err.empty() && chunks == 0 && cl.fits(R, m * k * a_in.element_size());
  if (offer) {
    prepare();
    carried.bytes = size_t(m * k * a.element_size());
    carried.data = [&a](int) { return a.data_ptr(); };
  }
  // (riding an armed group's folded agreement, see Pipeline::fold_note: mk across hosts, whose plain path is one
  // allgather and one GEMM; not with `gathered` returned, which a ride's blocks do not hold as one tensor)
  const bool may_ride = g.is_mk() && g.device.is_cpu() && R > 1 && !p.one_host() && !return_gathered;
  // (n may differ: each rank multiplies the gathered rows by its own b, e.g. an uneven column split)
  GemmAgreement ga(p, a_in, "k", true, m, k, n, false, chunks, model, err,
                   {{"return_gathered", int64_t(return_gathered), true}, {"ring", int64_t(may_ring), true},
                    {"half_products", int64_t(made_half), false}, {"small_half_limit", small_limit, false},
                    {"SUPERKERNEL_OPS_FOLD", int64_t(Pipeline::fold_allowed()), false},
                    {"packs_b", err.empty() ? pack_offer(a_in, b_in, made_half) : 0, false}},
                   std::move(carried), may_ride);
  if (ga.rides()) {
    // The call the group armed with, again on this rank (same descriptor): its shard, with its word, gathered
    // in place by the one allgather that call made (on this thread, as that call's), and its GEMM over the
    // gathered rows, with rank 0's limit for small half-type GEMMs as every rank used then.
    const Pipeline::FoldPlan plan = ga.fold_plan();
    TORCH_INTERNAL_ASSERT(plan.kind == Pipeline::FoldPlan::Kind::allgather && plan.elems == m * k, "mk ", op,
                          ": rank ", g.rank, ": the folded call's shard has ", plan.elems, " elements, this call's ",
                          m * k);
    const at::Tensor a_ride = a_in.contiguous();
    const Products ride(a_in, b_in, /*exact=*/false, R * m, /*widen_anyway=*/false, plan.aux);
    at::Tensor buf = p.fold_buffer(plan, a_ride.options(), /*reused=*/true);
    const int64_t block = plan.block(R);
    copy_bytes(static_cast<char*>(buf.data_ptr()) + plan.payload_at(r, R) * buf.element_size(), a_ride.data_ptr(),
               a_ride.nbytes());
    const at::Tensor own = alias_of(buf, buf.storage_offset() + r * block, {block}, {1});
    p.on_caller([&] { return p.allgather(own, buf); }).wait();
    if (p.fold_landed(buf, plan)) {
      ga.trace_ride();
      at::Tensor out = at::empty({R * m, n}, a_ride.options());
      if (plan.one_payload(R)) {
        ride.into(out, rows_of(buf, plan.payload_at(0, R), R * m, k));
      } else {  // (one GEMM per shard: a header sits between them)
        for (int q = 0; q < R; ++q)
          ride.into(out.narrow(0, q * m, m), rows_of(buf, plan.payload_at(q, R), m, k));
      }
      return {out, a_ride.new_empty({0, k})};
    }
    ga.agree_now();  // a rank did not ride this call: every rank agrees as usual (the shards travel again)
  }
  // Other backends on CPU (Gloo): the agreement is an exchange of its own (384 B each way took 0.18-0.32 ms
  // on Gloo here, about a 256^3 product), so this rank's own rows are multiplied while it
  // travels. Not on mk, where the agreement costs microseconds and splitting the GEMM in two measured slower
  // than the exchange it would hide (one host, 256^3 on 2 ranks: 0.92-0.94x of unfused against 0.97-1.03x;
  // across hosts too: 2 namespace hosts at 1 Gbit/s, bf16 1024x128x1024 on the plain path, medians of the
  // slowest rank over 150 interleaved calls, 6.87 ms with this rank's rows early against 4.51 without).
  // Only when one chunk is planned or the shard is offered (carried, every block is multiplied whole): every
  // rank then multiplies each rank's block with one GEMM of m rows, so the output is bitwise the same on
  // every rank (with more chunks each block is multiplied chunk by chunk everywhere, and an early product of
  // this rank's rows is redone that way).
  // Carried shards of at most kCarryMaxOther travel in about the time of the agreement alone, and there the
  // split GEMM cost more than it hid (Gloo, 2 hosts at 1 Gbit/s, fp16 128x256x256: 0.89x of unfused with
  // this rank's rows early, 1.05-1.15x without; 0.92x against 1.10x with 2 ranks per host).
  const bool early_own = err.empty() && R > 1 && !g.is_mk() && a_in.device().is_cpu() && m > 0 && n > 0 &&
                         (offer ? m * k * a_in.element_size() > int64_t(kCarryMaxOther) : ga.proposal() == 1);
  if (early_own) {
    prepare();
    // The GEMM's rounding can depend on where its input starts (its kernels pick paths by alignment): the
    // other ranks multiply this block from `gathered`, at byte offset r m k (element size) of a buffer
    // aligned to 64, so this rank's copy of it starts at the same offset modulo 64.
    const int64_t es = a.element_size(), lanes = 64 / es;
    const int64_t skew = ((int64_t(r) * m * k * es) % 64) / es;
    at::Tensor buf = at::empty({m * k + lanes}, a.options());
    const int64_t shift = ((skew - int64_t(reinterpret_cast<uintptr_t>(buf.data_ptr()) % 64) / es) % lanes + lanes) % lanes;
    at::Tensor src = buf.narrow(0, shift, m * k).view({m, k});
    src.copy_(a);
    at::Tensor own = c.narrow(0, r * m, m);
    prod->into(own, src);
  }
  const GemmAgreement::Agreed agreed = ga.chunks();
  const bool ring = may_ring && !agreed.plain;
  const int64_t C = agreed.count;
  prepare();
  // Ranks that make half-type products differently (hosts whose processors differ, see native_half_gemm) all
  // widen, so that every rank multiplies each block alike and the output is the same bytes everywhere.
  const bool mixed = ga.extra_min(2) != ga.extra_max(2);
  const bool other_limit = !mixed && ga.extra_of_rank0(3) != small_limit;
  if (mixed && !prod->widen) prod.emplace(a_in, b_in, /*exact=*/false, R * m, /*widen_anyway=*/true);
  if (other_limit) prod.emplace(a_in, b_in, /*exact=*/false, R * m, false, ga.extra_of_rank0(3));
  prod->may_pack = ga.extra_min(5) != 0;  // (every rank offered to pack b)
  const bool own_done = early_own && (C == 1 || ga.carried()) && !mixed && !other_limit;
  // (the caller does not get `gathered` back unless asked: then a fresh tensor, else a reused buffer, which
  // the in-place path below never needs)
  at::Tensor gathered;
  auto gathered_buffer = [&] {
    if (!gathered.defined())
      gathered = return_gathered ? at::empty({R * m, k}, a.options()) : scratch(R * m, k, a.options());
    return gathered;
  };
  if (return_gathered) gathered_buffer();
  // c from the whole `gathered`: one GEMM over all rows, or one per rank's block where any rank may have multiplied
  // its own rows early (this rank's skipped when it did). Which of the two is decided from agreed values only:
  // whether a rank multiplied early depends on its own proposal and its own measured small-GEMM limit, and a
  // GEMM's rounding can depend on the rows it is given (on an Intel VM with AMX, bf16 [144, 2048] x [2048, 64]
  // as one GEMM and as three of 48 rows differed in 23 elements over 20 inputs), so a rank that made one GEMM
  // while the others made one per block returned other bytes (Gloo, 3 ranks, bench/README.md).
  const bool per_block = !g.is_mk() && a_in.device().is_cpu() && (C == 1 || ga.carried()) && !mixed;
  auto multiply_gathered = [&] {
    if (!per_block) {
      prod->into(c, gathered);
      return;
    }
    for (int j = 0; j < R; ++j) {
      if (j == r && own_done) continue;
      at::Tensor dst = c.narrow(0, j * m, m);
      prod->into(dst, gathered.narrow(0, j * m, m));
    }
  };
  if (m == 0) return {c, return_gathered ? gathered : a.new_empty({0, k})};
  if (R == 1) {  // the shard is all there is: multiplied where it is (a copy of it only when asked for)
    prod->into(c, a);
    if (return_gathered) gathered.copy_(a);
    return {c, return_gathered ? gathered : a.new_empty({0, k})};
  }
  if (ga.carried()) {  // every shard came with the agreement: multiplied as after an allgather
    gathered_buffer();
    for (int q = 0; q < R; ++q) {
      at::Tensor dst = gathered.narrow(0, q * m, m);
      if (q != r)
        copy_bytes(dst.data_ptr(), ga.carried_from(q, dst.nbytes()), dst.nbytes());
      else if (!own_done || return_gathered)  // (else this block is never read)
        dst.copy_(a);
    }
    multiply_gathered();
    return {c, return_gathered ? gathered : a.new_empty({0, k})};
  }
  if (R > 1 && !ring) {
    // Other backends, mk on one host, and mk across hosts with shards too small for a ring: collectives.
    // One chunk: one allgather of the shards into `gathered` (on this thread, as unfused), then one GEMM over
    // all rows. More chunks: the
    // allgather of row part i+1 runs while part i's rows of every shard are multiplied. (A ring of separate
    // sends and receives would deadlock NCCL, whose point-to-point calls outside a group are serialised on
    // one stream; on one host it would copy each shard twice per hop, where the shm collective copies it in
    // once and out once.)
    // mk on one host: the shards are staged in shared memory once and every rank multiplies each one
    // straight from its slot (no copy out into `gathered`), chunk by chunk as they are staged.
    const size_t row_bytes = size_t(k) * a.element_size();
    const size_t rows = in_place_rows(p, m, row_bytes, 1, C);
    if (in_place_pays(m, rows, R, C, k, ga.max_over_ranks(2), double(R) * m * k, ga.extra_min(2) != 0)) {
      const char* src = static_cast<const char*>(a.data_ptr());
      p.run_in_place("allgather", rows, [&](Comm& comm) {
        coll::shm_allgather_rows(
            comm, size_t(m), row_bytes, rows,
            [&](char* dst, size_t row, size_t nrows) { copy_bytes(dst, src + row * row_bytes, nrows * row_bytes); },
            [&](int j, const char* from, size_t row, size_t nrows) {
              at::Tensor part = slot_tensor(from, int64_t(nrows), k, a.options());
              at::Tensor dst = c.narrow(0, j * m + int64_t(row), int64_t(nrows));
              prod->into(dst, part);
              if (return_gathered) gathered.narrow(0, j * m + int64_t(row), int64_t(nrows)).copy_(part);
            });
      }, return_gathered ? std::vector<at::Tensor>{a, c, gathered} : std::vector<at::Tensor>{a, c});
      return {c, return_gathered ? gathered : a.new_empty({0, k})};
    }
    gathered_buffer();
    if (C == 1) {
      p.on_caller([&] { return p.allgather(a, gathered); }).wait();
      multiply_gathered();
      // One allgather, every rank allowing the fold and multiplying alike, mk across hosts: a call the group
      // may arm with (every input here is agreed, so every rank notes alike).
      if (may_ride && !own_done && !mixed && !p.one_host() && ga.extra_min(4) == 1) {
        Pipeline::FoldPlan plan{Pipeline::FoldPlan::Kind::allgather, m * k, a.scalar_type()};
        plan.aux = ga.extra_of_rank0(3);
        p.fold_note(ga.fold_keys(), plan);
      }
      return {c, return_gathered ? gathered : a.new_empty({0, k})};
    }
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (int64_t i = 0; i < C; ++i) {
      auto rg = chunk_range(m, C, i);
      if (rg.second > rg.first) ranges.push_back(rg);
    }
    const size_t N = ranges.size();
    prod->pack_for(int64_t(N) * R, most_rows(ranges));
    std::vector<at::Tensor> parts(N);
    auto issue = [&](size_t i) {
      auto [lo, hi] = ranges[i];
      parts[i] = at::empty({R, hi - lo, k}, a.options());
      return p.allgather(a.narrow(0, lo, hi - lo), parts[i]);
    };
    Pending cur = issue(0);
    for (size_t i = 0; i < N; ++i) {
      Pending nxt = i + 1 < N ? issue(i + 1) : Pending();
      cur.wait();
      auto [lo, hi] = ranges[i];
      for (int j = 0; j < R; ++j) {
        at::Tensor src = parts[i].select(0, j);
        if (!(own_done && j == r)) {
          at::Tensor dst = c.narrow(0, j * m + lo, hi - lo);
          prod->into(dst, src);
        }
        if (return_gathered) gathered.narrow(0, j * m + lo, hi - lo).copy_(src);
      }
      parts[i] = at::Tensor();
      cur = std::move(nxt);
    }
    return {c, return_gathered ? gathered : a.new_empty({0, k})};
  }

  // mk: a ring straight over the transport.
  gathered_buffer().narrow(0, r * m, m).copy_(a);
  const int next = (r + 1) % R, prev = (r - 1 + R) % R;
  auto part = [&](int64_t block, int64_t i) {
    auto [lo, hi] = chunk_range(m, C, i);
    return std::make_pair(block * m + lo, hi - lo);
  };
  int64_t most = 0;
  for (int64_t i = 0; i < C; ++i) most = std::max(most, part(0, i).second);
  prod->pack_for(int64_t(R) * C, most);
  // Post every receive up front (distinct buffers: step s brings block (r - s - 1) mod R from prev).
  std::vector<Pending> recvs(size_t(std::max(R - 1, 0) * C));
  for (int s = 0; s + 1 < R; ++s) {
    const int64_t blk = ((r - s - 1) % R + R) % R;
    for (int64_t i = 0; i < C; ++i) {
      auto [row, rows] = part(blk, i);
      if (rows > 0) recvs[size_t(s * C + i)] = p.recv(gathered.narrow(0, row, rows), prev, uint32_t(s * C + i));
    }
  }
  std::vector<Pending> sends;
  sends.reserve(size_t(std::max(R - 1, 0) * C));
  for (int s = 0; s < R; ++s) {
    const int64_t blk = ((r - s) % R + R) % R;  // the block in hand at step s
    for (int64_t i = 0; i < C; ++i) {
      auto [row, rows] = part(blk, i);
      if (rows == 0) continue;
      if (s > 0) recvs[size_t((s - 1) * C + i)].wait();
      at::Tensor src = gathered.narrow(0, row, rows);
      if (s + 1 < R) sends.push_back(p.send(src, next, uint32_t(s * C + i)));
      at::Tensor dst = c.narrow(0, row, rows);
      prod->into(dst, src);
    }
  }
  for (auto& s : sends) s.wait();
  return {c, return_gathered ? gathered : a.new_empty({0, k})};
}

at::Tensor gemm_allreduce(const at::Tensor& a_in, const at::Tensor& b_in, c10::string_view group_name, int64_t chunks) {
  const char* op = "gemm_allreduce";
  Group g = resolve_group(std::string(group_name), a_in.device(), op);
  Pipeline p(g, op);
  std::string err = check_operands(a_in, b_in, "[m, k_r]", "[k_r, n]");
  if (err.empty() && chunks < 0) err = "chunks must be >= 0 (0 = automatic)";
  const int64_t m = dim_or(a_in, 0), k = dim_or(a_in, 1), n = dim_or(b_in, 1);
  const at::ScalarType acc_t = accumulate_type(a_in.scalar_type());
  const at::ScalarType made_t = Products::type(a_in, /*exact=*/true);
  bool sum_here = sums_here(g, acc_t, made_t, /*most_ranks=*/4);  // (until a rank that makes fp32 says no)
  bool mk_half = mk_sums_half(g, acc_t, made_t);                      // (likewise)
  const bool made_half = made_t != acc_t;
  ChunkModel model;  // (bytes sent by a rank: a ring allreduce's, or the gathered products' when sum_here)
  model.comm_bytes = double(std::max<int64_t>(m, 0)) * std::max<int64_t>(n, 0) *
                     (sum_here ? double(g.size - 1) * c10::elementSize(made_t) : 2.0 * c10::elementSize(acc_t));
  model.flops = 2.0 * double(std::max<int64_t>(m, 0)) * std::max<int64_t>(k, 0) * std::max<int64_t>(n, 0);
  // Over tcp, when R divides m: a ring straight over the transport (reduce-scatter of partial sums, then
  // allgather of the reduced blocks, see ring_reducescatter), so the link never waits for a collective to be
  // issued and finished per chunk; elsewhere each chunk's allreduce is a collective.
  const int R = g.size;
  const RingRows rr = ring_rows(g, p);
  if (err.empty()) err = rr.problem;
  const bool may_ring = err.empty() && m > 0 && m % R == 0 && rr.pays(m / R);
  model.max_chunks = std::max<int64_t>(1, may_ring ? m / R : m);  // (the ring splits each rank's block of rows)
  model.plain_too = may_ring && !rr.set;  // (see allgather_gemm)
  const CarryLimit cl = carry_limit(p, CarryTotal::one_peer, R == 2 ? kPairCarryBytes : kCarryMaxOther);
  if (err.empty()) err = cl.problem;
  const bool half = acc_t != a_in.scalar_type();
  at::Tensor a, acc, term;  // term: this rank's product as it travels (acc, or as made: sum_here, mk_half)
  std::optional<Products> prod;
  bool packs = false;  // every rank offered to pack b (agreed; no product made before the agreement packs)
  auto prepare = [&] {
    if (a.defined()) return;
    a = a_in.contiguous();
    prod.emplace(a_in, b_in, /*exact=*/true, m);
    prod->may_pack = packs;
    acc = at::empty({m, n}, a.options().dtype(acc_t));
  };
  auto make_term = [&] {  // (one rank: the product is the result, made as the unfused matmul makes it)
    if (!term.defined()) term = sum_here || mk_half || g.size == 1 ? at::empty({m, n}, a.options().dtype(made_t)) : acc;
  };
  // A small product is computed first and travels inside the agreement (the whole of it to every peer), in
  // the type it was made in (a half-type product made on the CPU loses nothing by travelling unwidened).
  Carried carried;
  at::Tensor own;  // this rank's product when offered
  const bool offer = err.empty() && chunks == 0 && m > 0 && n > 0 &&
                     cl.fits(R, m * n * int64_t(c10::elementSize(made_t)));
  if (offer) {
    prepare();
    own = prod->made(a, acc);
    carried.bytes = size_t(own.nbytes());
    carried.data = [&own](int) { return own.data_ptr(); };
  }
  // (riding an armed group's folded agreement, see Pipeline::fold_note: CPU tensors, ranks on more than one host)
  const bool may_ride = g.device.is_cpu() && R > 1 && !p.one_host();
  GemmAgreement ga(p, a_in, "k_r", false, m, k, n, true, chunks, model, err,
                   {{"ring", int64_t(may_ring), true}, {"half_products", int64_t(made_half), false},
                    {"SUPERKERNEL_OPS_FOLD", int64_t(Pipeline::fold_allowed()), false},
                    {"packs_b", err.empty() ? pack_offer(a_in, b_in, made_half) : 0, false}},
                   std::move(carried), may_ride);
  if (ga.rides()) {
    // The call the group armed with, again on this rank (same descriptor): its product and the one allreduce
    // that call made, with the header that tells whether every rank rode it. (Not prepare(): a ride needs no
    // fp32 buffer of its own.)
    prod.emplace(a_in, b_in, /*exact=*/true, m);
    if (auto sum = ride_products(p, ga, *prod, a_in.contiguous(), n, Pipeline::FoldPlan::Kind::allreduce,
                                 a_in.scalar_type()))
      return *sum;
    prod.reset();
    ga.agree_now();  // a rank did not ride this call: every rank agrees as usual (the product is made again)
  }
  // mk on one host: the products are written straight into the shm staging slots (no copy in), chunk by
  // chunk, and the sum lands in acc.
  const size_t row_bytes = size_t(std::max<int64_t>(n, 0)) * c10::elementSize(acc_t);
  const bool slots_fit = err.empty() && !may_ring && in_place_rows(p, m, row_bytes, 1, 1) > 0;
  // The in-place path's rows per chunk for a chunk count, the largest k, whether the terms travel as made and
  // whether every rank makes half-type products; 0 when it does not run.
  auto in_place_plan = [&](int64_t chunks, int64_t kmax, bool terms_half, bool half_products) -> size_t {
    if (!slots_fit) return 0;
    const size_t rows = in_place_rows(p, m, size_t(n) * c10::elementSize(terms_half ? made_t : acc_t), 1,
                                      std::max<int64_t>(chunks, 1));
    return in_place_pays(m, rows, 1, chunks, kmax, n, double(m) * n, half_products) ? rows : 0;
  };
  // Whether this rank expects the in-place path, from its own arguments (the agreed k, chunk count and product
  // type decide it after the agreement; a rank that expected otherwise has made the product for nothing, or
  // makes it after the agreement).
  const bool expect_in_place = in_place_plan(ga.proposal(), k, mk_half, made_half) > 0;
  // One chunk planned, no ring (or the plain path proposed), not in place: the whole product a_r @ b_r does not
  // depend on the agreed chunk count, so it is computed while the agreement travels (if rank 0 asked for more
  // chunks, they are reduced from it; if it chose the ring, that computes its own). Rows that fit a slot but
  // would not go in place were made after the agreement until 2026-12-01 (see bench/README.md).
  // (a product computed to be carried is that product, whatever the path)
  const bool early = offer || (err.empty() && m > 0 && n > 0 &&
                               (may_ring ? ga.proposal() == kPlainPath : !expect_in_place && ga.proposal() == 1));
  if (early && !offer) {
    prepare();
    make_term();
    prod->into(term, a);
    p.publish(term);
  }
  const GemmAgreement::Agreed agreed = ga.chunks();
  const bool ring = may_ring && !agreed.plain;
  const int64_t C = agreed.count;
  packs = ga.extra_min(3) != 0;
  if (prod) prod->may_pack = packs;
  const bool all_half = ga.extra_min(1) != 0;  // every rank makes its products in the half type
  if ((sum_here || mk_half) && !all_half) {  // a rank made fp32 products (see sums_here): every rank sums fp32
    sum_here = mk_half = false;
    if (term.defined() && !term.is_same(acc)) acc.copy_(term);
    term = acc;
  }
  if (ga.carried()) {  // every rank's product came with the agreement: summed in rank order, alike everywhere
    auto part = [&](int q) -> at::Tensor {
      if (q == g.rank) return own;
      return ga.carried_product(q, m, n, own.options());
    };
    if (half) {
      at::Tensor out = at::empty({m, n}, a.options());
      if (sum_half_in_rank_order(out, R, part)) return out;
    }
    at::Tensor sum = at::empty({m, n}, acc.options());
    sum_in_rank_order(sum, R, part);
    return half ? sum.to(a_in.scalar_type()) : sum;
  }
  if (offer && (sum_here || mk_half)) {
    term = own;  // offered but not carried: the product, as made
  } else if (offer && !own.is_same(acc)) {
    acc.copy_(own);  // ... widened
  }
  const size_t in_place_chunk = in_place_plan(C, ga.max_over_ranks(1), mk_half, all_half);
  const bool in_place = in_place_chunk > 0;
  if (!early) prepare();
  if (m == 0 || n == 0) return half ? acc.to(a_in.scalar_type()) : acc;
  if (g.size == 1) {  // the product, in the input type where it is made so: no fp32 buffer, no pass to round it
    if (!early) {
      make_term();
      prod->into(term, a);
    }
    return term.scalar_type() == a_in.scalar_type() ? term : term.to(a_in.scalar_type());
  }
  if (ring) {
    const int64_t mb = m / R;
    std::vector<std::pair<int64_t, int64_t>> blocks;
    for (int64_t i = 0; i < C; ++i) {
      auto rg = chunk_range(mb, C, i);
      if (rg.second > rg.first) blocks.push_back(rg);
    }
    at::Tensor mine = acc.narrow(0, int64_t(g.rank) * mb, mb);
    at::Tensor rounded = half ? at::empty({m, n}, a.options()) : at::Tensor();
    ring_reducescatter(p, a, *prod, mine, mb, blocks, all_half, &acc, half ? &rounded : nullptr);
    return half ? rounded : acc;
  }
  if (in_place) {
    const size_t rows = in_place_chunk;
    // (half-type products are summed into the half-type result, see mk_sums_half)
    at::Tensor sum = mk_half ? at::empty({m, n}, a.options().dtype(made_t)) : acc;
    p.run_in_place("allreduce", rows, [&](Comm& comm) {
      coll::shm_allreduce_rows(comm, sum.data_ptr(), size_t(m), size_t(n), mk_float(sum.scalar_type()), rows,
                               [&](char* dst, size_t row, size_t nrows) {
                                 at::Tensor out = slot_tensor(dst, int64_t(nrows), n, sum.options());
                                 prod->into(out, a.narrow(0, int64_t(row), int64_t(nrows)));
                               });
    }, {a, prod->b, sum});
    return half && !mk_half ? acc.to(a_in.scalar_type()) : sum;
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t i = 0; i < C; ++i) {
    auto rg = chunk_range(m, C, i);
    if (rg.second > rg.first) ranges.push_back(rg);
  }
  // Two ranks summing here: the backend's allreduce of the half-type products is that sum, bit for bit (one
  // addition per element, which Gloo makes in fp32 and rounds once). For chunks of at least
  // kPairAllreduceBytes it is the faster collective (the same bytes; between 2 namespace hosts at 1 Gbit/s,
  // fp16 1024^3 with one chunk: 34.3 ms against 43.6 through the allgather, unfused 33.3); below, Gloo's ring
  // pays its two steps (512^3: 7.4 against 6.9). The sum then lands in the products' own buffer.
  const bool pair = sum_here && R == 2;
  auto pair_chunk = [&](int64_t rows) {
    return pair && size_t(rows * n) * c10::elementSize(made_t) >= kPairAllreduceBytes;
  };
  make_term();
  if (!early) prod->pack_for(int64_t(ranges.size()), most_rows(ranges));
  at::Tensor out = pair || mk_half ? term : half ? at::empty({m, n}, a.options()) : acc;
  std::vector<at::Tensor> gathered(ranges.size());  // sum_here: every rank's rows of chunk i, [R, rows, n]
  p.overlap(
      int64_t(ranges.size()),
      [&](int64_t i) {
        if (early) return;
        auto [lo, hi] = ranges[size_t(i)];
        at::Tensor dst = term.narrow(0, lo, hi - lo);
        prod->into(dst, a.narrow(0, lo, hi - lo));
        p.publish(dst);
      },
      [&](int64_t i) {
        auto [lo, hi] = ranges[size_t(i)];
        if (pair_chunk(hi - lo)) return p.allreduce(term.narrow(0, lo, hi - lo));
        if (!sum_here) return p.allreduce(term.narrow(0, lo, hi - lo));  // (acc, or half with mk_half)
        gathered[size_t(i)] = at::empty({R, hi - lo, n}, term.options());
        return p.allgather(term.narrow(0, lo, hi - lo), gathered[size_t(i)]);
      },
      [&](int64_t i) {
        auto [lo, hi] = ranges[size_t(i)];
        if (pair_chunk(hi - lo)) return;
        if (sum_here) {  // (the products are half: so is out)
          auto part = [&](int q) { return gathered[size_t(i)].select(0, q); };
          if (!sum_half_in_rank_order(out.narrow(0, lo, hi - lo), R, part)) {
            at::Tensor wide = acc.narrow(0, lo, hi - lo);
            sum_in_rank_order(wide, R, part);
            out.narrow(0, lo, hi - lo).copy_(wide);
          }
          gathered[size_t(i)] = at::Tensor();
          return;
        }
        if (half && !mk_half) out.narrow(0, lo, hi - lo).copy_(acc.narrow(0, lo, hi - lo));
      },
      /*depth=*/int(ranges.size()) + 1);
  // One allreduce of the whole product, every rank allowing the fold, across hosts: a call the group may arm
  // with (every input here is agreed, so every rank notes alike).
  if (may_ride && ranges.size() == 1 && (pair_chunk(m) || !sum_here) && !p.one_host() && ga.extra_min(2) == 1)
    p.fold_note(ga.fold_keys(), {Pipeline::FoldPlan::Kind::allreduce, m * n, term.scalar_type()});
  return out;
}

at::Tensor gemm_reducescatter(const at::Tensor& a_in, const at::Tensor& b_in, c10::string_view group_name,
                              int64_t chunks) {
  const char* op = "gemm_reducescatter";
  Group g = resolve_group(std::string(group_name), a_in.device(), op);
  Pipeline p(g, op);
  const int R = g.size, r = g.rank;
  std::string err = check_operands(a_in, b_in, "[m, k_r]", "[k_r, n]");
  if (err.empty() && chunks < 0) err = "chunks must be >= 0 (0 = automatic)";
  const int64_t m = dim_or(a_in, 0), k = dim_or(a_in, 1), n = dim_or(b_in, 1);
  if (err.empty() && m % R != 0)
    err = c10::str("the group size ", R, " must divide m = ", m, " (rows are scattered in equal blocks)");
  const at::ScalarType acc_t = accumulate_type(a_in.scalar_type());
  const int64_t mb = m >= 0 ? m / R : 0;
  const at::ScalarType made_t = Products::type(a_in, /*exact=*/true);
  // Other backends on CPU: every rank's block goes to its rank by alltoall and is summed there, in rank order
  // (sums_here), fp32 products too: Gloo's reduce-scatter sent more than its allreduce of the same tensor (2
  // namespace hosts at 1 Gbit/s, 2 ranks, 1 MiB of fp32: 6.1 ms against 5.5), where the alltoall sends each
  // peer its block once. Half-type products travel as made unless a rank makes fp32 ones (then every rank
  // sends fp32).
  const bool sum_here = !g.is_mk() && g.device.is_cpu() && R > 1;
  const bool made_half = made_t != acc_t;
  // what the partial sums travel as (until a rank that makes fp32 says no); the model counts what crosses a
  // link, fp32 on mk (widened by mk's collective across hosts, or the ring's fp32 running sums)
  const at::ScalarType wire_t = sums_here(g, acc_t, made_t) ? made_t : acc_t;
  at::ScalarType stage_t = wire_t == made_t || mk_sums_half(g, acc_t, made_t) ? made_t : acc_t;
  ChunkModel model;
  model.comm_bytes = double(R - 1) * double(mb) * std::max<int64_t>(n, 0) * c10::elementSize(wire_t);
  model.flops = 2.0 * double(std::max<int64_t>(m, 0)) * std::max<int64_t>(k, 0) * std::max<int64_t>(n, 0);
  model.max_chunks = std::max<int64_t>(1, mb);
  // mk: the ring of partial sums over the transport across hosts; on one host each chunk's reduce-scatter is
  // an mk collective (with the one chunk Pipeline::chunks picks there: the GEMM, then the collective on this
  // thread, as unfused). Measured on 2 ranks, one host: 256x256x256 0.93x of unfused against 0.85x as a ring,
  // 512x256x512 0.96-0.97x against 0.96-1.00x; 1024x1024x1024 0.99x against 0.79-0.94x.
  const RingRows rr = ring_rows(g, p);
  if (err.empty()) err = rr.problem;
  const bool may_ring = rr.pays(mb);
  model.plain_too = err.empty() && may_ring && !rr.set;  // (see allgather_gemm)
  const CarryLimit cl = carry_limit(p, CarryTotal::every_peer, R == 2 ? kPairCarryBytes : kCarryMaxOther);
  if (err.empty()) err = cl.problem;
  const bool half = acc_t != a_in.scalar_type();
  at::Tensor a, acc_out, full;
  std::optional<Products> prod;
  bool packs = false;  // every rank offered to pack b (agreed; no product made before the agreement packs)
  auto prepare = [&] {
    if (a.defined()) return;
    a = a_in.contiguous();
    prod.emplace(a_in, b_in, /*exact=*/true, m);
    prod->may_pack = packs;
    acc_out = at::empty({mb, n}, a.options().dtype(acc_t));
  };
  // Small blocks: the whole product is computed first and travels inside the agreement (block q of it to rank
  // q), in the type it was made in (see gemm_allreduce).
  Carried carried;
  const int64_t block_bytes = mb * n * int64_t(c10::elementSize(made_t));
  const bool offer = err.empty() && chunks == 0 && mb > 0 && n > 0 && cl.fits(R, block_bytes);
  if (offer) {
    prepare();
    at::Tensor flat = made_t != acc_t ? at::Tensor() : at::empty({m, n}, a.options().dtype(acc_t));
    full = prod->made(a, flat).view({R, mb, n});
    carried.bytes = size_t(block_bytes);
    carried.data = [&full](int q) { return full.select(0, q).data_ptr(); };
  }
  // (riding an armed group's folded agreement, see Pipeline::fold_note: mk across hosts, whose plain path is one
  // reduce-scatter; other backends sum the blocks here after an alltoall)
  const bool may_ride = g.is_mk() && g.device.is_cpu() && R > 1 && !p.one_host();
  GemmAgreement ga(p, a_in, "k_r", false, m, k, n, true, chunks, model, err,
                   {{"ring", int64_t(may_ring), true}, {"half_products", int64_t(made_half), false},
                    {"SUPERKERNEL_OPS_FOLD", int64_t(Pipeline::fold_allowed()), false},
                    {"packs_b", err.empty() ? pack_offer(a_in, b_in, made_half) : 0, false}},
                   std::move(carried), may_ride);
  if (ga.rides()) {
    // The call the group armed with, again on this rank (same descriptor): every rank's block of its products,
    // each with the header, and the one reduce-scatter that call made.
    prod.emplace(a_in, b_in, /*exact=*/true, m);
    if (auto mine = ride_products(p, ga, *prod, a_in.contiguous(), n, Pipeline::FoldPlan::Kind::reduce_scatter,
                                  a_in.scalar_type()))
      return *mine;
    prod.reset();
    ga.agree_now();  // a rank did not ride this call: every rank agrees as usual (the products are made again)
  }
  // mk on one host: each block's products are written straight into the shm staging slots (no copy in),
  // chunk by chunk, and this rank's block of the sum lands in acc_out.
  const size_t row_bytes = size_t(std::max<int64_t>(n, 0)) * c10::elementSize(acc_t);
  const bool slots_fit = err.empty() && !may_ring && in_place_rows(p, mb, row_bytes, size_t(R), 1) > 0;
  // The in-place path's rows per chunk for a chunk count, the largest k, the staging type and whether every rank
  // makes half-type products; 0 when it does not run. (A chunk of every row is one GEMM into the slot, else one
  // per block.)
  auto in_place_plan = [&](int64_t chunks, int64_t kmax, at::ScalarType staged, bool half_products) -> size_t {
    if (!slots_fit) return 0;
    const size_t rows = in_place_rows(p, mb, size_t(n) * c10::elementSize(staged), size_t(R),
                                      std::max<int64_t>(chunks, 1));
    const int64_t gemms_per_chunk = int64_t(rows) == mb ? 1 : R;
    return in_place_pays(mb, rows, gemms_per_chunk, chunks, kmax, n, double(m) * n, half_products) ? rows : 0;
  };
  // Whether this rank expects the in-place path, from its own arguments (as gemm_allreduce's)
  const bool expect_in_place = in_place_plan(ga.proposal(), k, stage_t, made_half) > 0;
  // One chunk planned, no ring (or the plain path proposed), not in place: every rank's block of partial sums
  // (the whole a_r @ b_r, [R, mb, n]) is computed while the agreement travels. (Rows that fit a slot but would
  // not go in place were made after the agreement, one GEMM per block, until 2026-12-01: see bench/README.md.)
  // (a product computed to be carried is that product, whatever the path)
  const bool early = offer || (err.empty() && R > 1 && mb > 0 && n > 0 &&
                               (may_ring ? ga.proposal() == kPlainPath : !expect_in_place && ga.proposal() == 1));
  if (early && !offer) {
    prepare();
    full = at::empty({R, mb, n}, a.options().dtype(stage_t));
    prod->into(full.view({m, n}), a);
    p.publish(full);
  }
  const GemmAgreement::Agreed agreed = ga.chunks();
  const bool ring = may_ring && !agreed.plain;
  const int64_t C = agreed.count;
  packs = ga.extra_min(3) != 0;
  if (prod) prod->may_pack = packs;
  if (ga.carried()) {  // every rank's part of this block came with the agreement: summed in rank order
    auto part = [&](int q) {
      if (q == r) return full.select(0, r);
      return ga.carried_product(q, mb, n, full.options());
    };
    if (half) {
      at::Tensor out = at::empty({mb, n}, a.options());
      if (sum_half_in_rank_order(out, R, part)) return out;
    }
    sum_in_rank_order(acc_out, R, part);
    return half ? acc_out.to(a_in.scalar_type()) : acc_out;
  }
  const bool all_half = ga.extra_min(1) != 0;  // every rank makes its products in the half type
  if (!all_half) stage_t = acc_t;  // a rank made fp32 products (see sums_here): every rank sends fp32
  // offered but not carried, or made early for the alltoall where a reduce-scatter won: widened
  if (full.defined() && full.scalar_type() != stage_t) full = full.to(stage_t);
  const size_t stage_row_bytes = size_t(std::max<int64_t>(n, 0)) * c10::elementSize(stage_t);
  const size_t in_place_chunk = in_place_plan(C, ga.max_over_ranks(1), stage_t, all_half);
  const bool in_place = in_place_chunk > 0;
  if (!early) prepare();
  if (mb == 0 || n == 0) return half ? acc_out.to(a_in.scalar_type()) : acc_out;
  if (R == 1) {  // (as gemm_allreduce's: the product, in the input type where it is made so)
    at::Tensor none;
    const at::Tensor own = prod->made(a, half ? none : acc_out);
    return own.scalar_type() == a_in.scalar_type() ? own : own.to(a_in.scalar_type());
  }
  std::vector<std::pair<int64_t, int64_t>> ranges;
  for (int64_t i = 0; i < C; ++i) {
    auto rg = chunk_range(mb, C, i);
    if (rg.second > rg.first) ranges.push_back(rg);
  }
  if (ring) {
    ring_reducescatter(p, a, *prod, acc_out, mb, ranges, all_half);
    return half ? acc_out.to(a_in.scalar_type()) : acc_out;
  }
  if (in_place) {
    const size_t rows = in_place_chunk;
    // (half-type products are summed into the half-type result, see mk_sums_half)
    at::Tensor sum = stage_t == acc_t ? acc_out : at::empty({mb, n}, a.options().dtype(stage_t));
    const at::TensorOptions slot_opts = sum.options();
    p.run_in_place("reduce_scatter", rows, [&](Comm& comm) {
      coll::shm_reduce_scatter_rows(comm, sum.data_ptr(), size_t(mb), size_t(n), mk_float(stage_t), rows,
                                    [&](char* dst, size_t row, size_t nrows) {
                                      if (int64_t(nrows) == mb) {  // the chunk is the whole term: one GEMM
                                        prod->into(slot_tensor(dst, m, n, slot_opts), a);
                                        return;
                                      }
                                      for (int blk = 0; blk < R; ++blk) {  // [R][nrows][n]: one GEMM per block
                                        at::Tensor out = slot_tensor(dst + size_t(blk) * nrows * stage_row_bytes,
                                                                     int64_t(nrows), n, slot_opts);
                                        prod->into(out, a.narrow(0, blk * mb + int64_t(row), int64_t(nrows)));
                                      }
                                    });
    }, {a, prod->b, sum});
    return half && stage_t == acc_t ? acc_out.to(a_in.scalar_type()) : sum;
  }
  // Other backends, and mk on one host: one staging buffer per chunk, [R, rows_i, n], block
  // j = rows of rank j's block (the reduce-scatter input); the reduce_scatter of chunk i overlaps the
  // products of chunk i+1. With sum_here the blocks go by alltoall, and the sum is formed here.
  std::vector<at::Tensor> stage(ranges.size()), got(ranges.size());
  // half types summed here, or by mk's collective (stage_t half): the rounded sums land here
  at::Tensor out = half && (sum_here || stage_t != acc_t) ? at::empty({mb, n}, a.options()) : acc_out;
  if (!early) prod->pack_for(int64_t(ranges.size()) * R, most_rows(ranges));
  p.overlap(
      int64_t(ranges.size()),
      [&](int64_t i) {
        auto [lo, hi] = ranges[size_t(i)];
        const int64_t rows = hi - lo;
        if (early) {  // computed during the agreement; this chunk's rows of every block
          stage[size_t(i)] = rows == mb ? full : full.narrow(1, lo, rows).contiguous();
          return;
        }
        stage[size_t(i)] = at::empty({R, rows, n}, a.options().dtype(stage_t));
        if (rows == mb) {  // every row of every block: [R, mb, n] is the whole product, one GEMM
          prod->into(stage[size_t(i)].view({m, n}), a);
        } else {
          for (int j = 0; j < R; ++j) prod->into(stage[size_t(i)].select(0, j), a.narrow(0, j * mb + lo, rows));
        }
        p.publish(stage[size_t(i)]);
      },
      [&](int64_t i) {
        auto [lo, hi] = ranges[size_t(i)];
        if (!sum_here) return p.reduce_scatter(stage[size_t(i)], out.narrow(0, lo, hi - lo));
        const at::Tensor& in = stage[size_t(i)];
        got[size_t(i)] = at::empty(in.sizes(), in.options());
        return p.alltoall(in.view({R * (hi - lo), n}), got[size_t(i)].view({R * (hi - lo), n}), {}, {});
      },
      [&](int64_t i) {
        if (sum_here) {
          auto [lo, hi] = ranges[size_t(i)];
          auto part = [&](int q) { return got[size_t(i)].select(0, q); };
          if (!sum_half_in_rank_order(out.narrow(0, lo, hi - lo), R, part)) {
            at::Tensor dst = acc_out.narrow(0, lo, hi - lo);
            sum_in_rank_order(dst, R, part);
            if (!out.is_same(acc_out)) out.narrow(0, lo, hi - lo).copy_(dst);
          }
          got[size_t(i)] = at::Tensor();
        }
        stage[size_t(i)] = at::Tensor();
      },
      /*depth=*/int(ranges.size()) + 1);
  // One reduce-scatter of every block, every rank allowing the fold, mk across hosts: a call the group may arm
  // with (every input here is agreed, so every rank notes alike).
  if (may_ride && !sum_here && ranges.size() == 1 && !p.one_host() && ga.extra_min(2) == 1)
    p.fold_note(ga.fold_keys(), {Pipeline::FoldPlan::Kind::reduce_scatter, mb * n, stage_t});
  if (!out.is_same(acc_out)) return out;
  return half ? acc_out.to(a_in.scalar_type()) : acc_out;
}

}  // namespace mk::kernels

TORCH_LIBRARY_FRAGMENT(mk, m) {
  m.def("allgather_gemm(Tensor a, Tensor b, str group_name, bool return_gathered=False, int chunks=0) -> (Tensor, Tensor)");
  m.def("gemm_allreduce(Tensor a, Tensor b, str group_name, int chunks=0) -> Tensor");
  m.def("gemm_reducescatter(Tensor a, Tensor b, str group_name, int chunks=0) -> Tensor");
}

TORCH_LIBRARY_IMPL(mk, CompositeExplicitAutograd, m) {
  m.impl("allgather_gemm", &mk::kernels::allgather_gemm);
  m.impl("gemm_allreduce", &mk::kernels::gemm_allreduce);
  m.impl("gemm_reducescatter", &mk::kernels::gemm_reducescatter);
}
