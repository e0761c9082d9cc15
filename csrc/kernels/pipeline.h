// The pipeline scheduler every fused operator runs on: split the work into chunks, compute chunk i with
// ATen on the caller's thread (and the caller's current stream on an accelerator) while the communication
// of chunk i-1 is in flight.
//
// One interface, two engines behind it, picked from the group's backend for the tensors' device:
//   mk      point-to-point goes straight to the transport (Comm::isend/irecv, completed by the providers'
//           progress threads, in a tag space private to fused ops, no staging copies); collectives on
//           (sub-)buffers go to ProcessGroupMK's own algorithms (shm segments, rings), issued from a
//           communication lane thread (one per group, kept) so they never run inline on the compute thread.
//   other   (gloo; nccl on CUDA) the backend's own asynchronous c10d calls (send/recv/allreduce/...); the
//           pipeline waits on their c10d::Work.
// Device-generic: on a non-CPU device, publish() orders the communication after the compute already
// issued on the caller's stream (c10::Event through the device's guard implementation; NCCL orders by
// itself), so this file needs no CUDA headers.
//
// Waits honour the group timeout and the process-wide cancel generation (superkernel's interrupt,
// mk::cancel_all): every wait of a call that began before an interrupt fails with an error naming rank, op and
// peer.
// A transport failure (timeout, peer gone, interrupt) aborts the mk communicator as ProcessGroupMK does.
//
// Usage (an op in outline):
//   Group g = resolve_group(group_name, a.device(), "my_op");
//   Pipeline p(g, "my_op");
//   const int64_t proposal = p.chunks(requested, model);
//   std::vector<Field> fields{{"m", m}, {"k", k}};
//   for (const Field& f : p.tuner_fields()) fields.push_back(f);
//   fields.push_back({"chunks", proposal, false});
//   auto all = p.agree(std::move(fields), local_error);
//   int64_t chunks = all[0][4];            // every rank proceeded (or every rank threw); rank 0's proposal
//   p.use_chunks(chunks, all, 2);          // lets automatic proposals learn from the calls' durations
//   p.overlap(chunks, [&](int64_t i) { ...compute chunk i... },
//                     [&](int64_t i) { return p.allreduce(c_i); },
//                     [&](int64_t i) { ...chunk i's communication is complete... });
// Ring algorithms call send/recv with a `slot` (unique per message of this op call between one pair).
#pragma once
#include <ATen/core/Tensor.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/group.h"

namespace c10d {
class Work;
}

namespace mk::kernels {

// One asynchronous communication of a pipeline. Move-only; wait() once (later calls return at once).
// Keeps the tensors it reads or writes alive until it completed.
class Pending {
 public:
  struct State;
  Pending() = default;
  explicit Pending(std::shared_ptr<State> s) : state_(std::move(s)) {}
  Pending(Pending&&) noexcept = default;
  Pending& operator=(Pending&&) noexcept = default;
  Pending(const Pending&) = delete;
  Pending& operator=(const Pending&) = delete;
  ~Pending();

  bool valid() const { return state_ != nullptr; }
  // Block until complete. Throws c10::DistBackendError naming rank, op and peer on failure, timeout or
  // interrupt.
  void wait();
  // Whether wait() may poll c10d's Work::isCompleted (and so honour interrupts) or must block in
  // Work::wait (bounded by the group timeout). Set by the Pipeline.
  void set_pollable(bool p);

