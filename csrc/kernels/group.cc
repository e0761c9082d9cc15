#include "kernels/group.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/GroupRegistry.hpp>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <optional>

#include "kernels/agreement_board.h"
#include "transport/cancel_hook.h"
#include "transport/comm.h"
#include "transport/deadline.h"
#include "transport/error.h"
#include "transport/host.h"
#include "transport/process_group.h"
#include "transport/providers/shm.h"

namespace mk::kernels {

Comm& Group::comm() const {
  TORCH_CHECK(mk != nullptr, "mk: group ", name, " is not an mk group");
  return mk->comm();
}

std::string Group::backend_name() const { return backend ? backend->getBackendName() : std::string("?"); }

Group resolve_group(const std::string& group_name, const c10::Device& device, const char* op) {
  TORCH_CHECK(c10d::is_process_group_registered(group_name), "mk ", op, ": no process group named '", group_name,
              "' (pass pg.group_name of a group created by torch.distributed, or use the superkernel.ops wrappers)");
  Group g;
  g.name = group_name;
  g.pg = c10d::resolve_process_group(group_name);
  g.device = device;
  try {
    g.backend = g.pg->getBackend(device.type());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "mk ", op, ": process group '", group_name, "' has no backend for ", device.type(),
                " tensors: ", e.what_without_backtrace());
  }
  g.rank = g.pg->getRank();
  g.size = g.pg->getSize();
  g.mk = dynamic_cast<ProcessGroupMK*>(g.backend.get());
  if (!g.mk && g.backend && g.backend->getBackendName() == "mk") {
    // TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper (it checks collectives, which the ops agree on themselves):
    // through it, they ran as on a foreign backend, whose receives may be longer than the message (Gloo's),
    // and mk's refused that ("the ranks disagree on the size of the operation")
    auto inner = ProcessGroupMK::find_named(group_name);
    TORCH_CHECK(inner && inner->getRank() == g.rank && inner->getSize() == g.size, "mk ", op, ": rank ", g.rank,
                ": group '", group_name, "' reports the mk backend, but no mk backend of that name and size was created");
    g.backend = inner;
    g.mk = inner.get();
  }
  if (g.mk) {
    g.timeout = g.mk->comm().timeout();
  } else {
    try {
      g.timeout = g.backend->getBackendOptions()->timeout;
    } catch (const c10::Error&) {
      // Backends without options: keep the c10d default.
    }
  }
  return g;
}

int64_t dtype_code(at::ScalarType t) { return int64_t(t); }

namespace {

std::string value_text(const char* field, int64_t v) {
  if (std::string(field) == "dtype") return c10::toString(static_cast<at::ScalarType>(v));
  return std::to_string(v);
}

[[noreturn]] void throw_backend(const std::string& msg) {
  throw c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, uint32_t(__LINE__)}, msg);
}

// Descriptor words: magic, op name (32 bytes), call number, field count, own verdict, host identity (hash),
// where this rank's agreement board is (pid, fd, token; 0 without one) and whether it mapped its peers', the
// bytes of carried data that follow the descriptor in this message, the side channel (bit 0: this rank may
// open one, bit 1: it has one open; side_channel.h; 0 from builds before it, which so never use one), whether
// it carries (1: its messages hold its data, possibly 0 bytes of it), then the fields.
// (bumped whenever what a descriptor's words mean changes: see descriptor_version_problem; 6: chunk
// proposals may be kPlainPath, -1, and ring_attention's tuned path is 1 ring / -1 gather, where 2 / 1 was;
// 7: the tuned ops send Pipeline::tuner_fields before their chunk field; 8: gemm_allreduce sends
// SUPERKERNEL_OPS_FOLD, and on an armed group a call may ride its allreduce instead of agreeing, pipeline.h;
// 9: the GEMM ops send packs_b, gemm_collectives.cc's pack_offer)
constexpr int64_t kMagic = 0x6d6b616772656539;  // "mkagree9"
constexpr size_t kName = 1, kNameBytes = 32, kSeq = 5, kCount = 6, kOk = 7, kHost = 8;
constexpr size_t kBoardPid = 9, kBoardFd = 10, kBoardToken = 11, kBoardMapped = 12, kCarried = 13;
constexpr size_t kSide = 14, kCarries = 15, kHead = 16;
constexpr int64_t kSideMay = 1, kSideOpen = 2;
constexpr size_t kWords = 48;
constexpr size_t kDescriptorBytes = kWords * sizeof(int64_t);
constexpr size_t kMaxFields = kWords - kHead;
// Message tag of every agreement (bit 60: fused-op agreements; bit 61: fused-op data, pipeline.cc; bit 62:
// windows; bit 63: collectives). One tag for all calls: a pair's messages match in call order, and a rank at
// another call is caught by the call number and op name inside the descriptor instead of waiting forever for
// a tag that never comes.
constexpr uint64_t kTag = 1ull << 60;
constexpr uint64_t kCheck = 0x6167726565000001ull;
// The same on other backends with CPU tensors (gloo), whose tags are ints: bit 29 (pipeline.cc's point-to-point
// data uses bit 30). A user's own send/recv on the group must stay below 2^29.
constexpr int kOtherTag = (1 << 29) | 0x6167;

