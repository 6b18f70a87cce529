#pragma once

// ZeRO-2 LAMB on c10d: apex's DistributedFusedLAMB for LibTorch, on the machinery of
// DistributedFusedAdam.

#include <apex/parallel/distributed_fused_optimizer.h>

#include <tuple>

namespace apex::parallel {

/// Options of DistributedFusedLAMB, with apex's names and defaults (FusedLAMB's).
struct DistributedFusedLAMBOptions
    : public torch::optim::OptimizerCloneableOptions<DistributedFusedLAMBOptions> {
  DistributedFusedLAMBOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(bool, bias_correction) = true;
  /// true: decoupled weight decay in the update; false: L2 (added to the gradient).
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(bool, grad_averaging) = true;
  /// Gradients are divided by global_norm / max_grad_norm when the global norm exceeds it
  /// (0: never).
  TORCH_ARG(double, max_grad_norm) = 1.0;
  /// Apply the trust ratio to every parameter, also those without weight decay.
  TORCH_ARG(bool, use_nvlamb) = false;
  APEX_SHARDING_OPTIONS

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// ZeRO-2 LAMB: FusedLAMB's math on the shards. The per-parameter norms of the trust ratio are
/// sums over a parameter's fragments, wherever they lie (other buckets, other ranks), all-reduced
/// (one vector all-reduce per step), and the clipping norm is global (one scalar all-reduce).
///
///   apex::parallel::DistributedFusedLAMB opt(model->parameters(),
///       apex::parallel::DistributedFusedLAMBOptions(1e-3).weight_decay(0.01));
class DistributedFusedLAMB : public DistributedFusedOptimizer {
 public:
  explicit DistributedFusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                DistributedFusedLAMBOptions defaults = {},
                                ProcessGroup group = default_process_group());
  explicit DistributedFusedLAMB(std::vector<at::Tensor> params,
                                DistributedFusedLAMBOptions defaults = {},
                                ProcessGroup group = default_process_group())
      : DistributedFusedLAMB({torch::optim::OptimizerParamGroup(std::move(params))},
                             std::move(defaults), std::move(group)) {}

 protected:
  void update(const at::Tensor& inv_scale) override;
  void check_hyperparameters() const override;
  StateDict group_state(size_t group) const override;
};

}  // namespace apex::parallel
