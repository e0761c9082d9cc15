#include "kernels/pipeline.h"

#include <ATen/Dispatch.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>
#include <c10/core/Event.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <cmath>
#include <condition_variable>
#include <map>
#include <tuple>
#include <mutex>
#include <optional>
#include <thread>

#include "kernels/agreement_board.h"
#include "kernels/side_channel.h"
#include "transport/cancel_hook.h"
#include "transport/comm.h"
#include "transport/deadline.h"
#include "transport/host.h"
#include "transport/job_thread.h"
#include "transport/error.h"
#include "transport/process_group.h"

namespace mk::kernels {
namespace {

[[noreturn]] void throw_backend(const std::string& msg) {
  throw c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, uint32_t(__LINE__)}, msg);
}

uint64_t mix64(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  h ^= h >> 31;
  h *= 0xbf58476d1ce4e5b9ull;
  return h ^ (h >> 29);
}

size_t nbytes(const at::Tensor& t) { return size_t(t.numel()) * t.element_size(); }

// A lane: a thread that issues mk collectives in order and waits for each, so that ProcessGroupMK's inline
// path (small collectives run on the calling thread) never blocks the compute thread. One per group, kept
// with the group's state (a thread per op call would cost more than a small op); an idle lane only sleeps
// on its condition variable.
using Lane = JobThread;

// Per-group state shared by the op calls on that group: the op sequence number and the link estimate.
//
// It names its group by a weak reference to the ProcessGroup, not to the backend. A weak reference keeps an
// object's memory (so no new group can reuse the address and be taken for this one) but not its destructor:
// a backend's destructor is what joins its threads (Gloo's run loops, mk's progress threads), and a weak
// reference to the backend kept them running after destroy_process_group, into interpreter shutdown, where a
// Gloo worker that released a Python-owned tensor called std::terminate. ProcessGroup releases its backends
// when its last strong reference goes (release_resources), so they are destroyed on time.
// Other backends on CPU: allgathers of at most this many bytes per rank run as an alltoall (Pipeline::allgather).
constexpr size_t kAlltoallGatherBytes = size_t(256) << 10;

// A tuner's op and shape: the op, its ChunkModel's bytes and flops, the most chunks, whether the plain path is
// a candidate. (A tuple, not text: formatting the two doubles cost microseconds on every op call.)
using TunerKey = std::tuple<std::string, double, double, int64_t, bool>;

struct GroupState {
  c10::weak_intrusive_ptr<c10d::ProcessGroup> pg{c10::intrusive_ptr<c10d::ProcessGroup>()};  // whose state
  std::map<TunerKey, Tuner> tuners;  // automatic chunk counts by op and shape
  uint64_t next_seq = 0;
  int one_host = -1;   // non-mk backends: every rank on this host (learned from the first agreement; -1 unknown)
  std::shared_ptr<AgreementBoard> board;  // the agreement board (group.h, agreement_board.h), once created
  bool board_tried = false;
  // The agreement's side channel (side_channel.h), by the words of the last agreement: none yet (not wanted
  // so far), to open at the next call, opened at this one (the next agreement says whether on every rank),
  // in use, or never (a rank may not, every rank is on one host, or a rank could not open it).
  enum class Side { none, open_next, opened, active, never } side = Side::none;
  std::shared_ptr<Comm> side_comm;
  // The folded agreement (pipeline.h, Pipeline::fold_note): what the group armed with, and the streak toward it.
  struct Fold {
    bool armed = false;
    std::vector<uint64_t> keys;  // every rank's descriptor hash of the noted call
    Pipeline::FoldPlan plan;
    uint64_t last_seq = ~uint64_t(0);  // the call noted last
    int streak = 0;                    // noted calls in a row with the same keys and plan
    int need = 2;                      // streak that arms; doubled by every disarming (at most kFoldNeedMost),
                                       // back to 2 once as many calls rode in a row
    int rode = 0;                      // calls that rode since the group armed
    uint64_t gen = 0;                  // hash of the armed state (keys, plan, the call that armed it)
  } fold;
  double bw = 0;       // bytes/s, EWMA of the lane's collectives (0 = not measured yet)
  double latency = 0;  // seconds per message
  std::unique_ptr<Lane> lane;  // mk: created by the first lane collective
};

std::mutex& states_mu() {
  static std::mutex mu;
  return mu;
}
std::map<std::pair<std::string, const void*>, GroupState>& states() {
  static std::map<std::pair<std::string, const void*>, GroupState> s;
  return s;
}
// Lanes of dropped entries (guarded by states_mu()). They are joined outside that lock: a lane's job takes it.
std::vector<std::unique_ptr<Lane>>& retired_lanes() {
  static std::vector<std::unique_ptr<Lane>> v;
  return v;
}
std::pair<std::string, const void*> key_of(const Group& g) { return {g.name, g.backend.get()}; }

// The state of g's backend (caller holds states_mu()). A destroyed group's entry is reset when a new group
// reuses its name and backend address, so a re-created group starts counting op calls from 0 on every rank.
// When an entry is made, those of other destroyed groups are dropped: their agreement boards hold a memfd and
// a pidfd per peer, their lanes a thread, which a program that creates and destroys groups in a loop would
// otherwise run out of.
GroupState& state_of(const Group& g) {
  const auto key = key_of(g);
  auto& all = states();
  auto it = all.find(key);
  if (it != all.end() && it->second.pg.lock().get() == g.pg.get()) return it->second;
  // a new group (or a re-created one): the time to drop the entries of destroyed ones
  for (auto j = all.begin(); j != all.end();) {
    if (j->first != key && j->second.pg.expired()) {
      if (j->second.lane) retired_lanes().push_back(std::move(j->second.lane));
      j = all.erase(j);
    } else {
      ++j;
    }
  }
  GroupState& s = all[key];
  std::unique_ptr<Lane> lane = std::move(s.lane);  // a lane holds nothing of its group: the new one keeps it
  s = GroupState();
  s.pg = c10::weak_intrusive_ptr<c10d::ProcessGroup>(g.pg);
  s.lane = std::move(lane);
  return s;
}

void record_link_sample(const std::pair<std::string, const void*>& key, double bytes, double seconds) {
  if (bytes < double(64 << 10) || seconds <= 0) return;  // small transfers say nothing about bandwidth
  std::lock_guard<std::mutex> lock(states_mu());
  auto it = states().find(key);
  if (it == states().end()) return;
  auto& s = it->second;
  const double bw = bytes / seconds;
  s.bw = s.bw == 0 ? bw : 0.7 * s.bw + 0.3 * bw;
}

// Compute rate of ATen's mm on this process for a dtype, measured once (a few ms at most). A half type the ops
// widen (native_half_gemm) is multiplied in fp32, so fp32's rate is its rate: timing ATen's fp16 loop instead
// (AMD EPYC VM without AVX512-FP16: ~5.4 ms for this 128x256x256 product, 0.18 widened) cost ~16 ms at the
// first call and gave a rate ~30x too low.
double gemm_flops_per_second(at::ScalarType t, const c10::Device& device) {
  if ((t == at::kHalf || t == at::kBFloat16) && device.is_cpu() && !native_half_gemm(t, device)) t = at::kFloat;
  static std::mutex mu;
  static std::map<std::pair<int, int>, double> cache;
  const auto key = std::make_pair(int(t), int(device.type()));
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  double rate = device.is_cpu() ? 2e10 : 1e13;
  if (device.is_cpu()) {
    auto o = at::TensorOptions().dtype(t);
    at::Tensor a = at::empty({128, 256}, o).fill_(0.5), b = at::empty({256, 256}, o).fill_(0.25);
    at::mm(a, b);  // warm up
    const auto t0 = Clock::now();
    at::mm(a, b);
    at::mm(a, b);
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (s > 0) rate = 2.0 * 2 * 128 * 256 * 256 / s;
  }
  std::lock_guard<std::mutex> lock(mu);
  cache[key] = rate;
  return rate;
}