 private:
  std::shared_ptr<State> state_;
};

// Automatic chunk counts of one (group, op, shape): candidates, timed on real calls in turn, then the one with the
// lowest median is kept if it beats the baseline with confidence (below; ties: the fewer chunks). Each candidate's
// first call is not timed (it allocates and pays cold caches: 23 ms against 4-6 ms for the calls after it, Gloo fp16
// gemm_allreduce 512^3 with 4 chunks between two namespace hosts). After kTrials timed calls each, a candidate whose
// median is above kDropRatio times the best is dropped (never the baseline); the others are timed until each has
// kFinalTrials. Three calls each were too few on a shared VM: the same benchmark row (Gloo fp16 gemm_allreduce 512^3,
// the machine's noise 2-6%) picked 4 chunks once (0.73x of unfused) and 1 chunk another time (0.91x), whose medians of
// 40 interleaved calls were 6.91 and 6.55 ms. The median, not the fastest call: two namespace hosts at 1 Gbit/s, Gloo,
// fp16 allgather_gemm 512^3, 120 interleaved calls each, 1/2/4 chunks had fastest calls of 6.07/5.93/6.32 ms and
// medians of 7.86/8.14/9.61 ms; the fastest of two calls picked 4 (the op's median 10.9 ms against 9.1 with 1 chunk in
// the benchmark).
// A call's time is the slowest rank's: the one the caller of a collective op waits for, and the same on every
// rank, so every rank's tuner decides alike. Each rank sends its own time of its last tuning call in the next
// call's argument agreement (Pipeline::tuner_fields), where it is recorded as the largest of them; until then
// that call counts as made but not timed. Rank 0's own times alone had picked paths the other rank paid for:
// 2 namespace hosts at 1 Gbit/s, bf16 allgather_gemm 1024x128x1024: its tuning calls' medians were
// 3.3-3.7 ms per candidate on each rank, while the op's slowest rank took 5.6 ms a call in the benchmark
// and 4.1-5.4 ms in a probe (bench/README.md, "The tuner times the slowest rank").
// The baseline, the candidate with the fewest chunks (the plain path when there is one, else one chunk), runs
// as the op's unfused composition does; it is never dropped, and another candidate is kept over it only when
// its timed calls are faster with confidence: a one-sided Mann-Whitney test of the lowest-median candidate's
// calls against the baseline's, at kConfidenceZ. The lowest median alone had kept 3 and 4 chunks for all four
// shapes of a Gloo bf16 gemm_allreduce row set at 10 Gbit/s (one chunk's three calls 10.5, 7.5 and 10.5 ms
// against three chunks' 9.9, 8.3 and 8.3: one chunk dropped), and the op then ran at 0.73-0.85x of unfused
// while one chunk runs at its time (bench/README.md, "The tuner keeps the baseline unless").
struct Tuner {
  static constexpr size_t kTrials = 3;       // timed calls per candidate before the slow ones are dropped
  static constexpr size_t kFinalTrials = 7;  // timed calls per remaining candidate before the choice
  static constexpr double kDropRatio = 1.25;
  static constexpr double kConfidenceZ = 1.645;  // one-sided 5%
  // The most candidates Pipeline::chunks proposes: 4 chunk counts, and the op's plain path (ChunkModel).
  static constexpr size_t kMostCandidates = 5;
  std::vector<int64_t> candidates;
  int64_t hi = 1;                            // the most chunks the shape allows (ChunkModel::max_chunks)
  bool plain_too = false;                    // ChunkModel::plain_too
  std::vector<size_t> calls;                 // calls per candidate (its first, untimed, included)
  std::vector<std::vector<double>> seconds;  // the timed calls per candidate
  // This rank's last call while tuning, not yet recorded (chunks 0: none): its call number on the group, the
  // candidate it ran and its duration on this rank.
  struct Last {
    uint64_t seq = 0;
    int64_t chunks = 0;
    int64_t micros = 0;
  };
  Last last;
  // `last` taken out (cleared): what the next call records, or chunks 0 when there is nothing to record
  // (no call pending, or tuning over).
  Last take_last() {
    const Last l = std::exchange(last, {});
    return done() ? Last{} : l;
  }
  // The candidates for a modelled count: it, 1, its half and its double (at most hi), then the plain path.
  static std::vector<int64_t> candidates_for(int64_t modeled, int64_t hi, bool plain_too);
  void start(int64_t modeled, int64_t hi, bool plain_too);  // with candidates_for's
  void start(std::vector<int64_t> cands);
  // Rank 0's proposal on this tuner's first call (every rank uses it): a tuner of another rank whose model gave
  // another count starts over with the candidates rank 0's count gives, so that every rank times the same
  // candidates and, recording the same times, chooses alike at the same call. (Each rank models from its own
  // link estimate and compute rate: on mk between 2 namespace hosts rank 1 modelled 3 chunks where rank 0
  // modelled 2, and rank 1's tuner, whose candidates 2 and 4 were not, never finished.)
  void follow_first(int64_t agreed);
  bool done() const { return choice_ != 0; }
  // The candidate to use next: while tuning, the one still to be timed with the fewest calls (`last` counted
  // as made; the first on ties, so in turn), then kept(): the lowest median (equal medians: the fewer chunks,
  // kPlainPath counting as one and going before the overlapped path's one chunk) if clearly faster than the
  // baseline, else the baseline.
  int64_t next() const;
  void record(int64_t chunks, double secs);
  // The most calls tuning `n` candidates takes (the last one's time is recorded in the call after it).
  static size_t most_calls(size_t n) { return n * (1 + kFinalTrials) + 1; }

