#include "amp/unscale.h"

#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/zeros.h>
#include <apex/optim/multi_tensor.h>

#include "bridge/bridge.h"

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
  for (auto& list : bridge::by_device_and_dtype(tensors)) {
    const c10::Device device = list.front().device();
    at::Tensor& flag = flag_for(flags, device);
    at::Tensor inv = inv_scale.device() == device ? inv_scale : inv_scale.to(device);
    at::_amp_foreach_non_finite_check_and_unscale_(list, flag, inv);
  }
}

void check_finite_(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& flags) {
  for (const auto& list : bridge::by_device_and_dtype(tensors)) {
    optim::multi_tensor_check_finite(list, flag_for(flags, list.front().device()));
  }
}

at::Tensor sum_flags(const std::vector<at::Tensor>& flags, c10::Device device) {
  at::Tensor total = at::zeros({1}, at::TensorOptions().dtype(at::kFloat).device(device));
  for (const auto& f : flags) total.add_(f.to(device));
  return total;
}

}  // namespace apex::amp::detail
