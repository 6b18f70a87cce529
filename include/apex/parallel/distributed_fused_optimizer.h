#pragma once

// ZeRO-2 on c10d, what the sharded optimizers share (DistributedFusedAdam, DistributedFusedLAMB):
// optimizer state and gradients sharded over the ranks of a process group; every rank keeps the
// full model.

#include <ATen/core/Tensor.h>
#include <apex/optim/fused_optimizer.h>
#include <apex/parallel/process_group.h>
#include <apex/state_dict.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace apex::parallel {

/// How a bucket's gradients are reduce-scattered.
enum class ReduceScatter {
  kAuto,      ///< the one that sends fewer bytes on the group's backend (Gloo: kAllToAll)
  kNative,    ///< c10d's reduce_scatter_single (Gloo implements it as an all-reduce: 2x bytes)
  kAllToAll,  ///< c10d's all_to_all_single, then a local sum in rank order: (W-1)/W of a bucket
};

/// The sharding settings of a sharded optimizer's options (apex's names and defaults). They are
/// the whole optimizer's: a parameter group's own values are ignored, the defaults' count.
// NOLINTBEGIN(cppcoreguidelines-macro-usage): one list for every sharded optimizer's options
#define APEX_SHARDING_OPTIONS                                                                   \
  /** Gradient bucket size in MiB (of grad_sync_dtype elements). Parameters are cut into    */  \
  /** fragments where a bucket ends.                                                        */  \
  TORCH_ARG(double, bucket_cap_mb) = 100.0;                                                     \
  /** Collectives in flight at once (older ones are waited for before a new one starts).    */  \
  TORCH_ARG(int64_t, pipeline_size) = 2;                                                        \
  /** dtype of the sharded state (moments, the fp32 master): only kFloat.                   */  \
  TORCH_ARG(at::ScalarType, dtype) = at::kFloat;                                                \
  /** dtype gradients travel (and are kept sharded) in; unset: `dtype`.                     */  \
  TORCH_ARG(std::optional<at::ScalarType>, grad_sync_dtype) = std::nullopt;                     \
  /** dtype parameters are all-gathered in; unset: `dtype`.                                 */  \
  TORCH_ARG(std::optional<at::ScalarType>, param_sync_dtype) = std::nullopt;                    \
  /** Start a bucket's reduce-scatter as soon as its gradients are all in (during backward);*/  \
  /** false: every reduce-scatter starts in step().                                          */ \
  TORCH_ARG(bool, overlap_grad_sync) = true;                                                    \
  /** Average gradients over ranks (else sum).                                              */  \
  TORCH_ARG(bool, average_grad_sync) = true;                                                    \
  /** One full-size gradient buffer for the whole model, kept, instead of a buffer per      */  \
  /** bucket that lives only until its reduce-scatter ends.                                 */  \
  TORCH_ARG(bool, contiguous_grad_buffer) = false;                                              \
  /** Half parameters: keep an fp32 copy (the master) in the shard. false: none, each step   */ \
  /** updates the half values themselves (8 bytes of state per element instead of 12).     */   \
  TORCH_ARG(bool, store_params) = true;                                                         \
  /** bf16 parameters: keep 16-bit remainders instead of fp32 masters (the parameter is the  */ \
  /** master's high half, rounded half up; the remainder its low half): 2 bytes per element */  \
  /** of the shard instead of 4, the same fp32 master bit for bit (store_params is then moot;*/ \
  /** apex's Python class wants it false). CPU parameters only.                              */ \
  TORCH_ARG(bool, store_param_remainders) = false;                                              \
  /** Largest message of a bucket's exchanges in MiB per peer (0: one collective per bucket, */ \
  /** apex's). Above it a bucket's reduce-scatter and parameter all-gather go as several     */ \
  /** collectives, which the backend's worker threads run a few at a time: on a slow link    */ \
  /** with a deep queue, one large exchange both ways at once runs at ~60 % of the link (each*/ \
  /** direction's acknowledgments wait behind the other's data); pieces keep the queue short.*/ \
  /** Each piece costs a collective's latency: for slow links only (docs/distributed.md).    */ \
  TORCH_ARG(double, message_cap_mb) = 0.0;                                                      \
  TORCH_ARG(ReduceScatter, reduce_scatter) = ReduceScatter::kAuto;
// NOLINTEND(cppcoreguidelines-macro-usage)

/// The values of APEX_SHARDING_OPTIONS, for the shared constructor.
struct ShardingSettings {
  double bucket_cap_mb = 100.0;
  int64_t pipeline_size = 2;
  at::ScalarType dtype = at::kFloat;
  std::optional<at::ScalarType> grad_sync_dtype;
  std::optional<at::ScalarType> param_sync_dtype;
  bool overlap_grad_sync = true;
  bool average_grad_sync = true;
  bool contiguous_grad_buffer = false;
  ReduceScatter reduce_scatter = ReduceScatter::kAuto;
  bool store_param_remainders = false;
  double message_cap_mb = 0.0;
  bool store_params = true;

  template <class Options>
  static ShardingSettings of(const Options& o) {
    return {o.bucket_cap_mb(),          o.pipeline_size(),          o.dtype(),
            o.grad_sync_dtype(),        o.param_sync_dtype(),       o.overlap_grad_sync(),
            o.average_grad_sync(),      o.contiguous_grad_buffer(), o.reduce_scatter(),
            o.store_param_remainders(), o.message_cap_mb(),         o.store_params()};
  }
};

