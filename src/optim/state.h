#pragma once

// Internal: what the fused optimizers share besides the tensor glue (bridge/bridge.h): option
// checks with their messages, and fp32 state and master tensors shaped like their parameters.

#include <ATen/core/Tensor.h>

#include <tuple>

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

}  // namespace apex::optim::detail