// What a collective hands to another thread (a backend's worker, the lane): a tensor of its own over the same
// memory. That thread may drop its references after the op has returned; dropping a view releases its base,
// which by then can be the op's output owned by a Python object, and that release needs the GIL (a Gloo
// worker blocked on it stalls; at interpreter exit it calls std::terminate). A fresh alias has no base and no
// Python object.
// (made directly, not through the dispatcher, where at::empty and set_, and the flat view before them, are the
// steps that cost scratch 6.3-6.9 us a call; handoff's own share was not timed apart)
at::Tensor handoff(const at::Tensor& t) {
  return alias_of(t, t.storage_offset(), t.sizes(), t.strides());
}
// ... as a flat tensor (t contiguous)
at::Tensor handoff_flat(const at::Tensor& t) {
  const int64_t n = t.numel();
  return alias_of(t, t.storage_offset(), {n}, {1});
}

}  // namespace

// (narrow and view of a scratch buffer took 6.3-6.9 us per call inside allgather_gemm on the AMD VM, 0.5 us made
// this way)
at::Tensor alias_of(const at::Tensor& t, int64_t offset, c10::IntArrayRef sizes, c10::IntArrayRef strides) {
  auto alias = at::detail::make_tensor<c10::TensorImpl>(c10::Storage(t.storage()), t.key_set(), t.dtype());
  alias.unsafeGetTensorImpl()->set_sizes_and_strides(sizes, strides, offset);
  return alias;
}

// ---------------------------------------------------------------- Pending

struct Pending::State {
  enum class Kind { request, work, lane } kind;
  std::string what;  // "mk allgather_gemm: rank 0, peer 1: recv (slot 3)"
  int peer = -1;
  int rank = 0;
  std::chrono::milliseconds timeout{0};
  uint64_t generation = 0;
  std::vector<at::Tensor> keep;
  bool waited = false;
  // request
  Comm* comm = nullptr;
  RequestPtr req;
  bool is_recv = false;
  // work
  c10::intrusive_ptr<c10d::Work> work;
  bool device_wait = false;  // non-CPU: c10d's wait() orders the current stream instead of blocking
  bool pollable = true;      // isCompleted() reports completion (c10d collectives; not Gloo's send/recv)
  // lane
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr error;
};

Pending::~Pending() {
  if (!state_ || state_->waited) return;
  try {
    wait();
  } catch (...) {
    // Abandoned after an earlier error: the transfer is finished (or failed) now, which is all we need.
  }
}

void Pending::set_pollable(bool p) { state_->pollable = p; }

void Pending::wait() {
  if (!state_ || state_->waited) return;
  State& s = *state_;
  s.waited = true;
  const Deadline dl = Deadline::after(s.timeout);
  switch (s.kind) {
    case State::Kind::request: {
      try {
        // (an interrupt since the call began, while it computed: the request's own wait would not see it)
        if (CancelHook::cancelled_since(s.generation) && !s.req->test())
          throw CancelledError(cat("mk ", s.what, ": rank ", s.rank, ", peer ", s.peer, ": cancelled by an interrupt"));
        s.comm->wait(s.req, dl, s.what.c_str(), s.peer);
      } catch (const MismatchError& e) {
        throw_backend(e.what());
      } catch (const Error& e) {
        // Timeout, peer gone, interrupt: the exchange is torn, so the communicator cannot be trusted (the
        // same policy as ProcessGroupMK's collectives).
        if (s.is_recv && !s.req->test()) s.comm->matcher().cancel(s.req, e.what());
        s.comm->abort(e.what());
        throw_backend(e.what());
      }
      break;
    }
    case State::Kind::work: {
      if (s.device_wait || !s.pollable) {
        // Stream-ordered waits (accelerators), and works whose isCompleted() never turns true (Gloo's
        // send/recv): wait inside the backend, bounded by the group timeout. On the CPU an interrupt aborts
        // the work (cancel_hook.h: Gloo's send/recv end at once; a work that cannot be aborted, Gloo's
        // reduce_scatter, would still end only with the data or at the timeout: the ops use none on the CPU);
        // it also cuts the polling wait below.
        const auto fail = [&s](const std::string& why) {
          if (CancelHook::cancelled_since(s.generation)) throw_backend(cat(s.what, ": cancelled by an interrupt"));
          throw_backend(cat(s.what, ": ", why));
        };
        bool finished = false;  // false: aborted (by an interrupt), or the timeout passed
        try {
          std::optional<CancelHook> hook;
          if (!s.device_wait) hook.emplace([w = s.work.get()] { w->abort(); });
          if (!CancelHook::cancelled_since(s.generation)) finished = s.work->wait(s.timeout);
        } catch (const c10::DistBackendError& e) {
          // (named by the op already, or the backend's own words, e.g. ProcessGroupMK's for a collective it ran
          // on this thread: then they say which op's collective it was)
          const std::string msg = e.what_without_backtrace();
          if (!CancelHook::cancelled_since(s.generation) && msg.rfind(s.what.substr(0, s.what.find(':')), 0) == 0)
            throw;
          fail(msg);
        } catch (const c10::Error& e) {
          fail(e.what_without_backtrace());
        } catch (const std::exception& e) {
          fail(e.what());
        }
        if (!finished) fail(cat("timed out after ", s.timeout.count(), " ms"));
        break;
      }
      enum class Stop { none, interrupt, timeout };
      auto stop_reason = [&s, &dl] {
        if (cancel_generation().load(std::memory_order_acquire) != s.generation) return Stop::interrupt;
        return dl.expired() ? Stop::timeout : Stop::none;
      };
      auto give_up = [&s](Stop why) {
        if (why == Stop::interrupt) throw_backend(cat(s.what, ": cancelled by an interrupt"));
        try {
          s.work->abort();
        } catch (...) {
        }
        throw_backend(cat(s.what, ": timed out after ", s.timeout.count(), " ms"));
      };
      // Woken by the work's future (Gloo's and NCCL's works complete one) the moment the collective ends,
      // looking at interrupts and the deadline every 5 ms. Polling isCompleted() with back-off instead
      // overshot the end of a ~1 ms Gloo collective by up to the last sleep (hundreds of microseconds).
      c10::intrusive_ptr<c10::ivalue::Future> fut;
      try {
        fut = s.work->getFuture();
      } catch (const std::exception&) {
        // this work has no future: poll below
      }
      if (fut) {
        std::weak_ptr<State> weak = state_;
        fut->addCallback([weak](c10::ivalue::Future&) {
          if (auto st = weak.lock()) {
            {
              std::lock_guard<std::mutex> lock(st->mu);
              st->done = true;
            }
            st->cv.notify_all();
          }
        });
        Stop why = Stop::none;
        {
          std::unique_lock<std::mutex> lock(s.mu);
          while (!s.done && (why = stop_reason()) == Stop::none) s.cv.wait_for(lock, std::chrono::milliseconds(5));
        }
        if (why != Stop::none) give_up(why);  // (not under s.mu: aborting may complete the future and run the callback)
      } else {
        auto pause = std::chrono::microseconds(5);
        while (!s.work->isCompleted()) {
          if (Stop why = stop_reason(); why != Stop::none) give_up(why);
          std::this_thread::sleep_for(pause);
          pause = std::min(pause * 2, std::chrono::microseconds(200));
        }
      }
      try {
        s.work->wait();
      } catch (const c10::Error& e) {
        throw_backend(cat(s.what, ": ", e.what_without_backtrace()));
      } catch (const std::exception& e) {
        throw_backend(cat(s.what, ": ", e.what()));
      }
      break;
    }
    case State::Kind::lane: {
      std::unique_lock<std::mutex> lock(s.mu);
      while (!s.done) {
        if (cancel_generation().load(std::memory_order_acquire) != s.generation)
          throw_backend(cat(s.what, ": cancelled by an interrupt"));
        if (dl.expired()) throw_backend(cat(s.what, ": timed out after ", s.timeout.count(), " ms"));
        s.cv.wait_for(lock, std::chrono::milliseconds(5));
      }
      if (s.error) {
        try {
          std::rethrow_exception(s.error);
        } catch (const c10::Error& e) {
          throw_backend(cat(s.what, ": ", e.what_without_backtrace()));
        } catch (const std::exception& e) {
          throw_backend(cat(s.what, ": ", e.what()));
        }
      }
      break;
    }
  }
  s.keep.clear();
}