 private:
  bool first_round_done() const;
  size_t wanted(size_t i) const;  // timed calls candidate i still needs
  size_t baseline() const;        // the candidate with the fewest chunks (kPlainPath counting as one half)
  size_t lowest_median() const;   // lowest median of those not dropped (ties: fewer chunks)
  // Whether candidate c's timed calls are faster than candidate b's with confidence (Mann-Whitney, see above).
  bool clearly_faster(size_t c, size_t b) const;
  size_t kept() const;  // lowest_median() when clearly faster than the baseline, else the baseline
  // Decided once, in record(), so that calls after tuning (next() on every op call) do no work:
  std::vector<bool> dropped_;  // per candidate, once the first round is done (empty before)
  int64_t choice_ = 0;         // the candidate kept, once tuning is done (0 before; kPlainPath is -1)
};

// A proposal of Pipeline::chunks for a model with `plain_too`: the op's plain path (one collective, then one
// computation, as its unfused composition runs) instead of its overlapped one.
constexpr int64_t kPlainPath = -1;
// How traces name an agreed or proposed chunk count: "plain" for kPlainPath, else the count.
std::string chunks_name(int64_t chunks);

// Cost model inputs for the automatic chunk count.
struct ChunkModel {
  double comm_bytes = 0;   // bytes this rank sends over the whole op
  double flops = 0;        // this rank's compute, in floating point operations
  int64_t max_chunks = 1;  // upper bound (e.g. rows available to split)
  at::ScalarType dtype = at::kFloat;
  // The op can also run its plain path: the tuner then times it as one more candidate, kPlainPath, beside the
  // chunk counts (the GEMM ops' rings across hosts, which lose where the link leaves little to hide, and
  // with more GEMM threads than cores, bench/README.md; ring_attention's unmasked ring, one chunk, against
  // gathering K/V).
  bool plain_too = false;
};

class Pipeline {
 public:
  Pipeline(const Group& g, const char* op);
  ~Pipeline();  // waits for (and discards errors of) anything still outstanding
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  const Group& group() const { return g_; }
  const char* op() const { return op_; }
  int rank() const { return g_.rank; }
  int size() const { return g_.size; }
  // True when some rank of the group is reached over tcp, or the group is not mk (whose backends are
  // assumed to cross a network): the same on every rank of a group that spans hosts.
  bool over_tcp() const;
  // True when every rank of the group is on this host: mk knows it from its transports; other backends
  // learn it from the host identities in the first completed agreement on the group (false until then).
  bool one_host() const;
  // Sequence number of this op call on this group (the same on every rank; part of agree()'s descriptor).
  uint64_t seq() const { return seq_; }

  // group.h's agree() with the op's name and call number in the descriptor, so ranks that called different
  // fused ops (or a different number of them) fail instead of exchanging the wrong messages.
  std::vector<std::vector<int64_t>> agree(std::vector<Field> fields, const std::string& local_error);
  // The same, started now and checked by the returned Agreement's result(): compute that needs only this
  // rank's own (locally checked) arguments can run in between and hide the exchange. No communication of
  // the op may start before result() returned. `carried`: data sent inside the agreement's messages (group.h's
  // Carried: over mk's transport, or another backend's send/recv with CPU tensors; never on the board).
  Agreement start_agree(std::vector<Field> fields, const std::string& local_error, Carried carried = {});

  // This rank's proposal for the chunk count: `requested` > 0 wins (clamped to [1, max_chunks]); 0 picks
  // one from the model, the measured compute rate and the group's link estimate (measured on this group's
  // earlier pipelined collectives, else by transport kind: shm, tcp, accelerator). Local (no communication):
  // ranks may propose different counts, so pass it to agree() as a field with must_match = false and use
  // rank 0's value (all[0][i]) — that makes the count the same on every rank. With model.plain_too an
  // automatic proposal may be kPlainPath (the op's plain path; see ChunkModel).
  int64_t chunks(int64_t requested, const ChunkModel& model);
  // After chunks(), for the argument agreement, just before the chunk count: this rank's last tuning call of
  // this tuner not yet recorded (its call number, or -1) and its duration in microseconds (see Tuner: the
  // slowest rank's time is recorded). Every op that calls chunks() passes them on every rank (-1 when the
  // count was not automatic), so the agreement's layout does not depend on the tuner's state.
  std::vector<Field> tuner_fields() const;
  // Tell the pipeline the chunk count every rank agreed on (rank 0's proposal, kPlainPath included; 0: none,
  // e.g. a call that carried its data), with the agreement's result and where tuner_fields() are in it: the
  // previous tuning call is recorded as the slowest rank's time (its own when the ranks timed different
  // calls), and this call's duration (when the Pipeline is destroyed without an exception) waits for the next.
  void use_chunks(int64_t agreed, const std::vector<std::vector<int64_t>>& all, size_t tuner_at);

