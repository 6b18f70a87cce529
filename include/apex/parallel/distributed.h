#pragma once

// DistributedDataParallel for LibTorch modules, on torch's own c10d::Reducer (the engine behind
// Python's DDP): gradients all-reduced in buckets launched from autograd hooks while backward
// still runs.

#include <apex/parallel/process_group.h>
#include <torch/arg.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace apex::parallel {

/// How a gradient bucket travels (what Python DDP calls a comm hook).
enum class CommHook {
  kAllReduce,      ///< the bucket's own dtype, averaged (DDP's default)
  kFp16Compress,   ///< cast to fp16 for the wire, averaged, cast back (torch's fp16_compress_hook)
  kBf16Compress,   ///< the same in bf16 (torch's bf16_compress_hook)
  kAllReduceFp32,  ///< fp16/bf16 buckets upcast to fp32 for the wire (apex's allreduce_always_fp32)
};

/// Options of DistributedDataParallel, with torch's defaults (and apex's names where it had them).
struct DistributedDataParallelOptions {
  /// Bucket size in MiB (torch: 25). The first bucket is first_bucket_mb (torch: 1).
  TORCH_ARG(double, bucket_cap_mb) = 25.0;
  TORCH_ARG(double, first_bucket_mb) = 1.0;
  /// Parameters may get no gradient in some iterations (control flow): the graph is walked from
  /// the outputs after each forward. A parameter unused on every rank keeps an undefined grad.
  TORCH_ARG(bool, find_unused_parameters) = false;
  /// The set of used parameters and their order never change: the first iteration is recorded
  /// and later ones checked against it.
  TORCH_ARG(bool, static_graph) = false;
  /// .grad becomes a view into the bucket (saves one copy and the memory of the gradients).
  TORCH_ARG(bool, gradient_as_bucket_view) = false;
  /// Broadcast rank 0's buffers (BatchNorm's running statistics) before each training forward.
  TORCH_ARG(bool, broadcast_buffers) = true;
  /// At construction: check that every rank has the same parameter and buffer shapes, then
  /// broadcast rank 0's parameters and buffers.
  TORCH_ARG(bool, init_sync) = true;
  TORCH_ARG(CommHook, comm_hook) = CommHook::kAllReduce;
  /// apex: gradients are divided by this before the all-reduce and by world_size / factor after
  /// (keeps fp16 sums of many ranks in range). 1: plain averaging.
  TORCH_ARG(double, gradient_predivide_factor) = 1.0;
  /// apex: false sums the gradients over ranks instead of averaging them.
  TORCH_ARG(bool, gradient_average) = true;
  /// apex: no overlap; everything is reduced at the end of backward, in one bucket.
  TORCH_ARG(bool, delay_allreduce) = false;
};

namespace detail {

/// The module-independent part of DDP: the Reducer, its Logger, and the calls around forward.
class DdpEngine {
 public:
  DdpEngine(torch::nn::Module& module, ProcessGroup group, DistributedDataParallelOptions options);
  ~DdpEngine();
  DdpEngine(const DdpEngine&) = delete;
  DdpEngine& operator=(const DdpEngine&) = delete;

  /// Before the wrapped forward: the Reducer's bookkeeping, bucket rebuild, buffer broadcast.
  void pre_forward();
  /// After it, with every tensor of the output: returns them (passed through DDP's identity
  /// node where the Reducer needs one).
  std::vector<at::Tensor> post_forward(std::vector<at::Tensor> outputs);
  /// Whether the outputs must go through post_forward's returned tensors (else they are returned
  /// unchanged and the call only registers them).
  bool wants_sink() const;

  bool require_backward_grad_sync = true;
  const ProcessGroup& group() const { return group_; }
  const DistributedDataParallelOptions& options() const { return options_; }
  /// Runtime figures of c10d's Logger (ns): forward, backward compute, backward comm, overlap.
  struct Timings {
    int64_t forward_compute_ns = 0;
    int64_t backward_compute_ns = 0;
    int64_t backward_comm_ns = 0;
    int64_t backward_compute_comm_overlap_ns = 0;
  };
  Timings timings() const;
  /// Bucket layout: parameter indices per bucket, in reduction order.
  std::vector<std::vector<size_t>> bucket_indices() const;

 private:
  struct State;
  std::unique_ptr<State> state_;
  ProcessGroup group_;
  DistributedDataParallelOptions options_;
};

// Output flattening: Tensor, vectors and tuples of tensors.
inline void collect(const at::Tensor& t, std::vector<at::Tensor>& out) { out.push_back(t); }
inline void collect(const std::vector<at::Tensor>& ts, std::vector<at::Tensor>& out) {
  out.insert(out.end(), ts.begin(), ts.end());
}
template <typename... T>
void collect(const std::tuple<T...>& t, std::vector<at::Tensor>& out) {
  std::apply([&](const auto&... e) { (collect(e, out), ...); }, t);
}
inline void restore(at::Tensor& t, const std::vector<at::Tensor>& in, size_t& i) { t = in[i++]; }
inline void restore(std::vector<at::Tensor>& ts, const std::vector<at::Tensor>& in, size_t& i) {
  for (auto& t : ts) t = in[i++];
}
template <typename... T>
void restore(std::tuple<T...>& t, const std::vector<at::Tensor>& in, size_t& i) {
  std::apply([&](auto&... e) { (restore(e, in, i), ...); }, t);
}

/// What DDP holds the wrapped module by: a module holder (`Net` of TORCH_MODULE(Net)) or a
/// std::shared_ptr as given; a module class itself (`struct Net : torch::nn::Module`) by a
/// std::shared_ptr to it.
template <typename T>
struct DdpHolder {
  using type = T;
};
template <typename T>
requires std::is_base_of_v<torch::nn::Module, T>
struct DdpHolder<T> {
  using type = std::shared_ptr<T>;
};

}  // namespace detail

