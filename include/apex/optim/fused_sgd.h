#pragma once

#include <apex/optim/fused_optimizer.h>
#include <torch/arg.h>
#include <torch/optim/serialize.h>

#include <vector>

namespace apex::optim {

/// Options of FusedSGD (apex's defaults; lr is required as in torch.optim.SGD).
struct FusedSGDOptions : public torch::optim::OptimizerCloneableOptions<FusedSGDOptions> {
  FusedSGDOptions(double lr);  // NOLINT(google-explicit-constructor): as torch's options
  TORCH_ARG(double, lr);
  TORCH_ARG(double, momentum) = 0.0;
  TORCH_ARG(double, dampening) = 0.0;
  TORCH_ARG(double, weight_decay) = 0.0;
  TORCH_ARG(bool, nesterov) = false;
  /// Apply weight decay after the momentum update instead of before (apex's option).
  TORCH_ARG(bool, wd_after_momentum) = false;
  TORCH_ARG(bool, set_grad_none) = false;
  /// fp16/bf16 parameters get an fp32 master copy updated in the same pass.
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

struct FusedSGDParamState : public torch::optim::OptimizerCloneableParamState<FusedSGDParamState> {
  TORCH_ARG(at::Tensor, momentum_buffer);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// SGD with momentum, dampening, Nesterov and weight decay, fused over all parameters; matches
/// torch::optim::SGD (the first step seeds the momentum buffer with the gradient, as PyTorch
/// does). With loss scaling, only the very first step (which seeds the buffers) reads found_inf
/// on the host; later skipped steps cost no synchronization.
class FusedSGD : public FusedOptimizer {
 public:
  explicit FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                    FusedSGDOptions defaults);
  explicit FusedSGD(std::vector<at::Tensor> params, FusedSGDOptions defaults)
      : FusedSGD({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  using FusedOptimizer::step;
  bool skips_without_sync() const override { return true; }

  const char* kind() const override { return "FusedSGD"; }
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;
  StateDict python_state_dict() const override;
  void load_python_state_dict(const StateDict& state) override;

 protected:
  void check_options() const override;
  std::vector<double> option_values(const torch::optim::OptimizerOptions& options) const override;
  void fused_step(const GradScaling& scaling) override;
  bool set_grad_none() const override;
  std::vector<at::Tensor> elementwise_state(
      const torch::optim::OptimizerParamState& state) const override;
};

}  // namespace apex::optim
