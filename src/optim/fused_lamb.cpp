#include "apex/optim/fused_lamb.h"

#include <ATen/ops/stack.h>
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

constexpr const char* kWho = "FusedLAMB";

void validate(const FusedLAMBOptions& o) {
  detail::check_adam_style(kWho, o);
  // 0 turns clipping off; a negative or NaN bound has no meaning.
  detail::check_non_negative(kWho, "max_grad_norm", o.max_grad_norm());
}

const FusedLAMBOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const FusedLAMBOptions&>(g.options());
}

}  // namespace

FusedLAMBOptions::FusedLAMBOptions(double lr) : lr_(lr) {}

void FusedLAMBOptions::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(lr);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(betas);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(eps);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(weight_decay);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(bias_correction);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(adam_w_mode);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(grad_averaging);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(max_grad_norm);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(use_nvlamb);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(set_grad_none);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_weights);
}

void FusedLAMBOptions::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, lr);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(betas_t, betas);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, eps);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, weight_decay);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, bias_correction);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, adam_w_mode);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, grad_averaging);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(double, max_grad_norm);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, use_nvlamb);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, set_grad_none);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(bool, master_weights);
}

void FusedLAMBParamState::serialize(torch::serialize::OutputArchive& archive) const {
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(step);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(exp_avg_sq);
  _TORCH_OPTIM_SERIALIZE_TORCH_ARG(master_param);
}

void FusedLAMBParamState::serialize(torch::serialize::InputArchive& archive) {
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(int64_t, step);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, exp_avg_sq);
  _TORCH_OPTIM_DESERIALIZE_TORCH_ARG(at::Tensor, master_param);
}

FusedLAMB::FusedLAMB(const std::vector<torch::optim::OptimizerParamGroup>& param_groups,
                     FusedLAMBOptions defaults)
    : FusedOptimizer(param_groups, std::make_unique<FusedLAMBOptions>(defaults)) {
  validate(defaults);
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<at::Tensor> FusedLAMB::elementwise_state(
    const torch::optim::OptimizerParamState& state) const {
  const auto& s = static_cast<const FusedLAMBParamState&>(state);
  return {s.exp_avg(), s.exp_avg_sq(), s.master_param()};
}

bool FusedLAMB::set_grad_none() const {
  return static_cast<const FusedLAMBOptions&>(defaults()).set_grad_none();
}

void FusedLAMB::fused_step(const GradScaling& scaling) {
  check_options();
  const auto groups = collect(kWho);
  std::vector<at::Tensor> all_grads;
  for (const auto& entries : groups) {
    for (const auto& e : entries) all_grads.push_back(e.grad);
  }
  const auto grads_by_key = bridge::by_device_and_dtype(all_grads);
  if (grads_by_key.empty() || found_inf_on_host(scaling.found_inf)) return;

  // The global norm of the unscaled gradients over every group (what clipping compares with
  // max_grad_norm), combined on the device without a host read.
  std::vector<at::Tensor> squares;
  for (const auto& grads : grads_by_key) {
    const c10::Device device = grads.front().device();
    const at::Tensor inv = on(scaling.inv_scale, device);
    const auto norm = std::get<0>(inv.defined() ? multi_tensor_unscale_l2norm(grads, inv)
                                                : multi_tensor_l2norm(grads));
    squares.push_back(norm.square());
  }
  const c10::Device first_device = grads_by_key.front().front().device();
  for (auto& s : squares) s = s.to(first_device);
  const at::Tensor global_norm = at::stack(squares).sum().sqrt().reshape({1});

  for_each_group(groups, scaling, [&](const Group& g) {
    const FusedLAMBOptions& o = options_of(param_groups_[g.index]);
    const c10::Device device = g.device;
    const at::Tensor gnorm = on(global_norm, device);
    const int64_t step = next_group_step<FusedLAMBParamState>(g.entries);
    kernels::LambArgs args = detail::lamb_args(o, step);
    args.global_grad_norm = gnorm.data_ptr<float>();
    // The step was skipped on the host already: no found_inf for the kernel.
    args.amp = detail::amp_args(device, g.inv_scale, scaling.unscale_grads, at::Tensor(), kWho);
    for (const auto& bucket : buckets(g.entries)) {
      const bool master = o.master_weights() && bucket.front().param.scalar_type() != at::kFloat;
      bridge::ListBuilder lists(5);
      for (const auto& e : bucket) {
        auto& s = state_of<FusedLAMBParamState>(e.param, [&](FusedLAMBParamState& st) {
          st.exp_avg(detail::zeros_state(e.param));
          st.exp_avg_sq(detail::zeros_state(e.param));
        });
        s.step(step);
        s.exp_avg(detail::conform_state(s.exp_avg(), e.param));
        s.exp_avg_sq(detail::conform_state(s.exp_avg_sq(), e.param));
        if (master) s.master_param(detail::ensure_master(s.master_param(), e.param));
        lists.add({e.param, e.grad, s.exp_avg(), s.exp_avg_sq(),
                   master ? s.master_param() : at::Tensor()});
      }
      const auto opts = at::TensorOptions().dtype(at::kFloat).device(device);
      const at::Tensor u_sumsq = at::zeros({lists.size()}, opts);
      const at::Tensor p_sumsq = at::zeros({lists.size()}, opts);
      args.u_sumsq = u_sumsq.data_ptr<float>();
      args.p_sumsq = p_sumsq.data_ptr<float>();
      const auto view = lists.view();
      bridge::launch(device, kernels::cpu::lamb_stage1, kernels::cuda::lamb_stage1, view, args);
      bridge::launch(device, kernels::cpu::lamb_stage2, kernels::cuda::lamb_stage2, view, args);
    }
  });
}

void FusedLAMB::save(torch::serialize::OutputArchive& archive) const {
  save_archive<FusedLAMBParamState, FusedLAMBOptions>(archive);
}

void FusedLAMB::load(torch::serialize::InputArchive& archive) {
  load_archive<FusedLAMBParamState, FusedLAMBOptions>(archive);
}

void FusedLAMB::check_options() const {
  for (const auto& g : param_groups_) validate(options_of(g));
}

std::vector<double> FusedLAMB::option_values(const torch::optim::OptimizerOptions& options) const {
  const auto& o = static_cast<const FusedLAMBOptions&>(options);
  return {static_cast<double>(o.lr()),
          std::get<0>(o.betas()),
          std::get<1>(o.betas()),
          static_cast<double>(o.eps()),
          static_cast<double>(o.weight_decay()),
          static_cast<double>(o.bias_correction()),
          static_cast<double>(o.adam_w_mode()),
          static_cast<double>(o.grad_averaging()),
          static_cast<double>(o.max_grad_norm()),
          static_cast<double>(o.use_nvlamb()),
          static_cast<double>(o.set_grad_none()),
          static_cast<double>(o.master_weights())};
}

std::vector<double> FusedLAMB::state_values(const torch::optim::OptimizerParamState& state) const {
  return {static_cast<double>(static_cast<const FusedLAMBParamState&>(state).step())};
}

}  // namespace apex::optim
