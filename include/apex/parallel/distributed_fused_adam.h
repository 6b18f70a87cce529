#pragma once

// ZeRO-2 on c10d: apex's DistributedFusedAdam for LibTorch. Optimizer state and gradients are
// sharded over the ranks of a process group; every rank keeps the full model.

#include <ATen/core/Tensor.h>
#include <apex/optim/fused_optimizer.h>
#include <apex/parallel/process_group.h>
#include <apex/state_dict.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

namespace apex::parallel {

/// How a bucket's gradients are reduce-scattered.
enum class ReduceScatter {
  kAuto,      ///< the one that sends fewer bytes on the group's backend (Gloo: kAllToAll)
  kNative,    ///< c10d's reduce_scatter_single (Gloo implements it as an all-reduce: 2x bytes)
  kAllToAll,  ///< c10d's all_to_all_single, then a local sum in rank order: (W-1)/W of a bucket
};

/// Options of DistributedFusedAdam, with apex's names and defaults.
struct DistributedFusedAdamOptions
    : public torch::optim::OptimizerCloneableOptions<DistributedFusedAdamOptions> {
  DistributedFusedAdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  /// true: decoupled weight decay (AdamW, apex's default); false: L2.
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(bool, bias_correction) = true;

  // Settings of the whole optimizer (a group's own value is ignored; the defaults' count).
  /// Gradient bucket size in MiB (of grad_sync_dtype elements). Parameters are cut into
  /// fragments where a bucket ends.
  TORCH_ARG(double, bucket_cap_mb) = 100.0;
  /// Reduce-scatters in flight at once (older ones are waited for before a new one starts).
  TORCH_ARG(int64_t, pipeline_size) = 2;
  /// dtype of the sharded state (exp_avg, exp_avg_sq, the fp32 master): only kFloat.
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;
  /// dtype gradients travel (and are kept sharded) in; unset: `dtype`.
  TORCH_ARG(std::optional<at::ScalarType>, grad_sync_dtype) = std::nullopt;
  /// dtype parameters are all-gathered in; unset: `dtype`.
  TORCH_ARG(std::optional<at::ScalarType>, param_sync_dtype) = std::nullopt;
  /// Start a bucket's reduce-scatter as soon as its gradients are all in (during backward).
  /// false: every reduce-scatter starts in step().
  TORCH_ARG(bool, overlap_grad_sync) = true;
  /// Average gradients over ranks (else sum).
  TORCH_ARG(bool, average_grad_sync) = true;
  /// Keep one full-size gradient buffer for the whole model instead of a buffer per bucket that
  /// lives only until its reduce-scatter ends (more memory, no allocation per bucket).
  TORCH_ARG(bool, contiguous_grad_buffer) = false;
  TORCH_ARG(ReduceScatter, reduce_scatter) = ReduceScatter::kAuto;

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Bytes one rank holds for the sharded optimizer (see DistributedFusedAdam::memory).
struct ShardedMemory {
  int64_t params = 0;             ///< elements of the model's parameters (all ranks have all)
  int64_t shard_elements = 0;     ///< elements of this rank's shard, padding included
  int64_t state_bytes = 0;        ///< exp_avg + exp_avg_sq + fp32 master of this rank's shard
  int64_t grad_shard_bytes = 0;   ///< the reduced gradients of this rank's shard
  int64_t grad_buffer_bytes = 0;  ///< full-size bucket buffers alive now
};

/// ZeRO-2 Adam/AdamW (apex.contrib.optimizers.DistributedFusedAdam): each rank keeps only its
/// shard of the fp32 state and of the reduced gradients; the model is not wrapped.
///
///   auto pg = apex::parallel::init_process_group();
///   apex::parallel::DistributedFusedAdam opt(model->parameters(),
///       apex::parallel::DistributedFusedAdamOptions(1e-3).weight_decay(0.01));
///   loss.backward();   // gradients go into buckets; full buckets reduce-scatter meanwhile
///   opt.step();        // fused Adam on this rank's shard, then parameters are all-gathered
///   opt.zero_grad();
///
/// Parameters are laid out in reverse order of registration (the order backward produces their
/// gradients in), flattened into buckets of bucket_cap_mb, and each bucket is split into W
/// equal shards; a parameter may be cut into fragments across buckets and shards. Gradients
/// leave `p.grad` as soon as autograd accumulates them (a hook copies them into their bucket), so
/// `p.grad` stays undefined: use grad_norm() and clip_grad_norm() here, not on the parameters.
/// fp16/bf16 parameters get an fp32 master in the shard; fp32 parameters are updated in place.
/// Every rank must construct it with the same parameters (shapes and dtypes are compared).
class DistributedFusedAdam : public torch::optim::Optimizer, public optim::ScaledGradients {
 public:
  explicit DistributedFusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                DistributedFusedAdamOptions defaults = {},
                                ProcessGroup group = default_process_group());
  explicit DistributedFusedAdam(std::vector<at::Tensor> params,
                                DistributedFusedAdamOptions defaults = {},
                                ProcessGroup group = default_process_group())
      : DistributedFusedAdam({torch::optim::OptimizerParamGroup(std::move(params))},
                             std::move(defaults), std::move(group)) {}
  ~DistributedFusedAdam() override;
  DistributedFusedAdam(const DistributedFusedAdam&) = delete;
  DistributedFusedAdam& operator=(const DistributedFusedAdam&) = delete;

  /// Synchronizes the gradients still pending, updates this rank's shard and all-gathers the
  /// parameters. Every rank must call it.
  torch::Tensor step(LossClosure closure = nullptr) override;
  /// One step with a loss scaler's inverse scale (undefined: none): the kernel unscales, and an
  /// inf/NaN gradient on any rank skips the step on every rank. Returns the found-inf flag
  /// (one-element fp32, 1 when skipped), the same on every rank.
  at::Tensor scaled_step(const at::Tensor& inv_scale) override;
  /// Multiplies the synchronized gradients by `inv_scale` in place (GradScaler::unscale_) and
  /// returns the found-inf flag agreed by all ranks.
  at::Tensor unscale_grads(const at::Tensor& inv_scale) override;

  /// Drops the gradients accumulated so far (there are no p.grad to clear).
  void zero_grad();

  /// The global L2 norm of the (synchronized) gradients: one scalar all-reduce.
  double grad_norm();
  /// Scales the gradients so that their global norm is at most `max_norm` (torch's formula:
  /// by min(1, max_norm / (norm + 1e-6))) and returns the norm before clipping.
  double clip_grad_norm(double max_norm);

  /// Makes the backward passes inside the returned guard's life accumulate without
  /// synchronizing (micro-batches); the first backward after it synchronizes them all.
  class NoSync {
   public:
    explicit NoSync(DistributedFusedAdam& opt);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedFusedAdam& opt_;
    bool was_;
  };
  NoSync no_sync() { return NoSync(*this); }

  /// Memory this rank holds for the optimizer.
  ShardedMemory memory() const;
  /// Steps taken by group `group` (skipped ones do not count).
  int64_t step_count(size_t group = 0) const;
  const ProcessGroup& process_group() const { return group_; }
  ReduceScatter reduce_scatter_algorithm() const;

  /// Writes this rank's shard to `dir`/shard-<rank>-of-<world>.pt and, on rank 0, `dir`/manifest.pt
  /// (torch.save format, atomic; every rank must call it). Loadable at any world size.
  void save_sharded(const std::string& dir) const;
  /// Reads a folder written by save_sharded at any world size. Every file is checked (CRC, layout,
  /// shapes) before anything changes; on error the optimizer is as it was and the message names
  /// the file. Every rank must call it; the ranks agree on success before any of them changes.
  void load_sharded(const std::string& dir);

  /// The whole state gathered on every rank, in apex DistributedFusedAdam's state_dict format 2:
  /// {"state": {i: {"param": fp32, "exp_avg", "exp_avg_sq"}}, "param_groups": [{..., "step"}],
  /// "format": 2}. Every rank must call it.
  StateDict consolidated_state_dict() const;
  /// The same state in torch.optim.AdamW's (or Adam's) state_dict layout, for Python.
  StateDict torch_state_dict() const;
  /// Loads consolidated_state_dict() output (any world size saved it). Every rank must call it.
  void load_consolidated_state_dict(const StateDict& state);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
  ProcessGroup group_;
};

}  // namespace apex::parallel