// ---------------------------------------------------------------- Lane

Lane& lane_of(const Group& g) {
  std::lock_guard<std::mutex> lock(states_mu());
  auto& s = state_of(g);
  if (!s.lane) s.lane = std::make_unique<Lane>("mk-ops-lane");
  return *s.lane;  // stays while this op holds g.pg: only entries of destroyed groups are dropped
}

// ---------------------------------------------------------------- Pipeline

Pipeline::Pipeline(const Group& g, const char* op)
    : g_(g), op_(op), started_(Clock::now()), generation_(cancel_generation().load(std::memory_order_acquire)) {
  std::vector<std::unique_ptr<Lane>> retired;
  {
    std::lock_guard<std::mutex> lock(states_mu());
    seq_ = state_of(g_).next_seq++;
    retired.swap(retired_lanes());
  }
  // (destroying `retired` joins those lanes' threads, now that states_mu() is free)
}

Pipeline::~Pipeline() { record_timing(); }

std::vector<std::vector<int64_t>> Pipeline::agree(std::vector<Field> fields, const std::string& local_error) {
  return start_agree(std::move(fields), local_error).result();
}

// ---------------------------------------------------------------- the folded agreement

namespace {
constexpr int kFoldSlot = 9;            // a flag and 8 bytes per rank
constexpr int kFoldNeedMost = 64;
constexpr int64_t kFoldRides = 1, kFoldVetoes = 2;

void disarm(GroupState::Fold& f) {
  f.armed = false;
  f.streak = 0;
  f.last_seq = ~uint64_t(0);
  f.need = std::min(f.need * 2, kFoldNeedMost);
}

// This rank's word for call `seq` of an armed group: `flag`, then the bytes of a hash of the armed state and
// the call number, each a small integer (exact in every float type, and in a sum with zeros).
std::vector<float> fold_word(int64_t flag, uint64_t gen, uint64_t seq) {
  std::vector<float> w(kFoldSlot);
  w[0] = float(flag);
  const uint64_t h = mix64(gen, seq);
  for (int i = 0; i < 8; ++i) w[size_t(1 + i)] = float((h >> (8 * i)) & 0xff);
  return w;
}

// A ride's (or a veto's) buffer: the plan's blocks (one, or one per rank for a reduce-scatter or an allgather),
// each a payload and a header of one slot per rank (FoldPlan says where), this rank's word in its slot of every
// block and zeros elsewhere. The header is written element by element (no ATen ops: a call that rides avoids
// every per-call cost it can).
at::Tensor fold_header_buffer(const Pipeline::FoldPlan& plan, int size, int rank, const std::vector<float>& word,
                              const at::TensorOptions& opts, bool reused) {
  const int64_t total = plan.blocks(size) * plan.block(size);
  at::Tensor buf = reused ? alias_of(scratch(1, total, opts.dtype(plan.dtype)), 0, {total}, {1})
                          : at::empty({total}, opts.dtype(plan.dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, plan.dtype, "fold_header", [&] {
    scalar_t* const base = buf.data_ptr<scalar_t>();
    for (int64_t j = 0; j < plan.blocks(size); ++j) {
      scalar_t* h = base + plan.header_at(j, size);
      for (int64_t i = 0; i < plan.header(size); ++i) h[i] = scalar_t(0);
      for (int i = 0; i < kFoldSlot; ++i) h[int64_t(rank) * kFoldSlot + i] = scalar_t(word[size_t(i)]);
    }
  });
  return buf;
}
}  // namespace

uint64_t Pipeline::fold_key(const char* op, const std::vector<int64_t>& values) {
  uint64_t h = 0x6d6b666f6c64ull;  // "mkfold"
  for (const char* c = op; *c; ++c) h = mix64(h, uint64_t(uint8_t(*c)));
  for (int64_t v : values) h = mix64(h, uint64_t(v));
  return h;
}

bool Pipeline::fold_allowed() {
  static const bool allowed = [] {
    const char* v = std::getenv("SUPERKERNEL_OPS_FOLD");
    return !(v && std::string(v) == "0");
  }();
  return allowed;
}

bool Pipeline::fold_rides(uint64_t key, FoldPlan* plan) {
  if (g_.size < 2) return false;
  std::lock_guard<std::mutex> lock(states_mu());
  const auto& f = state_of(g_).fold;
  if (!f.armed || size_t(g_.rank) >= f.keys.size() || f.keys[size_t(g_.rank)] != key) return false;
  *plan = f.plan;
  return true;
}

at::Tensor Pipeline::fold_buffer(const FoldPlan& plan, const at::TensorOptions& opts, bool reused) {
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(states_mu());
    gen = state_of(g_).fold.gen;
  }
  return fold_header_buffer(plan, g_.size, g_.rank, fold_word(kFoldRides, gen, seq_), opts, reused);
}

int64_t Pipeline::FoldPlan::header(int size) const {
  const int64_t per_line = int64_t(64 / c10::elementSize(dtype));  // (whole 64-byte lines)
  return (int64_t(size) * kFoldSlot + per_line - 1) / per_line * per_line;
}

int64_t Pipeline::FoldPlan::block(int size) const { return elems + header(size); }

int64_t Pipeline::FoldPlan::payload_at(int64_t j, int size) const {
  if (kind != Kind::allreduce && size == 2) return header(size) + j * elems;
  return j * block(size);
}

int64_t Pipeline::FoldPlan::header_at(int64_t j, int size) const {
  if (kind != Kind::allreduce && size == 2) return j == 0 ? 0 : block(size) + elems;
  return j * block(size) + elems;
}

at::Tensor Pipeline::fold_payload(const at::Tensor& buf, const FoldPlan& plan, int64_t rows, int64_t cols) const {
  const int64_t j = plan.kind == FoldPlan::Kind::reduce_scatter ? g_.rank : 0;  // (the block this rank holds)
  return rows_of(buf, plan.payload_at(j, g_.size) - j * plan.block(g_.size), rows, cols);
}

