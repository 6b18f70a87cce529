#include "apex/optim/fused_adam.h"

#include <ATen/ops/clamp_max.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include "bridge/bridge.h"
#include "optim/archive.h"
#include "optim/python_state.h"
#include "optim/state.h"

namespace apex::optim {
namespace {

constexpr const char* kWho = "FusedAdam";

void validate(const FusedAdamOptions& o) {
  detail::check_adam_style(kWho, o);
  TORCH_CHECK(!o.amsgrad(),
              "FusedAdam: amsgrad is not supported (apex's FusedAdam rejects it "
              "too); use torch::optim::Adam with amsgrad(true)");
}

const FusedAdamOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const FusedAdamOptions&>(g.options());
}

}  // namespace

FusedAdamOptions::FusedAdamOptions(double lr) : lr_(lr) {}

void FusedAdamOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adam_w_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(amsgrad);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(set_grad_none);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(capturable);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedAdamOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adam_w_mode);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, amsgrad);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, set_grad_none);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, capturable);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedAdamParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedAdamParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedAdam::FusedAdam(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedAdamOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<FusedAdamOptions>(defaults)) {
  validate(defaults);
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<at::Tensor> FusedAdam::elementwise_state(
    const torch::optim::OptimizerParamState& state) const {
  const auto& s = static_cast<const FusedAdamParamState&>(state);
  return {s.exp_avg(), s.exp_avg_sq(), s.master_param()};
}

bool FusedAdam::set_grad_none() const {
  return static_cast<const FusedAdamOptions&>(defaults()).set_grad_none();
}

at::Tensor& FusedAdam::step_tensor(size_t group, c10::Device device) {
  if (steps_.size() <= group) steps_.resize(group + 1);
  at::Tensor& s = steps_[group];
  if (!s.defined()) {
    s = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  } else if (s.device() != device) {
    s = s.to(device);
  }
  return s;
}

at::Tensor FusedAdam::lr_tensor(size_t group) {
  TORCH_CHECK(group < param_groups_.size(), "FusedAdam::lr_tensor: group ", group,
              " out of range (", param_groups_.size(), " groups)");
  if (lrs_.size() <= group) lrs_.resize(group + 1);
  return lrs_[group];
}

int64_t FusedAdam::step_count(size_t group) const {
  if (group >= steps_.size() || !steps_[group].defined()) return 0;
  return static_cast<int64_t>(steps_[group].item<float>());
}

void FusedAdam::fused_step(const GradScaling& scaling) {
  check_options();
  for_each_group(collect(kWho), scaling, [&](const Group& g) {
    const size_t gi = g.index;
    const c10::Device device = g.device;
    const FusedAdamOptions& o = options_of(param_groups_[gi]);
    at::Tensor& step = step_tensor(gi, device);
    step.add_(1);
    kernels::AdamArgs args = detail::adam_args(o);
    args.step_ptr = step.data_ptr<float>();
    if (o.capturable()) {
      if (lrs_.size() <= gi) lrs_.resize(gi + 1);
      if (lr_seen_.size() <= gi) lr_seen_.resize(gi + 1, -1.0);
      at::Tensor& lr = lrs_[gi];
      if (!lr.defined() || lr.device() != device) {
        lr = at::full({1}, o.lr(), at::TensorOptions().dtype(at::kFloat).device(device));
        lr_seen_[gi] = o.lr();
      } else if (o.lr() != lr_seen_[gi]) {
        // A scheduler changed the options: that wins over the device value. Between graph
        // replays, write lr_tensor() instead.
        lr.fill_(o.lr());
        lr_seen_[gi] = o.lr();
      }
      args.lr_ptr = lr.data_ptr<float>();
    }
    args.amp = detail::amp_args(device, g.inv_scale, scaling.unscale_grads, g.found_inf, kWho);
    for (const auto& bucket : buckets(g.entries)) {
      const bool master = o.master_weights() && bucket.front().param.scalar_type() != at::kFloat;
      bridge::ListBuilder lists(5);
      for (const auto& e : bucket) {
        auto& s = state_of<FusedAdamParamState>(e.param, [&](FusedAdamParamState& st) {
          st.exp_avg(detail::zeros_state(e.param));
          st.exp_avg_sq(detail::zeros_state(e.param));
        });
        s.exp_avg(detail::conform_state(s.exp_avg(), e.param));
        s.exp_avg_sq(detail::conform_state(s.exp_avg_sq(), e.param));
        if (master) {
          s.master_param(detail::ensure_master(s.master_param(), e.param));
        }
        lists.add({e.param, e.grad, s.exp_avg(), s.exp_avg_sq(),
                   master ? s.master_param() : at::Tensor()});
      }
      const auto view = lists.view();
      bridge::launch(device, kernels::cpu::adam, kernels::cuda::adam, view, args);
    }
    // A skipped step does not count (found_inf may hold a sum of per-device flags).
    if (g.found_inf.defined()) step.sub_(at::clamp_max(g.found_inf, 1.0));
  });
}

void FusedAdam::sync_steps_to_state() const {
  for (size_t gi = 0; gi < param_groups_.size() && gi < steps_.size(); ++gi) {
    if (!steps_[gi].defined()) continue;
    const auto n = static_cast<int64_t>(steps_[gi].item<float>());
    for (const auto& p : param_groups_[gi].params()) {
      auto it = state_.find(p.unsafeGetTensorImpl());
      if (it != state_.end()) static_cast<FusedAdamParamState&>(*it->second).step(n);
    }
  }
}

void FusedAdam::sync_steps_from_state() {
  steps_.assign(param_groups_.size(), at::Tensor());
  lrs_.clear();
  lr_seen_.clear();
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    int64_t n = -1;
    c10::Device device = c10::kCPU;
    for (const auto& p : param_groups_[gi].params()) {
      auto it = state_.find(p.unsafeGetTensorImpl());
      if (it == state_.end()) continue;
      n = std::max(n, static_cast<FusedAdamParamState&>(*it->second).step());
      device = p.device();
    }
    if (n >= 0) {
      steps_[gi] = at::full({1}, static_cast<double>(n),
                            at::TensorOptions().dtype(at::kFloat).device(device));
    }
  }
}