void pack_name(const char* op, int64_t* out) {
  char name[kNameBytes] = {};
  std::strncpy(name, op, sizeof(name) - 1);
  std::memcpy(out, name, sizeof(name));
}

int64_t host_hash() {
  static const int64_t h = int64_t(std::hash<std::string>()(host_identity()) & 0x7fffffffffffffffull);
  return h;
}

std::string unpack_name(const int64_t* in) {
  char name[kNameBytes + 1] = {};
  std::memcpy(name, in, kNameBytes);
  return name;
}

}  // namespace

struct Agreement::State {
  Group g;
  const char* op;
  std::vector<Field> fields;
  std::string local_error;
  uint64_t seq;
  bool done = false;
  bool same_host = false;
  std::shared_ptr<AgreementBoard> board;  // this group's agreement board (null: none)
  bool on_board = false;                  // the descriptors of this call travel on the board
  std::function<void(bool)> on_result;
  SideChannel side;                       // (side.active: the descriptors travel on side.comm)
  std::function<void(const SideWords&)> on_side_words;
  bool side_words_told = false;
  std::vector<int64_t> mine;   // kWords
  std::vector<int64_t> theirs; // size * kWords (rank q at q * kWords; own row unused on mk)
  // mk, and other backends on CPU
  std::vector<at::Tensor> inbox;   // by peer: descriptor, then up to carry_max() bytes of carried data
  std::vector<at::Tensor> outbox;  // messages (descriptor + data) kept until sent
  bool carried_all = false;        // after check(): every rank carried its data
  // mk
  std::vector<RequestPtr> sends, recvs;  // by peer (null for this rank)
  // other backends on CPU: the backend's point-to-point works, by peer (null for this rank)
  std::vector<c10::intrusive_ptr<c10d::Work>> other_sends, other_recvs;
  uint64_t generation = cancel_generation().load(std::memory_order_acquire);  // an interrupt after: stop
  // other backends on other devices: the descriptors' alltoall (rank q's slot: its descriptor to q / from q)
  at::Tensor in, out;
  c10::intrusive_ptr<c10d::Work> work;

  // The communicator the descriptors travel on as point-to-point messages: mk's own, or the side channel.
  bool over_comm() const { return g.is_mk() || side.active; }
  Comm& comm() const { return side.active ? *side.comm : g.comm(); }
  bool finish_mk(bool quiet);  // false: the exchange failed (quiet: the communicator was aborted)
  void receive_other();
  void advance_board();
  void tell_side_words();
  std::vector<std::vector<int64_t>> check();
};