/// Bytes one rank holds for a sharded optimizer (DistributedFusedOptimizer::memory).
struct ShardedMemory {
  int64_t params = 0;          ///< elements of the model's parameters (all ranks have all)
  int64_t shard_elements = 0;  ///< elements of this rank's shard, padding included
  /// exp_avg + exp_avg_sq + the fp32 master (or the 16-bit remainders) of this rank's shard
  int64_t state_bytes = 0;
  int64_t grad_shard_bytes = 0;   ///< the reduced gradients of this rank's shard
  int64_t grad_buffer_bytes = 0;  ///< full-size bucket buffers alive now
  /// Transient buffers kept for the next step (bucket-sized; reused instead of reallocated).
  int64_t cached_buffer_bytes = 0;
};

/// The machinery of the sharded optimizers (see DistributedFusedAdam for the picture).
///
/// Parameters are flattened into buckets of bucket_cap_mb, each bucket split into W equal shards;
/// a parameter may be cut into fragments across buckets and shards. The order is the reverse of
/// registration until the first step, then the order in which rank 0's first backward produced
/// the gradients (the state moves with it, once), so that buckets fill one after the other;
/// init_params_bucket puts groups of parameters in buckets of their own, ahead of the rest.
/// Gradients leave `p.grad` as soon as autograd accumulates them (a hook copies them into their
/// bucket), so `p.grad` stays undefined: use grad_norm() and clip_grad_norm() here, not on the
/// parameters. fp16/bf16 parameters get an fp32 master in the shard (bf16 ones, with
/// store_param_remainders, a 16-bit remainder that makes the parameter its master); fp32
/// parameters are updated in place. Every rank must construct it with the same parameters (shapes
/// and dtypes are compared), and the layout is fixed then (add_param_group afterwards is not
/// supported).
class DistributedFusedOptimizer : public torch::optim::Optimizer, public optim::ScaledGradients {
 public:
  ~DistributedFusedOptimizer() override;
  DistributedFusedOptimizer(const DistributedFusedOptimizer&) = delete;
  DistributedFusedOptimizer& operator=(const DistributedFusedOptimizer&) = delete;

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
    explicit NoSync(DistributedFusedOptimizer& opt);
    ~NoSync();
    NoSync(const NoSync&) = delete;
    NoSync& operator=(const NoSync&) = delete;

   private:
    DistributedFusedOptimizer& opt_;
    bool was_;
  };
  NoSync no_sync() { return NoSync(*this); }

  /// Memory this rank holds for the optimizer.
  ShardedMemory memory() const;
  /// Steps taken by group `group` (skipped ones do not count).
  int64_t step_count(size_t group = 0) const;
  const ProcessGroup& process_group() const { return group_; }
  /// The parameters in layout order (bucket 0 first): reverse registration order until the first
  /// step, then the order rank 0's first backward produced their gradients in.
  std::vector<at::Tensor> layout() const;
  ReduceScatter reduce_scatter_algorithm() const;
  /// apex's init_params_bucket: `params` (this optimizer's) get buckets of their own, so that
  /// their gradients travel together and apart from the others'. Groups lead the layout in the
  /// order of the calls (the other parameters follow, in arrival order after the first step);
  /// parameters already in a group are ignored. The state moves with the layout. Every rank must
  /// call it with the same parameters, with no gradients pending (before backward, or after
  /// step() or zero_grad()).
  void init_params_bucket(const std::vector<at::Tensor>& params);

  /// Writes this rank's shard to `dir`/shard-<rank>-of-<world>.pt and, on rank 0,
  /// `dir`/manifest.pt (torch.save format, atomic; every rank must call it). Loadable at any
  /// world size.
  void save_sharded(const std::string& dir) const;
  /// Reads a folder written by save_sharded at any world size. Every file is checked (CRC, layout,
  /// shapes) before anything changes; on error the optimizer is as it was and the message names
  /// the file. Every rank must call it; the ranks agree on success before any of them changes.
  void load_sharded(const std::string& dir);

  /// The whole state gathered on every rank, in apex's distributed optimizers' state_dict
  /// format 2: {"state": {i: {"param": fp32, "exp_avg", "exp_avg_sq"}}, "param_groups":
  /// [{..., "step"}], "format": 2}. Every rank must call it.
  StateDict consolidated_state_dict() const;
  /// Loads consolidated_state_dict() output (any world size saved it), or the layout of the
  /// matching torch.optim optimizer. Every rank must call it.
  void load_consolidated_state_dict(const StateDict& state);

  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  struct Impl;

 protected:
  DistributedFusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                            std::unique_ptr<torch::optim::OptimizerOptions> defaults,
                            const ShardingSettings& sharding, ProcessGroup group, const char* name);
  /// The algorithm on this rank's shard (gradients synchronized, not skipped); advances the
  /// groups' step counters. `inv_scale` (undefined: 1) multiplies the gradients.
  virtual void update(const at::Tensor& inv_scale) = 0;
  /// Checks every group's hyperparameters (before any change).
  virtual void check_hyperparameters() const = 0;
  /// A group's entry of consolidated_state_dict (its options; the step is added).
  virtual StateDict group_state(size_t group) const = 0;
  /// One parameter's state in the torch.optim layout and every group's options there; nullopt
  /// for optimizers without a torch.optim counterpart.
  StateDict torch_layout(const std::function<StateDict(size_t)>& group) const;

  Impl& impl() { return *impl_; }
  const Impl& impl() const { return *impl_; }

 private:
  std::unique_ptr<Impl> impl_;
  ProcessGroup group_;
};

}  // namespace apex::parallel