  // The folded agreement (CPU tensors, ranks on more than one host). An op whose call is one collective
  // (gemm_allreduce's allreduce of its product with one chunk; on mk also the plain paths' one reduce-scatter
  // of gemm_reducescatter and one allgather of allgather_gemm) notes each such call that every rank made with
  // descriptors of the same hash as its previous call, right after it (fold_note, with every rank's descriptor
  // hash, fold_key). Once a group has seen `need` of them in a row (2 at first), with the agreement's side
  // channel settled on other backends, it is armed, alike on every rank (every input is agreed): the next call
  // whose descriptor hashes as this rank's did rides (fold_rides: no agreement messages), and its collective
  // carries, beside the payload of each block, a header with one slot per rank (fold_buffer: a flag, ride or
  // veto, and 8 bytes of a hash of the armed state and the call number, as small integers every float type
  // holds exactly; the other ranks' slots zero, so a sum is every rank's word, and a gather brings each
  // rank's). fold_landed() reads them: every rank rode the same call, or the group disarms and the op agrees
  // as usual (every rank learns it from the same words). Any other call on an armed group (another op, other
  // shapes, an argument error) first sends the armed collective with its veto (start_agree does), disarms and
  // agrees as usual; so ranks that called different things get the usual error, never collectives of
  // different sizes (Gloo aborts on those, and so does mk across hosts). On mk across hosts the agreement is
  // one small message to and from every peer, which on busy cores costs what the unfused composition with one
  // such exchange added costs (2 namespace hosts at 10 Gbit/s: 0.05-0.1 ms a call, bench/README.md).
  // Each disarming doubles `need` (at most 64), so a loop that changes calls often stops arming; once `need`
  // calls rode in a row it is 2 again.
  // SUPERKERNEL_OPS_FOLD=0 on any rank keeps its group from arming (the op puts it in its descriptor).
  struct FoldPlan {
    // The armed call's one collective: an allreduce of its whole result (gemm_allreduce), a reduce-scatter
    // whose every rank's block carries the header (gemm_reducescatter on mk: the sum of every rank's words
    // lands in each rank's block), or an allgather.
    // A block is its payload, then its header (a slot per rank, padded to whole 64-byte lines); except that
    // with 2 ranks the first of two blocks (reduce-scatter, allgather) has its header first, so the two
    // payloads are one [2 rows, cols] matrix in the middle (one GEMM, not one per block), each starting on a
    // line.
    // allgather (allgather_gemm on mk): every rank's block holds its shard and its word; every rank reads
    // every block's.
    enum class Kind : uint8_t { allreduce, reduce_scatter, allgather } kind = Kind::allreduce;
    int64_t elems = 0;  // payload elements of a block
    at::ScalarType dtype = at::kFloat;
    int64_t aux = 0;  // what the op's ride needs of the armed call (allgather_gemm: rank 0's small_half_limit)
    int64_t header(int size) const;  // elements of a block's header
    int64_t block(int size) const;   // elements of a block: the payload and the header
    int64_t blocks(int size) const { return kind == Kind::allreduce ? 1 : size; }
    // Where block j's payload and header start in the flat buffer of every block.
    int64_t payload_at(int64_t j, int size) const;
    int64_t header_at(int64_t j, int size) const;
    // The payloads follow each other (payload_at(j) = payload_at(0) + j * elems): one GEMM fills or reads them.
    bool one_payload(int size) const { return kind == Kind::allreduce || size == 2; }
  };
  static uint64_t fold_key(const char* op, const std::vector<int64_t>& values);
  static bool fold_allowed();  // SUPERKERNEL_OPS_FOLD is not 0 (read once)
  // Armed, and this call's descriptor hashes as this rank's did when the group armed: it rides. The plan is
  // the armed call's payload.
  bool fold_rides(uint64_t key, FoldPlan* plan);
  // (riding) the plan's blocks, flat: the payloads to fill and the headers (zeros, this rank's word in its slot),
  // where FoldPlan says; `reused`: in the calling thread's scratch buffer (see scratch(), for a buffer the op
  // does not return)
  at::Tensor fold_buffer(const FoldPlan& plan, const at::TensorOptions& opts, bool reused = false);
  // (riding) after the collective of fold_buffer(), with what it left here (the allreduced buffer, this rank's
  // block of the reduce-scatter, or every block of the allgather): true when every rank rode this call; else
  // the group is disarmed (on every rank: they read the same words). fold_payload(): an allreduced or
  // reduce-scattered block's payload, [rows, cols].
  bool fold_landed(const at::Tensor& buf, const FoldPlan& plan);
  at::Tensor fold_payload(const at::Tensor& buf, const FoldPlan& plan, int64_t rows, int64_t cols) const;
  void fold_note(const std::vector<uint64_t>& keys, const FoldPlan& plan);