bool Pipeline::fold_landed(const at::Tensor& buf, const FoldPlan& plan) {
  const bool all = plan.kind == FoldPlan::Kind::allgather;  // (every block, each with its owner's word)
  const int64_t want = all ? plan.blocks(g_.size) * plan.block(g_.size) : plan.block(g_.size);
  TORCH_INTERNAL_ASSERT(buf.is_contiguous() && buf.numel() == want && buf.scalar_type() == plan.dtype, "mk ",
                        op_, ": rank ", g_.rank, ": the folded collective left ", buf.numel(),
                        " elements here, the plan ", want);
  // (the words read outside the lock: states_mu() is every group's)
  std::vector<float> header(size_t(g_.size) * kFoldSlot);
  const int64_t j = plan.kind == FoldPlan::Kind::reduce_scatter ? g_.rank : 0;  // (the block this rank holds)
  const int64_t from = plan.header_at(j, g_.size) - j * plan.block(g_.size);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, plan.dtype, "fold_landed", [&] {
    const scalar_t* src = buf.data_ptr<scalar_t>();
    for (int q = 0; q < g_.size; ++q) {  // rank q's word: its slot of the summed header, or of its own block's
      const scalar_t* w = src + (all ? plan.header_at(q, g_.size) : from) + int64_t(q) * kFoldSlot;
      for (int i = 0; i < kFoldSlot; ++i) header[size_t(q) * kFoldSlot + size_t(i)] = float(w[i]);
    }
  });
  const float* h = header.data();
  int vetoed = -1, differs = -1;
  {
    std::lock_guard<std::mutex> lock(states_mu());
    auto& f = state_of(g_).fold;
    const std::vector<float> mine = fold_word(kFoldRides, f.gen, seq_);
    for (int q = 0; q < g_.size; ++q) {
      const float* w = h + size_t(q) * kFoldSlot;
      if (w[0] != float(kFoldRides)) {
        if (vetoed < 0) vetoed = q;
      } else if (!std::equal(w + 1, w + kFoldSlot, mine.begin() + 1)) {
        if (differs < 0) differs = q;
      }
    }
    if (vetoed < 0 && differs < 0) {
      if (++f.rode == f.need) f.need = 2;  // (the fold paid for its arming: a later change re-arms soon)
      return true;
    }
    disarm(f);
  }
  if (tracing())
    emit_trace(vetoed >= 0 ? c10::str("fold: rank ", vetoed, " did not ride call ", seq_, "; agreeing as usual")
                           : c10::str("fold: rank ", differs, " rode another call or state at call ", seq_,
                                      "; agreeing as usual"));
  return false;
}

void Pipeline::fold_note(const std::vector<uint64_t>& keys, const FoldPlan& plan) {
  if (g_.size < 2 || !g_.device.is_cpu()) return;
  std::lock_guard<std::mutex> lock(states_mu());
  auto& st = state_of(g_);
  auto& f = st.fold;
  if (f.armed) return;  // (a call that rode: nothing to note)
  const bool same = f.last_seq != ~uint64_t(0) && f.last_seq + 1 == seq_ && f.keys == keys &&
                    f.plan.elems == plan.elems && f.plan.dtype == plan.dtype && f.plan.kind == plan.kind &&
                    f.plan.aux == plan.aux;
  f.streak = same ? f.streak + 1 : 1;
  f.keys = keys;
  f.plan = plan;
  f.last_seq = seq_;
  // (mk has no side channel: its agreement always travels over the group's own communicator)
  const bool side_settled =
      g_.is_mk() || st.side == GroupState::Side::active || st.side == GroupState::Side::never;
  if (f.streak < f.need || !side_settled) return;
  f.armed = true;
  f.rode = 0;
  f.gen = mix64(mix64(mix64(mix64(mix64(0x61726d6564ull, seq_), uint64_t(plan.elems)), uint64_t(plan.dtype)),
                      uint64_t(plan.kind)),
                uint64_t(plan.aux));
  for (uint64_t k : keys) f.gen = mix64(f.gen, k);
  if (tracing()) emit_trace(c10::str("fold: armed after call ", seq_, " (", f.streak, " alike)"));
}

void Pipeline::fold_veto() {
  FoldPlan plan;
  uint64_t gen = 0;
  {
    std::lock_guard<std::mutex> lock(states_mu());
    auto& f = state_of(g_).fold;
    if (!f.armed) return;
    plan = f.plan;
    gen = f.gen;
    disarm(f);  // (first: whatever the allreduce does, this rank agrees as usual from now on)
  }
  using Kind = FoldPlan::Kind;
  trace("fold: call ", seq_, " does not ride; sending the armed ",
        plan.kind == Kind::allreduce ? "allreduce" : plan.kind == Kind::reduce_scatter ? "reduce-scatter" : "allgather",
        " with its veto");
  at::Tensor buf = fold_header_buffer(plan, g_.size, g_.rank, fold_word(kFoldVetoes, gen, seq_),
                                      at::TensorOptions().device(g_.device), /*reused=*/false);
  const int64_t block = plan.block(g_.size);
  for (int64_t j = 0; j < plan.blocks(g_.size); ++j)  // (the payload is dropped on every rank; zeros keep it defined)
    buf.narrow(0, plan.payload_at(j, g_.size), plan.elems).zero_();
  if (plan.kind == Kind::allreduce) {
    allreduce(buf).wait();
  } else if (plan.kind == Kind::reduce_scatter) {
    at::Tensor out = at::empty({block}, buf.options());
    reduce_scatter(buf, out).wait();
  } else {
    allgather(buf.narrow(0, int64_t(g_.rank) * block, block), buf).wait();
  }
}

Agreement Pipeline::start_agree(std::vector<Field> fields, const std::string& local_error, Carried carried) {
  if (g_.size > 1) fold_veto();  // (an armed group: this call does not ride)
  std::shared_ptr<AgreementBoard> board;
  SideChannel side;
  bool open_side = false;
  if (g_.size > 1) {
    std::lock_guard<std::mutex> lock(states_mu());
    auto& st = state_of(g_);
    if (!st.board_tried) {
      st.board_tried = true;
      st.board = new_agreement_board(g_);
    }
    if (st.board && st.board->retired()) st.board.reset();
    board = st.board;
    if (st.side == GroupState::Side::open_next) {
      st.side = GroupState::Side::opened;  // (every rank opens at this call: the words of the last said so)
      open_side = true;
    }
    side.may = st.side != GroupState::Side::never && side_channel_possible(g_);
    side.comm = st.side_comm;
    side.active = st.side == GroupState::Side::active;
  }
  if (open_side) {  // (outside the lock: a rendezvous through the store, up to kSideOpenTimeout)
    side.comm = open_side_channel(g_);
    std::lock_guard<std::mutex> lock(states_mu());
    state_of(g_).side_comm = side.comm;
  }
  const bool decide_side = !g_.is_mk() && side.may && !side.active;
  Agreement a(g_, op_, std::move(fields), local_error, seq_, std::move(board), std::move(carried), std::move(side));
  if (decide_side) {
    // the side channel's next step, from words every rank holds alike (side_channel.h)
    a.on_side_words([key = key_of(g_)](const SideWords& w) {
      std::shared_ptr<Comm> closing;  // (closed outside the lock: its destructor joins its threads)
      {
        std::lock_guard<std::mutex> lock(states_mu());
        auto it = states().find(key);
        if (it == states().end()) return;
        GroupState& st = it->second;
        using Side = GroupState::Side;
        if (!w.all_may || w.one_host) {
          st.side = Side::never;
        } else if (st.side == Side::none) {
          st.side = Side::open_next;
        } else if (st.side == Side::opened) {
          st.side = w.all_open ? Side::active : Side::never;
        }
        if (st.side == Side::never) closing = std::move(st.side_comm);
      }
    });
  }
  if (!g_.is_mk()) {
    // what the group's layout is, for one_host() of later calls (mk knows its transports)
    auto key = key_of(g_);
    a.on_result([key](bool same) {
      std::lock_guard<std::mutex> lock(states_mu());
      auto it = states().find(key);
      if (it != states().end()) it->second.one_host = same ? 1 : 0;
    });
  }
  return a;
}

