#pragma once

#include <apex/optim/fused_optimizer.h>
#include <torch/arg.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <vector>

namespace apex::optim {

/// Options of FusedLAMB, with apex's defaults (eps 1e-6, weight_decay 0.01, max_grad_norm 1).
struct FusedLAMBOptions : public torch::optim::OptimizerCloneableOptions<FusedLAMBOptions> {
  FusedLAMBOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, weight_decay) = 0.01;
  TORCH_ARG(bool, bias_correction) = true;
  TORCH_ARG(bool, adam_w_mode) = true;
  /// m = b1*m + (1-b1)*g when true; m = b1*m + g when false.
  TORCH_ARG(bool, grad_averaging) = true;
  /// Gradients are divided by global_norm / max_grad_norm when the global norm (over every
  /// group) exceeds it; <= 0 disables clipping.
  TORCH_ARG(double, max_grad_norm) = 1.0;
  /// Apply the trust ratio even when weight_decay is 0 (NVLAMB).
  TORCH_ARG(bool, use_nvlamb) = false;
  TORCH_ARG(bool, set_grad_none) = true;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct FusedLAMBParamState
    : public torch::optim::OptimizerCloneableParamState<FusedLAMBParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// LAMB (layer-wise adaptive moments) fused over all parameters. Unlike apex's FusedLAMB it never
/// overwrites the user's gradient tensors: stage 1 updates the moments and accumulates the
/// per-tensor norms of the update and of the parameter; stage 2 recomputes the update from the
/// moments and applies lr * |p| / |u|. With loss scaling the found-inf flag is read once per
/// step on the host.
class FusedLAMB : public FusedOptimizer {
 public:
  explicit FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedLAMBOptions defaults = {});
  explicit FusedLAMB(std::vector<at::Tensor> params, FusedLAMBOptions defaults = {})
      : FusedLAMB({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  using FusedOptimizer::step;

  const char* kind() const override { return "FusedLAMB"; }
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  void check_options() const override;
  std::vector<double> option_values(const torch::optim::OptimizerOptions& options) const override;
  std::vector<double> state_values(const torch::optim::OptimizerParamState& state) const override;
  void fused_step(const GradScaling& scaling) override;
  bool set_grad_none() const override;
  std::vector<at::Tensor> elementwise_state(
      const torch::optim::OptimizerParamState& state) const override;
};

}  // namespace apex::optim
