#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <apex/state_dict.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>

namespace apex::amp {

/// Options of a `LossScaler`. Defaults are apex's (and torch's): start at 2^16, double after 2000
/// clean steps, halve on overflow, never above 2^24.
///
///   LossScalerOptions().init_scale(1024).growth_interval(100).min_scale(1.0)
struct LossScalerOptions {
  /// Dynamic scaling (true) or a fixed scale equal to `init_scale` (false).
  TORCH_ARG(bool, dynamic) = true;
  /// First scale (dynamic) or the fixed scale (static). Must be finite and > 0.
  TORCH_ARG(double, init_scale) = 65536.0;
  /// Multiplier after `growth_interval` consecutive clean steps; must be > 1.
  TORCH_ARG(double, growth_factor) = 2.0;
  /// Multiplier on overflow; must be in (0, 1).
  TORCH_ARG(double, backoff_factor) = 0.5;
  /// Clean steps between two growths; must be >= 1.
  TORCH_ARG(int64_t, growth_interval) = 2000;
  /// Overflowing steps tolerated before the scale backs off (Megatron's hysteresis); 1 backs off
  /// on every overflow, as apex and torch do. Every overflowing step is skipped regardless.
  TORCH_ARG(int64_t, hysteresis) = 1;
  /// Optional floor; apex had none and users saw scales sink to 1e-205.
  TORCH_ARG(std::optional<double>, min_scale) = std::nullopt;
  /// Cap, as apex's `max_loss_scale`.
  TORCH_ARG(double, max_scale) = 16777216.0;
};

/// apex's loss scaler as a host-side state machine.
///
/// The state (scale, clean-step counter, hysteresis budget) lives on the host so that a step can be
/// fed with a plain bool (`update(found_inf)`) and tested without tensors. The device part, a fused
/// non-finite check and unscale over a gradient list, is `unscale_`; `apex::amp::Amp` reads the
/// device flag once per optimizer step and feeds the result here.
class LossScaler {
 public:
  explicit LossScaler(LossScalerOptions options = {});

  /// Current loss scale.
  double loss_scale() const { return scale_; }
  bool dynamic() const { return options_.dynamic(); }
  /// Consecutive clean steps since the last growth or overflow (apex's `_unskipped`).
  int64_t unskipped() const { return unskipped_; }
  /// Overflows still tolerated before the next backoff.
  int64_t hysteresis_left() const { return hysteresis_left_; }
  const LossScalerOptions& options() const { return options_; }

  /// Advances the state machine by one step. Returns true when the step must be skipped, which is
  /// whenever `found_inf` is true (static scalers skip too, but keep their scale).
  bool update(bool found_inf);

  /// Multiplies every gradient by 1/loss_scale in place and sets `found_inf` (a one-element fp32
  /// tensor on the gradients' device, or undefined: then one is created) to 1 if any element is
  /// inf or NaN. Gradients may sit on several devices; one flag is kept per device in
  /// `found_inf_per_device`. No host synchronization.
  void unscale_(const std::vector<at::Tensor>& grads,
                std::vector<at::Tensor>& found_inf_per_device) const;

  /// `{"loss_scale": float, "unskipped": int, "hysteresis_left": int}`: apex's keys plus ours.
  StateDict state_dict() const;
  /// Restores `state_dict()` output. The scale must be finite and > 0, counters >= 0; otherwise
  /// the scaler is left unchanged and an error names the bad value.
  void load_state_dict(const StateDict& state);

 private:
  LossScalerOptions options_;
  double scale_;
  int64_t unskipped_ = 0;
  int64_t hysteresis_left_;
};

}  // namespace apex::amp
