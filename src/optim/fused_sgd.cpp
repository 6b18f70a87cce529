#include "apex/optim/fused_sgd.h"

#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include "bridge/bridge.h"
#include "optim/archive.h"
#include "optim/python_state.h"
#include "optim/state.h"

namespace apex::optim {
namespace {

constexpr const char* kWho = "FusedSGD";

void validate(const FusedSGDOptions& o) {
  detail::check_non_negative(kWho, "lr", o.lr());
  detail::check_non_negative(kWho, "momentum", o.momentum());
  detail::check_non_negative(kWho, "weight_decay", o.weight_decay());
  TORCH_CHECK(!o.nesterov() || (o.momentum() > 0 && o.dampening() == 0),
              "FusedSGD: nesterov requires momentum > 0 and dampening = 0, got momentum ",
              o.momentum(), " and dampening ", o.dampening());
}

const FusedSGDOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const FusedSGDOptions&>(g.options());
}

}  // namespace

FusedSGDOptions::FusedSGDOptions(double lr) : lr_(lr) {}

void FusedSGDOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(dampening);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(nesterov);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(wd_after_momentum);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(set_grad_none);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedSGDOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, dampening);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, nesterov);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, wd_after_momentum);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, set_grad_none);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedSGDParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(momentum_buffer);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedSGDParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, momentum_buffer);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedSGD::FusedSGD(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                   FusedSGDOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<FusedSGDOptions>(defaults)) {
  validate(defaults);
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<at::Tensor> FusedSGD::elementwise_state(
    const torch::optim::OptimizerParamState& state) const {
  const auto& s = static_cast<const FusedSGDParamState&>(state);
  return {s.momentum_buffer(), s.master_param()};
}

bool FusedSGD::set_grad_none() const {
  return static_cast<const FusedSGDOptions&>(defaults()).set_grad_none();
}

void FusedSGD::fused_step(const GradScaling& scaling) {
  check_options();
  for_each_group(collect(kWho), scaling, [&](const Group& g) {
    const FusedSGDOptions& o = options_of(param_groups_[g.index]);
    const c10::Device device = g.device;
    const at::Tensor& found = g.found_inf;
    const bool with_momentum = o.momentum() != 0;
    for (const auto& bucket : buckets(g.entries)) {
      const bool master = o.master_weights() && bucket.front().param.scalar_type() != at::kFloat;
      // Parameters whose momentum buffer is not seeded yet form their own call (first_run).
      std::vector<Entry> fresh;
      std::vector<Entry> running;
      for (const auto& e : bucket) {
        auto& s = state_of<FusedSGDParamState>(e.param, [](FusedSGDParamState&) {});
        (with_momentum && !s.momentum_buffer().defined() ? fresh : running).push_back(e);
      }
      for (const bool first : {true, false}) {
        bridge::ListBuilder lists(4);
        std::vector<FusedSGDParamState*> seeded;
        for (const auto& e : first ? fresh : running) {
          auto& s = state_of<FusedSGDParamState>(e.param, [](FusedSGDParamState&) {});
          if (master) s.master_param(detail::ensure_master(s.master_param(), e.param));
          if (with_momentum) {
            s.momentum_buffer(first ? detail::zeros_state(e.param)
                                    : detail::conform_state(s.momentum_buffer(), e.param));
          }
          if (first) seeded.push_back(&s);
          lists.add(
              {e.param, e.grad, s.momentum_buffer(), master ? s.master_param() : at::Tensor()});
        }
        if (lists.size() == 0) continue;
        kernels::SgdArgs args;
        args.lr = static_cast<float>(o.lr());
        args.momentum = static_cast<float>(o.momentum());
        args.dampening = static_cast<float>(o.dampening());
        args.weight_decay = static_cast<float>(o.weight_decay());
        args.nesterov = o.nesterov();
        args.wd_after_momentum = o.wd_after_momentum();
        args.first_run = first && with_momentum;
        args.amp = detail::amp_args(device, g.inv_scale, scaling.unscale_grads, found, kWho);
        const auto view = lists.view();
        bridge::launch(device, kernels::cpu::sgd, kernels::cuda::sgd, view, args);
        // A skipped step changed nothing (but unscaled the gradients when asked); the buffers
        // seeded for it must not stay either: the one host read of this optimizer.
        if (args.first_run && found.defined() && found_inf_on_host(found)) {
          for (auto* s : seeded) s->momentum_buffer(at::Tensor());
        }
      }
    }
  });
}

void FusedSGD::save(torch::serialize::OutputArchive& archive) const {
  save_archive<FusedSGDParamState, FusedSGDOptions>(archive);
}

void FusedSGD::load(torch::serialize::InputArchive& archive) {
  load_archive<FusedSGDParamState, FusedSGDOptions>(archive);
}

void FusedSGD::check_options() const {
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<double> FusedSGD::option_values(const torch::optim::OptimizerOptions& options) const {
  const auto& o = static_cast<const FusedSGDOptions&>(options);
  return {static_cast<double>(o.lr()),
          static_cast<double>(o.momentum()),
          static_cast<double>(o.dampening()),
          static_cast<double>(o.weight_decay()),
          static_cast<double>(o.nesterov()),
          static_cast<double>(o.wd_after_momentum()),
          static_cast<double>(o.set_grad_none()),
          static_cast<double>(o.master_weights())};
}

StateDict FusedSGD::python_state_dict() const {
  return detail::write_python_layout(
      *this,
      [&](const at::Tensor& p) -> std::optional<StateDict> {
        auto it = state_.find(p.unsafeGetTensorImpl());
        if (it == state_.end()) return std::nullopt;
        const auto& s = static_cast<const FusedSGDParamState&>(*it->second);
        StateDict d = make_state_dict();
        d.insert("momentum_buffer", s.momentum_buffer().defined()
                                        ? c10::IValue(s.momentum_buffer().cpu())
                                        : c10::IValue());
        return d;
      },
      [&](size_t gi) {
        const FusedSGDOptions& o = options_of(param_groups_[gi]);
        StateDict g = make_state_dict();
        g.insert("lr", o.lr());
        g.insert("momentum", o.momentum());
        g.insert("dampening", o.dampening());
        g.insert("weight_decay", o.weight_decay());
        g.insert("nesterov", o.nesterov());
        g.insert("maximize", false);
        g.insert("foreach", c10::IValue());
        g.insert("differentiable", false);
        g.insert("fused", c10::IValue());
        return g;
      });
}

void FusedSGD::load_python_state_dict(const StateDict& layout) {
  constexpr const char* who = "FusedSGD::load_python_state_dict";
  LoadedOptions opts;
  LoadedStates states;
  detail::read_python_layout(
      *this, layout, who,
      [&](size_t gi, const StateDict& g) {
        auto o = std::make_unique<FusedSGDOptions>(options_of(param_groups_[gi]));
        o->lr(detail::number_at(g, "lr", who));
        o->momentum(detail::number_or(g, "momentum", 0.0, who));
        o->dampening(detail::number_or(g, "dampening", 0.0, who));
        o->weight_decay(detail::number_or(g, "weight_decay", 0.0, who));
        o->nesterov(detail::bool_or(g, "nesterov", false));
        validate(*o);
        opts.push_back(std::move(o));
      },
      [&](const at::Tensor& p, const StateDict& s) {
        auto st = std::make_unique<FusedSGDParamState>();
        if (s.contains("momentum_buffer") && s.at("momentum_buffer").isTensor()) {
          st->momentum_buffer(detail::tensor_at(s, "momentum_buffer", p, who));
        }
        states.emplace_back(p, std::move(st));
      });
  replace_loaded_state(std::move(opts), std::move(states));
}

}  // namespace apex::optim
