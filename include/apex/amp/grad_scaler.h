#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <apex/state_dict.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace torch::optim {
class Optimizer;
}
namespace apex::optim {
class FusedOptimizer;
}

namespace apex::amp {

/// Options of `GradScaler`, with `torch.amp.GradScaler`'s defaults.
struct GradScalerOptions {
  /// Device type the scaler serves. A CUDA scaler without CUDA warns and disables itself.
  TORCH_ARG(c10::DeviceType, device) = c10::kCUDA;
  TORCH_ARG(double, init_scale) = 65536.0;
  TORCH_ARG(double, growth_factor) = 2.0;
  TORCH_ARG(double, backoff_factor) = 0.5;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(bool, enabled) = true;
};

/// `torch.amp.GradScaler` for C++: same API, same state machine, same errors, same state_dict keys.
///
///   apex::amp::GradScaler scaler(GradScalerOptions().device(c10::kCPU));
///   scaler.scale(loss).backward();
///   scaler.step(optimizer);   // skipped when a gradient is inf/NaN
///   scaler.update();
///
/// The scale and growth tracker live on the device (`at::_amp_update_scale_`); `step` reads the
/// found-inf flag once (one host synchronization), exactly as torch's non-fused path does.
class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  /// `outputs * scale`; the scale tensor is created on the first call, on `outputs`' device.
  /// Returns `outputs` unchanged when disabled.
  at::Tensor scale(const at::Tensor& outputs);
  std::vector<at::Tensor> scale(const std::vector<at::Tensor>& outputs);

  /// Divides `optimizer`'s gradients by the scale in place and records whether any is inf/NaN.
  /// Errors if called twice before `update()`, after `step()`, or on fp16 gradients.
  void unscale_(torch::optim::Optimizer& optimizer);

  /// Unscales (if not yet done) and calls `optimizer.step()` unless a gradient was inf/NaN.
  /// Returns what `step()` returned, or nullopt when the step was skipped.
  ///
  /// An `apex::optim::FusedOptimizer` gets torch's fused protocol instead: the gradients are only
  /// checked (not written), the kernel unscales them, and an overflow is skipped on the device
  /// with no host synchronization (FusedAdam, FusedSGD). The return value then holds what
  /// `step()` returned whether or not the device skipped the update.
  std::optional<at::Tensor> step(torch::optim::Optimizer& optimizer);

  /// Updates the scale from this iteration's inf checks (backoff on inf, growth after
  /// `growth_interval` clean steps), or sets it to `new_scale` when given.
  void update(std::optional<double> new_scale = std::nullopt);
  /// Sets the scale to a one-element fp32 tensor's value.
  void update(const at::Tensor& new_scale);

  /// Current scale (1.0 when disabled; `init_scale` before the first `scale()`). Synchronizes.
  double get_scale() const;
  double get_growth_factor() const { return growth_factor_; }
  void set_growth_factor(double v);
  double get_backoff_factor() const { return backoff_factor_; }
  void set_backoff_factor(double v);
  int64_t get_growth_interval() const { return growth_interval_; }
  void set_growth_interval(int64_t v);
  bool is_enabled() const { return enabled_; }

  /// `{"scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker"}` as
  /// Python floats and ints, so Python's `GradScaler.load_state_dict(torch.load(f))` accepts it.
  /// Empty when disabled.
  StateDict state_dict() const;
  /// Loads `state_dict()` output (C++'s or Python's). Rejects an empty dict, missing keys and a
  /// scale that is not finite and > 0; on error nothing changes.
  void load_state_dict(const StateDict& state);
  /// Writes `state_dict()` as a `torch.save`-compatible file (readable with weights_only=True).
  void save(const std::string& path) const;
  /// Reads a file written by `save()` or by Python's `torch.save(scaler.state_dict(), path)`.
  void load(const std::string& path);

 private:
  enum class Stage { kReady, kUnscaled, kStepped };
  struct OptimizerState {
    Stage stage = Stage::kReady;
    std::vector<at::Tensor> found_inf_per_device;
  };

  void lazy_init_scale_growth_tracker(c10::Device device);
  OptimizerState& state_of(const torch::optim::Optimizer& optimizer);
  void unscale_grads(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale,
                     bool allow_fp16, OptimizerState& state) const;
  void check_scale_initialized(const char* fn) const;
  at::Tensor inv_scale() const;
  std::optional<at::Tensor> fused_step(apex::optim::FusedOptimizer& optimizer,
                                       OptimizerState& state);

  c10::DeviceType device_;
  bool enabled_;
  double init_scale_;
  double growth_factor_;
  double backoff_factor_;
  int64_t growth_interval_;
  int64_t init_growth_tracker_ = 0;
  at::Tensor scale_;           // fp32, one element, lazily created
  at::Tensor growth_tracker_;  // int32, one element
  std::unordered_map<const torch::optim::Optimizer*, OptimizerState> per_optimizer_;
};

}  // namespace apex::amp
