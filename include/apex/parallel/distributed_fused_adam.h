#pragma once

// ZeRO-2 Adam on c10d: apex's DistributedFusedAdam for LibTorch.

#include <apex/parallel/distributed_fused_optimizer.h>

#include <tuple>

namespace apex::parallel {

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
  APEX_SHARDING_OPTIONS

 public:
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
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
/// See DistributedFusedOptimizer for the layout, gradients, checkpoints and limits.
class DistributedFusedAdam : public DistributedFusedOptimizer {
 public:
  explicit DistributedFusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& groups,
                                DistributedFusedAdamOptions defaults = {},
                                ProcessGroup group = default_process_group());
  explicit DistributedFusedAdam(std::vector<at::Tensor> params,
                                DistributedFusedAdamOptions defaults = {},
                                ProcessGroup group = default_process_group())
      : DistributedFusedAdam({torch::optim::OptimizerParamGroup(std::move(params))},
                             std::move(defaults), std::move(group)) {}

  /// The state in torch.optim.AdamW's (or Adam's) state_dict layout, gathered on every rank,
  /// for Python's torch.load(weights_only=True) after apex::save_pickle. Every rank must call it.
  StateDict torch_state_dict() const;

 protected:
  void update(const at::Tensor& inv_scale) override;
  void check_hyperparameters() const override;
  StateDict group_state(size_t group) const override;
};

}  // namespace apex::parallel
