#include <apex/amp/grad_scaler.h>

#include "amp/unscale.h"
#include "common/io.h"

#include <ATen/ops/_amp_update_scale.h>
#include <ATen/ops/full.h>
#include <apex/io.h>
#include <apex/optim/fused_optimizer.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>
#include <torch/optim/optimizer.h>

#include <cmath>

namespace apex::amp {

using apex::optim::GradScaling;

namespace {

double number_entry(const StateDict& state, const char* key) {
  TORCH_CHECK(state.contains(key), "GradScaler::load_state_dict: missing key '", key, "'");
  const auto& v = state.at(key);
  TORCH_CHECK(v.isDouble() || v.isInt(), "GradScaler::load_state_dict: '", key,
              "' must be a number, got ", v.tagKind());
  return v.isDouble() ? v.toDouble() : static_cast<double>(v.toInt());
}

int64_t int_entry(const StateDict& state, const char* key) {
  TORCH_CHECK(state.contains(key), "GradScaler::load_state_dict: missing key '", key, "'");
  const auto& v = state.at(key);
  TORCH_CHECK(v.isInt(), "GradScaler::load_state_dict: '", key, "' must be an int, got ",
              v.tagKind());
  return v.toInt();
}

void check_factors(double growth, double backoff, int64_t interval) {
  TORCH_CHECK(growth > 1.0 && std::isfinite(growth),
              "GradScaler: the growth factor must be > 1.0, got ", growth);
  TORCH_CHECK(backoff > 0.0 && backoff < 1.0,
              "GradScaler: the backoff factor must be in (0, 1.0), got ", backoff);
  TORCH_CHECK(interval >= 1, "GradScaler: growth_interval must be >= 1, got ", interval);
}

}  // namespace

GradScaler::GradScaler(GradScalerOptions options)
    : device_(options.device()),
      enabled_(options.enabled()),
      init_scale_(options.init_scale()),
      growth_factor_(options.growth_factor()),
      backoff_factor_(options.backoff_factor()),
      growth_interval_(options.growth_interval()) {
  TORCH_CHECK(std::isfinite(init_scale_) && init_scale_ > 0,
              "GradScaler: init_scale must be finite and > 0, got ", init_scale_);
  check_factors(growth_factor_, backoff_factor_, growth_interval_);
  if (enabled_ && device_ == c10::kCUDA && !torch::cuda::is_available()) {
    TORCH_WARN("GradScaler is enabled for CUDA, but CUDA is not available. Disabling.");
    enabled_ = false;
  }
}

void GradScaler::lazy_init_scale_growth_tracker(c10::Device device) {
  TORCH_INTERNAL_ASSERT(!growth_tracker_.defined(), "growth tracker initialized before scale");
  scale_ = at::full({}, init_scale_, at::TensorOptions().dtype(at::kFloat).device(device));
  growth_tracker_ =
      at::full({}, init_growth_tracker_, at::TensorOptions().dtype(at::kInt).device(device));
}

at::Tensor GradScaler::inv_scale() const {
  // Reciprocal in double, rounded once to fp32 (as torch does).
  return scale_.to(at::kDouble).reciprocal().to(at::kFloat);
}

void GradScaler::check_scale_initialized(const char* fn) const {
  TORCH_CHECK(scale_.defined(), "GradScaler: attempted ", fn,
              "() but the scale is not initialized; call scale(loss) earlier in the iteration");
}

at::Tensor GradScaler::scale(const at::Tensor& outputs) {
  if (!enabled_) return outputs;
  TORCH_CHECK(outputs.defined(), "GradScaler::scale: outputs is an undefined tensor");
  if (!scale_.defined()) lazy_init_scale_growth_tracker(outputs.device());
  return outputs * scale_.to(outputs.device(), /*non_blocking=*/true);
}

std::vector<at::Tensor> GradScaler::scale(const std::vector<at::Tensor>& outputs) {
  std::vector<at::Tensor> out;
  out.reserve(outputs.size());
  for (const auto& t : outputs) out.push_back(scale(t));
  return out;
}

GradScaler::OptimizerState& GradScaler::state_of(const torch::optim::Optimizer& optimizer) {
  return per_optimizer_[&optimizer];
}

void GradScaler::unscale_grads(torch::optim::Optimizer& optimizer, const at::Tensor& inv_scale,
                               bool allow_fp16, OptimizerState& state) const {
  std::vector<at::Tensor> grads;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      at::Tensor& g = p.mutable_grad();
      if (!g.defined()) continue;
      TORCH_CHECK(allow_fp16 || g.scalar_type() != at::kHalf,
                  "GradScaler::unscale_: attempting to unscale FP16 gradients (shape ", g.sizes(),
                  "); keep fp32 master parameters, e.g. apex::amp O2 or an fp32 model");
      if (g.is_sparse()) {
        // fp16 sparse values may overflow when duplicates are summed later: coalesce first.
        if (g.scalar_type() == at::kHalf) g = g.coalesce();
        grads.push_back(g._values());
      } else {
        grads.push_back(g);
      }
    }
  }
  detail::check_and_unscale_(grads, inv_scale, state.found_inf_per_device);
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return;
  check_scale_initialized("unscale_");
  auto& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kUnscaled,
              "GradScaler::unscale_() has already been called on this optimizer since the last "
              "update()");
  TORCH_CHECK(state.stage != Stage::kStepped,
              "GradScaler::unscale_() is being called after step(); call update() first");
  OptimizerState staged{Stage::kReady, {}};
  if (auto* own = dynamic_cast<apex::optim::ScaledGradients*>(&optimizer)) {
    staged.found_inf_per_device = {own->unscale_grads(inv_scale())};
  } else {
    unscale_grads(optimizer, inv_scale(), /*allow_fp16=*/false, staged);
  }
  state.found_inf_per_device = std::move(staged.found_inf_per_device);
  state.stage = Stage::kUnscaled;
}

