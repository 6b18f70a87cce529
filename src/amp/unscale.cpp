#include "unscale.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/zeros.h>

#include <utility>

namespace apex::amp::detail {

at::Tensor& flag_for(std::vector<at::Tensor>& flags, c10::Device device) {
  for (auto& f : flags) {
    if (f.device() == device) return f;
  }
  flags.push_back(at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device)));
  return flags.back();
}

void check_and_unscale_(const std::vector<at::Tensor>& tensors, const at::Tensor& inv_scale,
                        std::vector<at::Tensor>& flags) {
  // Groups keep first-seen order so that results do not depend on hashing.
  std::vector<std::pair<std::pair<c10::Device, c10::ScalarType>, std::vector<at::Tensor>>> groups;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const auto key = std::make_pair(t.device(), t.scalar_type());
    auto it = groups.begin();
    while (it != groups.end() && it->first != key) ++it;
    if (it == groups.end()) {
      groups.push_back({key, {}});
      it = std::prev(groups.end());
    }
    it->second.push_back(t);
  }
  for (auto& [key, list] : groups) {
    const c10::Device device = key.first;
    at::Tensor& flag = flag_for(flags, device);
    at::Tensor inv = inv_scale.device() == device ? inv_scale : inv_scale.to(device);
    at::_amp_foreach_non_finite_check_and_unscale_(list, flag, inv);
  }
}

at::Tensor sum_flags(const std::vector<at::Tensor>& flags, c10::Device device) {
  at::Tensor total = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const auto& f : flags) total.add_(f.to(device));
  return total;
}

}  // namespace apex::amp::detail