int64_t Pipeline::chunks(int64_t requested, const ChunkModel& model) {
  const int64_t hi = std::max<int64_t>(1, model.max_chunks);
  if (requested > 0) return std::min(requested, hi);
  if (g_.size == 1 || model.comm_bytes <= 0) return 1;
  // Every peer on this host, CPU tensors: the "communication" is copies and reductions (through shared
  // memory, or loopback TCP on Gloo) on the cores the GEMM needs, so chunking only adds overhead (smaller
  // GEMMs, more messages). Measured on 2 ranks, one chunk against the tuned count, two rounds: mk
  // allgather_gemm 256^3 0.92-0.93x of the unfused composition against 0.86-0.94x, 1024^3 1.00x against
  // 0.95-0.97x; gemm_allreduce level (0.95-1.00x); Gloo gemm_reducescatter 1024x128x1024 with 3 chunks 0.61x.
  if (g_.device.is_cpu() && one_host()) return 1;
  // The tuner of this op and shape, once it has started: its next candidate (the model below only gives the
  // candidates it starts with; worked out on every call, with the tuner's key as text, it cost 8-11 us of CPU a
  // call, allgather_gemm between 2 namespace hosts)
  const TunerKey key{op_, model.comm_bytes, model.flops, hi, model.plain_too};
  {
    std::lock_guard<std::mutex> lock(states_mu());
    auto& tuners = state_of(g_).tuners;
    auto it = tuners.find(key);
    if (it != tuners.end() && !it->second.candidates.empty()) {
      tuner_ = &it->second;
      return tuner_->next();
    }
  }
  // Link estimate: measured (lane collectives on this group) when available, else by transport kind.
  double bw = 0, lat = 0;
  {
    std::lock_guard<std::mutex> lock(states_mu());
    auto& s = state_of(g_);
    bw = s.bw;
    lat = s.latency;
  }
  const bool tcp = over_tcp();
  if (bw <= 0) bw = !g_.device.is_cpu() ? 2e10 : tcp ? 1e9 : 4e9;
  if (lat <= 0) lat = !g_.device.is_cpu() ? 2e-5 : tcp ? 6e-5 : 1.5e-5;
  const double t_comm = model.comm_bytes / bw;
  const double t_comp = model.flops / gemm_flops_per_second(model.dtype, g_.device);
  // Total ~ max(tc, tm) + min(tc, tm) / C + C * overhead (per-chunk message latency, thread hand-offs and a
  // smaller GEMM's lost efficiency; ~150 us measured on a shared 2-core VM); minimised at
  // C = sqrt(min / overhead). Beyond 8 chunks the fill/drain gain is below the noise.
  const double overhead = lat + 1.5e-4;
  const double c = std::sqrt(std::min(t_comm, t_comp) / overhead);
  const int64_t modeled = std::clamp<int64_t>(int64_t(std::lround(c)), 1, std::min<int64_t>(hi, 8));
  // The model cannot see how much CPU the communication itself needs (shm copies, TCP at 10 Gbit/s on a
  // small machine): then overlap gains less and chunking may cost more than it saves. So the automatic
  // count is tuned per (group, op, shape) on the calls themselves: the modelled count, its neighbours and 1
  // are timed in turn (see Tuner), then the lowest median is kept (rank 0's proposal is the one every rank
  // uses).
  std::lock_guard<std::mutex> lock(states_mu());
  Tuner& t = state_of(g_).tuners[key];
  if (t.candidates.empty()) {
    int64_t m = modeled;
    // Test hook: the count this rank's model gives, as another link estimate or compute rate would give it
    if (const char* v = std::getenv("SUPERKERNEL_TEST_MODELED_CHUNKS"); v && *v)
      m = std::clamp<int64_t>(std::atoll(v), 1, std::min<int64_t>(hi, 8));
    t.start(m, hi, model.plain_too);
  }
  tuner_ = &t;
  return t.next();
}

namespace {
double median_of(std::vector<double> v) {
  if (v.empty()) return std::numeric_limits<double>::infinity();
  const size_t h = v.size() / 2;
  std::nth_element(v.begin(), v.begin() + h, v.end());
  if (v.size() % 2) return v[h];
  return (v[h] + *std::max_element(v.begin(), v.begin() + h)) / 2;
}
}  // namespace

std::vector<int64_t> Tuner::candidates_for(int64_t modeled, int64_t hi, bool plain_too) {
  std::vector<int64_t> cands;
  for (int64_t v : {modeled, int64_t(1), std::max<int64_t>(1, modeled / 2), std::min<int64_t>(hi, modeled * 2)})
    if (std::find(cands.begin(), cands.end(), v) == cands.end()) cands.push_back(v);
  if (plain_too) cands.push_back(kPlainPath);
  TORCH_INTERNAL_ASSERT(cands.size() <= kMostCandidates, "mk: ", cands.size(), " tuner candidates");
  return cands;
}

void Tuner::follow_first(int64_t agreed) {
  if (agreed < 1 || candidates.empty() || agreed == candidates[0] || last.chunks != 0) return;
  for (size_t n : calls)
    if (n != 0) return;  // (not this tuner's first call; a tuner that is done has made calls)
  start(agreed, hi, plain_too);
}

void Tuner::start(int64_t modeled, int64_t h, bool plain) {
  start(candidates_for(modeled, h, plain));
  hi = h;
  plain_too = plain;
}

void Tuner::start(std::vector<int64_t> cands) {
  last = {};
  candidates = std::move(cands);
  calls.assign(candidates.size(), 0);
  seconds.assign(candidates.size(), {});
  dropped_.clear();
  choice_ = 0;
}

bool Tuner::first_round_done() const {
  for (const auto& s : seconds)
    if (s.size() < kTrials) return false;
  return true;
}

size_t Tuner::wanted(size_t i) const {
  const size_t goal = dropped_.empty() ? kTrials : dropped_[i] ? 0 : kFinalTrials;
  // (`last`, when of this candidate and not its first call, is a timing on its way)
  const size_t have = seconds[i].size() + (last.chunks == candidates[i] && calls[i] > 0 ? 1 : 0);
  return have < goal ? goal - have : 0;
}

int64_t Tuner::next() const {
  if (candidates.empty()) return 1;
  if (choice_ != 0) return choice_;
  auto made = [this](size_t i) { return calls[i] + (last.chunks == candidates[i] ? 1 : 0); };
  size_t pick = candidates.size();
  for (size_t i = 0; i < candidates.size(); ++i)
    if (wanted(i) > 0 && (pick == candidates.size() || made(i) < made(pick))) pick = i;
  // (none wanted: the last timing is still on its way; the leader so far)
  return candidates[pick == candidates.size() ? kept() : pick];
}

namespace {
bool fewer_chunks(int64_t x, int64_t y) {
  const double fx = x == kPlainPath ? 0.5 : double(x), fy = y == kPlainPath ? 0.5 : double(y);
  return fx < fy;
}
}  // namespace

size_t Tuner::baseline() const {
  size_t b = 0;
  for (size_t c = 1; c < candidates.size(); ++c)
    if (fewer_chunks(candidates[c], candidates[b])) b = c;
  return b;
}

bool Tuner::clearly_faster(size_t c, size_t b) const {
  const auto& x = seconds[c];
  const auto& y = seconds[b];
  if (x.empty() || y.empty()) return false;
  // U: the pairs (one call of each) in which c's call was the slower, ties counting one half; without a
  // difference its mean is n1 n2 / 2 (the normal approximation, with a continuity correction)
  double u = 0;
  for (double xi : x)
    for (double yj : y) u += xi > yj ? 1.0 : xi == yj ? 0.5 : 0.0;
  const double n1 = double(x.size()), n2 = double(y.size());
  const double z = (u + 0.5 - n1 * n2 / 2) / std::sqrt(n1 * n2 * (n1 + n2 + 1) / 12);
  return z < -kConfidenceZ;
}