std::optional<at::Tensor> GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!enabled_) return optimizer.step();
  check_scale_initialized("step");
  auto& state = state_of(optimizer);
  TORCH_CHECK(state.stage != Stage::kStepped,
              "GradScaler::step() has already been called since the last update()");
  if (auto* fused = dynamic_cast<apex::optim::FusedOptimizer*>(&optimizer)) {
    return fused_step(*fused, state);
  }
  if (auto* own = dynamic_cast<apex::optim::ScaledGradients*>(&optimizer)) {
    // It finds overflow itself (its gradients are not in p.grad): the kernel unscales, unless
    // unscale_() did already.
    const at::Tensor found =
        own->scaled_step(state.stage == Stage::kReady ? inv_scale() : at::Tensor());
    state.found_inf_per_device = {found.to(scale_.device())};
    state.stage = Stage::kStepped;
    if (found.item<float>() != 0.0f) return std::nullopt;
    return at::Tensor();
  }
  if (state.stage == Stage::kReady) unscale_(optimizer);
  TORCH_CHECK(!state.found_inf_per_device.empty(),
              "GradScaler::step: no inf checks were recorded for this optimizer (no parameter "
              "has a gradient; did backward run?)");
  // The one host synchronization of the step.
  const bool found_inf =
      detail::sum_flags(state.found_inf_per_device, scale_.device()).item<float>() != 0.0f;
  std::optional<at::Tensor> result;
  if (!found_inf) result = optimizer.step();
  state.stage = Stage::kStepped;
  return result;
}

std::optional<at::Tensor> GradScaler::fused_step(apex::optim::FusedOptimizer& optimizer,
                                                 OptimizerState& state) {
  // torch's protocol for optimizers that support amp scaling: the gradients are only read here
  // (no unscale pass), and the kernel unscales them and skips on overflow by itself.
  GradScaling scaling;
  if (state.stage == Stage::kReady) {
    std::vector<at::Tensor> grads;
    for (auto& group : optimizer.param_groups()) {
      for (auto& p : group.params()) {
        if (p.grad().defined() && !p.grad().is_sparse()) grads.push_back(p.grad());
      }
    }
    detail::check_finite_(grads, state.found_inf_per_device);
    scaling.inv_scale = inv_scale();
    // torch's contract: p.grad unscaled after step(), whether the step ran or was skipped.
    scaling.unscale_grads = true;
  }
  TORCH_CHECK(!state.found_inf_per_device.empty(),
              "GradScaler::step: no inf checks were recorded for this optimizer (no parameter "
              "has a gradient; did backward run?)");
  scaling.found_inf = detail::sum_flags(state.found_inf_per_device, scale_.device());
  std::optional<at::Tensor> result;
  if (optimizer.skips_without_sync()) {
    result = optimizer.step(scaling);
  } else if (scaling.found_inf.item<float>() == 0.0f) {
    // Optimizers that read the flag on the host anyway: read it once here instead.
    result = optimizer.step(GradScaling{scaling.inv_scale, at::Tensor(), scaling.unscale_grads});
  } else if (scaling.unscale_grads) {
    optimizer.step(scaling);  // skipped: only unscales the gradients (FusedOptimizer::step)
  }
  state.stage = Stage::kStepped;
  return result;
}

