#include "apex/optim/fused_novograd.h"

#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <apex/optim/multi_tensor.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include <cmath>

#include "bridge/bridge.h"
#include "optim/archive.h"
#include "optim/state.h"

namespace apex::optim {
namespace {

constexpr const char* kWho = "FusedNovoGrad";

void validate(const FusedNovoGradOptions& o) { detail::check_adam_style(kWho, o); }

const FusedNovoGradOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const FusedNovoGradOptions&>(g.options());
}

}  // namespace

FusedNovoGradOptions::FusedNovoGradOptions(double lr) : lr_(lr) {}

void FusedNovoGradOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(reg_inside_moment);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_averaging);
  archive.write("norm_type", c10::IValue(static_cast<int64_t>(norm_type())));
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(init_zero);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(set_grad_none);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedNovoGradOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, reg_inside_moment);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, grad_averaging);
  c10::IValue norm;
  if (archive.try_read("norm_type", norm)) {
    TORCH_CHECK(norm.isInt() && (norm.toInt() == 0 || norm.toInt() == 1),
                "FusedNovoGradOptions: norm_type in the archive must be 0 (L2) or 1 (inf), got ",
                norm);
    norm_type(static_cast<NovoGradNorm>(norm.toInt()));
  }
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, init_zero);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, set_grad_none);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedNovoGradParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedNovoGradParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedNovoGrad::FusedNovoGrad(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                             FusedNovoGradOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<FusedNovoGradOptions>(defaults)) {
  validate(defaults);
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<at::Tensor> FusedNovoGrad::elementwise_state(
    const torch::optim::OptimizerParamState& state) const {
  const auto& s = static_cast<const FusedNovoGradParamState&>(state);
  return {s.exp_avg(), s.master_param()};
}

bool FusedNovoGrad::set_grad_none() const {
  return static_cast<const FusedNovoGradOptions&>(defaults()).set_grad_none();
}

void FusedNovoGrad::fused_step(const GradScaling& scaling) {
  check_options();
  const auto groups = collect(kWho);
  bool any = false;
  for (const auto& entries : groups) any = any || !entries.empty();
  if (!any || found_inf_on_host(scaling.found_inf)) return;
  for_each_group(groups, scaling, [&](const Group& g) {
    const FusedNovoGradOptions& o = options_of(param_groups_[g.index]);
    const c10::Device device = g.device;
    const at::Tensor& inv = g.inv_scale;
    const int64_t step = next_group_step<FusedNovoGradParamState>(g.entries);
    const auto [b1, b2] = o.betas();
    const bool l2 = o.norm_type() == NovoGradNorm::kL2;
    for (const auto& bucket : buckets(g.entries)) {
      const bool master = o.master_weights() && bucket.front().param.scalar_type() != at::kFloat;
      std::vector<at::Tensor> grads;
      for (const auto& e : bucket) grads.push_back(e.grad);
      // Per-tensor norms of the unscaled gradients (norms scale linearly).
      at::Tensor norms =
          std::get<1>(l2 ? multi_tensor_l2norm(grads, true) : multi_tensor_max_norm(grads, true));
      if (inv.defined()) norms = norms * inv;
      std::vector<at::Tensor> old;
      bridge::ListBuilder lists(4);
      for (size_t i = 0; i < bucket.size(); ++i) {
        const auto& e = bucket[i];
        bool is_new = false;
        auto& s = state_of<FusedNovoGradParamState>(e.param, [&](FusedNovoGradParamState& st) {
          st.exp_avg(detail::zeros_state(e.param));
          is_new = true;
        });
        // A fresh state starts at 0 (init_zero) or at this step's norm, so that the first blend
        // leaves it there.
        old.push_back(is_new ? (o.init_zero() ? at::zeros({}, norms.options()) : norms[i])
                             : s.exp_avg_sq().to(device).reshape({}));
        s.exp_avg(detail::conform_state(s.exp_avg(), e.param));
        if (master) s.master_param(detail::ensure_master(s.master_param(), e.param));
        lists.add({e.param, e.grad, s.exp_avg(), master ? s.master_param() : at::Tensor()});
      }
      const at::Tensor v_old = at::stack(old);
      const at::Tensor v = l2 ? (v_old.square() * b2 + norms.square() * (1.0 - b2)).sqrt()
                              : v_old * b2 + norms * (1.0 - b2);
      kernels::NovoGradArgs args;
      args.lr = static_cast<float>(o.lr());
      args.beta1 = static_cast<float>(b1);
      args.beta3 = kernels::grad_weight(b1, o.grad_averaging());
      args.eps = static_cast<float>(o.eps());
      args.weight_decay = static_cast<float>(o.weight_decay());
      args.bias_correction1 =
          static_cast<float>(kernels::bias_correction(b1, step, o.bias_correction()));
      args.bias_correction2 =
          static_cast<float>(std::sqrt(kernels::bias_correction(b2, step, o.bias_correction())));
      args.reg_inside_moment = o.reg_inside_moment();
      args.v = v.data_ptr<float>();
      // The step was skipped on the host already: no found_inf for the kernel.
      args.amp = detail::amp_args(device, inv, scaling.unscale_grads, at::Tensor(), kWho);
      const auto view = lists.view();
      bridge::launch(device, kernels::cpu::novograd, kernels::cuda::novograd, view, args);
      for (size_t i = 0; i < bucket.size(); ++i) {
        auto& s = static_cast<FusedNovoGradParamState&>(
            *state_.at(bucket[i].param.unsafeGetTensorImpl()));
        s.step(step);
        s.exp_avg_sq(v[static_cast<int64_t>(i)].clone());
      }
    }
  });
}

void FusedNovoGrad::save(torch::serialize::OutputArchive& archive) const {
  save_archive<FusedNovoGradParamState, FusedNovoGradOptions>(archive);
}

void FusedNovoGrad::load(torch::serialize::InputArchive& archive) {
  load_archive<FusedNovoGradParamState, FusedNovoGradOptions>(archive);
}

void FusedNovoGrad::check_options() const {
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<double> FusedNovoGrad::option_values(
    const torch::optim::OptimizerOptions& options) const {
  const auto& o = static_cast<const FusedNovoGradOptions&>(options);
  return {static_cast<double>(o.lr()),
          std::get<0>(o.betas()),
          std::get<1>(o.betas()),
          static_cast<double>(o.eps()),
          static_cast<double>(o.weight_decay()),
          static_cast<double>(o.bias_correction()),
          static_cast<double>(o.reg_inside_moment()),
          static_cast<double>(o.grad_averaging()),
          static_cast<double>(o.norm_type()),
          static_cast<double>(o.init_zero()),
          static_cast<double>(o.set_grad_none()),
          static_cast<double>(o.master_weights())};
}

std::vector<double> FusedNovoGrad::state_values(
    const torch::optim::OptimizerParamState& state) const {
  // The per-tensor second moment is a scalar tensor: covered here, not as elementwise state.
  const auto& s = static_cast<const FusedNovoGradParamState&>(state);
  return {static_cast<double>(s.step()),
          s.exp_avg_sq().defined() ? s.exp_avg_sq().to(at::kCPU).item<double>() : -1.0};
}

}  // namespace apex::optim