size_t Tuner::kept() const {
  const size_t best = lowest_median(), base = baseline();
  return best == base || clearly_faster(best, base) ? best : base;
}

size_t Tuner::lowest_median() const {
  size_t best = candidates.size();
  double best_median = std::numeric_limits<double>::infinity();
  for (size_t c = 0; c < candidates.size(); ++c) {
    if (!dropped_.empty() && dropped_[c]) continue;
    const double m = median_of(seconds[c]);
    if (best == candidates.size() || m < best_median ||
        (m == best_median && fewer_chunks(candidates[c], candidates[best]))) {
      best = c;
      best_median = m;
    }
  }
  return best == candidates.size() ? 0 : best;
}

void Tuner::record(int64_t chunks, double secs) {
  auto it = std::find(candidates.begin(), candidates.end(), chunks);
  if (it == candidates.end() || done()) return;
  // (rank 0's proposal is what every rank uses, so a call may have used another candidate than next() gave:
  // another rank's tuner may then never finish, and keeps at most kFinalTrials timings of each candidate)
  const size_t i = size_t(it - candidates.begin());
  if (calls[i]++ == 0 || wanted(i) == 0) return;
  seconds[i].push_back(secs);
  if (dropped_.empty() && first_round_done()) {
    // on each candidate's first kTrials timed calls, so a drop never changes later
    std::vector<double> first(candidates.size());
    for (size_t c = 0; c < candidates.size(); ++c)
      first[c] = median_of(std::vector<double>(seconds[c].begin(), seconds[c].begin() + kTrials));
    const double best = *std::min_element(first.begin(), first.end());
    const size_t base = baseline();
    for (size_t c = 0; c < candidates.size(); ++c) dropped_.push_back(c != base && first[c] > kDropRatio * best);
  }
  if (dropped_.empty()) return;
  for (size_t c = 0; c < candidates.size(); ++c)
    if (wanted(c) > 0) return;
  // tuned: the lowest median of the candidates kept (ties: the fewer chunks; the plain path as one chunk,
  // before the overlapped one) if it is clearly faster than the baseline, else the baseline
  choice_ = candidates[kept()];
}

bool Pipeline::one_host() const {
  if (g_.is_mk()) return !over_tcp();
  std::lock_guard<std::mutex> lock(states_mu());
  auto it = states().find(key_of(g_));
  return it != states().end() && it->second.one_host == 1;
}

bool Pipeline::over_tcp() const {
  if (!g_.is_mk()) return true;
  for (int q = 0; q < g_.size; ++q)
    if (std::strcmp(g_.comm().transport_of(q), "tcp") == 0) return true;  // (on every call: no string built)
  return false;
}

std::vector<Field> Pipeline::tuner_fields() const {
  int64_t seq = -1, micros = -1;
  if (tuner_) {
    std::lock_guard<std::mutex> lock(states_mu());
    if (tuner_->last.chunks != 0) {
      seq = int64_t(tuner_->last.seq);
      micros = tuner_->last.micros;
    }
  }
  return {{"tuner: previous call", seq, false}, {"tuner: its microseconds", micros, false}};
}

void Pipeline::use_chunks(int64_t agreed, const std::vector<std::vector<int64_t>>& all, size_t tuner_at) {
  chunks_used_ = agreed;
  if (!tuner_) return;
  std::lock_guard<std::mutex> lock(states_mu());
  if (g_.rank != 0) tuner_->follow_first(agreed);
  const Tuner::Last last = tuner_->take_last();
  if (last.chunks == 0) return;
  // the slowest rank's time of that call, when every rank timed it (a rank whose count was not automatic, or
  // whose call failed, sent -1: then this rank's own)
  int64_t micros = last.micros;
  bool every_rank = true;
  for (const auto& r : all) {
    TORCH_INTERNAL_ASSERT(tuner_at + 1 < r.size(), "mk ", op_, ": rank ", g_.rank, ": tuner fields at ", tuner_at,
                          " of ", r.size());
    if (r[tuner_at] != int64_t(last.seq)) every_rank = false;
    micros = std::max(micros, r[tuner_at + 1]);
  }
  if (!every_rank) micros = last.micros;
  tuner_->record(last.chunks, double(micros) * 1e-6);
  if (!tracing()) return;
  std::string line = c10::str("tuner: call ", last.seq, " chunks=", chunks_name(last.chunks), " took ",
                              double(micros) * 1e-3, " ms on ", every_rank ? "the slowest rank" : "this rank");
  if (tuner_->done()) line += c10::str("; tuned, using chunks=", chunks_name(tuner_->next()));
  emit_trace(line);
}

std::string chunks_name(int64_t chunks) { return chunks == kPlainPath ? "plain" : std::to_string(chunks); }

void Pipeline::record_timing() {
  if (!tuner_ || chunks_used_ == 0 || std::uncaught_exceptions() > 0) return;
  const int64_t micros = std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - started_).count();
  std::lock_guard<std::mutex> lock(states_mu());
  if (tuner_->done()) return;
  // (recorded in the next call's agreement, as the slowest rank's time: see Tuner)
  tuner_->last = {seq_, chunks_used_, micros};
  if (tracing())
    emit_trace(c10::str("tuner: chunks=", chunks_name(chunks_used_), " took ", double(micros) * 1e-3, " ms here"));
}

Pending Pipeline::send(const at::Tensor& t, int peer, uint32_t slot) { return p2p(t, peer, slot, false); }

Pending Pipeline::recv(const at::Tensor& t, int peer, uint32_t slot) { return p2p(t, peer, slot, true); }

Pending Pipeline::p2p(const at::Tensor& t, int peer, uint32_t slot, bool is_recv) {
  const char* dir = is_recv ? "recv" : "send";
  TORCH_CHECK(t.is_contiguous(), "mk ", op_, ": rank ", g_.rank, ": ", dir, " buffer must be contiguous");
  TORCH_CHECK(slot < (1u << 20), "mk ", op_, ": slot ", slot, " out of range");
  const std::string what = cat("mk ", op_, ": ", dir, is_recv ? " from" : " to", " peer ", peer, " (message ", slot, ")");
  if (g_.is_mk()) {
    auto st = std::make_shared<Pending::State>();
    st->kind = Pending::State::Kind::request;
    st->what = what.substr(3);  // (Comm::wait puts "mk " before it)
    st->peer = peer;
    st->rank = g_.rank;
    st->timeout = g_.timeout;
    st->comm = &g_.comm();
    st->is_recv = is_recv;
    st->generation = generation_;
    st->keep = {t};
    // bit 61: fused-op data (bits 20-59 the call number, 0-19 the slot); group.cc lists the other tag spaces
    const uint64_t tag = (1ull << 61) | ((seq_ & 0xffffffffffull) << 20) | slot;
    const uint64_t check = mix64(mix64(0x6d6b6f70, tag), nbytes(t)) | 1;
    try {
      st->comm->check_usable(op_);
      st->req = is_recv ? st->comm->irecv(peer, tag, t.data_ptr(), nbytes(t), check)
                        : st->comm->isend(peer, tag, t.data_ptr(), nbytes(t), check);
    } catch (const Error& e) {
      throw_backend(e.what());
    }
    return Pending(std::move(st));
  }
  std::vector<at::Tensor> v{handoff(t)};
  const int tag = (1 << 30) | int((seq_ & 0x3ff) << 20) | int(slot);
  auto work = is_recv ? g_.backend->recv(v, peer, tag) : g_.backend->send(v, peer, tag);
  return backend_work(std::move(work), what.c_str(), peer, {t});
}