Agreement::Agreement(const Group& g, const char* op, std::vector<Field> fields, std::string local_error, uint64_t seq,
                     std::shared_ptr<AgreementBoard> board, Carried carried, SideChannel side)
    : s_(std::make_unique<State>()) {
  State& s = *s_;
  s.g = g;
  s.op = op;
  s.fields = std::move(fields);
  s.local_error = std::move(local_error);
  s.seq = seq;
  TORCH_CHECK(s.fields.size() <= kMaxFields, "mk ", op, ": too many agreement fields (", s.fields.size(), ")");
  s.mine.assign(kWords, 0);
  s.mine[0] = kMagic;
  pack_name(op, &s.mine[kName]);
  s.mine[kSeq] = int64_t(seq);
  s.mine[kCount] = int64_t(s.fields.size());
  s.mine[kOk] = s.local_error.empty() ? 1 : 0;
  s.mine[kHost] = host_hash();
  TORCH_CHECK(!side.active || side.comm, "mk ", op, ": the side channel is active but not open");
  s.mine[kSide] = (side.may ? kSideMay : 0) | (side.comm ? kSideOpen : 0);
  s.side = std::move(side);
  if (board && g.size > 1) {
    s.board = std::move(board);
    s.mine[kBoardPid] = s.board->pid();
    s.mine[kBoardFd] = s.board->fd();
    s.mine[kBoardToken] = s.board->token();
    s.mine[kBoardMapped] = s.board->mapped() ? 1 : 0;
  }
  for (size_t i = 0; i < s.fields.size(); ++i) s.mine[kHead + i] = s.fields[i].value;
  const int R = g.size;
  // (carried data never rides on the board, nor in an accelerator backend's alltoall)
  const bool board_active = s.board && s.board->active();
  const bool wants =
      R > 1 && carried.data && (carried.bytes > 0 || carried.size) && carried.bytes <= carry_max(g.is_mk());
  const bool other_cpu = !g.is_mk() && g.device.is_cpu();
  const bool carry = wants && !board_active && (g.is_mk() || other_cpu);
  if (carry) {
    s.mine[kCarries] = 1;
    s.mine[kCarried] = int64_t(carried.bytes);  // (with per-peer sizes: rewritten in each peer's message)
  }
  s.theirs.assign(size_t(R) * kWords, 0);
  // What this rank carries to peer q (when it carries).
  auto bytes_to = [&](int q) {
    const size_t bytes = carried.size ? carried.size(q) : carried.bytes;
    TORCH_CHECK(bytes <= carried.bytes, "mk ", op, ": rank ", g.rank, ": carries ", bytes, " bytes to rank ", q,
                ", more than the ", carried.bytes, " it announced");
    return bytes;
  };
  // This rank's message to peer q, in the outbox: the descriptor, saying how many bytes follow it, then those
  // bytes (peers that get the same data share one message).
  const void* last_data = nullptr;
  size_t last_bytes = 0;
  auto message_to = [&](int q) -> const at::Tensor& {
    const void* data = carry ? carried.data(q) : nullptr;
    const size_t bytes = carry ? bytes_to(q) : 0;
    if (!s.outbox.empty() && data == last_data && bytes == last_bytes) return s.outbox.back();
    at::Tensor msg = at::empty({int64_t(kDescriptorBytes + bytes)}, at::TensorOptions().dtype(at::kByte));
    auto* dst = static_cast<char*>(msg.data_ptr());
    std::memcpy(dst, s.mine.data(), kDescriptorBytes);
    const int64_t announced = int64_t(bytes);
    std::memcpy(dst + kCarried * sizeof(int64_t), &announced, sizeof(announced));
    if (bytes) std::memcpy(dst + kDescriptorBytes, data, bytes);
    s.outbox.push_back(std::move(msg));
    last_data = data;
    last_bytes = bytes;
    return s.outbox.back();
  };
  std::copy(s.mine.begin(), s.mine.end(), s.theirs.begin() + ptrdiff_t(size_t(g.rank) * kWords));
  if (R == 1) return;
  if (s.board && s.board->active()) {
    if (g.is_mk()) {
      try {
        g.comm().check_usable(op);
      } catch (const Error& e) {
        s.done = true;
        throw_backend(e.what());
      }
    }
    s.on_board = true;
    s.board->publish(seq, s.mine.data());
    return;
  }
  s.inbox.resize(size_t(R));
  auto bytes_opts = at::TensorOptions().dtype(at::kByte);
  // Every receive takes up to carry_max() bytes of carried data whether or not this rank carries any: a peer
  // may (its limit, or its arguments, differ), and its message must still be taken whole.
  const size_t capacity = kDescriptorBytes + carry_max(g.is_mk());
  if (s.over_comm()) {
    Comm& comm = s.comm();
    s.sends.resize(size_t(R));
    s.recvs.resize(size_t(R));
    try {
      comm.check_usable(op);
      // (sends first: this rank's message is what its peers wait for; one arriving before its receive is
      // posted waits in the matcher's unexpected queue)
      for (int i = 1; i < R; ++i) {
        const int q = (g.rank + i) % R;
        if (!carry) {
          s.sends[size_t(q)] = comm.isend(q, kTag, s.mine.data(), kDescriptorBytes, kCheck);
          continue;
        }
        const at::Tensor& msg = message_to(q);
        s.sends[size_t(q)] = comm.isend(q, kTag, msg.data_ptr(), size_t(msg.numel()), kCheck);
      }
      for (int i = 1; i < R; ++i) {
        const int q = (g.rank - i + R) % R;
        s.inbox[size_t(q)] = at::empty({int64_t(capacity)}, bytes_opts);
        s.recvs[size_t(q)] = comm.irecv(q, kTag, s.inbox[size_t(q)].data_ptr(), capacity, kCheck, /*up_to=*/true);
      }
    } catch (const Error& e) {
      s.done = true;
      comm.abort(e.what());
      throw_backend(c10::str("mk ", op, ": rank ", g.rank, ": sending the argument descriptor failed: ", e.what()));
    }
    return;
  }
  try {
    if (other_cpu) {
      // One message to and from every peer through the backend's send/recv, each only as long as what it
      // holds: a receive posted for `capacity` bytes takes a shorter message whole (Gloo checks only that it
      // fits), and the descriptor says how many bytes follow it. An alltoall needs one slot size on every rank
      // before anything is exchanged, so the data could ride only in a room sized from the group's earlier
      // calls, whose padding a small call after a large carried one paid: 3-18x its time alone between two
      // namespace hosts at 1 Gbit/s (bench/README.md). Gloo between those hosts, 2 ranks, a 384 B descriptor,
      // barrier before each call, medians: send/recv 0.18-0.22 ms, its alltoall 0.25-0.28 ms, the alltoall
      // with a 128 KiB room 0.31-0.35 ms (bench/README.md). Receives are posted first, so a peer's message
      // finds its receive.
      s.other_sends.resize(size_t(R));
      s.other_recvs.resize(size_t(R));
      for (int i = 1; i < R; ++i) {
        const int q = (g.rank - i + R) % R;
        s.inbox[size_t(q)] = at::empty({int64_t(capacity)}, bytes_opts);
        std::vector<at::Tensor> box{s.inbox[size_t(q)]};
        s.other_recvs[size_t(q)] = g.backend->recv(box, q, kOtherTag);
      }
      for (int i = 1; i < R; ++i) {
        const int q = (g.rank + i) % R;
        std::vector<at::Tensor> msg{message_to(q)};
        s.other_sends[size_t(q)] = g.backend->send(msg, q, kOtherTag);
      }
      return;
    }
    // Accelerators (nccl): one alltoall_base of the descriptors, nothing carried (a batch of unmatched
    // point-to-point calls would serialise there).
    auto opts = at::TensorOptions().dtype(at::kLong);
    s.in = at::empty({R * int64_t(kWords)}, opts);
    for (int q = 0; q < R; ++q)
      std::memcpy(s.in.data_ptr<int64_t>() + q * int64_t(kWords), s.mine.data(), kDescriptorBytes);
    s.in = s.in.to(g.device);
    s.out = at::empty({R * int64_t(kWords)}, opts.device(g.device));
    std::vector<int64_t> equal_splits;  // (empty: R equal slots)
    s.work = g.backend->alltoall_base(s.out, s.in, equal_splits, equal_splits, c10d::AllToAllOptions());
  } catch (const c10::Error& e) {
    s.done = true;
    throw_backend(c10::str("mk ", op, ": rank ", g.rank, ": exchanging the argument descriptors with the ", R - 1,
                           " other ranks failed: ", e.what_without_backtrace()));
  }
}

