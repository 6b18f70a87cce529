#include <apex/amp/loss_scaler.h>

#include "amp/unscale.h"

#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>

namespace apex::amp {
namespace {

int64_t int_entry(const StateDict& state, const std::string& key, int64_t fallback) {
  if (!state.contains(key)) return fallback;
  const auto& v = state.at(key);
  TORCH_CHECK(v.isInt(), "LossScaler::load_state_dict: '", key, "' must be an int, got ",
              v.tagKind());
  return v.toInt();
}

}  // namespace

LossScaler::LossScaler(LossScalerOptions options) : options_(std::move(options)) {
  const auto& o = options_;
  TORCH_CHECK(std::isfinite(o.init_scale()) && o.init_scale() > 0,
              "LossScaler: init_scale must be finite and > 0, got ", o.init_scale());
  TORCH_CHECK(o.growth_factor() > 1.0 && std::isfinite(o.growth_factor()),
              "LossScaler: growth_factor must be > 1, got ", o.growth_factor());
  TORCH_CHECK(o.backoff_factor() > 0.0 && o.backoff_factor() < 1.0,
              "LossScaler: backoff_factor must be in (0, 1), got ", o.backoff_factor());
  TORCH_CHECK(o.growth_interval() >= 1, "LossScaler: growth_interval must be >= 1, got ",
              o.growth_interval());
  TORCH_CHECK(o.hysteresis() >= 1, "LossScaler: hysteresis must be >= 1, got ", o.hysteresis());
  TORCH_CHECK(std::isfinite(o.max_scale()) && o.max_scale() > 0,
              "LossScaler: max_scale must be finite and > 0, got ", o.max_scale());
  if (o.min_scale()) {
    TORCH_CHECK(
        std::isfinite(*o.min_scale()) && *o.min_scale() > 0 && *o.min_scale() <= o.max_scale(),
        "LossScaler: min_scale must be in (0, max_scale=", o.max_scale(), "], got ",
        *o.min_scale());
  }
  // apex starts a dynamic scaler at min(max_loss_scale, init); a static scale is taken as given.
  scale_ = o.dynamic() ? std::min(o.max_scale(), o.init_scale()) : o.init_scale();
  if (o.dynamic() && o.min_scale()) scale_ = std::max(scale_, *o.min_scale());
  hysteresis_left_ = o.hysteresis();
}

bool LossScaler::update(bool found_inf) {
  if (!options_.dynamic()) return found_inf;
  if (found_inf) {
    unskipped_ = 0;
    hysteresis_left_ -= 1;
    if (hysteresis_left_ <= 0) {
      scale_ *= options_.backoff_factor();
      if (options_.min_scale()) scale_ = std::max(scale_, *options_.min_scale());
      // Stay at zero tolerance until a growth restores the budget (Megatron's behaviour).
      hysteresis_left_ = 0;
    }
    return true;
  }
  unskipped_ += 1;
  if (unskipped_ == options_.growth_interval()) {
    scale_ = std::min(scale_ * options_.growth_factor(), options_.max_scale());
    unskipped_ = 0;
    hysteresis_left_ = options_.hysteresis();
  }
  return false;
}

void LossScaler::unscale_(const std::vector<at::Tensor>& grads,
                          std::vector<at::Tensor>& found_inf_per_device) const {
  // The reciprocal is taken in double and rounded once to fp32, as torch's GradScaler does.
  const at::Tensor inv = at::full({1}, 1.0 / scale_, at::TensorOptions().dtype(at::kFloat));
  detail::check_and_unscale_(grads, inv, found_inf_per_device);
}

StateDict LossScaler::state_dict() const {
  StateDict d = make_state_dict();
  d.insert("loss_scale", scale_);
  d.insert("unskipped", unskipped_);
  d.insert("hysteresis_left", hysteresis_left_);
  return d;
}

void LossScaler::load_state_dict(const StateDict& state) {
  for (const auto& entry : state) {
    const auto& key = entry.key().toStringRef();
    TORCH_CHECK(key == "loss_scale" || key == "unskipped" || key == "hysteresis_left",
                "LossScaler::load_state_dict: unexpected key '", key,
                "'; expected loss_scale, unskipped, hysteresis_left");
  }
  TORCH_CHECK(state.contains("loss_scale"), "LossScaler::load_state_dict: missing 'loss_scale'");
  const auto& v = state.at("loss_scale");
  TORCH_CHECK(v.isDouble() || v.isInt(),
              "LossScaler::load_state_dict: 'loss_scale' must be a number, got ", v.tagKind());
  const double scale = v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
  TORCH_CHECK(std::isfinite(scale) && scale > 0,
              "LossScaler::load_state_dict: loss_scale must be finite and > 0, got ", scale);
  const int64_t unskipped = int_entry(state, "unskipped", 0);
  const int64_t hysteresis_left = int_entry(state, "hysteresis_left", options_.hysteresis());
  if (options_.dynamic()) {
    // A dynamic scale never leaves [min_scale, max_scale], nor its counters their ranges: a value
    // outside them was not written by a scaler with these options.
    const double floor = options_.min_scale().value_or(0.0);
    TORCH_CHECK(scale <= options_.max_scale() && scale >= floor,
                "LossScaler::load_state_dict: loss_scale ", scale, " is outside [",
                floor > 0 ? floor : 0.0, ", max_scale=", options_.max_scale(),
                "] of this dynamic scaler");
    TORCH_CHECK(unskipped >= 0 && unskipped < options_.growth_interval(),
                "LossScaler::load_state_dict: unskipped must be in [0, growth_interval=",
                options_.growth_interval(), "), got ", unskipped);
    TORCH_CHECK(hysteresis_left >= 0 && hysteresis_left <= options_.hysteresis(),
                "LossScaler::load_state_dict: hysteresis_left must be in [0, hysteresis=",
                options_.hysteresis(), "], got ", hysteresis_left);
  } else {
    TORCH_CHECK(unskipped >= 0, "LossScaler::load_state_dict: unskipped must be >= 0, got ",
                unskipped);
    TORCH_CHECK(hysteresis_left >= 0,
                "LossScaler::load_state_dict: hysteresis_left must be >= 0, got ", hysteresis_left);
  }
  scale_ = scale;
  unskipped_ = unskipped;
  hysteresis_left_ = hysteresis_left;
}

}  // namespace apex::amp