bool Pipeline::exchange_supported() const {
  return g_.is_mk() || g_.device.is_cpu() || g_.backend->supportsCoalescing();
}

std::vector<Pending> Pipeline::exchange(const at::Tensor& out, int to, const at::Tensor& in, int from, uint32_t slot) {
  std::vector<Pending> done;
  if (g_.is_mk() || !g_.backend->supportsCoalescing()) {
    done.push_back(send(out, to, slot));
    done.push_back(recv(in, from, slot));
    return done;
  }
  TORCH_CHECK(out.is_contiguous() && in.is_contiguous(), "mk ", op_, ": rank ", g_.rank,
              ": exchange buffers must be contiguous");
  TORCH_CHECK(slot < (1u << 20), "mk ", op_, ": slot ", slot, " out of range");
  const std::string what = cat("mk ", op_, ": batched send to peer ", to, " + recv from peer ", from, " (message ", slot, ")");
  // The works of the individual calls inside a coalesced group are not the group's completion (nccl returns
  // none); endCoalescing's work is, and waiting on it orders the caller's stream after the whole group.
  std::vector<at::Tensor> o{handoff(out)}, i{handoff(in)};
  const int tag = (1 << 30) | int((seq_ & 0x3ff) << 20) | int(slot);
  g_.backend->startCoalescing();
  try {
    g_.backend->send(o, to, tag);
    g_.backend->recv(i, from, tag);
  } catch (...) {
    try {
      g_.backend->endCoalescing();  // leave the backend out of coalescing mode; the error is the first one
    } catch (...) {
    }
    throw;
  }
  auto work = g_.backend->endCoalescing();
  TORCH_CHECK(work, what, ": the ", g_.backend_name(), " backend returned no work for the coalesced group");
  done.push_back(backend_work(std::move(work), what.c_str(), to, {out, in}));
  return done;
}

Pending Pipeline::backend_work(c10::intrusive_ptr<c10d::Work> work, const char* what, int peer,
                               std::vector<at::Tensor> keep) {
  auto st = std::make_shared<Pending::State>();
  st->kind = Pending::State::Kind::work;
  st->what = cat(what, " (rank ", g_.rank, ", ", g_.backend_name(), ")");
  st->peer = peer;
  st->rank = g_.rank;
  st->timeout = g_.timeout;
  st->work = std::move(work);
  st->device_wait = !g_.device.is_cpu();
  // Only c10d works known to report completion are polled (allreduce, allgather, alltoall set it); Gloo's
  // send/recv works never report it (a CancelHook aborts their wait), nor does its reduce_scatter (which the
  // ops do not use on the CPU: gemm_reducescatter sums there after an alltoall).
  st->pollable = false;
  st->generation = generation_;
  st->keep = std::move(keep);
  return Pending(std::move(st));
}

Pending Pipeline::lane_collective(std::function<c10::intrusive_ptr<c10d::Work>()> issue, const char* what,
                                  std::vector<at::Tensor> keep) {
  if (inline_) {
    // ProcessGroupMK's own work, run on this thread when the group is idle (the op waits for it next, with
    // nothing to overlap: see ProcessGroupMK::CallerWaits), else queued behind what is; its wait honours the
    // timeout and interrupts.
    c10::intrusive_ptr<c10d::Work> work;
    {
      ProcessGroupMK::CallerWaits here;
      work = issue();
    }
    auto pend = backend_work(std::move(work), cat("mk ", op_, ": ", what).c_str(), -1, std::move(keep));
    pend.set_pollable(false);
    return pend;
  }
  auto st = std::make_shared<Pending::State>();
  st->kind = Pending::State::Kind::lane;
  st->what = cat("mk ", op_, ": rank ", g_.rank, ": ", what);
  st->rank = g_.rank;
  st->timeout = g_.timeout;
  st->generation = generation_;
  size_t bytes = 0;
  for (auto& t : keep) bytes += nbytes(t);
  st->keep = std::move(keep);
  Lane& lane = lane_of(g_);
  auto timeout = g_.timeout;
  auto key = key_of(g_);
  lane.post([st, issue = std::move(issue), timeout, key, bytes]() mutable {
    std::exception_ptr err;
    const auto t0 = Clock::now();
    try {
      issue()->wait(timeout);
    } catch (...) {
      err = std::current_exception();
    }
    // `issue` holds the backend and the buffers: let them go before the caller hears of the end, which may
    // destroy the group next. Released after that, the last reference made this thread run the backend's
    // destructor late (its threads outlived destroy_process_group: one round in 30 under ASan).
    issue = nullptr;
    if (!err) record_link_sample(key, double(bytes), std::chrono::duration<double>(Clock::now() - t0).count());
    {
      std::lock_guard<std::mutex> lock(st->mu);
      st->error = err;
      st->done = true;
    }
    st->cv.notify_all();
  });
  return Pending(std::move(st));
}

Pending Pipeline::allreduce(const at::Tensor& t) {
  TORCH_CHECK(t.is_contiguous(), "mk ", op_, ": allreduce buffer must be contiguous");
  auto backend = g_.backend;
  auto issue = [backend, t = handoff(t)] {
    std::vector<at::Tensor> v{t};
    return backend->allreduce(v, c10d::AllreduceOptions());
  };
  if (g_.is_mk()) return lane_collective(issue, "allreduce", {t});
  auto pend = backend_work(issue(), cat("mk ", op_, ": allreduce").c_str(), -1, {t});
  pend.set_pollable(true);  // Gloo's and NCCL's allreduce works report completion
  return pend;
}

Pending Pipeline::reduce_scatter(const at::Tensor& in, const at::Tensor& out) {
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "mk ", op_, ": reduce_scatter buffers must be contiguous");
  auto backend = g_.backend;
  auto issue = [backend, in = handoff_flat(in), out = handoff_flat(out)] {
    at::Tensor i = in, o = out;  // flat: Gloo compares shapes dimension by dimension
    return backend->_reduce_scatter_base(o, i, c10d::ReduceScatterOptions());
  };
  if (g_.is_mk()) return lane_collective(issue, "reduce_scatter", {in, out});
  return backend_work(issue(), cat("mk ", op_, ": reduce_scatter").c_str(), -1, {in, out});
}

bool Pipeline::in_place_allowed() const {
  if (in_place_env_ < 0) {  // read once per op call (not per process: a test flips it on one rank)
    const char* v = std::getenv("SUPERKERNEL_OPS_IN_PLACE");
    in_place_env_ = (v && std::strcmp(v, "0") == 0) ? 0 : 1;
  }
  return in_place_env_ == 1;
}

bool Pipeline::in_place_shm() const {
  return in_place_allowed() && g_.is_mk() && g_.device.is_cpu() && g_.size > 1 && g_.comm().all_local();
}