void FusedAdam::save(torch::serialize::OutputArchive& archive) const {
  sync_steps_to_state();
  save_archive<FusedAdamParamState, FusedAdamOptions>(archive);
}

void FusedAdam::load(torch::serialize::InputArchive& archive) {
  // The counters live on the device: into the state first, so that the restored state holds
  // them; the device tensors themselves (which lr_tensor() handed out) are put back on failure.
  sync_steps_to_state();
  auto steps = steps_;
  auto lrs = lrs_;
  auto lr_seen = lr_seen_;
  try {
    load_archive<FusedAdamParamState, FusedAdamOptions>(archive, [&] { sync_steps_from_state(); });
  } catch (...) {
    steps_ = std::move(steps);
    lrs_ = std::move(lrs);
    lr_seen_ = std::move(lr_seen);
    throw;
  }
}

void FusedAdam::check_options() const {
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<double> FusedAdam::option_values(const torch::optim::OptimizerOptions& options) const {
  const auto& o = static_cast<const FusedAdamOptions&>(options);
  return {static_cast<double>(o.lr()),
          std::get<0>(o.betas()),
          std::get<1>(o.betas()),
          static_cast<double>(o.eps()),
          static_cast<double>(o.weight_decay()),
          static_cast<double>(o.adam_w_mode()),
          static_cast<double>(o.bias_correction()),
          static_cast<double>(o.amsgrad()),
          static_cast<double>(o.set_grad_none()),
          static_cast<double>(o.capturable()),
          static_cast<double>(o.master_weights())};
}

std::vector<double> FusedAdam::state_values(const torch::optim::OptimizerParamState& state) const {
  return {static_cast<double>(static_cast<const FusedAdamParamState&>(state).step())};
}

StateDict FusedAdam::python_state_dict() const {
  sync_steps_to_state();
  return detail::write_python_layout(
      *this,
      [&](const at::Tensor& p) -> std::optional<StateDict> {
        auto it = state_.find(p.unsafeGetTensorImpl());
        if (it == state_.end()) return std::nullopt;
        const auto& s = static_cast<const FusedAdamParamState&>(*it->second);
        StateDict d = make_state_dict();
        d.insert("step", detail::step_tensor_value(static_cast<double>(s.step())));
        d.insert("exp_avg", s.exp_avg().cpu());
        d.insert("exp_avg_sq", s.exp_avg_sq().cpu());
        return d;
      },
      [&](size_t gi) { return detail::torch_adam_group(options_of(param_groups_[gi])); });
}

void FusedAdam::load_python_state_dict(const StateDict& layout) {
  constexpr const char* who = "FusedAdam::load_python_state_dict";
  // Parse into new objects first: a malformed file leaves the optimizer as it was.
  LoadedOptions opts;
  LoadedStates states;
  detail::read_python_layout(
      *this, layout, who,
      [&](size_t gi, const StateDict& g) {
        auto o = std::make_unique<FusedAdamOptions>(options_of(param_groups_[gi]));
        o->lr(detail::number_at(g, "lr", who));
        TORCH_CHECK(g.contains("betas") && g.at("betas").isTuple(), who,
                    ": 'betas' must be a tuple");
        const auto& b = g.at("betas").toTupleRef().elements();
        TORCH_CHECK(b.size() == 2, who, ": 'betas' must have two elements, got ", b.size());
        auto beta = [&](size_t k) {
          const c10::IValue& v = b[k];
          if (v.isDouble()) return v.toDouble();
          if (v.isInt()) return static_cast<double>(v.toInt());
          TORCH_CHECK(v.isTensor() && v.toTensor().numel() == 1, who, ": betas[", k,
                      "] must be a number, got ", v.tagKind());
          return v.toTensor().item<double>();
        };
        o->betas({beta(0), beta(1)});
        o->eps(detail::number_at(g, "eps", who));
        o->weight_decay(detail::number_at(g, "weight_decay", who));
        TORCH_CHECK(!detail::bool_or(g, "amsgrad", false), who,
                    ": the state uses amsgrad, which FusedAdam does not support");
        o->adam_w_mode(detail::bool_or(g, "decoupled_weight_decay", o->adam_w_mode()));
        validate(*o);
        opts.push_back(std::move(o));
      },
      [&](const at::Tensor& p, const StateDict& s) {
        auto st = std::make_unique<FusedAdamParamState>();
        st->step(static_cast<int64_t>(detail::number_at(s, "step", who)));
        st->exp_avg(detail::tensor_at(s, "exp_avg", p, who));
        st->exp_avg_sq(detail::tensor_at(s, "exp_avg_sq", p, who));
        states.emplace_back(p, std::move(st));
      });
  replace_loaded_state(std::move(opts), std::move(states));
  sync_steps_from_state();
}

}  // namespace apex::optim
