#pragma once

#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>
#include <torch/arg.h>

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

namespace apex::amp {

/// apex's optimization levels.
///  - O0: fp32 everywhere (the accuracy baseline).
///  - O1: weights stay fp32; autocast casts per op; dynamic loss scaling.
///  - O2: model cast to the half dtype except BatchNorm; fp32 master weights in the optimizer;
///        dynamic loss scaling.
///  - O3: everything in the half dtype; static scale 1.0 (the "speed of light" baseline).
enum class OptLevel { O0, O1, O2, O3 };

/// Parses "O0".."O3" (a clear error otherwise).
OptLevel parse_opt_level(std::string_view text);
/// "O0".."O3".
std::string to_string(OptLevel level);

/// A loss scale: dynamic, or a fixed number.
///
///   LossScale::dynamic(), LossScale(128.0), LossScale::parse("dynamic"), LossScale::parse("512")
class LossScale {
 public:
  /// A static scale; must be finite and > 0.
  LossScale(double value);  // NOLINT(google-explicit-constructor): mirrors apex's loss_scale=128.0
  static LossScale dynamic();
  /// "dynamic" or a positive number.
  static LossScale parse(std::string_view text);

  bool is_dynamic() const { return dynamic_; }
  /// The static value (1.0 for a dynamic scale, unused).
  double value() const { return value_; }
  bool operator==(const LossScale&) const = default;

 private:
  LossScale(bool dynamic, double value) : dynamic_(dynamic), value_(value) {}
  bool dynamic_;
  double value_;
};

/// Everything `initialize` takes besides models and optimizers. Unset overrides take the opt
/// level's defaults; set ones are validated the way apex validated them.
///
///   Options(OptLevel::O2).half_dtype(at::kBFloat16).loss_scale(LossScale::dynamic())
struct Options {
  /* implicit */ Options(OptLevel opt_level = OptLevel::O1);  // NOLINT

  TORCH_ARG(OptLevel, opt_level);
  /// false: `initialize` returns a pass-through handle (fp32, no scaling).
  TORCH_ARG(bool, enabled) = true;
  /// The lower precision used by O1's autocast and O2/O3's model cast: kHalf or kBFloat16.
  /// Unset: follows the models' device, as apex-train does: fp16 on CUDA (apex's default), bf16 on
  /// the CPU (fast there, natively or through apex's CPU half fallback, and it needs no loss
  /// scaling).
  TORCH_ARG(std::optional<c10::ScalarType>, half_dtype) = std::nullopt;
  /// Override: dtype the model is cast to (O2/O3 default: half_dtype; O0: fp32; O1: must be unset).
  TORCH_ARG(std::optional<c10::ScalarType>, cast_model_type) = std::nullopt;
  /// Override: autocast around the model (apex's name). Only O1 may enable it.
  TORCH_ARG(std::optional<bool>, patch_torch_functions) = std::nullopt;
  /// Override: keep affine BatchNorm in fp32 when the model is cast. Must be unset under O1.
  TORCH_ARG(std::optional<bool>, keep_batchnorm_fp32) = std::nullopt;
  /// Override: fp32 master copies of half parameters in the optimizer. Must be unset under O1.
  TORCH_ARG(std::optional<bool>, master_weights) = std::nullopt;
  /// Override: loss scale. Defaults: O0/O3 static 1.0; O1/O2 dynamic with fp16 and static 1.0
  /// with bf16 (bf16 has fp32's exponent range, so gradients do not underflow).
  TORCH_ARG(std::optional<LossScale>, loss_scale) = std::nullopt;
  /// dtype floating model outputs are cast to by `Amp::forward` (fp32 by default).
  TORCH_ARG(c10::ScalarType, cast_model_outputs) = c10::kFloat;
  /// Number of independent loss scalers (one per loss that is backpropagated separately).
  TORCH_ARG(int64_t, num_losses) = 1;
  /// Dynamic scaling: first scale, growth interval, hysteresis, floor and cap.
  TORCH_ARG(double, init_loss_scale) = 65536.0;
  TORCH_ARG(int64_t, growth_interval) = 2000;
  TORCH_ARG(int64_t, hysteresis) = 1;
  TORCH_ARG(std::optional<double>, min_loss_scale) = std::nullopt;
  TORCH_ARG(double, max_loss_scale) = 16777216.0;
  /// 0: silent; 1: the settings at initialize and one line on stderr per skipped step (apex's
  /// "Gradient overflow" message), printed by rank 0 of a distributed job only ($RANK unset or 0);
  /// 2: the same on every rank.
  TORCH_ARG(int, verbosity) = 1;
  /// For optimizers that are `apex::optim::FusedOptimizer`s and keep no master copies (O0 with a
  /// dynamic scale, O1, O3): leave the gradients scaled after `scale_loss` and let the optimizer
  /// unscale them inside its kernel, which saves one read-and-write pass over the gradients.
  /// Off by default because gradients read between backward and `step()` (clipping, logging) are
  /// then still multiplied by the loss scale. A second `scale_loss` before the step unscales the
  /// pending gradients first, so accumulation stays correct.
  TORCH_ARG(bool, unscale_in_optimizer) = false;
};

/// The concrete settings an opt level and its overrides resolve to (apex's `Properties`).
struct Properties {
  OptLevel opt_level = OptLevel::O1;
  bool enabled = true;
  c10::ScalarType half_dtype = c10::kHalf;
  /// nullopt: the model is not cast.
  std::optional<c10::ScalarType> cast_model_type;
  bool patch_torch_functions = false;
  bool keep_batchnorm_fp32 = false;
  bool master_weights = false;
  LossScale loss_scale = LossScale(1.0);
  c10::ScalarType cast_model_outputs = c10::kFloat;

  /// Resolves and validates `options` for models on `device` (which picks an unset half_dtype:
  /// see Options::half_dtype); errors name the offending override.
  static Properties resolve(const Options& options, c10::DeviceType device = c10::kCPU);
  /// The half dtype an unset Options::half_dtype resolves to for models on `device`.
  static c10::ScalarType default_half_dtype(c10::DeviceType device);
  /// A readable multi-line table, as apex printed at initialize.
  std::string describe() const;
};

}  // namespace apex::amp