  // Point-to-point within this op call. `t` must be contiguous and stay untouched until waited. `slot` < 2^20.
  // On mk: straight to the transport, completed by its progress threads (rings: post every recv up front).
  // On other backends: c10d send/recv (Gloo: fine for rings; NCCL: unbatched p2p calls are serialised on one
  // stream, so a ring where every rank sends before it receives deadlocks there; use exchange() or the
  // collectives below on non-mk backends). Their waits block in c10d's Work::wait (group timeout).
  Pending send(const at::Tensor& t, int peer, uint32_t slot);
  Pending recv(const at::Tensor& t, int peer, uint32_t slot);

  // One ring step: send `out` to peer `to` and receive `in` from peer `from` (message `slot`; contiguous,
  // untouched until waited; wait every returned Pending). On mk: two transport requests. On other backends
  // that support coalescing (nccl), the send and the receive are issued as one batched group
  // (Backend::startCoalescing / endCoalescing, as torch's batch_isend_irecv does), so a ring where every
  // rank sends before it receives cannot deadlock on a stream that serialises p2p calls; every rank must
  // call exchange() the same number of times in the same order (a collective-like sequence). Elsewhere
  // (gloo) the backend's send and recv, as send()/recv().
  std::vector<Pending> exchange(const at::Tensor& out, int to, const at::Tensor& in, int from, uint32_t slot);
  // Whether exchange() is safe here: mk, a CPU device, or a backend that coalesces p2p (otherwise an
  // accelerator backend's unbatched p2p could deadlock).
  bool exchange_supported() const;

  // mk, CPU, every rank on this host (shared memory): the op may run an in-place shm collective
  // (transport/collectives/collectives.h), whose staging slots its GEMMs write into and read from directly.
  bool in_place_shm() const;
  // SUPERKERNEL_OPS_IN_PLACE=0 turns the in-place paths off (a diagnostic). Ops that may take them put this
  // in their argument agreement, so ranks that disagree get an error, not different collectives.
  bool in_place_allowed() const;
  // Run such a collective, moving `rows_per_chunk` rows per chunk, and wait for it (traced as "in place: N
  // rows per chunk"): `fn` drives the group's Comm itself, in the group's collective order (on this thread
  // when nothing else is queued; else after what is, on ProcessGroupMK's worker). The wait is bounded by the
  // group timeout; a failure aborts the communicator, as a collective's does, except a mismatch of the call
  // between ranks, reported on every rank.
  void run_in_place(const char* what, size_t rows_per_chunk, std::function<void(Comm&)> fn,
                    std::vector<at::Tensor> keep);

  // Collectives (sum) on contiguous (sub-)tensors, run in issue order, asynchronously.
  Pending allreduce(const at::Tensor& t);
  Pending reduce_scatter(const at::Tensor& in, const at::Tensor& out);  // in: R x out.numel()
  // out: R x in.numel(). (Other backends on CPU, up to 256 KiB per rank: their alltoall, which is cheaper.)
  Pending allgather(const at::Tensor& in, const at::Tensor& out);
  // Rows of dim 0 split per peer (empty splits = even).
  Pending alltoall(const at::Tensor& in, const at::Tensor& out, std::vector<int64_t> out_splits,
                   std::vector<int64_t> in_splits);

  // Issue a collective (one of the calls above, made inside `issue`) on the caller's thread instead of the
  // communication lane: for a collective with no computation left to overlap, as an unfused call would be.
  // Only while no lane collective of this call is in flight (collectives run in issue order everywhere).
  template <typename Issue>
  Pending on_caller(Issue issue) {
    InlineScope scope(*this);
    return issue();
  }

  // SUPERKERNEL_OPS_TRACE=1: one line per op call on stderr (op, rank, shape, agreed chunk count). The
  // arguments are formatted (c10::str) only when tracing is on: calls sit on every op's path.
  template <typename... Args>
  void trace(const Args&... what) const {
    if (tracing()) emit_trace(c10::str(what...));
  }
  // Whether SUPERKERNEL_OPS_TRACE is on (read once).
  static bool tracing();