void Pipeline::run_in_place(const char* what, size_t rows_per_chunk, std::function<void(Comm&)> fn,
                            std::vector<at::Tensor> keep) {
  trace("in place: ", rows_per_chunk, " rows per chunk");
  Comm& comm = g_.comm();
  const std::string title = cat("mk ", op_, ": ", what, " (in place)");
  // Queued behind other collectives it runs on ProcessGroupMK's worker thread, which must then dispatch as the
  // op's kernel does: below autograd (the kernel's mm_out calls would otherwise refuse inputs that require
  // grad). A guard on the running thread is enough: the kernel needs no other state of the caller's (no
  // at::ThreadLocalState capture on every call, which copies the profiler's and Python's thread state).
  auto work = g_.mk->run_ordered(what, keep, [&comm, title, fn = std::move(fn)] {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    try {
      fn(comm);
    } catch (const MismatchError&) {
      throw;  // every rank saw it at the same step: the group stays in step and usable
    } catch (const std::exception& e) {
      // The op's own work failed between two steps (a GEMM's allocation): the peers' steps can no longer
      // match ours, so the communicator is done, as after a transport failure.
      comm.abort(cat(title, ": ", e.what()));
      throw;
    }
  });
  Pending pend = backend_work(work, title.c_str(), -1, std::move(keep));
  pend.set_pollable(false);
  std::string failure;
  try {
    pend.wait();
    return;
  } catch (const c10::Error& e) {
    failure = e.what_without_backtrace();
  } catch (const std::exception& e) {
    failure = e.what();
  }
  // The wait gave up before the work ran (queued behind a collective that hangs): fn refers to this call's
  // stack, so a late start must find the communicator aborted (its first step checks) instead of running.
  if (!work->isCompleted()) {
    comm.abort(cat(title, ": ", failure));
    try {  // if it did start, let it fail on the aborted communicator before this stack unwinds
      work->wait(std::chrono::seconds(10));
    } catch (...) {
    }
  }
  // A transport error names the collective step ("mk allreduce: rank 0: peer 1 aborted ..."): say which op.
  if (failure.find(title) == std::string::npos) failure = cat(title, " (rank ", g_.rank, "): ", failure);
  throw_backend(failure);
}

Pending Pipeline::allgather(const at::Tensor& in, const at::Tensor& out) {
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "mk ", op_, ": allgather buffers must be contiguous");
  auto backend = g_.backend;
  auto issue = [backend, in = handoff_flat(in), out = handoff_flat(out)] {
    at::Tensor i = in, o = out;
    return backend->_allgather_base(o, i, c10d::AllgatherOptions());
  };
  if (g_.is_mk()) return lane_collective(issue, "allgather", {in, out});
  if (g_.device.is_cpu() && g_.size > 1 && in.nbytes() <= kAlltoallGatherBytes) {
    // The same result from the backend's alltoall, each peer's slot a copy of `in` (what it receives lands at
    // rank order in `out`, as an allgather's would): on Gloo cheaper up to a few hundred KiB. Two namespace
    // hosts, 1 Gbit/s, 2 ranks, median: 384 B allgather 0.43 ms against alltoall 0.34 ms, 4 KiB 0.46 / 0.37,
    // 64 KiB 0.49 / 0.40, 256 KiB 0.79 / 0.72, 1 MiB 5.9 / 5.9, 4 MiB 36 / 42.
    at::Tensor copies = in.reshape({1, -1}).expand({g_.size, in.numel()}).contiguous().view({-1});
    return alltoall(copies, out.view({-1}), {}, {});
  }
  auto pend = backend_work(issue(), cat("mk ", op_, ": allgather").c_str(), -1, {in, out});
  pend.set_pollable(true);  // (as alltoall's below)
  return pend;
}

Pending Pipeline::alltoall(const at::Tensor& in, const at::Tensor& out, std::vector<int64_t> out_splits,
                           std::vector<int64_t> in_splits) {
  TORCH_CHECK(in.is_contiguous() && out.is_contiguous(), "mk ", op_, ": alltoall buffers must be contiguous");
  auto backend = g_.backend;
  auto issue = [backend, in = handoff(in), out = handoff(out), out_splits, in_splits] {
    at::Tensor i = in, o = out;
    auto os = out_splits, is = in_splits;
    return backend->alltoall_base(o, i, os, is, c10d::AllToAllOptions());
  };
  if (g_.is_mk()) return lane_collective(issue, "alltoall", {in, out});
  auto pend = backend_work(issue(), cat("mk ", op_, ": alltoall").c_str(), -1, {in, out});
  // Gloo's alltoall and allgather works complete their future, so the wait below can see an interrupt. Waited
  // inside Gloo, which cannot abort them, an interrupt went unnoticed until the data had crossed: two namespace
  // hosts at 100 Mbit/s, 8 MiB a rank, both ranks interrupted 0.4 s into the call: moe_dispatch_gemm raised
  // 0.35-0.42 s after the interrupt, allgather_gemm 0.55-0.66 s, and gemm_reducescatter (0.5-0.6 s) and
  // moe_combine (1.0-1.2 s) returned as if never interrupted (tests/ops/interrupt_in_flight.py).
  pend.set_pollable(true);
  return pend;
}

bool Pipeline::tracing() {
  static const bool on = [] {
    const char* v = std::getenv("SUPERKERNEL_OPS_TRACE");
    return v && *v && std::string(v) != "0";
  }();
  return on;
}

void Pipeline::emit_trace(const std::string& line) const {
  std::fprintf(stderr, "[mk %s rank %d call %llu] %s\n", op_, g_.rank, (unsigned long long)seq_, line.c_str());
}

void Pipeline::publish(const at::Tensor& t) {
  if (t.device().is_cpu() || g_.backend_name() == "nccl") return;
  c10::impl::VirtualGuardImpl guard(t.device().type());
  c10::Event ev(t.device().type());
  ev.record(guard.getStream(t.device()));
  ev.synchronize();
}

int64_t env_integer(const char* name, int64_t fallback, int64_t least, std::string& problem, bool* set) {
  const char* v = std::getenv(name);
  if (set) *set = v && *v;
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const long long x = std::strtoll(v, &end, 10);
  if (*end == '\0' && x >= least) return int64_t(x);
  problem = c10::str(name, " must be ", least == 0 ? "a non-negative" : "a positive", " integer, got '", v, "'");
  return 0;
}

CarryLimit carry_limit(const Pipeline& p, CarryTotal total_rule, size_t other_most) {
  const Group& g = p.group();
  CarryLimit cl;
  cl.may_carry = g.size > 1 && (g.is_mk() ? p.over_tcp() : g.device.is_cpu());
  cl.most_per_peer = std::min(other_most, carry_max(g.is_mk()));
  const int peers = total_rule == CarryTotal::every_peer ? std::max(1, g.size - 1) : 1;
  const int64_t total = int64_t(cl.most_per_peer) * peers;
  if (cl.may_carry) cl.total = env_integer("SUPERKERNEL_OPS_CARRY_BYTES", total, 0, cl.problem);
  return cl;
}

std::pair<int64_t, int64_t> chunk_range(int64_t n, int64_t chunks, int64_t i) {
  const int64_t base = n / chunks, extra = n % chunks;
  const int64_t begin = i * base + std::min(i, extra);
  return {begin, begin + base + (i < extra ? 1 : 0)};
}

at::Tensor scratch(int64_t rows, int64_t cols, const at::TensorOptions& opts) {
  const size_t bytes = size_t(std::max<int64_t>(rows * cols, 0)) * c10::elementSize(opts.dtype().toScalarType());
  if (!opts.device().is_cpu() || bytes > kScratchBytes) return at::empty({rows, cols}, opts);
  thread_local std::map<at::ScalarType, at::Tensor> kept;
  at::Tensor& buf = kept[opts.dtype().toScalarType()];
  if (!buf.defined() || size_t(buf.numel()) < size_t(rows * cols)) buf = at::empty({rows * cols}, opts);
  return alias_of(buf, 0, {rows, cols}, {cols, 1});
}

at::ScalarType accumulate_type(at::ScalarType t) {
  return (t == at::kHalf || t == at::kBFloat16) ? at::kFloat : t;
}

}  // namespace mk::kernels
