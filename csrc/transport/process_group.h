// ProcessGroupMK: the mk transport as a torch.distributed backend ("mk", CPU tensors).
// Collectives run in order on one worker thread per group (small ones inline on the caller's thread when
// nothing is queued: same semantics, less latency); send/recv start at once and complete from the
// providers' progress threads.
#pragma once
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

#include "transport/comm.h"
#include "transport/work.h"

namespace mk {

class ProcessGroupMK : public c10d::Backend {
 public:
  ProcessGroupMK(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, std::chrono::milliseconds timeout);
  ~ProcessGroupMK() override;

  // `group_name` (torch's name for the group, when known) is remembered for find_named.
  static c10::intrusive_ptr<c10d::Backend> create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                  std::chrono::duration<float> timeout,
                                                  const std::string& group_name = "");
  // The live mk backend created for the group named `group_name`, or null. With TORCH_DISTRIBUTED_DEBUG=DETAIL
  // torch puts a checking wrapper between a group and its backend, which the fused ops see through this way.
  static c10::intrusive_ptr<ProcessGroupMK> find_named(const std::string& group_name);
  // The last strong reference went: forget the name (the destructor runs once the weak references are gone).
  void release_resources() override;

  const std::string getBackendName() const override { return "mk"; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void abort() override;
  void shutdown() override;

  // dist.split_group: the ranks of this group (in its numbering) that form the caller's new group, each
  // member bootstrapping a new communicator through the caller's namespaced store; null on a rank not in it.
  bool supportsSplitting() const override { return true; }

  // How many c10d collectives this rank issued on the group (send/recv and the fused ops' own tasks not
  // counted): ranks in step agree on it. TORCH_DISTRIBUTED_DEBUG=DETAIL's wrapper asks for it at creation.
  uint64_t getSequenceNumberForGroup() override;
  c10::intrusive_ptr<c10d::Backend::Options> getBackendOptions() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<c10d::Backend::Options>& opts) override;

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors, const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors, const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs, std::vector<at::Tensor>& inputs,
                                        const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs, std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                               std::vector<int64_t>& input_splits,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  Comm& comm() { return *comm_; }

  // How many collectives (and run_ordered tasks) ran on the thread that issued them, and how many on the worker.
  std::pair<uint64_t, uint64_t> runs() {
    std::lock_guard<std::mutex> lock(mu_);
    return {runs_on_caller_, runs_on_worker_};
  }

  // While one is alive, the collectives this thread issues run on it whatever their size (not only up to
  // SUPERKERNEL_INLINE_BYTES), when nothing is queued or running: for a caller that waits for the collective
  // at once and has nothing to overlap with it (a fused op's last collective). Handing it to the worker then
  // only adds two thread switches: between two namespace hosts on 2 cores, 0.27-0.33 ms of a 3.35 ms bf16
  // GEMM + 1 MiB allreduce (bench/README.md, "The last collective on the caller's thread"). Per thread.
  class CallerWaits {
   public:
    CallerWaits() { ++depth(); }
    ~CallerWaits() { --depth(); }
    CallerWaits(const CallerWaits&) = delete;
    CallerWaits& operator=(const CallerWaits&) = delete;
    static bool active() { return depth() > 0; }

   private:
    static int& depth() {
      thread_local int d = 0;
      return d;
    }
  };

  // Run `fn` (which drives comm() itself, e.g. a fused operator's in-place shm collective) as one of this
  // group's collectives, in issue order: on the calling thread when nothing is queued or running, else on the
  // worker after what is. Failures complete the returned Work as a collective's would (a mismatch leaves
  // the group usable; a timeout, a lost peer or an interrupt aborts it).
  c10::intrusive_ptr<c10d::Work> run_ordered(const char* title, std::vector<at::Tensor> outputs,
                                             std::function<void()> fn) {
    return enqueue(std::chrono::milliseconds(0), c10d::OpType::UNKNOWN, title, std::move(outputs), 0, std::move(fn));
  }

 private:
  using Task = std::function<void()>;
  // Run `fn` in order with the other collectives, under its own timeout when one is given (> 0);
  // `bytes` decides whether it may run inline.
  c10::intrusive_ptr<c10d::Work> enqueue(std::chrono::milliseconds timeout, c10d::OpType type, const char* title,
                                         std::vector<at::Tensor> outputs, size_t bytes, Task fn);
  c10::intrusive_ptr<c10d::Work> p2p(c10d::OpType type, const char* title, at::Tensor& tensor, int peer, int tag,
                                     bool sending);
  // Run `fn` (aborting the communicator on a timeout, a lost peer or an interrupt); returns what its Work is
  // completed with (null when it succeeded), which the caller does once the group is marked idle.
  std::exception_ptr run(const Task& fn, const char* title);
  void worker_loop();

  std::unique_ptr<Comm> comm_;
  size_t inline_bytes_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Queued {
    c10::intrusive_ptr<WorkMK> work;
    Task fn;
    const char* title;
  };
  std::deque<Queued> queue_;
  bool running_ = false;
  bool stop_ = false;
  uint64_t runs_on_caller_ = 0, runs_on_worker_ = 0;  // (guarded by mu_) see runs()
  uint64_t collectives_ = 0;                          // (guarded by mu_) see getSequenceNumberForGroup()
  std::thread worker_;
};

}  // namespace mk
