// The process group a fused operator runs on: resolved from its `group_name` (c10d::resolve_process_group),
// with the backend for the tensors' device, and whether that backend is mk (the pipeline then drives the
// transport directly) or anything else (gloo, nccl: the pipeline uses that backend's async collectives).
// Also the cross-rank agreement every op runs before it communicates: each rank contributes a small
// descriptor (shapes, dtype, options, its own argument-check verdict); every rank sees all of them and either
// every rank proceeds or every rank throws, naming the op and the ranks that differ. Never a hang or a wrong
// answer because ranks called an op with different shapes.
#pragma once
#include <ATen/core/Tensor.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace mk {
class ProcessGroupMK;
class Comm;
}  // namespace mk

namespace mk::kernels {

class AgreementBoard;

struct Group {
  std::string name;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Backend> backend;  // the backend for `device`
  ProcessGroupMK* mk = nullptr;               // non-null when backend is ProcessGroupMK
  c10::Device device = c10::Device(c10::kCPU);
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};

  bool is_mk() const { return mk != nullptr; }
  Comm& comm() const;  // only when is_mk()
  std::string backend_name() const;
};

// Resolve `group_name` for tensors on `device`. TORCH_CHECK with the op's name when the name is unknown or
// the group has no backend for that device.
Group resolve_group(const std::string& group_name, const c10::Device& device, const char* op);

// One field of an agreement descriptor.
struct Field {
  const char* name;  // as shown in errors: "m", "k", "dtype", ...
  int64_t value;
  bool must_match = true;  // every rank must pass the same value (otherwise it is only exchanged)
};

// Data that travels inside this rank's agreement messages (not on the board): a tiny call's operand or partial
// product, so the op needs no exchange after the agreement (one round trip instead of two). Peer q gets
// size(q) bytes from data(q) (0 allowed: the message is then the descriptor alone), or without `size` `bytes`
// bytes; `bytes` (at most carry_max()) is the most any peer gets. data(q) is read while the Agreement is
// constructed (the messages are copies). Every receive of an agreement is posted carry_max() bytes long past
// the descriptor, so a message holds only what its sender carries:
//   mk     the transport's point-to-point messages;
//   other  with CPU tensors (gloo), the backend's send/recv (never with accelerator tensors: nothing rides
//          in their descriptors' alltoall).
// An offer needs `data`, and `bytes` > 0 or `size` (a routed exchange may have nothing to send).
struct Carried {
  size_t bytes = 0;
  std::function<const void*(int peer)> data;
  std::function<size_t(int peer)> size;
};
// The most carried to one peer: kCarryMax on mk (every receive is posted that large), kCarryMaxGather on other
// backends (every receive is posted that large, untouched beyond what arrives). The ops' own limits there (see
// CarryLimit in pipeline.h): kCarryMaxOther for gemm_allreduce and gemm_reducescatter, kCarryMaxGather for
// allgather_gemm, whose carried shard is what its allgather would send.
constexpr size_t kCarryMax = size_t(64) << 10;
constexpr size_t kCarryMaxOther = size_t(256) << 10;
constexpr size_t kCarryMaxGather = size_t(4) << 20;
inline size_t carry_max(bool mk) { return mk ? kCarryMax : kCarryMaxGather; }

// The agreement's own channel on other backends with CPU tensors across hosts (side_channel.h), as the
// pipeline holds it for this call.
struct SideChannel {
  bool may = false;            // this rank may open one (said in the descriptor)
  std::shared_ptr<Comm> comm;  // open on this rank (said in the descriptor)
  bool active = false;         // every rank had it open at an earlier agreement: this one travels on it
};

// What every rank said about the side channel in an agreement's descriptors (the same on every rank).
struct SideWords {
  bool all_may = false;    // every rank may open one
  bool all_open = false;   // every rank has one open
  bool one_host = false;   // every rank is on this host (the board's case, not the side channel's)
};

