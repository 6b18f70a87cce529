#pragma once

#include <apex/optim/fused_optimizer.h>
#include <torch/arg.h>
#include <torch/optim/serialize.h>

#include <vector>

namespace apex::optim {

/// Options of FusedAdagrad: apex's defaults, plus torch.optim.Adagrad's lr_decay and
/// initial_accumulator_value so that it can stand in for LibTorch's Adagrad.
struct FusedAdagradOptions : public torch::optim::OptimizerCloneableOptions<FusedAdagradOptions> {
  FusedAdagradOptions(double lr = 1e-2);  // NOLINT(google-explicit-constructor)
  TORCH_ARG(double, lr) = 1e-2;
  TORCH_ARG(double, lr_decay) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(double, initial_accumulator_value) = 0.0;
  TORCH_ARG(double, eps) = 1e-10;
  /// true: decoupled weight decay (p -= lr*wd*p); false: L2 added to the gradient.
  TORCH_ARG(bool, adagrad_w_mode) = false;
  TORCH_ARG(bool, set_grad_none) = true;
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct FusedAdagradParamState
    : public torch::optim::OptimizerCloneableParamState<FusedAdagradParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, sum);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// Adagrad fused over all parameters: h += g*g; p -= clr * g / (sqrt(h) + eps), with
/// clr = lr / (1 + (step - 1) * lr_decay); matches torch::optim::Adagrad. With loss scaling the
/// found-inf flag is read once per step on the host.
class FusedAdagrad : public FusedOptimizer {
 public:
  explicit FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                        FusedAdagradOptions defaults = {});
  explicit FusedAdagrad(std::vector<at::Tensor> params, FusedAdagradOptions defaults = {})
      : FusedAdagrad({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  using FusedOptimizer::step;

  const char* kind() const override { return "FusedAdagrad"; }
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  StateDict python_state_dict() const override;
  void load_python_state_dict(const StateDict& state) override;

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
