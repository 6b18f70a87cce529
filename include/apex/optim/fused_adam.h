#pragma once

#include <apex/optim/fused_optimizer.h>
#include <torch/arg.h>
#include <torch/optim/serialize.h>

#include <tuple>
#include <vector>

namespace apex::optim {

/// Options of FusedAdam, with apex's defaults (note adam_w_mode = true).
struct FusedAdamOptions : public torch::optim::OptimizerCloneableOptions<FusedAdamOptions> {
  FusedAdamOptions(double lr = 1e-3);  // NOLINT(google-explicit-constructor): as torch's options
  TORCH_ARG(double, lr) = 1e-3;
  using betas_t = std::tuple<double, double>;
  TORCH_ARG(betas_t, betas) = std::make_tuple(0.9, 0.999);
  TORCH_ARG(double, eps) = 1e-8;
  TORCH_ARG(double, weight_decay) = 0.0;
  /// true: decoupled weight decay (AdamW); false: L2 (decay added to the gradient, as Adam).
  TORCH_ARG(bool, adam_w_mode) = true;
  TORCH_ARG(bool, bias_correction) = true;
  /// Not supported: true is rejected with a clear error (as apex does).
  TORCH_ARG(bool, amsgrad) = false;
  /// zero_grad() sets gradients to undefined rather than to zero.
  TORCH_ARG(bool, set_grad_none) = true;
  /// lr and step counter live in device tensors (see FusedAdam::lr_tensor), so a whole step can
  /// be captured in a CUDA graph; also works on the CPU.
  TORCH_ARG(bool, capturable) = false;
  /// fp16/bf16 parameters get an fp32 master copy in the optimizer state; the kernel updates the
  /// master and writes the rounded value into the parameter in the same pass.
  TORCH_ARG(bool, master_weights) = false;

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
  double get_lr() const override { return lr(); }
  void set_lr(const double lr) override { this->lr(lr); }
};

/// Per-parameter state: fp32 moments, the master copy when master_weights, and the step count
/// (kept per group on the device while stepping; mirrored here for serialization).
struct FusedAdamParamState
    : public torch::optim::OptimizerCloneableParamState<FusedAdamParamState> {
  TORCH_ARG(int64_t, step) = 0;
  TORCH_ARG(at::Tensor, exp_avg);
  TORCH_ARG(at::Tensor, exp_avg_sq);
  TORCH_ARG(at::Tensor, master_param);

 public:
  void serialize(torch::serialize::InputArchive& archive) override;
  void serialize(torch::serialize::OutputArchive& archive) const override;
};

/// Adam/AdamW fused over all parameters: one pass per (device, dtype) bucket, reading p, g, m, v
/// and writing p, m, v. Matches torch::optim::AdamW (adam_w_mode) or torch::optim::Adam (L2).
///
///   apex::optim::FusedAdam opt(model->parameters(),
///                              apex::optim::FusedAdamOptions(1e-3).weight_decay(0.01));
///
/// The step counter is one fp32 device tensor per group (apex keeps one per group too, not one
/// per parameter): a skipped step (found_inf) does not advance it, without host synchronization.
class FusedAdam : public FusedOptimizer {
 public:
  explicit FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedAdamOptions defaults = {});
  explicit FusedAdam(std::vector<at::Tensor> params, FusedAdamOptions defaults = {})
      : FusedAdam({torch::optim::OptimizerParamGroup(std::move(params))}, std::move(defaults)) {}

  using FusedOptimizer::step;
  bool skips_without_sync() const override { return true; }

  /// The device tensor holding group `group`'s learning rate in capturable mode (created on the
  /// first step). Write to it to change lr between replays of a captured graph.
  at::Tensor lr_tensor(size_t group);
  /// Group `group`'s step count (reads the device counter).
  int64_t step_count(size_t group) const;

  const char* kind() const override { return "FusedAdam"; }
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

 private:
  at::Tensor& step_tensor(size_t group, c10::Device device);
  void sync_steps_to_state() const;
  void sync_steps_from_state();

  std::vector<at::Tensor> steps_;  // per group, fp32 [1] on the group's device
  std::vector<at::Tensor> lrs_;    // per group, capturable mode only
  std::vector<double> lr_seen_;    // the options' lr when lrs_ was last written
};

}  // namespace apex::optim