// The cross-rank agreement in flight. Constructing it sends this rank's descriptor (the op's name, its call
// number `seq` on this group, the fields, and whether its own argument check passed) and posts the receives
// of every other rank's; result() waits for them and checks. Between the two the caller may compute
// anything that needs only its own, locally checked, arguments: the exchange then hides behind that work.
//   mk      one small message to and from every other rank straight over the transport (tag space of its
//           own, matched in call order per pair), so nothing waits for a collective to be scheduled;
//   other   CPU tensors (gloo): one message to and from every other rank through the backend's send/recv (a
//           tag of its own, matched in call order per pair); accelerators: one asynchronous alltoall of the
//           descriptors on the backend;
//   board   on either, once every rank is known to be on this host and has mapped its peers' boards: the
//           descriptors go through `board` (shared memory, agreement_board.h);
//   side    other backends with CPU tensors across hosts, once every rank opened it (`side`, side_channel.h):
//           as on mk, over that communicator (carried data included, up to the backend's limits).
// result() throws on every rank, naming the op: with this rank's own error (`local_error`); "rank X rejected
// its arguments"; the ranks are at different fused-op calls (another op name or call number: every rank must
// call the same fused ops in the same order); or the must_match fields that differ, with each rank's value.
// Returns all ranks' values: result[r][i] = rank r's fields[i].value. Call it once. With `carried`, the data
// rides along (see Carried: never on the board) and, after result(), carried() says whether every rank
// attached its data (the same answer on every rank): then carried_from(q) is what rank q sent to this rank,
// carried_bytes(q) bytes of it. Otherwise the op runs its usual exchange (what came along is dropped).
// Destroyed without a result() (an exception in between), it still consumes the descriptors (bounded by the
// group timeout), so later calls on the group stay in step.
class Agreement {
 public:
  Agreement(const Group& g, const char* op, std::vector<Field> fields, std::string local_error, uint64_t seq,
            std::shared_ptr<AgreementBoard> board = nullptr, Carried carried = {}, SideChannel side = {});
  ~Agreement();
  Agreement(Agreement&&) noexcept;
  Agreement& operator=(Agreement&&) = delete;
  Agreement(const Agreement&) = delete;
  Agreement& operator=(const Agreement&) = delete;

  std::vector<std::vector<int64_t>> result();
  // The descriptors of this call travel on the group's agreement board (not as a collective).
  bool on_board() const;
  // ... on the side channel (not through the backend).
  bool on_side() const;
  // After result(): every rank carried its data in its agreement message (see Carried).
  bool carried() const;
  // After result() with carried(): what rank q (not this rank) sent to this rank, and how many bytes.
  const void* carried_from(int q) const;
  size_t carried_bytes(int q) const;
  // After result(): whether every rank of the group runs on this host (same host identity: hostname, boot id,
  // network namespace). Every rank gets the same answer.
  bool same_host() const;
  // Called with same_host() by result() once the agreement succeeded (the pipeline learns the group's layout).
  void on_result(std::function<void(bool same_host)> fn);
  // Called with what the descriptors said of the side channel once they are in, whether or not the arguments
  // matched (by result(), or by the destructor when result() was not called), so every rank takes the same
  // step at the same call. Not on the board.
  void on_side_words(std::function<void(const SideWords&)> fn);

  struct State;

 private:
  std::unique_ptr<State> s_;
};

// This rank's agreement board for g (null for an mk group that spans hosts, when SUPERKERNEL_OPS_BOARD=0, or
// when the segment cannot be created: the agreement then keeps its usual exchange).
std::shared_ptr<AgreementBoard> new_agreement_board(const Group& g);

// What is wrong with the first word of rank `peer`'s argument descriptor, as this rank's error (empty: it is
// this build's). The word is "mkagree" and a version character: a build whose descriptors mean something else
// (a field's values read differently, e.g. a chunk proposal) has another version, so a job whose ranks run
// different builds fails on its first fused op instead of the ranks taking different paths and timing out.
std::string descriptor_version_problem(int64_t word, int peer);

// A dtype as a small integer for descriptors, and back to its name for messages.
int64_t dtype_code(at::ScalarType t);

}  // namespace mk::kernels
