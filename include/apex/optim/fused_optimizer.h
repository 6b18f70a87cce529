#pragma once

#include <ATen/core/Tensor.h>
#include <apex/state_dict.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

namespace apex::optim {

/// Loss-scaling inputs of one fused step (torch's `grad_scale`/`found_inf` protocol).
struct GradScaling {
  /// One-element fp32 tensor: gradients are multiplied by it inside the kernels. Undefined:
  /// gradients are used as they are.
  at::Tensor inv_scale;
  /// One-element fp32 tensor: when it holds a non-zero value the step changes nothing
  /// (parameters, moments, step counters). Undefined: never skip.
  at::Tensor found_inf;
  /// Leave the gradients unscaled (g * inv_scale) after the step, written in the update's own
  /// pass (and alone on a skipped step): torch's GradScaler contract, which GradScaler::step
  /// asks for. Off: the gradients are only read.
  bool unscale_grads = false;
};

/// An optimizer that keeps its gradients itself instead of in `p.grad` (the sharded
/// apex::parallel::DistributedFusedAdam): GradScaler hands it the inverse scale and it reports
/// overflow, agreed by every rank.
class ScaledGradients {
 public:
  virtual ~ScaledGradients() = default;
  /// Multiplies the gradients by `inv_scale` in place; returns the found-inf flag (one-element
  /// fp32, non-zero when any gradient is inf/NaN).
  virtual at::Tensor unscale_grads(const at::Tensor& inv_scale) = 0;
  /// Steps unless a gradient is inf/NaN, multiplying the gradients by `inv_scale` in the update
  /// (undefined: they are unscaled already); returns the found-inf flag.
  virtual at::Tensor scaled_step(const at::Tensor& inv_scale) = 0;
};

/// Base of the fused multi-tensor optimizers. A step updates every parameter of a group in one
/// pass over memory per (device, dtype) bucket. Parameters may be fp32, fp16 or bf16 (math and
/// state in fp32); each group's parameters must sit on one device.
///
/// `step(scaling)` accepts a loss scaler's inverse scale and found-inf flag: gradients are
/// unscaled inside the kernel and an overflow skips the update on the device.
/// `apex::amp::GradScaler::step` and `apex::amp::Amp::step` use it automatically.
class FusedOptimizer : public torch::optim::Optimizer {
 public:
  FusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                 std::unique_ptr<torch::optim::OptimizerOptions> defaults);

  /// Adds a group. Unlike torch::optim::Optimizer::add_param_group in LibTorch 2.13, which
  /// replaces the options of optimizer types it does not know by the defaults, the group keeps
  /// its own options.
  void add_param_group(const torch::optim::OptimizerParamGroup& param_group);

  torch::Tensor step(LossClosure closure = nullptr) override;
  /// One step with loss-scaling inputs; see GradScaling.
  torch::Tensor step(const GradScaling& scaling, LossClosure closure = nullptr);

  /// Clears gradients: to undefined when `set_grad_none` (the default of apex's optimizers),
  /// else to zero.
  void zero_grad();
  using torch::optim::Optimizer::zero_grad;

  /// True when a step with `found_inf` set needs no host synchronization (counters live on the
  /// device). False optimizers read the flag once per step.
  virtual bool skips_without_sync() const { return false; }

  /// The optimizer's state in the layout of the matching `torch.optim` class's `state_dict()`
  /// (tensors on the CPU), for `apex::save_pickle` and Python's `torch.load`. Throws for
  /// optimizers that have no `torch.optim` counterpart.
  virtual StateDict python_state_dict() const;
  /// Loads the layout written by `python_state_dict()` or by Python's `optimizer.state_dict()`.
  virtual void load_python_state_dict(const StateDict& state);

  /// The optimizer's name ("FusedAdam", ...), which its archives carry.
  virtual const char* kind() const = 0;

 protected:
  /// The update itself; `scaling` tensors are already on the right device or undefined.
  virtual void fused_step(const GradScaling& scaling) = 0;
  virtual bool set_grad_none() const { return true; }
  /// The state tensors of one parameter that must have its shape; collect() checks them before
  /// anything changes (state loaded from another model fails there, not halfway through a step).
  virtual std::vector<at::Tensor> elementwise_state(
      const torch::optim::OptimizerParamState& /*state*/) const {
    return {};
  }
  /// Checks every group's options (the constructor's checks), e.g. after a load.
  virtual void check_options() const = 0;
  /// The numbers of a group's options and of a parameter's state besides its elementwise tensors
  /// (step counters), which an archive's checksum covers.
  virtual std::vector<double> option_values(
      const torch::optim::OptimizerOptions& options) const = 0;
  virtual std::vector<double> state_values(
      const torch::optim::OptimizerParamState& /*state*/) const {
    return {};
  }