void GradScaler::update(std::optional<double> new_scale) {
  if (!enabled_) return;
  check_scale_initialized("update");
  if (new_scale) {
    TORCH_CHECK(std::isfinite(*new_scale) && *new_scale > 0,
                "GradScaler::update: new_scale must be finite and > 0, got ", *new_scale);
    scale_.fill_(*new_scale);
  } else {
    std::vector<at::Tensor> all;
    for (auto& [opt, st] : per_optimizer_) {
      all.insert(all.end(), st.found_inf_per_device.begin(), st.found_inf_per_device.end());
    }
    TORCH_CHECK(!all.empty(),
                "GradScaler::update: no inf checks were recorded prior to update() (call "
                "step(optimizer) or unscale_(optimizer) first)");
    at::_amp_update_scale_(scale_, growth_tracker_, detail::sum_flags(all, scale_.device()),
                           growth_factor_, backoff_factor_, growth_interval_);
  }
  per_optimizer_.clear();
}

void GradScaler::update(const at::Tensor& new_scale) {
  if (!enabled_) return;
  check_scale_initialized("update");
  TORCH_CHECK(
      new_scale.numel() == 1 && new_scale.device().type() == device_ && !new_scale.requires_grad(),
      "GradScaler::update: new_scale should be a float or a one-element tensor on ", device_,
      " with requires_grad=false; got shape ", new_scale.sizes(), " on ", new_scale.device());
  scale_.copy_(new_scale.reshape({}));
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!enabled_) return 1.0;
  return scale_.defined() ? scale_.item<double>() : init_scale_;
}

void GradScaler::set_growth_factor(double v) {
  check_factors(v, backoff_factor_, growth_interval_);
  growth_factor_ = v;
}
void GradScaler::set_backoff_factor(double v) {
  check_factors(growth_factor_, v, growth_interval_);
  backoff_factor_ = v;
}
void GradScaler::set_growth_interval(int64_t v) {
  check_factors(growth_factor_, backoff_factor_, v);
  growth_interval_ = v;
}

StateDict GradScaler::state_dict() const {
  StateDict d = make_state_dict();
  if (!enabled_) return d;
  d.insert("scale", get_scale());
  d.insert("growth_factor", growth_factor_);
  d.insert("backoff_factor", backoff_factor_);
  d.insert("growth_interval", growth_interval_);
  d.insert("_growth_tracker",
           growth_tracker_.defined() ? growth_tracker_.item<int64_t>() : init_growth_tracker_);
  return d;
}

void GradScaler::load_state_dict(const StateDict& state) {
  if (!enabled_) return;
  TORCH_CHECK(state.size() > 0,
              "GradScaler::load_state_dict: the source state dict is empty, possibly because it "
              "was saved from a disabled GradScaler");
  const double scale = number_entry(state, "scale");
  const double growth = number_entry(state, "growth_factor");
  const double backoff = number_entry(state, "backoff_factor");
  const int64_t interval = int_entry(state, "growth_interval");
  const int64_t tracker = int_entry(state, "_growth_tracker");
  TORCH_CHECK(std::isfinite(scale) && scale > 0,
              "GradScaler::load_state_dict: scale must be finite and > 0, got ", scale);
  check_factors(growth, backoff, interval);
  TORCH_CHECK(tracker >= 0, "GradScaler::load_state_dict: _growth_tracker must be >= 0, got ",
              tracker);
  init_scale_ = scale;
  if (scale_.defined()) scale_.fill_(scale);
  growth_factor_ = growth;
  backoff_factor_ = backoff;
  growth_interval_ = interval;
  init_growth_tracker_ = tracker;
  if (growth_tracker_.defined()) growth_tracker_.fill_(tracker);
}

void GradScaler::save(const std::string& path) const {
  const auto bytes = apex::detail::pickle_save(state_dict(), "grad_scaler");
  apex::write_file_atomic(path, std::string_view(bytes.data(), bytes.size()));
}

void GradScaler::load(const std::string& path) {
  const c10::IValue v = apex::detail::load_state_file(
      path, "grad_scaler", "GradScaler::load",
      "a GradScaler state (GradScaler::save, or Python's GradScaler.state_dict() saved by "
      "torch.save)");
  TORCH_CHECK(v.isGenericDict(), "GradScaler::load: '", path,
              "' does not hold a dict (expected GradScaler.state_dict()), got ", v.tagKind());
  StateDict d = make_state_dict();
  for (const auto& e : v.toGenericDict()) {
    TORCH_CHECK(e.key().isString(), "GradScaler::load: '", path, "' has a non-string key");
    d.insert(e.key().toStringRef(), e.value());
  }
  TORCH_CHECK(!d.contains("loss_scaler0"), "GradScaler::load: '", path,
              "' holds an Amp state (keys loss_scaler0, ...), expected a GradScaler state (keys "
              "scale, growth_factor, ...)");
  TORCH_CHECK(!d.contains("param_groups"), "GradScaler::load: '", path,
              "' holds an optimizer state (keys state, param_groups), expected a GradScaler "
              "state (keys scale, growth_factor, ...)");
  load_state_dict(d);
}

}  // namespace apex::amp
