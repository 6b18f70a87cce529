#include "optim/state.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros_like.h>
#include <c10/util/Exception.h>

#include "bridge/bridge.h"

namespace apex::optim::detail {

kernels::AmpArgs amp_args(c10::Device device, const at::Tensor& inv_scale, bool unscale_grads,
                          const at::Tensor& found_inf, const char* who) {
  kernels::AmpArgs a;
  a.inv_scale = bridge::scalar_ptr(inv_scale, device, who, "inv_scale");
  a.unscale_grads = unscale_grads;
  a.found_inf = bridge::scalar_ptr(found_inf, device, who, "found_inf");
  return a;
}

void check_non_negative(const char* who, const char* name, double value) {
  TORCH_CHECK(value >= 0, who, ": ", name, " must be >= 0, got ", value);
}

void check_betas(const char* who, const std::tuple<double, double>& betas) {
  const auto [b1, b2] = betas;
  TORCH_CHECK(b1 >= 0 && b1 < 1, who, ": betas[0] must be in [0, 1), got ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, who, ": betas[1] must be in [0, 1), got ", b2);
}

at::Tensor zeros_state(const at::Tensor& param) {
  return at::zeros_like(param, param.options().dtype(at::kFloat));
}

at::Tensor conform_state(const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK(t.sizes() == param.sizes(), "optimizer state of shape ", t.sizes(),
              " does not fit its parameter of shape ", param.sizes(),
              " (was the state loaded from another model?)");
  if (t.scalar_type() == at::kFloat && t.device() == param.device() &&
      t.strides() == param.strides() && t.sizes() == param.sizes()) {
    return t;
  }
  return at::empty_like(param, param.options().dtype(at::kFloat)).copy_(t);
}

at::Tensor master_copy(const at::Tensor& param) {
  return at::empty_like(param, param.options().dtype(at::kFloat)).copy_(param);
}

}  // namespace apex::optim::detail
