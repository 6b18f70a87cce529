#pragma once

// Internal: what the fused optimizers share besides the tensor glue (bridge/bridge.h): option
// checks with their messages, and fp32 state and master tensors shaped like their parameters.

#include <ATen/core/Tensor.h>
#include <apex/state_dict.h>

#include <tuple>

#include "kernels/multi_tensor.h"

namespace apex::optim::detail {

/// Hyper-parameter checks shared by the optimizers: "<who>: <name> must be >= 0, got <value>"
/// and "<who>: betas[i] must be in [0, 1), got <value>".
void check_non_negative(const char* who, const char* name, double value);
void check_betas(const char* who, const std::tuple<double, double>& betas);
/// lr, eps, betas and weight_decay of the Adam-style optimizers (Adam, LAMB, NovoGrad).
template <class Options>
void check_adam_style(const char* who, const Options& o) {
  check_non_negative(who, "lr", o.lr());
  check_non_negative(who, "eps", o.eps());
  check_betas(who, o.betas());
  check_non_negative(who, "weight_decay", o.weight_decay());
}

/// fp32 zeros with `param`'s shape, device and strides (optimizer state).
at::Tensor zeros_state(const at::Tensor& param);
/// `t` as fp32 with `param`'s device and strides; `t` itself when it already is.
at::Tensor conform_state(const at::Tensor& t, const at::Tensor& param);
/// An fp32 copy of `param` with its strides (a master weight).
at::Tensor master_copy(const at::Tensor& param);
/// `current` conformed to `param`, or a new master copy of `param` when undefined.
inline at::Tensor ensure_master(const at::Tensor& current, const at::Tensor& param) {
  return current.defined() ? conform_state(current, param) : master_copy(param);
}

/// A group's entry in torch.optim.Adam/AdamW's state_dict layout: lr, betas, eps, weight_decay
/// and the flags torch writes (FusedAdam and DistributedFusedAdam alike).
template <class Options>
StateDict torch_adam_group(const Options& o) {
  StateDict g = make_state_dict();
  g.insert("lr", o.lr());
  g.insert("betas", c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("amsgrad", false);
  g.insert("maximize", false);
  g.insert("foreach", c10::IValue());
  g.insert("capturable", false);
  g.insert("differentiable", false);
  g.insert("fused", c10::IValue());
  g.insert("decoupled_weight_decay", o.adam_w_mode());
  return g;
}

/// Adam's kernel arguments from a group's options (FusedAdam and DistributedFusedAdam alike); the
/// caller sets the step and the scaling pointers.
template <class Options>
kernels::AdamArgs adam_args(const Options& o) {
  kernels::AdamArgs args;
  args.lr = static_cast<float>(o.lr());
  args.beta1 = static_cast<float>(std::get<0>(o.betas()));
  args.beta2 = static_cast<float>(std::get<1>(o.betas()));
  args.eps = static_cast<float>(o.eps());
  args.weight_decay = static_cast<float>(o.weight_decay());
  args.adam_w_mode = o.adam_w_mode();
  args.bias_correction = o.bias_correction();
  return args;
}

/// LAMB's kernel arguments for a group at `step` (FusedLAMB and DistributedFusedLAMB alike); the
/// caller sets the norm and scaling pointers.
template <class Options>
kernels::LambArgs lamb_args(const Options& o, int64_t step) {
  const auto [b1, b2] = o.betas();
  kernels::LambArgs args;
  args.lr = static_cast<float>(o.lr());
  args.beta1 = static_cast<float>(b1);
  args.beta2 = static_cast<float>(b2);
  args.beta3 = kernels::grad_weight(b1, o.grad_averaging());
  args.eps = static_cast<float>(o.eps());
  args.weight_decay = static_cast<float>(o.weight_decay());
  args.bias_correction1 =
      static_cast<float>(kernels::bias_correction(b1, step, o.bias_correction()));
  args.bias_correction2 =
      static_cast<float>(kernels::bias_correction(b2, step, o.bias_correction()));
  args.adam_w_mode = o.adam_w_mode();
  args.use_nvlamb = o.use_nvlamb();
  args.max_grad_norm = static_cast<float>(o.max_grad_norm());
  return args;
}

}  // namespace apex::optim::detail