  // Make what the caller's stream computed into `t` visible to communication issued after this call.
  // No-op on CPU and for stream-aware backends (nccl).
  void publish(const at::Tensor& t);

  // The canonical overlap loop: for i in [0, n): compute(i); publish; comm(i) starts (returns a Pending);
  // then the oldest outstanding chunk is finished once more than `depth` - 1 are in flight, so comm(i)
  // overlaps compute(i+1). finish(i) runs in order after chunk i's Pending completed.
  //
  // The last chunk's communication has no compute left to hide behind: once the earlier chunks are done it is
  // issued on the caller's thread (no lane hand-off, as an unfused collective would be; on mk it also runs
  // there, not on ProcessGroupMK's worker: ProcessGroupMK::CallerWaits), so a pipeline whose tuned chunk count
  // is 1 costs what the unfused composition costs.
  template <typename Compute, typename Communicate, typename Finish>
  void overlap(int64_t n, Compute compute, Communicate communicate, Finish finish, int depth = 2) {
    std::deque<std::pair<int64_t, Pending>> inflight;
    for (int64_t i = 0; i < n; ++i) {
      compute(i);
      if (i == n - 1) {
        while (!inflight.empty()) {  // the lane must be idle: collectives are issued in the same order everywhere
          auto [j, pend] = std::move(inflight.front());
          inflight.pop_front();
          pend.wait();
          finish(j);
        }
        InlineScope on_caller(*this);
        inflight.emplace_back(i, communicate(i));
        continue;
      }
      inflight.emplace_back(i, communicate(i));
      while (int64_t(inflight.size()) >= depth) {
        auto [j, pend] = std::move(inflight.front());
        inflight.pop_front();
        pend.wait();
        finish(j);
      }
    }
    while (!inflight.empty()) {
      auto [j, pend] = std::move(inflight.front());
      inflight.pop_front();
      pend.wait();
      finish(j);
    }
  }

 private:
  Pending p2p(const at::Tensor& t, int peer, uint32_t slot, bool is_recv);

  struct InlineScope {
    explicit InlineScope(Pipeline& p) : p_(p) { p_.inline_ = true; }
    ~InlineScope() { p_.inline_ = false; }
    Pipeline& p_;
  };

  Pending lane_collective(std::function<c10::intrusive_ptr<c10d::Work>()> issue, const char* what,
                          std::vector<at::Tensor> keep);
  Pending backend_work(c10::intrusive_ptr<c10d::Work> work, const char* what, int peer, std::vector<at::Tensor> keep);

  void record_timing();

