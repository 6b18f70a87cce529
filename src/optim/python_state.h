#pragma once

// Internal: the layout of a Python `torch.optim` optimizer's state_dict():
//   {"state": {index: {name: tensor or number}}, "param_groups": [{options..., "params": [index]}]}
// with parameters numbered across groups in order.

#include <apex/state_dict.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <optional>

namespace apex::optim::detail {

using ParamStateFn = std::function<std::optional<StateDict>(const at::Tensor& param)>;
using GroupFn = std::function<StateDict(size_t group)>;

/// Builds the layout: per_param returns nullopt for parameters without state.
StateDict write_python_layout(const torch::optim::Optimizer& optimizer,
                              const ParamStateFn& per_param, const GroupFn& group);

/// Checks `layout` against `optimizer` (group count, group sizes), then calls on_group for every
/// group dict and on_param for every parameter that has a state entry. Messages start with who.
void read_python_layout(torch::optim::Optimizer& optimizer, const StateDict& layout,
                        const char* who,
                        const std::function<void(size_t, const StateDict&)>& on_group,
                        const std::function<void(const at::Tensor&, const StateDict&)>& on_param);

/// A number entry (int or float) of `d`, or of a 0-dim/1-element tensor entry (Python's step).
double number_at(const StateDict& d, const char* key, const char* who);
/// An optional number entry: `fallback` when absent.
double number_or(const StateDict& d, const char* key, double fallback, const char* who);
/// A tensor entry, converted to fp32 on `like`'s device with `like`'s shape.
at::Tensor tensor_at(const StateDict& d, const char* key, const at::Tensor& like, const char* who);
/// A bool entry, or `fallback` when absent or None.
bool bool_or(const StateDict& d, const char* key, bool fallback);

/// A 0-dim float32 CPU tensor holding `step` (what Python keeps as a parameter's step).
at::Tensor step_tensor_value(double step);

}  // namespace apex::optim::detail