  /// torch::save support for the concrete optimizer: torch::optim::serialize of its types, then
  /// its kind and a CRC-32 of its options and state (LibTorch's reader checks no CRC, so a flipped
  /// payload byte would otherwise load silently). Defined in src/optim/archive.h.
  template <class State, class Options>
  void save_archive(torch::serialize::OutputArchive& archive) const;
  /// torch::load support: the kind is checked first, then the archive is read and the options,
  /// the state's shapes and the checksum are checked; on any failure the options and state are
  /// put back as they were and the error says what failed. `after` runs inside (e.g. to update
  /// device copies of the loaded state).
  template <class State, class Options>
  void load_archive(torch::serialize::InputArchive& archive,
                    const std::function<void()>& after = {});

  /// A parameter with its gradient.
  struct Entry {
    at::Tensor param;
    at::Tensor grad;
  };
  /// Per group, the parameters that have gradients, checked (dtype, device, shape, density,
  /// sparsity) before anything changes. `who` prefixes the messages.
  std::vector<std::vector<Entry>> collect(const char* who) const;
  /// Splits a group's entries into buckets of one (param dtype, grad dtype).
  static std::vector<std::vector<Entry>> buckets(const std::vector<Entry>& entries);
  /// `t` on `device` (a copy only when it lives elsewhere), or undefined.
  static at::Tensor on(const at::Tensor& t, c10::Device device);
  /// Reads a found-inf flag on the host (one synchronization): true when it is set.
  static bool found_inf_on_host(const at::Tensor& found_inf);

  /// One group's share of a fused step: its index, parameters with gradients, their device, and
  /// the step's scaling tensors there (undefined where not scaling).
  struct Group {
    size_t index;
    const std::vector<Entry>& entries;
    c10::Device device;
    at::Tensor inv_scale;
    at::Tensor found_inf;
  };
  /// The fused step's skeleton, written once: `body(group)` for every group of `groups`
  /// (collect()'s, in order) that has parameters.
  template <class Body>
  static void for_each_group(const std::vector<std::vector<Entry>>& groups,
                             const GradScaling& scaling, const Body& body) {
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      if (groups[gi].empty()) continue;
      const c10::Device device = groups[gi].front().param.device();
      body(Group{gi, groups[gi], device, on(scaling.inv_scale, device),
                 on(scaling.found_inf, device)});
    }
  }

  /// The step a group's update is about to make, for optimizers that keep apex's one counter per
  /// group in their parameters' states: one past the largest step found there.
  template <class State>
  int64_t next_group_step(const std::vector<Entry>& entries) const {
    int64_t step = 0;
    for (const auto& e : entries) {
      auto it = state_.find(e.param.unsafeGetTensorImpl());
      if (it != state_.end()) step = std::max(step, static_cast<const State&>(*it->second).step());
    }
    return step + 1;
  }

  /// Options and parameter states parsed by load_python_state_dict.
  using LoadedOptions = std::vector<std::unique_ptr<torch::optim::OptimizerOptions>>;
  using LoadedStates =
      std::vector<std::pair<at::Tensor, std::unique_ptr<torch::optim::OptimizerParamState>>>;
  /// The checksum of the options and state as they are now.
  uint32_t state_checksum() const;
  void write_integrity(torch::serialize::OutputArchive& archive) const;
  void load_transaction(torch::serialize::InputArchive& archive, const std::function<void()>& read,
                        const std::function<void()>& after);

  /// Installs what load_python_state_dict parsed: each group's options, and the states replacing
  /// all current state (as Python's load_state_dict does).
  void replace_loaded_state(LoadedOptions options, LoadedStates states);

  /// The state of `param`, created by `init` when absent.
  template <class State, class Init>
  State& state_of(const at::Tensor& param, const Init& init) {
    auto& slot = state_[param.unsafeGetTensorImpl()];
    if (!slot) {
      auto s = std::make_unique<State>();
      init(*s);
      slot = std::move(s);
    }
    return static_cast<State&>(*slot);
  }
};

}  // namespace apex::optim
