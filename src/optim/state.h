#pragma once

// Internal: what the fused optimizers share besides the tensor glue (bridge/bridge.h): option
// checks with their messages, and fp32 state and master tensors shaped like their parameters.

#include <ATen/core/Tensor.h>
#include <apex/state_dict.h>

#include <tuple>

#include "kernels/multi_tensor.h"
#include "ops/kernel_args.h"

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

/// The kernels' loss-scaling arguments on `device`: the inverse scale, whether to unscale the
/// gradients in place, and the found-inf flag (undefined tensors: none). Errors name `who`.
kernels::AmpArgs amp_args(c10::Device device, const at::Tensor& inv_scale, bool unscale_grads,
                          const at::Tensor& found_inf, const char* who);

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
  return ops::adam_args(o.lr(), std::get<0>(o.betas()), std::get<1>(o.betas()), o.eps(),
                        /*step=*/1, o.adam_w_mode(), o.bias_correction(), o.weight_decay());
}

/// LAMB's kernel arguments for a group at `step` (FusedLAMB and DistributedFusedLAMB alike); the
/// caller sets the norm and scaling pointers.
template <class Options>
kernels::LambArgs lamb_args(const Options& o, int64_t step) {
  const auto [b1, b2] = o.betas();
  return ops::lamb_args(o.lr(), b1, b2, o.eps(), step, o.bias_correction(), o.weight_decay(),
                        o.grad_averaging(), o.adam_w_mode(), o.max_grad_norm(), o.use_nvlamb());
}

}  // namespace apex::optim::detail
