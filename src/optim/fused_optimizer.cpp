#include "apex/optim/fused_optimizer.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>

#include <map>
#include <unordered_map>
#include <utility>

#include "bridge/bridge.h"

namespace apex::optim {

FusedOptimizer::FusedOptimizer(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                               std::unique_ptr<torch::optim::OptimizerOptions> defaults)
    : torch::optim::Optimizer(param_groups, std::move(defaults)) {
  // LibTorch merges a group's options with the defaults only for its own optimizer types and
  // silently uses the defaults for any other: put the user's options back.
  for (size_t i = 0; i < param_groups.size(); ++i) {
    if (param_groups[i].has_options()) {
      param_groups_[i].set_options(param_groups[i].options().clone());
    }
  }
}

void FusedOptimizer::add_param_group(const torch::optim::OptimizerParamGroup& param_group) {
  torch::optim::Optimizer::add_param_group(param_group);
  if (param_group.has_options()) {
    param_groups_.back().set_options(param_group.options().clone());
  }
}

torch::Tensor FusedOptimizer::step(LossClosure closure) { return step(GradScaling{}, closure); }

torch::Tensor FusedOptimizer::step(const GradScaling& scaling, LossClosure closure) {
  for (const auto* t : {&scaling.inv_scale, &scaling.found_inf}) {
    TORCH_CHECK(!t->defined() || (t->numel() == 1 && t->scalar_type() == at::kFloat),
                "FusedOptimizer::step: ", t == &scaling.inv_scale ? "inv_scale" : "found_inf",
                " must be a one-element float32 tensor, got ", t->scalar_type(), " with ",
                t->numel(), " elements");
  }
  torch::Tensor loss;
  if (closure != nullptr) {
    const at::AutoGradMode enable_grad(true);
    loss = closure();
  }
  const at::NoGradGuard no_grad;
  fused_step(scaling);
  return loss;
}

void FusedOptimizer::zero_grad() { torch::optim::Optimizer::zero_grad(set_grad_none()); }

StateDict FusedOptimizer::python_state_dict() const {
  TORCH_CHECK(false, "python_state_dict: this optimizer has no torch.optim counterpart");
}

void FusedOptimizer::load_python_state_dict(const StateDict& /*state*/) {
  TORCH_CHECK(false, "load_python_state_dict: this optimizer has no torch.optim counterpart");
}

std::vector<std::vector<FusedOptimizer::Entry>> FusedOptimizer::collect(const char* who) const {
  std::vector<std::vector<Entry>> out(param_groups_.size());
  std::unordered_map<const void*, std::pair<size_t, size_t>> seen;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& params = param_groups_[gi].params();
    std::optional<c10::Device> device;
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor& p = params[i];
      // The same tensor twice would be updated by two threads at once within one kernel call.
      const auto [it, fresh] = seen.emplace(p.unsafeGetTensorImpl(), std::make_pair(gi, i));
      TORCH_CHECK(fresh, who, ": parameter ", i, " of group ", gi,
                  " is the same tensor as parameter ", it->second.second, " of group ",
                  it->second.first, "; each parameter may appear only once");
      const at::Tensor& g = p.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), who, ": sparse gradients are not supported (parameter ", i,
                  " of group ", gi, ")");
      bridge::kernel_dtype(p, who);
      bridge::kernel_dtype(g, who);
      TORCH_CHECK(g.sizes() == p.sizes(), who, ": the gradient of parameter ", i, " of group ", gi,
                  " has shape ", g.sizes(), ", expected the parameter's shape ", p.sizes());
      TORCH_CHECK(g.device() == p.device(), who, ": the gradient of parameter ", i, " of group ",
                  gi, " is on ", g.device(), " but the parameter is on ", p.device());
      if (!device) device = p.device();
      TORCH_CHECK(p.device() == *device, who, ": all parameters of group ", gi,
                  " must be on one device, got ", *device, " and ", p.device(), " (parameter ", i,
                  ")");
      TORCH_CHECK(bridge::backend_available(p.device()), who, ": parameter ", i, " of group ", gi,
                  " is on ", p.device(), ", which this build of apex-cpp has no kernels for");
      TORCH_CHECK(p.is_non_overlapping_and_dense(), who, ": parameter ", i, " of group ", gi,
                  " must be dense (non-overlapping, no gaps)");
      TORCH_CHECK(g.strides() == p.strides(), who, ": the gradient of parameter ", i, " of group ",
                  gi, " has strides ", g.strides(), " but the parameter has ", p.strides(),
                  " (make the gradient contiguous like its parameter)");
      auto st = state_.find(p.unsafeGetTensorImpl());
      if (st != state_.end()) {
        for (const at::Tensor& t : elementwise_state(*st->second)) {
          TORCH_CHECK(!t.defined() || t.sizes() == p.sizes(), who, ": the state of parameter ", i,
                      " of group ", gi, " has shape ", t.sizes(), " but the parameter has shape ",
                      p.sizes(), " (was the state loaded from another model?)");
        }
      }
      out[gi].push_back({p, g});
    }
  }
  return out;
}

std::vector<std::vector<FusedOptimizer::Entry>> FusedOptimizer::buckets(
    const std::vector<Entry>& entries) {
  std::map<std::pair<int, int>, std::vector<Entry>> by_dtype;
  for (const auto& e : entries) {
    by_dtype[{static_cast<int>(e.param.scalar_type()), static_cast<int>(e.grad.scalar_type())}]
        .push_back(e);
  }
  std::vector<std::vector<Entry>> out;
  out.reserve(by_dtype.size());
  for (auto& [key, list] : by_dtype) out.push_back(std::move(list));
  return out;
}

void FusedOptimizer::replace_loaded_state(LoadedOptions options, LoadedStates states) {
  for (size_t gi = 0; gi < options.size(); ++gi) {
    param_groups_[gi].set_options(std::move(options[gi]));
  }
  state_.clear();
  for (auto& [p, st] : states) state_[p.unsafeGetTensorImpl()] = std::move(st);
}

bool FusedOptimizer::found_inf_on_host(const at::Tensor& found_inf) {
  return found_inf.defined() && found_inf.item<float>() != 0.0f;
}

at::Tensor FusedOptimizer::on(const at::Tensor& t, c10::Device device) {
  if (!t.defined() || t.device() == device) return t;
  // A CPU kernel dereferences these at once: only a copy to a device may be asynchronous.
  return t.to(device, /*non_blocking=*/!device.is_cpu());
}

}  // namespace apex::optim