  Group g_;
  const char* op_;
  uint64_t seq_;
  std::chrono::steady_clock::time_point started_;
  // The cancel generation when the call began: every wait of the call stops on an interrupt after that, also
  // one that came while the call computed between two waits (a wait that went by its own start missed it, and
  // the call ran to its end: under ASan, mk's gemm_allreduce ring between two hosts, interrupted once).
  uint64_t generation_;
  Tuner* tuner_ = nullptr;  // set by chunks() for automatic counts; owned by the group's state
  int64_t chunks_used_ = 0;
  void fold_veto();  // start_agree on an armed group, for a call that does not ride
  void emit_trace(const std::string& line) const;
  mutable int8_t in_place_env_ = -1;  // SUPERKERNEL_OPS_IN_PLACE as this call read it (-1: not yet)
  bool inline_ = false;  // the next lane collective runs on the caller's thread (lane idle, nothing to overlap)
};

// An integer environment variable of at least `least` (`fallback` when unset or empty); an invalid value sets
// `problem` (an argument error, reported through the agreement) and gives 0. `set`, when given, says whether
// the variable was set (not empty), valid or not.
int64_t env_integer(const char* name, int64_t fallback, int64_t least, std::string& problem, bool* set = nullptr);

// Small calls: the whole payload travels inside the argument agreement's messages (group.h's Carried), so the
// call makes one exchange instead of the agreement's round trip followed by the op's own (2 namespace hosts at
// 1 Gbit/s, before: 8x8x8 gemm_reducescatter 0.64x of unfused on mk, 0.41x on Gloo, where the agreement's
// extra exchange was the difference; bench/README.md). On mk with a peer over tcp, and on other backends with
// CPU tensors (on one host the board soon takes the agreement there, and nothing rides on it). Taken when
// this rank sends at most the per-peer limit to each peer (64 KiB, or `other_most` below) and at most
// SUPERKERNEL_OPS_CARRY_BYTES to all together (default: see CarryTotal; 0 turns it off), with an automatic
// chunk count; the op then uses it only if every rank carried its part (decided from the exchanged
// descriptors, so alike everywhere; otherwise its usual path, and what came along is dropped).
// `other_most`: the most to one peer, on other backends (gemm_allreduce and gemm_reducescatter pass
// kCarryMaxOther, 256 KiB: on Gloo between 2 namespace hosts at 1 Gbit/s, 128x256x256 gemm_allreduce went
// from 0.33x of unfused to 1.18x and allgather_gemm from 0.83x to 1.00x; the agreement's messages then carry
// what Gloo's own collective would have sent, one exchange instead of two; gemm_allreduce on two ranks
// passes 512 KiB, allgather_gemm kCarryMaxGather, 4 MiB, see there).
//
// The default total, by what the direct sends to every peer cost against the op's unfused exchange:
enum class CarryTotal {
  // More: gemm_allreduce sends its whole partial product to every peer, (R - 1) m n per rank against a ring
  // allreduce's 2 (R - 1) / R m n; the total is one peer's limit, which keeps that small.
  one_peer,
  // The same bytes: an allgather's shard, a reduce-scatter's blocks, a K/V gather, the MoE ops' alltoall by
  // routing; the total is the per-peer limit times R - 1. 2 namespace hosts x 2 ranks, mk, 1 Gbit/s, with a
  // 64 KiB total where 96-192 KiB leave a rank against R - 1 times 64 KiB (bench/README.md): t=64 h=256 f=256
  // k=2 fp32 moe_combine 0.66-0.95x of unfused -> 1.24-1.28x, moe_dispatch_gemm 0.92-0.93x -> 1.29-1.36x;
  // allgather_gemm 64x128x256 / 128x128x256 0.71-0.85x -> 1.02-1.07x, gemm_reducescatter 128x128x256
  // 0.83-0.84x -> 1.04x, ring_attention s=32 0.88-0.93x -> 1.09-1.19x.
  every_peer,
};

struct CarryLimit {
  bool may_carry = false;  // R > 1, and mk with a peer across hosts or another backend on CPU
  int64_t total = 0;       // the limit (0: off, not read, or invalid)
  size_t most_per_peer = kCarryMax;  // the most to one peer
  std::string problem;     // the argument error when the variable is invalid
  // Whether a call that sends `per_peer` bytes to each of the other R - 1 ranks carries them.
  bool fits(int R, int64_t per_peer) const { return per_peer > 0 && fits_routed(per_peer, int64_t(R - 1) * per_peer); }
  // Whether a routed call (counts per peer) that sends at most `largest` bytes to one peer and `sum` in all
  // carries them (nothing to send at all carries too: the agreement alone then completes the exchange).
  bool fits_routed(int64_t largest, int64_t sum) const {
    return may_carry && total > 0 && largest >= 0 && size_t(largest) <= most_per_peer && sum <= total;
  }
};
CarryLimit carry_limit(const Pipeline& p, CarryTotal total, size_t other_most = kCarryMax);

// [begin, end) of chunk i when n items are split into `chunks` nearly equal parts (the first n % chunks
// parts get one more; parts are empty when chunks > n).
std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t chunks, int64_t i);

// The fp32 type partial results are accumulated in for `t` (float for half types, t otherwise).
at::ScalarType accumulate_type(at::ScalarType t);

// Whether ATen's GEMM is fast on the half type `t` (bf16, fp16) itself on `device`, so products are made in
// `t` (accumulated in fp32 inside, rounded once) instead of on operands widened to fp32. On the CPU that is
// oneDNN's support for the type on this processor: the other CPU GEMM of half types is a plain loop (fp16 on
// an AVX-512 VM without AVX512-FP16: 1024^3 took 2.2 s against 27 ms widened). Elsewhere false (cuBLAS may
// reduce fp16 in fp16). Support does not say which is faster: bf16 with AVX512-BF16 was 2.3x faster than
// widened at 1024^3 on one VM and 1.2-1.9x slower on another (AVX512-BF16 and -FP16, no AMX); timing it in
// each process flipped the choice in 1-2 of 4 ranks started together on 2 cores, so the user chooses:
// SUPERKERNEL_OPS_WIDEN_HALF=1 widens both types, =bfloat16 / =float16 / =bfloat16,float16 those named.
// Decided once per process. Ranks may differ in it, as hosts differ in processors: every GEMM op agrees on
// it (see sums_here in gemm_collectives.cc).
bool native_half_gemm(at::ScalarType t, const c10::Device& device);

