#include "apex/optim/fused_adagrad.h"

#include <ATen/ops/full_like.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <map>

#include "bridge/bridge.h"
#include "optim/archive.h"
#include "optim/python_state.h"
#include "optim/state.h"

namespace apex::optim {
namespace {

constexpr const char* kWho = "FusedAdagrad";

void validate(const FusedAdagradOptions& o) {
  detail::check_non_negative(kWho, "lr", o.lr());
  detail::check_non_negative(kWho, "lr_decay", o.lr_decay());
  detail::check_non_negative(kWho, "weight_decay", o.weight_decay());
  detail::check_non_negative(kWho, "initial_accumulator_value", o.initial_accumulator_value());
  detail::check_non_negative(kWho, "eps", o.eps());
}

const FusedAdagradOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const FusedAdagradOptions&>(g.options());
}

}  // namespace

FusedAdagradOptions::FusedAdagradOptions(double lr) : lr_(lr) {}

void FusedAdagradOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(initial_accumulator_value);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adagrad_w_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(set_grad_none);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedAdagradOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, initial_accumulator_value);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adagrad_w_mode);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, set_grad_none);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedAdagradParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(sum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedAdagradParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, sum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedAdagrad::FusedAdagrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                           FusedAdagradOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<FusedAdagradOptions>(defaults)) {
  validate(defaults);
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<at::Tensor> FusedAdagrad::elementwise_state(
    const torch::optim::OptimizerParamState& state) const {
  const auto& s = static_cast<const FusedAdagradParamState&>(state);
  return {s.sum(), s.master_param()};
}

bool FusedAdagrad::set_grad_none() const {
  return static_cast<const FusedAdagradOptions&>(defaults()).set_grad_none();
}

void FusedAdagrad::fused_step(const GradScaling& scaling) {
  check_options();
  const auto groups = collect(kWho);
  for (const auto& entries : groups) {
    if (!entries.empty() && found_inf_on_host(scaling.found_inf)) return;
  }
  for_each_group(groups, scaling, [&](const Group& g) {
    const FusedAdagradOptions& o = options_of(param_groups_[g.index]);
    const c10::Device device = g.device;
    for (const auto& bucket : buckets(g.entries)) {
      const bool master = o.master_weights() && bucket.front().param.scalar_type() != at::kFloat;
      // The decayed lr depends on each parameter's step: one call per step value.
      std::map<int64_t, std::vector<Entry>> by_step;
      for (const auto& e : bucket) {
        auto& s = state_of<FusedAdagradParamState>(e.param, [&](FusedAdagradParamState& st) {
          st.sum(at::full_like(e.param, o.initial_accumulator_value(),
                               e.param.options().dtype(at::kFloat)));
        });
        by_step[s.step() + 1].push_back(e);
      }
      for (const auto& [step, list] : by_step) {
        bridge::ListBuilder lists(4);
        for (const auto& e : list) {
          auto& s = state_of<FusedAdagradParamState>(e.param, [](FusedAdagradParamState&) {});
          s.step(step);
          s.sum(detail::conform_state(s.sum(), e.param));
          if (master) s.master_param(detail::ensure_master(s.master_param(), e.param));
          lists.add({e.param, e.grad, s.sum(), master ? s.master_param() : at::Tensor()});
        }
        kernels::AdagradArgs args;
        args.lr = static_cast<float>(o.lr() / (1.0 + static_cast<double>(step - 1) * o.lr_decay()));
        args.eps = static_cast<float>(o.eps());
        args.weight_decay = static_cast<float>(o.weight_decay());
        args.adagrad_w_mode = o.adagrad_w_mode();
        // The step was skipped on the host already: no found_inf for the kernel.
        args.amp = detail::amp_args(device, g.inv_scale, scaling.unscale_grads, at::Tensor(), kWho);
        const auto view = lists.view();
        bridge::launch(device, kernels::cpu::adagrad, kernels::cuda::adagrad, view, args);
      }
    }
  });
}

void FusedAdagrad::save(torch::serialize::OutputArchive& archive) const {
  save_archive<FusedAdagradParamState, FusedAdagradOptions>(archive);
}

void FusedAdagrad::load(torch::serialize::InputArchive& archive) {
  load_archive<FusedAdagradParamState, FusedAdagradOptions>(archive);
}

void FusedAdagrad::check_options() const {
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<double> FusedAdagrad::option_values(
    const torch::optim::OptimizerOptions& options) const {
  const auto& o = static_cast<const FusedAdagradOptions&>(options);
  return {static_cast<double>(o.lr()),
          static_cast<double>(o.lr_decay()),
          static_cast<double>(o.weight_decay()),
          static_cast<double>(o.initial_accumulator_value()),
          static_cast<double>(o.eps()),
          static_cast<double>(o.adagrad_w_mode()),
          static_cast<double>(o.set_grad_none()),
          static_cast<double>(o.master_weights())};
}

std::vector<double> FusedAdagrad::state_values(
    const torch::optim::OptimizerParamState& state) const {
  return {static_cast<double>(static_cast<const FusedAdagradParamState&>(state).step())};
}

StateDict FusedAdagrad::python_state_dict() const {
  return detail::write_python_layout(
      *this,
      [&](const at::Tensor& p) -> std::optional<StateDict> {
        auto it = state_.find(p.unsafeGetTensorImpl());
        if (it == state_.end()) return std::nullopt;
        const auto& s = static_cast<const FusedAdagradParamState&>(*it->second);
        StateDict d = make_state_dict();
        d.insert("step", detail::step_tensor_value(static_cast<double>(s.step())));
        d.insert("sum", s.sum().cpu());
        return d;
      },
      [&](size_t gi) {
        const FusedAdagradOptions& o = options_of(param_groups_[gi]);
        StateDict g = make_state_dict();
        g.insert("lr", o.lr());
        g.insert("lr_decay", o.lr_decay());
        g.insert("weight_decay", o.weight_decay());
        g.insert("initial_accumulator_value", o.initial_accumulator_value());
        g.insert("eps", o.eps());
        g.insert("foreach", c10::IValue());
        g.insert("maximize", false);
        g.insert("differentiable", false);
        g.insert("fused", c10::IValue());
        return g;
      });
}

void FusedAdagrad::load_python_state_dict(const StateDict& layout) {
  constexpr const char* who = "FusedAdagrad::load_python_state_dict";
  LoadedOptions opts;
  LoadedStates states;
  detail::read_python_layout(
      *this, layout, who,
      [&](size_t gi, const StateDict& g) {
        auto o = std::make_unique<FusedAdagradOptions>(options_of(param_groups_[gi]));
        o->lr(detail::number_at(g, "lr", who));
        o->lr_decay(detail::number_or(g, "lr_decay", 0.0, who));
        o->weight_decay(detail::number_or(g, "weight_decay", 0.0, who));
        o->initial_accumulator_value(detail::number_or(g, "initial_accumulator_value", 0.0, who));
        o->eps(detail::number_or(g, "eps", 1e-10, who));
        validate(*o);
        opts.push_back(std::move(o));
      },
      [&](const at::Tensor& p, const StateDict& s) {
        auto st = std::make_unique<FusedAdagradParamState>();
        st->step(static_cast<int64_t>(detail::number_at(s, "step", who)));
        st->sum(detail::tensor_at(s, "sum", p, who));
        states.emplace_back(p, std::move(st));
      });
  replace_loaded_state(std::move(opts), std::move(states));
}

}  // namespace apex::optim
