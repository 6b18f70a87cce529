#include "apex/optim/multi_tensor.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <limits>
#include <utility>

#include "bridge/bridge.h"

namespace apex::optim {
namespace {

using bridge::ListBuilder;

float* flag_ptr(const at::Tensor& found_inf, c10::Device device, const char* who) {
  TORCH_CHECK(found_inf.defined(), who, ": found_inf must be a defined one-element float32 tensor");
  return bridge::scalar_ptr(found_inf, device, who, "found_inf");
}

std::tuple<at::Tensor, at::Tensor> run_norm(const std::vector<at::Tensor>& x,
                                            const at::Tensor& inv_scale, bool per_tensor,
                                            kernels::NormType type, const char* who) {
  bridge::check_list(x, who, "x");
  const c10::Device device = x.front().device();
  const auto opts = x.front().options().dtype(at::kFloat);
  at::Tensor total = at::empty({}, opts);
  at::Tensor per = per_tensor ? at::empty({static_cast<int64_t>(x.size())}, opts) : at::Tensor();
  ListBuilder b(1);
  for (const auto& t : x) b.add({t});
  kernels::NormArgs args;
  args.type = type;
  args.inv_scale = bridge::scalar_ptr(inv_scale, device, who, "inv_scale");
  args.total = total.data_ptr<float>();
  args.per_tensor = per_tensor ? per.data_ptr<float>() : nullptr;
  const auto lists = b.view();
  bridge::launch(device, kernels::cpu::norm, kernels::cuda::norm, lists, args);
  return {total, per};
}

}  // namespace

void multi_tensor_scale(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out,
                        double scale, const at::Tensor& found_inf) {
  constexpr const char* who = "multi_tensor_scale";
  bridge::check_list(in, who, "in");
  bridge::check_list(out, who, "out");
  bridge::check_matching(in, out, who, "in", "out");
  ListBuilder b(2);
  for (size_t i = 0; i < in.size(); ++i) b.add({in[i], out[i]});
  kernels::ScaleArgs args;
  args.scale = static_cast<float>(scale);
  args.found_inf = flag_ptr(found_inf, in.front().device(), who);
  const auto lists = b.view();
  bridge::launch(in.front().device(), kernels::cpu::scale, kernels::cuda::scale, lists, args);
}

void multi_tensor_axpby(const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& y,
                        const std::vector<at::Tensor>& out, double a, double b,
                        const at::Tensor& found_inf, int arg_to_check) {
  constexpr const char* who = "multi_tensor_axpby";
  TORCH_CHECK(arg_to_check >= -1 && arg_to_check <= 1, who,
              ": arg_to_check must be -1 (both), 0 (x) or 1 (y), got ", arg_to_check);
  bridge::check_list(x, who, "x");
  bridge::check_list(y, who, "y");
  bridge::check_list(out, who, "out");
  bridge::check_matching(x, y, who, "x", "y");
  bridge::check_matching(x, out, who, "x", "out");
  ListBuilder builder(3);
  for (size_t i = 0; i < x.size(); ++i) builder.add({x[i], y[i], out[i]});
  kernels::AxpbyArgs args;
  args.a = static_cast<float>(a);
  args.b = static_cast<float>(b);
  args.arg_to_check = arg_to_check;
  args.found_inf = flag_ptr(found_inf, x.front().device(), who);
  const auto lists = builder.view();
  bridge::launch(x.front().device(), kernels::cpu::axpby, kernels::cuda::axpby, lists, args);
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& x,
                                                       bool per_tensor) {
  return run_norm(x, at::Tensor(), per_tensor, kernels::NormType::kL2, "multi_tensor_l2norm");
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(const std::vector<at::Tensor>& x,
                                                               const at::Tensor& inv_scale,
                                                               bool per_tensor) {
  TORCH_CHECK(inv_scale.defined(), "multi_tensor_unscale_l2norm: inv_scale must be defined");
  return run_norm(x, inv_scale, per_tensor, kernels::NormType::kL2, "multi_tensor_unscale_l2norm");
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_max_norm(const std::vector<at::Tensor>& x,
                                                         bool per_tensor) {
  return run_norm(x, at::Tensor(), per_tensor, kernels::NormType::kInf, "multi_tensor_max_norm");
}

void multi_tensor_check_finite(const std::vector<at::Tensor>& x, const at::Tensor& found_inf) {
  constexpr const char* who = "multi_tensor_check_finite";
  bridge::check_list(x, who, "x");
  ListBuilder b(1);
  for (const auto& t : x) b.add({t});
  float* flag = flag_ptr(found_inf, x.front().device(), who);
  const auto lists = b.view();
  bridge::on_backend(
      x.front().device(), [&] { kernels::cpu::check_finite(lists, flag); },
      [&](void* s) { kernels::cuda::check_finite(lists, flag, s); });
}

const char* cpu_kernel_isa() { return kernels::cpu::isa_name(); }

double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm, double norm_type,
                       bool error_if_nonfinite) {
  const bool inf_norm = std::isinf(norm_type) && norm_type > 0;
  TORCH_CHECK(inf_norm || norm_type == 2.0,
              "clip_grad_norm_: norm_type must be 2 or infinity, got ", norm_type);
  std::vector<at::Tensor> all;
  for (const auto& p : parameters) {
    const at::Tensor& g = p.grad();
    if (!g.defined()) continue;
    TORCH_CHECK(!g.is_sparse(), "clip_grad_norm_: sparse gradients are not supported");
    all.push_back(g);
  }
  const auto groups = bridge::by_device_and_dtype(all);
  if (groups.empty()) return 0.0;
  double total = 0.0;
  for (const auto& grads : groups) {
    const auto [norm, unused] =
        inf_norm ? multi_tensor_max_norm(grads) : multi_tensor_l2norm(grads);
    const double n = norm.item<float>();
    if (inf_norm) {
      total = (std::isnan(n) || std::isnan(total)) ? std::numeric_limits<double>::quiet_NaN()
                                                   : std::max(total, n);
    } else {
      total += n * n;
    }
  }
  if (!inf_norm) total = std::sqrt(total);
  // LibTorch computes the norm in the gradients' dtype (fp32): round the same way.
  total = static_cast<float>(total);
  TORCH_CHECK(!error_if_nonfinite || std::isfinite(total), "clip_grad_norm_: the total norm of ",
              "order ", norm_type, " of the gradients is non-finite (", total,
              "), so it cannot be clipped; pass error_if_nonfinite=false to scale anyway");
  const float coef = static_cast<float>(max_norm / (static_cast<float>(total) + 1e-6));
  // Multiplying by 1 changes nothing, so that pass is skipped; a NaN coefficient is applied, as
  // LibTorch applies it.
  if (coef >= 1.0f) return total;
  for (const auto& grads : groups) {
    const at::Tensor flag = at::zeros({1}, grads.front().options().dtype(at::kFloat));
    multi_tensor_scale(grads, grads, coef, flag);
  }
  return total;
}

}  // namespace apex::optim
