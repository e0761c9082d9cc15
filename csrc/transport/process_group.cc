#include "transport/process_group.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <cstdlib>
#include <iterator>
#include <map>
#include <numeric>
#include <optional>

#include "transport/bootstrap.h"
#include "transport/host.h"
#include "transport/collectives/collectives.h"
#include "transport/error.h"

namespace mk {
namespace {

// c10d's Store as the bootstrap's key-value store.
class StoreKV final : public KeyValue {
 public:
  explicit StoreKV(c10::intrusive_ptr<c10d::Store> s) : store_(std::move(s)) {}
  void set(const std::string& key, const std::string& value) override {
    store_->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  std::string get(const std::string& key) override {
    auto v = store_->get(key);
    return std::string(v.begin(), v.end());
  }
  int64_t add(const std::string& key, int64_t delta) override { return store_->add(key, delta); }

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

std::exception_ptr backend_error(const std::string& msg) {
  return std::make_exception_ptr(c10::DistBackendError(c10::SourceLocation{__func__, __FILE__, uint32_t(__LINE__)}, msg));
}

DType to_dtype(const at::Tensor& t, const char* op, int rank) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::f32;
    case at::kDouble: return DType::f64;
    case at::kHalf: return DType::f16;
    case at::kBFloat16: return DType::bf16;
    case at::kChar: return DType::i8;
    case at::kByte: return DType::u8;
    case at::kShort: return DType::i16;
    case at::kInt: return DType::i32;
    case at::kLong: return DType::i64;
    case at::kBool: return DType::boolean;
    default:
      TORCH_CHECK(false, "mk ", op, ": rank ", rank, ": dtype ", t.scalar_type(), " is not supported");
  }
}

RedOp to_redop(const c10d::ReduceOp& op, const char* name, int rank) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return RedOp::sum;
    case c10d::ReduceOp::AVG: return RedOp::avg;
    case c10d::ReduceOp::PRODUCT: return RedOp::prod;
    case c10d::ReduceOp::MIN: return RedOp::min;
    case c10d::ReduceOp::MAX: return RedOp::max;
    case c10d::ReduceOp::BAND: return RedOp::band;
    case c10d::ReduceOp::BOR: return RedOp::bor;
    case c10d::ReduceOp::BXOR: return RedOp::bxor;
    default:
      TORCH_CHECK(false, "mk ", name, ": rank ", rank, ": ReduceOp ", int(op.op_),
                  " is not supported (PREMUL_SUM is NCCL-only, as with Gloo)");
  }
}

void check_tensor(const at::Tensor& t, const char* op, int rank) {
  TORCH_CHECK(t.device().is_cpu(), "mk ", op, ": rank ", rank, ": tensor is on ", t.device(),
              "; the mk backend handles CPU tensors (use init_process_group(\"cpu:mk,cuda:nccl\") for both)");
  TORCH_CHECK(!t.is_sparse(), "mk ", op, ": rank ", rank, ": sparse tensors are not supported");
  TORCH_CHECK(!t.is_complex(), "mk ", op, ": rank ", rank, ": complex tensors are not supported");
}

void check_single(const std::vector<at::Tensor>& v, const char* op, int rank) {
  TORCH_CHECK(v.size() == 1, "mk ", op, ": rank ", rank, ": expected one tensor, got ", v.size());
  check_tensor(v[0], op, rank);
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* op, int rank, const char* what, size_t i) {
  check_tensor(t, op, rank);
  TORCH_CHECK(t.scalar_type() == ref.scalar_type(), "mk ", op, ": rank ", rank, ": ", what, " ", i, " has dtype ",
              t.scalar_type(), ", expected ", ref.scalar_type());
  TORCH_CHECK(t.numel() == ref.numel(), "mk ", op, ": rank ", rank, ": ", what, " ", i, " has ", t.numel(),
              " elements, expected ", ref.numel());
}

size_t nbytes(const at::Tensor& t) { return size_t(t.numel()) * t.element_size(); }

// A contiguous tensor to work on; copy_back() writes it into the original when they differ.
struct Staged {
  at::Tensor orig, work;
  explicit Staged(const at::Tensor& t) : orig(t), work(t.contiguous()) {}
  void copy_back() {
    if (!work.is_same(orig)) orig.copy_(work);
  }
  void* ptr() const { return work.data_ptr(); }
};

