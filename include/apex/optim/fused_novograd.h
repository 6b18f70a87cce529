#pragma once

#include <apex/optim/fused_optimizer.h>
#include <torch/arg.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <vector>

namespace apex::optim {

/// Norm used for NovoGrad's per-tensor second moment.
enum class NovoGradNorm { kL2, kInf };

/// Options of FusedNovoGrad, with apex's defaults.
struct FusedNovoGradOptions : public torch::optim::OptimizerCloneableOptions<FusedNovoGradOptions> {
  FusedNovoGradOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, bias_correction) = true;
  /// Put the normalized gradient plus decay inside the moment (the paper's form) instead of
  /// adding the decay to the update.
  TORCH_ARG(bool, reg_inside_moment) = false;
  TORCH_ARG(bool, grad_averaging) = true;
  TORCH_ARG(NovoGradNorm, norm_type) = NovoGradNorm::kL2;
  /// Start the second moment at 0 instead of at the first step's norm.
  TORCH_ARG(bool, init_zero) = false;
  TORCH_ARG(bool, set_grad_none) = true;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// exp_avg_sq is one fp32 scalar per tensor: the blended gradient norm (not squared, as apex).
struct FusedNovoGradParamState
    : public torch::optim::OptimizerCloneableParamState<FusedNovoGradParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// NovoGrad (per-tensor second moment) fused over all parameters, with apex's semantics:
///   L2:  v = sqrt(b2*v^2 + (1-b2)*|g|^2)     inf: v = b2*v + (1-b2)*max|g|
///   m = b1*m + beta3*(g/(v/bc2 + eps) + wd*p)        when reg_inside_moment, p -= lr*m/bc1
///   m = b1*m + beta3*g;  p -= lr*((m/bc1)/(v/bc2 + eps) + wd*p)   otherwise
/// with bc2 = sqrt(1 - b2^step). With loss scaling the found-inf flag is read once per step.
class FusedNovoGrad : public FusedOptimizer {
 public:
  explicit FusedNovoGrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                         FusedNovoGradOptions defaults = {});
  explicit FusedNovoGrad(std::vector<at::Tensor> params, FusedNovoGradOptions defaults = {})
      : FusedNovoGrad({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {
  }

  using FusedOptimizer::step;

  const char* kind() const override { return "FusedNovoGrad"; }
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