Agreement::Agreement(Agreement&&) noexcept = default;

bool Agreement::same_host() const { return s_ && s_->same_host; }

bool Agreement::on_board() const { return s_ && s_->on_board; }

bool Agreement::on_side() const { return s_ && !s_->on_board && s_->side.active; }

bool Agreement::carried() const { return s_ && s_->carried_all; }

const void* Agreement::carried_from(int q) const {
  TORCH_CHECK(carried() && q != s_->g.rank && q >= 0 && q < s_->g.size, "mk ", s_->op, ": rank ", s_->g.rank,
              ": no data carried from rank ", q, " in the argument agreement");
  return static_cast<const char*>(s_->inbox[size_t(q)].data_ptr()) + kDescriptorBytes;
}

size_t Agreement::carried_bytes(int q) const {
  carried_from(q);  // (the same checks)
  return size_t(s_->theirs[size_t(q) * kWords + kCarried]);
}

void Agreement::on_result(std::function<void(bool)> fn) { s_->on_result = std::move(fn); }

void Agreement::on_side_words(std::function<void(const SideWords&)> fn) { s_->on_side_words = std::move(fn); }

Agreement::~Agreement() {
  if (!s_ || s_->done) return;
  s_->done = true;
  try {
    if (s_->on_board) {
      // nothing to consume: a peer rewrites this call's slot only after it has seen every rank's next one
    } else if (s_->over_comm()) {
      if (s_->finish_mk(true)) {
        s_->advance_board();
        s_->tell_side_words();
      }
    } else if (s_->work || !s_->other_recvs.empty()) {
      // The words still decide the board's and the side channel's state, as on every other rank (result()
      // was not called here).
      s_->receive_other();
      s_->advance_board();
      s_->tell_side_words();
    }
  } catch (...) {
    // Unwinding after another error: the descriptors are consumed or the communicator was aborted.
  }
}