// An operation's own timeout (c10d's per-call `timeout` option) for as long as it runs.
class TimeoutScope {
 public:
  TimeoutScope(Comm& c, std::chrono::milliseconds t) : comm_(c), saved_(c.timeout()) {
    if (t.count() > 0) comm_.set_timeout(t);
  }
  ~TimeoutScope() { comm_.set_timeout(saved_); }

 private:
  Comm& comm_;
  std::chrono::milliseconds saved_;
};

}  // namespace

ProcessGroupMK::ProcessGroupMK(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                               std::chrono::milliseconds timeout)
    : c10d::Backend(rank, size) {
  StoreKV kv(store);
  try {
    comm_ = bootstrap(kv, rank, size, timeout, BootstrapOptions::from_env());
  } catch (const Error& e) {
    C10_THROW_ERROR(DistBackendError, c10::str("mk: creating the process group failed on rank ", rank, ": ", e.what()));
  }
  const char* inl = std::getenv("SUPERKERNEL_INLINE_BYTES");
  inline_bytes_ = inl && *inl ? size_t(std::strtoull(inl, nullptr, 10)) : size_t(256) << 10;
  worker_ = std::thread([this] {
    name_this_thread("mk-worker");
    worker_loop();
  });
}

ProcessGroupMK::~ProcessGroupMK() { shutdown(); }

namespace {

std::mutex named_mu;
std::map<std::string, c10::weak_intrusive_ptr<ProcessGroupMK>>& named() {
  static std::map<std::string, c10::weak_intrusive_ptr<ProcessGroupMK>> m;
  return m;
}

// A weak reference keeps the object's destructor (which joins its threads) waiting until it goes, so each
// entry goes in release_resources, when the last strong reference does (the agreement board's test counted
// one destroyed group's progress thread still running per round while the entries stayed).
void remember(const std::string& group_name, const c10::intrusive_ptr<ProcessGroupMK>& pg) {
  if (group_name.empty()) return;
  std::lock_guard<std::mutex> lock(named_mu);
  named().insert_or_assign(group_name, c10::weak_intrusive_ptr<ProcessGroupMK>(pg));
}

}  // namespace

void ProcessGroupMK::release_resources() {
  {
    std::lock_guard<std::mutex> lock(named_mu);
    auto& m = named();
    for (auto it = m.begin(); it != m.end();)
      it = it->second._unsafe_get_target() == this ? m.erase(it) : std::next(it);
  }
  // (c10d::Backend releases nothing there: intrusive_ptr_target's is empty, and private)
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupMK::create(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                                                         std::chrono::duration<float> timeout,
                                                         const std::string& group_name) {
  auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(timeout);
  auto pg = c10::make_intrusive<ProcessGroupMK>(store, rank, size, ms);
  remember(group_name, pg);
  return pg;
}

c10::intrusive_ptr<ProcessGroupMK> ProcessGroupMK::find_named(const std::string& group_name) {
  std::lock_guard<std::mutex> lock(named_mu);
  const auto it = named().find(group_name);
  return it == named().end() ? c10::intrusive_ptr<ProcessGroupMK>() : it->second.lock();
}

void ProcessGroupMK::setTimeout(std::chrono::milliseconds timeout) { comm_->set_timeout(timeout); }

uint64_t ProcessGroupMK::getSequenceNumberForGroup() {
  std::lock_guard<std::mutex> lock(mu_);
  return collectives_;
}

c10::intrusive_ptr<c10d::Backend::Options> ProcessGroupMK::getBackendOptions() {
  auto o = c10::make_intrusive<c10d::Backend::Options>("mk", comm_->timeout());
  o->group_name = getGroupUid();
  o->group_desc = getGroupDesc();
  return o;
}

c10::intrusive_ptr<c10d::Backend> ProcessGroupMK::split(const c10::intrusive_ptr<c10d::Store>& store,
                                                        const std::vector<int>& ranks,
                                                        const c10::intrusive_ptr<c10d::Backend::Options>& opts) {
  std::vector<int> seen(size_t(size_), 0);
  for (int r : ranks) {
    TORCH_CHECK(r >= 0 && r < size_, "mk split_group: rank ", rank_, ": rank ", r, " is not in the parent group (size ",
                size_, ")");
    TORCH_CHECK(!seen[size_t(r)]++, "mk split_group: rank ", rank_, ": rank ", r, " is listed twice");
  }
  const auto me = std::find(ranks.begin(), ranks.end(), rank_);
  if (me == ranks.end()) return nullptr;
  const auto timeout = opts ? opts->timeout : comm_->timeout();
  // (ProcessGroup::splitGroup names the new group, and so this backend)
  auto child = c10::make_intrusive<ProcessGroupMK>(store, int(me - ranks.begin()), int(ranks.size()), timeout);
  if (opts) remember(opts->group_name, child);
  return child;
}

void ProcessGroupMK::abort() {
  comm_->abort(cat("rank ", rank_, " aborted the process group"));
  shutdown();
}

void ProcessGroupMK::shutdown() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (worker_.joinable()) worker_.join();
}

