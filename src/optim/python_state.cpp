#include "optim/python_state.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <c10/util/Exception.h>

namespace apex::optim::detail {

StateDict write_python_layout(const torch::optim::Optimizer& optimizer,
                              const ParamStateFn& per_param, const GroupFn& group) {
  c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
  c10::impl::GenericList groups(c10::AnyType::get());
  int64_t index = 0;
  const auto& param_groups = optimizer.param_groups();
  for (size_t gi = 0; gi < param_groups.size(); ++gi) {
    StateDict g = group(gi);
    c10::impl::GenericList ids(c10::AnyType::get());
    for (const auto& p : param_groups[gi].params()) {
      if (auto s = per_param(p)) state.insert(index, *s);
      ids.push_back(index++);
    }
    g.insert("params", ids);
    groups.push_back(g);
  }
  StateDict out = make_state_dict();
  out.insert("state", state);
  out.insert("param_groups", groups);
  return out;
}

void read_python_layout(torch::optim::Optimizer& optimizer, const StateDict& layout,
                        const char* who,
                        const std::function<void(size_t, const StateDict&)>& on_group,
                        const std::function<void(const at::Tensor&, const StateDict&)>& on_param) {
  TORCH_CHECK(layout.contains("state") && layout.contains("param_groups"), who,
              ": expected a dict with keys 'state' and 'param_groups'");
  const auto& groups_iv = layout.at("param_groups");
  TORCH_CHECK(groups_iv.isList(), who, ": 'param_groups' must be a list, got ",
              groups_iv.tagKind());
  const auto groups = groups_iv.toList();
  auto& param_groups = optimizer.param_groups();
  TORCH_CHECK(groups.size() == param_groups.size(), who, ": the state has ", groups.size(),
              " parameter groups but the optimizer has ", param_groups.size());
  const auto& state_iv = layout.at("state");
  TORCH_CHECK(state_iv.isGenericDict(), who, ": 'state' must be a dict, got ", state_iv.tagKind());
  const auto state = state_iv.toGenericDict();
  // Check everything first so that a bad file changes nothing.
  std::vector<std::pair<at::Tensor, StateDict>> params;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    const c10::IValue& giv = groups.get(gi);
    TORCH_CHECK(giv.isGenericDict(), who, ": param_groups[", gi, "] must be a dict");
    const auto g = giv.toGenericDict();
    TORCH_CHECK(g.contains("params") && g.at("params").isList(), who, ": param_groups[", gi,
                "] has no 'params' list");
    const auto ids = g.at("params").toList();
    const auto& current = param_groups[gi].params();
    TORCH_CHECK(ids.size() == current.size(), who, ": param_groups[", gi, "] has ", ids.size(),
                " parameters but the optimizer's group has ", current.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      const c10::IValue& id = ids.get(i);
      TORCH_CHECK(id.isInt(), who, ": param_groups[", gi, "]['params'][", i, "] is not an int");
      if (!state.contains(id)) continue;
      const c10::IValue& s = state.at(id);
      TORCH_CHECK(s.isGenericDict(), who, ": state[", id.toInt(), "] must be a dict");
      params.emplace_back(current[i], s.toGenericDict());
    }
  }
  for (size_t gi = 0; gi < groups.size(); ++gi) on_group(gi, groups.get(gi).toGenericDict());
  for (const auto& [p, s] : params) on_param(p, s);
}

double number_at(const StateDict& d, const char* key, const char* who) {
  TORCH_CHECK(d.contains(key), who, ": missing key '", key, "'");
  const c10::IValue& v = d.at(key);
  if (v.isDouble()) return v.toDouble();
  if (v.isInt()) return static_cast<double>(v.toInt());
  if (v.isTensor() && v.toTensor().numel() == 1) return v.toTensor().item<double>();
  TORCH_CHECK(false, who, ": '", key, "' must be a number, got ", v.tagKind());
}

double number_or(const StateDict& d, const char* key, double fallback, const char* who) {
  return d.contains(key) && !d.at(key).isNone() ? number_at(d, key, who) : fallback;
}

at::Tensor tensor_at(const StateDict& d, const char* key, const at::Tensor& like, const char* who) {
  TORCH_CHECK(d.contains(key) && d.at(key).isTensor(), who, ": missing tensor '", key, "'");
  const at::Tensor t = d.at(key).toTensor();
  TORCH_CHECK(t.sizes() == like.sizes(), who, ": '", key, "' has shape ", t.sizes(),
              " but the parameter has shape ", like.sizes());
  return at::empty_like(like, like.options().dtype(at::kFloat)).copy_(t);
}

bool bool_or(const StateDict& d, const char* key, bool fallback) {
  if (!d.contains(key)) return fallback;
  const c10::IValue& v = d.at(key);
  return v.isBool() ? v.toBool() : fallback;
}

at::Tensor step_tensor_value(double step) {
  return at::full({}, step, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace apex::optim::detail