// A GEMM of a half type that native_half_gemm makes as it is, small enough (rows x k x n multiply-adds at most
// small_half_limit(t)) that oneDNN's fixed cost per call outweighs the arithmetic: the ops make it on operands
// widened to fp32 and round the product to the half type, which is what the half-type GEMM computes (fp32
// accumulation, one rounding), in the fp32 GEMM's order. Where that pays depends on the processor, so the
// limit is measured once per process and type (calibrate_small_half in half_gemm.cc), unless
// SUPERKERNEL_OPS_SMALL_HALF_GEMM sets it. One thread, fp16 / bf16 as it is against widened (b too) and
// rounded, ms: on an Intel VM (AVX512-BF16 and -FP16, no AMX) 128x64x64 0.030 against 0.013, 512x256x256
// 0.432 against 0.563 (bf16 faster widened at every size); on an AMD EPYC VM (AVX512-BF16, no -FP16) bf16
// 8x64x64 0.016 against 0.007, 128x64x64 0.020 against 0.020, 128x256x256 0.101 against 0.179.
// Widening b ([k, n]) is the cost that grows with it: a fresh fp32 copy of 1024x1024 took 0.24 ms, so b is
// widened only up to kSmallHalfOperand elements (8x1024x1024: 0.269 as it is against 0.460 widened; 16x512x1024:
// 0.179 against 0.271), and no limit exceeds kSmallHalfGemm.
constexpr double kSmallHalfGemm = double(int64_t(1) << 23);
// The fixed cost of one more GEMM oneDNN makes in a half type, in elements of staging copy (2^19): the in-place
// rule's per-GEMM term (in_place_pays in gemm_collectives.cc, where it was measured).
constexpr double kHalfGemmCall = double(int64_t(1) << 19);
constexpr double kSmallHalfOperand = double(int64_t(1) << 18);
// The limit for `t` (bf16, fp16) in multiply-adds: SUPERKERNEL_OPS_SMALL_HALF_GEMM (an integer, both types;
// 0: never widen) or, without it, this CPU's crossover measured at the first call (a power of two in
// [2^17, kSmallHalfGemm], or 0 where widening never paid); 0 for a type native_half_gemm widens anyway (the
// question does not arise). Ranks may differ in it, as they may in native_half_gemm; an op whose ranks must
// all make one product alike (allgather_gemm) agrees on rank 0's.
int64_t small_half_limit(at::ScalarType t);
// SUPERKERNEL_OPS_SMALL_HALF_GEMM as read (once), -1 when unset; raises naming it when it is no non-negative
// integer (superkernel checks it at import, so a bad value fails every rank before any op).
int64_t small_half_setting();
inline bool small_half_gemm(int64_t rows, int64_t k, int64_t n, int64_t limit) {
  return double(rows) * double(k) * double(n) <= double(limit) && double(k) * double(n) <= kSmallHalfOperand;
}
inline bool small_half_gemm(at::ScalarType t, int64_t rows, int64_t k, int64_t n) {
  return small_half_gemm(rows, k, n, small_half_limit(t));
}

// A [rows, cols] buffer for an intermediate that does not outlive the op call (never returned): on CPU, up
// to kScratchBytes, one per thread and dtype, reused by later calls, so the op does not fault in fresh pages
// each call (a fresh 2 MiB CPU buffer costs ~500 minor faults, ~1 ms on the development VM). Elsewhere, and
// above the limit, a new tensor. The contents are undefined.
constexpr size_t kScratchBytes = size_t(64) << 20;
at::Tensor scratch(int64_t rows, int64_t cols, const at::TensorOptions& opts);
// A new tensor over `t`'s storage with this geometry (`offset` in elements from the storage's start), made
// without the dispatcher: for the views of a hot path (narrow and view cost a microsecond or more each).
// No autograd history, no base.
at::Tensor alias_of(const at::Tensor& t, int64_t offset, c10::IntArrayRef sizes, c10::IntArrayRef strides);
// rows * cols elements of contiguous `t` from its element `from` on, as [rows, cols] (alias_of).
inline at::Tensor rows_of(const at::Tensor& t, int64_t from, int64_t rows, int64_t cols) {
  return alias_of(t, t.storage_offset() + from, {rows, cols}, {cols, 1});
}

}  // namespace mk::kernels