void ProcessGroupMK::worker_loop() {
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    cv_.wait(lock, [&] { return (!queue_.empty() && !running_) || (stop_ && queue_.empty() && !running_); });
    if (queue_.empty()) return;
    std::optional<Queued> task(std::move(queue_.front()));
    queue_.pop_front();
    running_ = true;
    lock.unlock();
    const std::exception_ptr err = run(task->fn, task->title);
    lock.lock();
    running_ = false;
    // idle before the waiter hears of the end: a collective its caller issues next may run on the caller
    // (enqueue), instead of queueing behind a task that is over
    lock.unlock();
    task->work->complete(err);
    // The task's tensors (its closure's, its Work's) are released here, without mu_: dropping the last
    // reference to a tensor that Python made may take the GIL (c10's decref_pyobject), and a Python thread
    // that holds the GIL may be waiting for mu_ (runs(), enqueue). Released under mu_, a rank hung in
    // tests/ops/test_caller_runs.py: the worker waited for the GIL, the main thread for mu_ in runs().
    task.reset();
    lock.lock();
  }
}

std::exception_ptr ProcessGroupMK::run(const Task& fn, const char* title) {
  try {
    fn();
    return nullptr;
  } catch (const MismatchError& e) {
    return backend_error(e.what());  // every rank saw it: the group stays usable
  } catch (const TimeoutError& e) {
    comm_->abort(e.what());
    return backend_error(e.what());
  } catch (const PeerError& e) {
    comm_->abort(e.what());
    return backend_error(e.what());
  } catch (const CancelledError& e) {
    comm_->abort(e.what());
    return backend_error(e.what());
  } catch (const Error& e) {
    return backend_error(e.what());
  } catch (const c10::Error& e) {
    return std::current_exception();
  } catch (const std::exception& e) {
    return backend_error(cat("mk ", title, ": rank ", rank_, ": ", e.what()));
  }
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::enqueue(std::chrono::milliseconds timeout, c10d::OpType type,
                                                       const char* title,
                                                       std::vector<at::Tensor> outputs, size_t bytes, Task fn) {
  fn = [this, timeout, inner = std::move(fn)] {
    TimeoutScope scope(*comm_, timeout);
    inner();
  };
  // Collectives end by their own deadline; the Work's own limit only guards against a stuck worker.
  auto work = c10::make_intrusive<WorkMK>(rank_, type, title, std::move(outputs), comm_->timeout() * 2);
  std::unique_lock<std::mutex> lock(mu_);
  TORCH_CHECK(!stop_, "mk ", title, ": rank ", rank_, ": the process group was shut down");
  if (type != c10d::OpType::UNKNOWN) ++collectives_;
  if (queue_.empty() && !running_ && (bytes <= inline_bytes_ || CallerWaits::active())) {
    running_ = true;
    ++runs_on_caller_;
    lock.unlock();
    const std::exception_ptr err = run(fn, title);
    lock.lock();
    running_ = false;
    // Only the worker waits on cv_, and it has something to do only if a task was queued meanwhile: waking
    // it for nothing costs it a context switch per inline collective (measured: 6% of a 2-rank loop of tiny
    // fused ops went to the worker's wake-ups), on a core the ranks need.
    if (!queue_.empty() || stop_) cv_.notify_all();
    lock.unlock();
    work->complete(err);
    return work;
  }
  ++runs_on_worker_;
  queue_.push_back(Queued{work, std::move(fn), title});
  cv_.notify_all();
  return work;
}

// ---- collectives ----

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::allreduce(std::vector<at::Tensor>& tensors,
                                                         const c10d::AllreduceOptions& opts) {
  TORCH_CHECK(!opts.sparseIndices.has_value(), "mk allreduce: rank ", rank_, ": sparse allreduce is not supported");
  size_t bytes = 0;
  for (auto& t : tensors) {
    check_tensor(t, "allreduce", rank_);
    bytes += nbytes(t);
  }
  const RedOp op = to_redop(opts.reduceOp, "allreduce", rank_);
  return enqueue(opts.timeout, c10d::OpType::ALLREDUCE, "mk:all_reduce", tensors, bytes, [this, tensors, op] {
    for (const auto& t : tensors) {
      Staged s(t);
      coll::allreduce(*comm_, s.ptr(), size_t(t.numel()), to_dtype(t, "allreduce", rank_), op);
      s.copy_back();
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                                   const c10d::AllreduceCoalescedOptions& opts) {
  c10d::AllreduceOptions o;
  o.reduceOp = opts.reduceOp;
  o.timeout = opts.timeout;
  return allreduce(tensors, o);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::broadcast(std::vector<at::Tensor>& tensors,
                                                         const c10d::BroadcastOptions& opts) {
  check_single(tensors, "broadcast", rank_);
  const int root = int(opts.rootRank);
  at::Tensor t = tensors[0];
  return enqueue(opts.timeout, c10d::OpType::BROADCAST, "mk:broadcast", tensors, nbytes(t), [this, t, root] {
    Staged s(t);
    coll::broadcast(*comm_, s.ptr(), nbytes(t), root);
    s.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  check_single(tensors, "reduce", rank_);
  const RedOp op = to_redop(opts.reduceOp, "reduce", rank_);
  const int root = int(opts.rootRank);
  at::Tensor t = tensors[0];
  return enqueue(opts.timeout, c10d::OpType::REDUCE, "mk:reduce", tensors, nbytes(t), [this, t, op, root] {
    Staged s(t);
    coll::reduce(*comm_, s.ptr(), size_t(t.numel()), to_dtype(t, "reduce", rank_), op, root);
    if (rank_ == root) s.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                         std::vector<at::Tensor>& inputs,
                                                         const c10d::AllgatherOptions& opts) {
  check_single(inputs, "allgather", rank_);
  TORCH_CHECK(outputs.size() == 1 && int(outputs[0].size()) == size_, "mk allgather: rank ", rank_,
              ": expected one list of ", size_, " output tensors");
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs = outputs[0];
  for (size_t i = 0; i < outs.size(); ++i) check_like(outs[i], in, "allgather", rank_, "output tensor", i);
  return enqueue(opts.timeout, c10d::OpType::ALLGATHER, "mk:all_gather", outs, nbytes(in) * size_t(size_), [this, in, outs] {
    at::Tensor src = in.contiguous();
    at::Tensor flat = at::empty({int64_t(size_) * in.numel()}, in.options());
    coll::allgather(*comm_, src.data_ptr(), flat.data_ptr(), nbytes(in));
    for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(flat.narrow(0, int64_t(i) * in.numel(), in.numel()).view(outs[i].sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                               const c10d::AllgatherOptions& opts) {
  check_tensor(input, "all_gather_into_tensor", rank_);
  check_tensor(output, "all_gather_into_tensor", rank_);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "mk all_gather_into_tensor: rank ", rank_,
              ": output dtype ", output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(output.numel() == input.numel() * size_, "mk all_gather_into_tensor: rank ", rank_, ": output has ",
              output.numel(), " elements, expected world_size * input = ", input.numel() * size_);
  at::Tensor in = input, out = output;
  return enqueue(opts.timeout, c10d::OpType::_ALLGATHER_BASE, "mk:_allgather_base", {out}, nbytes(out), [this, in, out] {
    at::Tensor src = in.contiguous();
    Staged s(out);
    coll::allgather(*comm_, src.data_ptr(), s.ptr(), nbytes(in));
    s.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                                   std::vector<at::Tensor>& inputs,
                                                                   const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "mk allgather_coalesced: rank ", rank_, ": ", outputs.size(),
              " output lists for ", inputs.size(), " inputs");
  std::vector<at::Tensor> all_outs;
  size_t bytes = 0;
  for (size_t j = 0; j < inputs.size(); ++j) {
    check_tensor(inputs[j], "allgather_coalesced", rank_);
    TORCH_CHECK(int(outputs[j].size()) == size_, "mk allgather_coalesced: rank ", rank_, ": output list ", j,
                " has ", outputs[j].size(), " tensors, expected ", size_);
    for (size_t i = 0; i < outputs[j].size(); ++i) {
      check_like(outputs[j][i], inputs[j], "allgather_coalesced", rank_, "output tensor", i);
      all_outs.push_back(outputs[j][i]);
    }
    bytes += nbytes(inputs[j]) * size_t(size_);
  }
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(opts.timeout, c10d::OpType::ALLGATHER_COALESCED, "mk:allgather_coalesced", all_outs, bytes, [this, ins, outs] {
    for (size_t j = 0; j < ins.size(); ++j) {
      at::Tensor src = ins[j].contiguous();
      at::Tensor flat = at::empty({int64_t(size_) * src.numel()}, src.options());
      coll::allgather(*comm_, src.data_ptr(), flat.data_ptr(), nbytes(src));
      for (size_t i = 0; i < outs[j].size(); ++i)
        outs[j][i].copy_(flat.narrow(0, int64_t(i) * src.numel(), src.numel()).view(outs[j][i].sizes()));
    }
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                               std::vector<at::Tensor>& inputs,
                                                                               const c10d::AllgatherOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "mk allgather_into_tensor_coalesced: rank ", rank_,
              ": outputs and inputs differ in number");
  size_t bytes = 0;
  for (size_t j = 0; j < inputs.size(); ++j) {
    check_tensor(inputs[j], "allgather_into_tensor_coalesced", rank_);
    check_tensor(outputs[j], "allgather_into_tensor_coalesced", rank_);
    TORCH_CHECK(outputs[j].numel() == inputs[j].numel() * size_ && outputs[j].scalar_type() == inputs[j].scalar_type(),
                "mk allgather_into_tensor_coalesced: rank ", rank_, ": output ", j, " must hold world_size x input ", j);
    bytes += nbytes(outputs[j]);
  }
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(opts.timeout, c10d::OpType::ALLGATHER_INTO_TENSOR_COALESCED, "mk:allgather_into_tensor_coalesced", outs, bytes,
                 [this, ins, outs] {
                   for (size_t j = 0; j < ins.size(); ++j) {
                     at::Tensor src = ins[j].contiguous();
                     Staged s(outs[j]);
                     coll::allgather(*comm_, src.data_ptr(), s.ptr(), nbytes(src));
                     s.copy_back();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                                      std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  check_single(inputs, "gather", rank_);
  const int root = int(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "mk gather: rank ", rank_, ": invalid root ", root, " (group size ", size_, ")");
  at::Tensor in = inputs[0];
  std::vector<at::Tensor> outs;
  if (rank_ == root) {
    TORCH_CHECK(outputs.size() == 1 && int(outputs[0].size()) == size_, "mk gather: rank ", rank_,
                " (root): expected one list of ", size_, " output tensors");
    outs = outputs[0];
    for (size_t i = 0; i < outs.size(); ++i) check_like(outs[i], in, "gather", rank_, "output tensor", i);
  } else {
    TORCH_CHECK(outputs.empty() || (outputs.size() == 1 && outputs[0].empty()), "mk gather: rank ", rank_,
                ": only the root (", root, ") passes output tensors");
  }
  return enqueue(opts.timeout, c10d::OpType::GATHER, "mk:gather", outs, nbytes(in) * size_t(size_), [this, in, outs, root] {
    at::Tensor src = in.contiguous();
    at::Tensor flat = rank_ == root ? at::empty({int64_t(size_) * in.numel()}, in.options()) : at::Tensor();
    coll::gather(*comm_, src.data_ptr(), rank_ == root ? flat.data_ptr() : nullptr, nbytes(in), root);
    for (size_t i = 0; i < outs.size(); ++i) outs[i].copy_(flat.narrow(0, int64_t(i) * in.numel(), in.numel()).view(outs[i].sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ScatterOptions& opts) {
  check_single(outputs, "scatter", rank_);
  const int root = int(opts.rootRank);
  TORCH_CHECK(root >= 0 && root < size_, "mk scatter: rank ", rank_, ": invalid root ", root, " (group size ", size_, ")");
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins;
  if (rank_ == root) {
    TORCH_CHECK(inputs.size() == 1 && int(inputs[0].size()) == size_, "mk scatter: rank ", rank_,
                " (root): expected one list of ", size_, " input tensors");
    ins = inputs[0];
    for (size_t i = 0; i < ins.size(); ++i) check_like(ins[i], out, "scatter", rank_, "input tensor", i);
  } else {
    TORCH_CHECK(inputs.empty() || (inputs.size() == 1 && inputs[0].empty()), "mk scatter: rank ", rank_,
                ": only the root (", root, ") passes input tensors");
  }
  return enqueue(opts.timeout, c10d::OpType::SCATTER, "mk:scatter", {out}, nbytes(out) * size_t(size_), [this, ins, out, root] {
    at::Tensor flat;
    if (rank_ == root) {
      std::vector<at::Tensor> flats;
      for (auto& t : ins) flats.push_back(t.reshape({-1}));
      flat = at::cat(flats);
    }
    Staged s(out);
    coll::scatter(*comm_, rank_ == root ? flat.data_ptr() : nullptr, s.ptr(), nbytes(out), root);
    s.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                              std::vector<std::vector<at::Tensor>>& inputs,
                                                              const c10d::ReduceScatterOptions& opts) {
  check_single(outputs, "reduce_scatter", rank_);
  TORCH_CHECK(inputs.size() == 1 && int(inputs[0].size()) == size_, "mk reduce_scatter: rank ", rank_,
              ": expected one list of ", size_, " input tensors");
  at::Tensor out = outputs[0];
  std::vector<at::Tensor> ins = inputs[0];
  for (size_t i = 0; i < ins.size(); ++i) check_like(ins[i], out, "reduce_scatter", rank_, "input tensor", i);
  const RedOp op = to_redop(opts.reduceOp, "reduce_scatter", rank_);
  return enqueue(opts.timeout, c10d::OpType::REDUCE_SCATTER, "mk:reduce_scatter", {out}, nbytes(out) * size_t(size_),
                 [this, ins, out, op] {
                   std::vector<at::Tensor> flats;
                   for (auto& t : ins) flats.push_back(t.reshape({-1}));
                   at::Tensor flat = at::cat(flats);
                   Staged s(out);
                   coll::reduce_scatter(*comm_, flat.data_ptr(), s.ptr(), size_t(out.numel()),
                                        to_dtype(out, "reduce_scatter", rank_), op);
                   s.copy_back();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                                    const c10d::ReduceScatterOptions& opts) {
  check_tensor(input, "reduce_scatter_tensor", rank_);
  check_tensor(output, "reduce_scatter_tensor", rank_);
  TORCH_CHECK(output.scalar_type() == input.scalar_type(), "mk reduce_scatter_tensor: rank ", rank_,
              ": output dtype ", output.scalar_type(), " differs from input dtype ", input.scalar_type());
  TORCH_CHECK(input.numel() == output.numel() * size_, "mk reduce_scatter_tensor: rank ", rank_, ": input has ",
              input.numel(), " elements, expected world_size * output = ", output.numel() * size_);
  const RedOp op = to_redop(opts.reduceOp, "reduce_scatter_tensor", rank_);
  at::Tensor in = input, out = output;
  return enqueue(opts.timeout, c10d::OpType::_REDUCE_SCATTER_BASE, "mk:_reduce_scatter_base", {out}, nbytes(in), [this, in, out, op] {
    at::Tensor src = in.contiguous();
    Staged s(out);
    coll::reduce_scatter(*comm_, src.data_ptr(), s.ptr(), size_t(out.numel()), to_dtype(out, "reduce_scatter", rank_), op);
    s.copy_back();
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                               std::vector<at::Tensor>& inputs,
                                                                               const c10d::ReduceScatterOptions& opts) {
  TORCH_CHECK(outputs.size() == inputs.size(), "mk reduce_scatter_tensor_coalesced: rank ", rank_,
              ": outputs and inputs differ in number");
  size_t bytes = 0;
  for (size_t j = 0; j < inputs.size(); ++j) {
    check_tensor(inputs[j], "reduce_scatter_tensor_coalesced", rank_);
    check_tensor(outputs[j], "reduce_scatter_tensor_coalesced", rank_);
    TORCH_CHECK(inputs[j].numel() == outputs[j].numel() * size_ && outputs[j].scalar_type() == inputs[j].scalar_type(),
                "mk reduce_scatter_tensor_coalesced: rank ", rank_, ": input ", j, " must hold world_size x output ", j);
    bytes += nbytes(inputs[j]);
  }
  const RedOp op = to_redop(opts.reduceOp, "reduce_scatter_tensor_coalesced", rank_);
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(opts.timeout, c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED, "mk:reduce_scatter_tensor_coalesced", outs, bytes,
                 [this, ins, outs, op] {
                   for (size_t j = 0; j < ins.size(); ++j) {
                     at::Tensor src = ins[j].contiguous();
                     Staged s(outs[j]);
                     coll::reduce_scatter(*comm_, src.data_ptr(), s.ptr(), size_t(outs[j].numel()),
                                          to_dtype(outs[j], "reduce_scatter", rank_), op);
                     s.copy_back();
                   }
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                             std::vector<int64_t>& output_splits,
                                                             std::vector<int64_t>& input_splits,
                                                             const c10d::AllToAllOptions& opts) {
  check_tensor(input, "all_to_all_single", rank_);
  check_tensor(output, "all_to_all_single", rank_);
  TORCH_CHECK(input.scalar_type() == output.scalar_type(), "mk all_to_all_single: rank ", rank_,
              ": input and output dtypes differ");
  auto splits = [&](const at::Tensor& t, const std::vector<int64_t>& given, const char* which) {
    std::vector<size_t> bytes(static_cast<size_t>(size_)), off(static_cast<size_t>(size_));
    const int64_t rows = t.dim() == 0 ? 1 : t.size(0);
    const size_t row_bytes = rows == 0 ? 0 : nbytes(t) / size_t(rows);
    std::vector<int64_t> s = given;
    if (s.empty()) {
      TORCH_CHECK(rows % size_ == 0, "mk all_to_all_single: rank ", rank_, ": ", which, " has ", rows,
                  " rows, not divisible by world size ", size_, " (pass split sizes for uneven splits)");
      s.assign(size_t(size_), rows / size_);
    }
    TORCH_CHECK(int(s.size()) == size_, "mk all_to_all_single: rank ", rank_, ": ", which, " split sizes have ",
                s.size(), " entries, expected ", size_);
    TORCH_CHECK(std::accumulate(s.begin(), s.end(), int64_t(0)) == rows, "mk all_to_all_single: rank ", rank_, ": ",
                which, " split sizes sum to ", std::accumulate(s.begin(), s.end(), int64_t(0)), " but the tensor has ",
                rows, " rows");
    size_t o = 0;
    for (int r = 0; r < size_; ++r) {
      TORCH_CHECK(s[size_t(r)] >= 0, "mk all_to_all_single: rank ", rank_, ": negative split size");
      bytes[size_t(r)] = size_t(s[size_t(r)]) * row_bytes;
      off[size_t(r)] = o;
      o += bytes[size_t(r)];
    }
    return std::make_pair(bytes, off);
  };
  auto [sb, so] = splits(input, input_splits, "input");
  auto [rb, ro] = splits(output, output_splits, "output");
  at::Tensor in = input, out = output;
  return enqueue(opts.timeout, c10d::OpType::ALLTOALL_BASE, "mk:all_to_all", {out}, nbytes(in),
                 [this, in, out, sb = sb, so = so, rb = rb, ro = ro] {
                   at::Tensor src = in.contiguous();
                   Staged s(out);
                   coll::alltoall(*comm_, src.data_ptr(), s.ptr(), sb, so, rb, ro);
                   s.copy_back();
                 });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                        const c10d::AllToAllOptions& opts) {
  TORCH_CHECK(int(outputs.size()) == size_ && int(inputs.size()) == size_, "mk all_to_all: rank ", rank_,
              ": expected ", size_, " input and output tensors");
  std::vector<size_t> sb, so, rb, ro;
  size_t s_total = 0, r_total = 0;
  for (int r = 0; r < size_; ++r) {
    check_tensor(inputs[size_t(r)], "all_to_all", rank_);
    check_tensor(outputs[size_t(r)], "all_to_all", rank_);
    TORCH_CHECK(inputs[size_t(r)].scalar_type() == outputs[size_t(r)].scalar_type(), "mk all_to_all: rank ", rank_,
                ": input and output dtypes differ");
    so.push_back(s_total);
    sb.push_back(nbytes(inputs[size_t(r)]));
    s_total += sb.back();
    ro.push_back(r_total);
    rb.push_back(nbytes(outputs[size_t(r)]));
    r_total += rb.back();
  }
  auto ins = inputs;
  auto outs = outputs;
  return enqueue(opts.timeout, c10d::OpType::ALLTOALL, "mk:all_to_all", outs, s_total, [this, ins, outs, sb, so, rb, ro, r_total] {
    std::vector<at::Tensor> flats;
    for (auto& t : ins) flats.push_back(t.contiguous().view(at::kByte).reshape({-1}));
    at::Tensor src = at::cat(flats);
    at::Tensor dst = at::empty({int64_t(r_total)}, at::TensorOptions().dtype(at::kByte));
    coll::alltoall(*comm_, src.data_ptr(), dst.data_ptr(), sb, so, rb, ro);
    for (size_t r = 0; r < outs.size(); ++r)
      outs[r].copy_(dst.narrow(0, int64_t(ro[r]), int64_t(rb[r])).view(outs[r].scalar_type()).view(outs[r].sizes()));
  });
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::barrier(const c10d::BarrierOptions& opts) {
  return enqueue(opts.timeout, c10d::OpType::BARRIER, "mk:barrier", {}, 0, [this] { coll::barrier(*comm_); });
}

// ---- point to point ----

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::p2p(c10d::OpType type, const char* title, at::Tensor& tensor, int peer,
                                                   int tag, bool sending) {
  const char* op = sending ? "send" : "recv";
  check_tensor(tensor, op, rank_);
  TORCH_CHECK(tag >= 0, "mk ", op, ": rank ", rank_, ": tag must be >= 0, got ", tag);
  TORCH_CHECK(peer == kAnySource || (peer >= 0 && peer < size_ && peer != rank_), "mk ", op, ": rank ", rank_,
              ": invalid peer rank ", peer, " (group size ", size_, ")");
  comm_->check_usable(op);
  auto work = c10::make_intrusive<WorkMK>(rank_, type, title, std::vector<at::Tensor>{tensor}, comm_->timeout());
  at::Tensor orig = tensor;
  at::Tensor buf = tensor.contiguous();
  RequestPtr req = sending ? comm_->isend(peer, uint64_t(tag), buf.data_ptr(), nbytes(buf), 0)
                           : comm_->irecv(peer, uint64_t(tag), buf.data_ptr(), nbytes(buf), 0);
  const int me = rank_;
  {
    // The hooks may run after the group is gone (a user's is_completed() or a held future): they reach the
    // communicator only through a weak reference, and the sleeping guard only touches the shared-memory
    // segment it keeps mapped.
    auto weak_pg = c10::weak_intrusive_ptr<ProcessGroupMK>(c10::intrusive_ptr<ProcessGroupMK>::unsafe_reclaim_from_nonowning(this));
    work->progress_hooks(
        [weak_pg, weak = std::weak_ptr<Request>(req), peer] {
          auto pg = weak_pg.lock();
          auto r = weak.lock();
          if (pg && r) pg->comm().progress_while_pending(*r, peer);
        },
        [weak_pg, peer] {
          if (auto pg = weak_pg.lock()) pg->comm().poll(peer);
        },
        [weak_pg, peer] {
          auto pg = weak_pg.lock();
          return pg ? std::shared_ptr<void>(std::make_shared<Comm::Sleeping>(pg->comm(), peer)) : nullptr;
        });
  }
  if (!sending) {
    Comm* comm = comm_.get();
    work->on_timeout([comm, req, me, peer, tag] {
      comm->matcher().cancel(req, cat("rank ", me, ": recv from peer ", peer, " (tag ", tag, ") timed out"));
    });
  }
  req->on_finish([work, buf, orig, sending, op, me, peer, tag](Request& r) {
    if (r.failed()) {
      work->complete(backend_error(cat("mk ", op, ": rank ", me, ", peer ", peer == kAnySource ? std::string("any") : std::to_string(peer),
                                       ", tag ", tag, ": ", r.error())));
      return;
    }
    if (!sending && !buf.is_same(orig)) orig.copy_(buf);
    work->complete(nullptr, r.source());
  });
  return work;
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::send(std::vector<at::Tensor>& tensors, int dst, int tag) {
  check_single(tensors, "send", rank_);
  return p2p(c10d::OpType::SEND, "mk:send", tensors[0], dst, tag, true);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::recv(std::vector<at::Tensor>& tensors, int src, int tag) {
  check_single(tensors, "recv", rank_);
  return p2p(c10d::OpType::RECV, "mk:recv", tensors[0], src, tag, false);
}

c10::intrusive_ptr<c10d::Work> ProcessGroupMK::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  check_single(tensors, "recv", rank_);
  return p2p(c10d::OpType::RECVANYSOURCE, "mk:recvAnySource", tensors[0], kAnySource, tag, false);
}

}  // namespace mk