/// Wraps a module (its holder, e.g. `Net` or `std::shared_ptr<NetImpl>`) for data-parallel
/// training: parameters and buffers are rank 0's after construction, and after each backward
/// every rank holds the gradients averaged over all ranks. forward passes through; outputs may be
/// a Tensor, a std::vector<Tensor> or a tuple of them.
///
///   auto pg = apex::parallel::init_process_group();            // torchrun's environment
///   apex::parallel::DistributedDataParallel<Net> ddp(net);      // after amp::initialize
///   auto loss = loss_fn(ddp->forward(x), y);  loss.backward();  optimizer.step();
///
/// Its registered submodule is "module", so state_dict keys read as Python DDP's. The template
/// argument may be the holder, a std::shared_ptr, or the module class itself, and is deduced from
/// the constructor's argument:
///
///   auto net = std::make_shared<Net>();                  // struct Net : torch::nn::Module
///   apex::parallel::DistributedDataParallel ddp(net);    // DistributedDataParallel<Net>
///   auto out = ddp(x);                                   // or ddp->forward(x)
template <typename Wrapped>
class DistributedDataParallelImpl : public torch::nn::Module {
 public:
  using Holder = typename detail::DdpHolder<Wrapped>::type;

  explicit DistributedDataParallelImpl(Holder module, DistributedDataParallelOptions options = {},
                                       ProcessGroup group = default_process_group())
      : module_(register_module("module", module)),
        engine_(std::make_unique<detail::DdpEngine>(*module_, std::move(group), options)) {}

  template <typename... Args>
  auto forward(Args&&... args) {
    engine_->pre_forward();
    auto out = module_->forward(std::forward<Args>(args)...);
    std::vector<at::Tensor> flat;
    detail::collect(out, flat);
    auto passed = engine_->post_forward(std::move(flat));
    if (engine_->wants_sink()) {
      size_t i = 0;
      detail::restore(out, passed, i);
    }
    return out;
  }

  /// The wrapped module.
  Holder& module() { return module_; }
  detail::DdpEngine& engine() { return *engine_; }

 private:
  Holder module_;
  std::unique_ptr<detail::DdpEngine> engine_;
};

template <typename Wrapped>
class DistributedDataParallel
    : public torch::nn::ModuleHolder<DistributedDataParallelImpl<Wrapped>> {
 public:
  using torch::nn::ModuleHolder<DistributedDataParallelImpl<Wrapped>>::ModuleHolder;

  /// `ddp(x)`, as for LibTorch's own modules (whose holders find a non-template forward; this one
  /// forwards whatever the wrapped module's forward takes).
  template <typename... Args>
  decltype(auto) operator()(Args&&... args) {
    return this->get()->forward(std::forward<Args>(args)...);
  }
};

// Deduction from the wrapped module: a holder (Net), a std::shared_ptr<Net>.
template <typename M>
DistributedDataParallel(std::shared_ptr<M>) -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(std::shared_ptr<M>, DistributedDataParallelOptions)
    -> DistributedDataParallel<M>;
template <typename M>
DistributedDataParallel(std::shared_ptr<M>, DistributedDataParallelOptions, ProcessGroup)
    -> DistributedDataParallel<M>;
template <typename H>
DistributedDataParallel(H) -> DistributedDataParallel<H>;
template <typename H>
DistributedDataParallel(H, DistributedDataParallelOptions) -> DistributedDataParallel<H>;
template <typename H>
DistributedDataParallel(H, DistributedDataParallelOptions, ProcessGroup)
    -> DistributedDataParallel<H>;

/// `make_distributed_data_parallel(net, options)`: the same, as a function.
template <typename M, typename... Rest>
auto make_distributed_data_parallel(M&& module, Rest&&... rest) {
  return DistributedDataParallel(std::forward<M>(module), std::forward<Rest>(rest)...);
}

/// Gradient accumulation without communication: backward passes run while a guard lives (their
/// forwards included) only accumulate local gradients; the first synced backward after it
/// reduces the sum.
///
///   { apex::parallel::NoSyncGuard no_sync(ddp); loss_fn(ddp->forward(x0), y0).backward(); }
///   loss_fn(ddp->forward(x1), y1).backward();  // reduces both micro-batches' gradients
class NoSyncGuard {
 public:
  template <typename Holder>
  explicit NoSyncGuard(DistributedDataParallel<Holder>& ddp) : NoSyncGuard(ddp->engine()) {}
  template <typename Holder>
  explicit NoSyncGuard(DistributedDataParallelImpl<Holder>& ddp) : NoSyncGuard(ddp.engine()) {}
  explicit NoSyncGuard(detail::DdpEngine& engine);
  ~NoSyncGuard();
  NoSyncGuard(const NoSyncGuard&) = delete;
  NoSyncGuard& operator=(const NoSyncGuard&) = delete;

 private:
  detail::DdpEngine& engine_;
  bool previous_;
};

}  // namespace apex::parallel
