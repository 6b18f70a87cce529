#include "apex/optim/fused_optimizer.h"

#include <ATen/core/grad_mode.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cstring>
#include <map>
#include <unordered_map>
#include <utility>

#include "bridge/bridge.h"
#include "common/archive.h"

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
  // Optimizers that decide a skip on the host (skips_without_sync() false) read the flag once,
  // here, for every group; a skipped step changes nothing but, under unscale_grads, the
  // gradients (GradScaler's contract: unscaled after the step, stepped or not). The others
  // decide on the device, where their kernels do the same.
  GradScaling s = scaling;
  bool skipped = false;
  if (s.found_inf.defined() && !skips_without_sync()) {
    skipped = found_inf_on_host(s.found_inf);
    s.found_inf = at::Tensor();
  }
  if (!skipped) {
    fused_step(s);
  } else if (s.unscale_grads && s.inv_scale.defined()) {
    for (auto& group : param_groups_) {
      for (auto& p : group.params()) {
        at::Tensor g = p.grad();
        if (g.defined() && !g.is_sparse()) g.mul_(s.inv_scale.to(g.device()));
      }
    }
  }
  // The kernels write through raw pointers; count the update as torch.optim's in-place ops do,
  // so that autograd and whoever watches the parameters (apex::amp) see that they changed (the
  // gradients too, when they were unscaled in place).
  const bool grads_written = scaling.unscale_grads && scaling.inv_scale.defined();
  for (auto& group : param_groups_) {
    for (auto& p : group.params()) {
      if (p.grad().defined() && !p.is_inference()) p.unsafeGetTensorImpl()->bump_version();
      if (grads_written && p.grad().defined() && !p.grad().is_inference()) {
        p.grad().unsafeGetTensorImpl()->bump_version();
      }
    }
  }
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
      TORCH_CHECK(bridge::same_memory_order(p.sizes(), g.strides(), p.strides()), who,
                  ": the gradient of parameter ", i, " of group ", gi, " has strides ", g.strides(),
                  " but the parameter has ", p.strides(),
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

namespace {

constexpr const char* kKindKey = "apex_kind";
constexpr const char* kChecksumKey = "apex_state_crc32";

template <class T>
uint32_t crc_of(const T& value, uint32_t crc) {
  return detail::crc32(&value, sizeof(value), crc);
}

}  // namespace

uint32_t FusedOptimizer::state_checksum() const {
  uint32_t crc = 0;
  for (const auto& group : param_groups_) {
    for (double v : option_values(group.options())) crc = crc_of(v, crc);
    for (const auto& p : group.params()) {
      auto it = state_.find(p.unsafeGetTensorImpl());
      const uint8_t present = it != state_.end() ? 1 : 0;
      crc = crc_of(present, crc);
      if (present == 0) continue;
      for (double v : state_values(*it->second)) crc = crc_of(v, crc);
      for (const at::Tensor& t : elementwise_state(*it->second)) {
        const uint8_t defined = t.defined() ? 1 : 0;
        crc = crc_of(defined, crc);
        if (defined == 0) continue;
        for (int64_t d : t.sizes()) crc = crc_of(d, crc);
        const at::Tensor c = t.to(at::kCPU).contiguous();
        crc = detail::crc32(c.data_ptr(), static_cast<size_t>(c.nbytes()), crc);
      }
    }
  }
  return crc;
}

void FusedOptimizer::write_integrity(torch::serialize::OutputArchive& archive) const {
  archive.write(kKindKey, c10::IValue(std::string(kind())));
  archive.write(kChecksumKey, c10::IValue(static_cast<int64_t>(state_checksum())));
}

void FusedOptimizer::load_transaction(torch::serialize::InputArchive& archive,
                                      const std::function<void()>& read,
                                      const std::function<void()>& after) {
  const std::string who = std::string(kind()) + "::load";
  c10::IValue kind_value;
  if (archive.try_read(kKindKey, kind_value)) {
    TORCH_CHECK(kind_value.isString() && kind_value.toStringRef() == kind(), who,
                ": the archive holds the state of a ",
                kind_value.isString() ? kind_value.toStringRef() : std::string("?"),
                ", expected a ", kind(), " state");
  }
  c10::IValue stored;
  const bool has_checksum = archive.try_read(kChecksumKey, stored);
  // Everything read below is put back if any check fails.
  std::vector<std::unique_ptr<torch::optim::OptimizerOptions>> options;
  for (const auto& g : param_groups_) options.push_back(g.options().clone());
  decltype(state_) state;
  for (const auto& [key, value] : state_) state[key] = value->clone();
  try {
    // LibTorch's loader only overwrites the states it finds: start from none, as Python's
    // load_state_dict does (stale states would also fail the checksum).
    state_.clear();
    try {
      read();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, who, ": the archive does not hold a ", kind(),
                  " state of this optimizer's parameters (", e.what_without_backtrace(), ")");
    }
    // A damaged archive can name one saved state for two parameters; LibTorch then leaves the
    // second without one (a moved-from entry).
    for (const auto& [key, value] : state_) {
      TORCH_CHECK(value != nullptr, who,
                  ": the archive is damaged: it gives one state to two parameters");
    }
    check_options();
    for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
      const auto& params = param_groups_[gi].params();
      for (size_t i = 0; i < params.size(); ++i) {
        auto it = state_.find(params[i].unsafeGetTensorImpl());
        if (it == state_.end()) continue;
        for (const at::Tensor& t : elementwise_state(*it->second)) {
          TORCH_CHECK(!t.defined() || t.sizes() == params[i].sizes(), who,
                      ": the loaded state of parameter ", i, " of group ", gi, " has shape ",
                      t.sizes(), " but the parameter has shape ", params[i].sizes(),
                      " (the archive belongs to another model)");
        }
      }
    }
    if (after) after();
    if (has_checksum) {
      const uint32_t actual = state_checksum();
      TORCH_CHECK(stored.isInt() && static_cast<uint32_t>(stored.toInt()) == actual, who,
                  ": the archive is corrupted: its options and state do not match their stored "
                  "CRC-32");
    }
  } catch (...) {
    for (size_t gi = 0; gi < options.size(); ++gi) {
      param_groups_[gi].set_options(std::move(options[gi]));
    }
    state_ = std::move(state);
    // Device copies of the state (FusedAdam's step counters) follow the restored state.
    if (after) after();
    throw;
  }
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