// Wait for every descriptor (mk). A transport failure (timeout, a peer gone, an interrupt) leaves the pairs
// out of step, so the communicator is aborted, as for any torn exchange.
bool Agreement::State::finish_mk(bool quiet) {
  Comm& comm = this->comm();
  const Deadline dl = Deadline::after(g.timeout);
  const std::string what = c10::str(op, " (argument agreement)");
  for (int q = 0; q < g.size; ++q) {
    for (RequestPtr* r : {&recvs[size_t(q)], &sends[size_t(q)]}) {
      if (!*r) continue;
      try {
        comm.wait(*r, dl, what.c_str(), q);
      } catch (const Error& e) {
        for (auto& x : recvs)
          if (x && !x->test()) comm.matcher().cancel(x, e.what());
        comm.abort(e.what());
        if (quiet) return false;
        throw_backend(c10::str("mk ", op, ": rank ", g.rank, ": exchanging the argument descriptors failed: ", e.what()));
      }
    }
  }
  // Each peer's descriptor into its row of `theirs`; a message whose size is not the descriptor plus the data
  // it announces is left out (its row stays zero: check() reports a malformed descriptor).
  for (int q = 0; q < g.size; ++q) {
    if (!recvs[size_t(q)]) continue;
    const auto* msg = static_cast<const char*>(inbox[size_t(q)].data_ptr());
    const size_t got = recvs[size_t(q)]->bytes();
    if (got < kDescriptorBytes) continue;
    int64_t announced = 0;
    std::memcpy(&announced, msg + kCarried * sizeof(int64_t), sizeof(announced));
    if (announced < 0 || got != kDescriptorBytes + size_t(announced)) continue;
    std::memcpy(&theirs[size_t(q) * kWords], msg, kDescriptorBytes);
  }
  return true;
}

std::vector<std::vector<int64_t>> Agreement::result() {
  TORCH_CHECK(s_ && !s_->done, "mk agreement: result() called twice");
  State& s = *s_;
  s.done = true;
  if (s.g.size > 1) {
    if (s.on_board) {
      const Deadline dl = Deadline::after(s.g.timeout);
      for (int i = 1; i < s.g.size; ++i) {
        const int q = (s.g.rank + i) % s.g.size;
        std::function<void()> usable;
        if (s.g.is_mk() && s.g.comm().shm())
          usable = [&s, q] {
            s.g.comm().check_usable(s.op);
            s.g.comm().shm()->check_peer_usable(q, s.op);
          };
        try {
          s.board->collect(q, s.seq, &s.theirs[size_t(q) * kWords], dl, s.op, usable);
        } catch (const Error& e) {
          throw_backend(e.what());
        }
      }
    } else if (s.over_comm()) {
      s.finish_mk(false);
      s.advance_board();
      s.tell_side_words();
    } else {
      s.receive_other();
      s.advance_board();
      s.tell_side_words();
    }
  }
  auto all = s.check();
  if (s.on_result) s.on_result(s.same_host);
  return all;
}

// Wait for the descriptors on another backend (its point-to-point messages, or its alltoall) and copy them to
// `theirs`. A message whose announced data would not fit its receive is left out (its row stays zero: check()
// reports a malformed descriptor).
void Agreement::State::receive_other() {
  using Clock = std::chrono::steady_clock;
  const auto deadline = Clock::now() + g.timeout;
  // An interrupt aborts the work (cancel_hook.h): Gloo's send/recv end at once; the alltoall of an accelerator
  // backend is not aborted (that would tear down its communicator) and ends at the timeout.
  auto wait = [&](c10d::Work& w, const std::string& what) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    const auto cancelled = [&] {
      throw_backend(c10::str("mk ", op, ": rank ", g.rank, ": ", what, ": cancelled by an interrupt"));
    };
    bool finished = false;
    try {
      std::optional<CancelHook> hook;
      if (!work) hook.emplace([&w] { w.abort(); });
      if (!CancelHook::cancelled_since(generation)) finished = w.wait(std::max(left, std::chrono::milliseconds(1)));
    } catch (const c10::Error& e) {
      if (CancelHook::cancelled_since(generation)) cancelled();
      throw_backend(c10::str("mk ", op, ": rank ", g.rank, ": ", what, " failed: ", e.what_without_backtrace()));
    }
    if (!finished && CancelHook::cancelled_since(generation)) cancelled();
  };
  if (work) {
    wait(*work, c10::str("exchanging the argument descriptors with the ", g.size - 1, " other ranks"));
    if (!out.is_cpu()) out = out.cpu();
    for (int r = 0; r < g.size; ++r)
      std::memcpy(&theirs[size_t(r) * kWords], out.data_ptr<int64_t>() + r * int64_t(kWords), kDescriptorBytes);
    return;
  }
  for (int q = 0; q < g.size; ++q)
    if (other_recvs[size_t(q)])
      wait(*other_recvs[size_t(q)], c10::str("receiving the argument descriptor of rank ", q));
  for (int q = 0; q < g.size; ++q)
    if (other_sends[size_t(q)]) wait(*other_sends[size_t(q)], c10::str("sending the argument descriptor to rank ", q));
  for (int q = 0; q < g.size; ++q) {
    if (!other_recvs[size_t(q)]) continue;
    const auto* msg = static_cast<const char*>(inbox[size_t(q)].data_ptr());
    int64_t announced = 0;
    std::memcpy(&announced, msg + kCarried * sizeof(int64_t), sizeof(announced));
    if (announced < 0 || size_t(announced) > size_t(inbox[size_t(q)].numel()) - kDescriptorBytes) continue;
    std::memcpy(&theirs[size_t(q) * kWords], msg, kDescriptorBytes);
  }
}

// After a collective agreement, the next step of the board (agreement_board.h), decided from the exchanged
// words only, which every rank holds alike (whether or not the arguments matched), so every rank takes the
// same step at the same call: retire it unless every rank is on this host and offers a board; map the
// peers' boards; once every rank said "mapped", use the board from the next call on.
void Agreement::State::advance_board() {
  if (!board || board->retired()) return;
  const int R = g.size;
  auto row = [&](int r) { return &theirs[size_t(r) * kWords]; };
  bool offered = true, mapped = true;
  for (int r = 0; r < R; ++r) {
    offered = offered && row(r)[0] == kMagic && row(r)[kHost] == mine[kHost] && row(r)[kBoardToken] != 0;
    mapped = mapped && row(r)[kBoardMapped] == 1;
  }
  if (!offered) {
    board->retire();
  } else if (mapped) {
    board->activate();
  } else if (!board->mapped()) {
    const auto n = static_cast<size_t>(R);
    std::vector<int64_t> pids(n), fds(n), tokens(n);
    for (int r = 0; r < R; ++r) {
      pids[size_t(r)] = row(r)[kBoardPid];
      fds[size_t(r)] = row(r)[kBoardFd];
      tokens[size_t(r)] = row(r)[kBoardToken];
    }
    if (!board->map_peers(pids, fds, tokens)) board->retire();  // (the others see no offer next time)
  }
}

// After an exchange of descriptors (not on the board), what they said of the side channel, to on_side_words.
void Agreement::State::tell_side_words() {
  if (!on_side_words || side_words_told) return;
  side_words_told = true;
  SideWords w;
  w.all_may = w.all_open = w.one_host = true;
  for (int r = 0; r < g.size; ++r) {
    const int64_t* row = &theirs[size_t(r) * kWords];
    const bool valid = row[0] == kMagic;
    w.all_may = w.all_may && valid && (row[kSide] & kSideMay) != 0;
    w.all_open = w.all_open && valid && (row[kSide] & kSideOpen) != 0;
    w.one_host = w.one_host && valid && row[kHost] == mine[kHost];
  }
  on_side_words(w);
}

std::vector<std::vector<int64_t>> Agreement::State::check() {
  const int R = g.size;
  auto row = [&](int r) { return &theirs[size_t(r) * kWords]; };
  // Same op and call number everywhere, before anything is read as this op's fields.
  for (int r = 0; r < R; ++r) {
    const int64_t* d = row(r);
    TORCH_CHECK(d[0] == kMagic, "mk ", op, ": rank ", g.rank, ": ", descriptor_version_problem(d[0], r));
    const bool same_call = std::memcmp(d + kName, &mine[kName], kNameBytes) == 0 && d[kSeq] == int64_t(seq) &&
                           d[kCount] == int64_t(fields.size());
    TORCH_CHECK(same_call, "mk ", op, ": the ranks are at different fused-op calls on this group: rank ", g.rank,
                " is at ", op, " (call ", seq, "), rank ", r, " at ", unpack_name(d + kName), " (call ", d[kSeq],
                "); every rank must call the same fused ops in the same order");
  }
  TORCH_CHECK(local_error.empty(), "mk ", op, ": rank ", g.rank, ": ", local_error);
  for (int r = 0; r < R; ++r)
    TORCH_CHECK(row(r)[kOk] == 1, "mk ", op, ": rank ", r, " rejected its arguments (see rank ", r,
                "'s error); no rank ran the op (this is rank ", g.rank, ")");
  same_host = true;
  for (int r = 0; r < R; ++r) same_host = same_host && row(r)[kHost] == mine[kHost];
  std::vector<std::vector<int64_t>> all(size_t(R), std::vector<int64_t>(fields.size()));
  for (int r = 0; r < R; ++r)
    for (size_t i = 0; i < fields.size(); ++i) all[size_t(r)][i] = row(r)[kHead + i];
  // (a message's size was checked against its kCarried on receipt; this is the limit on what was sent)
  const size_t fits = carry_max(g.is_mk());
  carried_all = true;
  for (int r = 0; r < R; ++r)
    carried_all = carried_all && row(r)[kCarries] == 1 && row(r)[kCarried] >= 0 && size_t(row(r)[kCarried]) <= fits;
  std::string bad;  // (formatted only when a field differs: this runs on every call)
  for (size_t i = 0; i < fields.size(); ++i) {
    if (!fields[i].must_match) continue;
    bool same = true;
    for (int r = 1; r < R; ++r) same = same && all[size_t(r)][i] == all[0][i];
    if (same) continue;
    bad += cat(bad.empty() ? "" : "; ", fields[i].name, " differs:");
    for (int r = 0; r < R; ++r) bad += cat(" rank ", r, " has ", value_text(fields[i].name, all[size_t(r)][i]));
  }
  TORCH_CHECK(bad.empty(), "mk ", op, ": the ranks called it with different arguments (", bad,
              "); every rank must pass matching shapes and dtypes (this is rank ", g.rank, " of ", R, ")");
  return all;
}

std::shared_ptr<AgreementBoard> new_agreement_board(const Group& g) {
  if (g.size < 2 || (g.is_mk() && !g.comm().all_local())) return nullptr;
  static const bool wanted = [] {
    const char* v = std::getenv("SUPERKERNEL_OPS_BOARD");
    return !(v && std::string(v) == "0");
  }();
  if (!wanted) return nullptr;
  try {
    return std::make_shared<AgreementBoard>(g.rank, g.size, kWords);
  } catch (const Error&) {
    return nullptr;  // the agreement stays a collective of the backend
  }
}

std::string descriptor_version_problem(int64_t word, int peer) {
  if (word == kMagic) return {};
  constexpr int64_t kPrefix = kMagic >> 8;  // "mkagree"
  const char theirs = char(word & 0xff), ours = char(kMagic & 0xff);
  if ((word >> 8) == kPrefix && theirs >= '0' && theirs <= '9')
    return c10::str("rank ", peer, " runs a superkernel build whose argument descriptors are version ", theirs,
                    ", this rank's are version ", ours, "; every rank of a job must run the same build");
  return c10::str("rank ", peer, " sent a malformed argument descriptor");
}

}  // namespace mk::kernels
