#include "apex/normalization/functional.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/layer_norm.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <vector>

#include "kernels/norm.h"
#include "optim/lists.h"

namespace apex::normalization {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct Geometry {
  int64_t rows;
  int64_t cols;
  size_t shape_dims;
};

Geometry check_inputs(const char* who, const at::Tensor& x, at::IntArrayRef shape,
                      const at::Tensor& w, const at::Tensor& b, double eps) {
  TORCH_CHECK(x.defined(), who, ": input is undefined");
  TORCH_CHECK(at::isFloatingType(x.scalar_type()), who,
              ": input must be a floating-point tensor, got ", x.scalar_type());
  TORCH_CHECK(eps > 0, who, ": eps must be > 0, got ", eps);
  TORCH_CHECK(!shape.empty(), who, ": normalized_shape must not be empty");
  const auto nd = static_cast<int64_t>(shape.size());
  TORCH_CHECK(x.dim() >= nd && x.sizes().slice(static_cast<size_t>(x.dim() - nd)) == shape, who,
              ": normalized_shape ", shape,
              " does not match the trailing dimensions of an input of shape ", x.sizes());
  for (const auto* t : {&w, &b}) {
    if (!t->defined()) continue;
    const char* name = t == &w ? "weight" : "bias";
    TORCH_CHECK(t->sizes() == shape, who, ": ", name, " must have shape ", shape, ", got ",
                t->sizes());
    TORCH_CHECK(t->device() == x.device(), who, ": ", name, " is on ", t->device(),
                " but the input is on ", x.device());
  }
  int64_t cols = 1;
  for (int64_t d : shape) cols *= d;
  return {cols == 0 ? 0 : x.numel() / cols, cols, shape.size()};
}

struct NormFunction : public torch::autograd::Function<NormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, Geometry g, double eps, bool rms, bool mixed) {
    // Absent weight/bias arrive as 0-element placeholders (autograd inputs must be defined).
    const at::Tensor x = input.contiguous();
    const at::Tensor w = weight.numel() > 0 ? weight.contiguous() : at::Tensor();
    const at::Tensor b = bias.numel() > 0 ? bias.contiguous() : at::Tensor();
    // The mixed variants return the parameters' dtype (apex's MixedFused* definition).
    at::Tensor y =
        at::empty_like(x, x.options().dtype(mixed ? weight.scalar_type() : x.scalar_type()),
                       at::MemoryFormat::Contiguous);
    const auto stat_opts = x.options().dtype(at::kFloat);
    at::Tensor mean = rms ? at::Tensor() : at::empty({g.rows}, stat_opts);
    at::Tensor rstd = at::empty({g.rows}, stat_opts);
    kernels::NormForwardArgs a;
    a.rows = g.rows;
    a.cols = g.cols;
    a.rms = rms;
    a.eps = static_cast<float>(eps);
    a.x_dtype = optim::detail::kernel_dtype(x, rms ? "FusedRMSNorm" : "FusedLayerNorm");
    a.y_dtype = optim::detail::kernel_dtype(y, rms ? "FusedRMSNorm" : "FusedLayerNorm");
    if (w.defined()) a.w_dtype = optim::detail::kernel_dtype(w, "FusedLayerNorm weight");
    if (b.defined()) a.w_dtype = optim::detail::kernel_dtype(b, "FusedLayerNorm bias");
    a.x = x.data_ptr();
    a.w = w.defined() ? w.data_ptr() : nullptr;
    a.b = b.defined() ? b.data_ptr() : nullptr;
    a.y = y.data_ptr();
    a.mean = rms ? nullptr : mean.data_ptr<float>();
    a.rstd = rstd.data_ptr<float>();
    if (g.rows > 0 && g.cols > 0) kernels::cpu::norm_forward(a);
    ctx->save_for_backward({x, w.defined() ? w : at::empty({0}, x.options()),
                            rms ? at::empty({0}, stat_opts) : mean, rstd});
    ctx->saved_data["rms"] = rms;
    ctx->saved_data["rows"] = g.rows;
    ctx->saved_data["cols"] = g.cols;
    ctx->saved_data["has_bias"] = b.defined();
    ctx->saved_data["bias_dtype"] = b.defined() ? static_cast<int64_t>(b.scalar_type()) : 0;
    ctx->saved_data["shape"] = std::vector<int64_t>(
        x.sizes().begin() + (x.dim() - static_cast<int64_t>(g.shape_dims)), x.sizes().end());
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "FusedLayerNorm/FusedRMSNorm: double backward is not supported");
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor w = saved[1].numel() > 0 ? saved[1] : at::Tensor();
    const at::Tensor& mean = saved[2];
    const at::Tensor& rstd = saved[3];
    const bool rms = ctx->saved_data["rms"].toBool();
    const int64_t rows = ctx->saved_data["rows"].toInt();
    const int64_t cols = ctx->saved_data["cols"].toInt();
    const bool has_bias = ctx->saved_data["has_bias"].toBool();
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dx = at::empty_like(x, at::MemoryFormat::Contiguous);
    const auto f32 = x.options().dtype(at::kFloat);
    at::Tensor dw = w.defined() ? at::empty({cols}, f32) : at::Tensor();
    at::Tensor db = has_bias ? at::empty({cols}, f32) : at::Tensor();
    kernels::NormBackwardArgs a;
    a.rows = rows;
    a.cols = cols;
    a.rms = rms;
    a.x_dtype = optim::detail::kernel_dtype(x, "FusedLayerNorm");
    a.dy_dtype = optim::detail::kernel_dtype(dy, "FusedLayerNorm gradient");
    if (w.defined()) a.w_dtype = optim::detail::kernel_dtype(w, "FusedLayerNorm weight");
    a.dy = dy.data_ptr();
    a.x = x.data_ptr();
    a.w = w.defined() ? w.data_ptr() : nullptr;
    a.mean = rms ? nullptr : mean.data_ptr<float>();
    a.rstd = rstd.data_ptr<float>();
    a.dx = dx.data_ptr();
    a.dw = dw.defined() ? dw.data_ptr<float>() : nullptr;
    a.db = db.defined() ? db.data_ptr<float>() : nullptr;
    if (rows > 0 && cols > 0) {
      kernels::cpu::norm_backward(a);
    } else {
      dx.zero_();
      if (dw.defined()) dw.zero_();
      if (db.defined()) db.zero_();
    }
    const auto shape = ctx->saved_data["shape"].toIntVector();
    if (dw.defined()) dw = dw.view(shape).to(w.scalar_type());
    if (db.defined()) {
      db = db.view(shape).to(static_cast<at::ScalarType>(ctx->saved_data["bias_dtype"].toInt()));
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor run(const char* who, const at::Tensor& input, at::IntArrayRef shape,
               const at::Tensor& weight, const at::Tensor& bias, double eps, bool rms,
               bool mixed = false) {
  const Geometry g = check_inputs(who, input, shape, weight, bias, eps);
  TORCH_CHECK(!mixed || weight.defined(), who, ": the mixed-dtype variants need a weight");
  if (!input.device().is_cpu()) {
    // CUDA kernels come later: the composite ATen expression, correct but not fused.
    const auto out_dtype = mixed ? weight.scalar_type() : input.scalar_type();
    if (!rms) return at::layer_norm(input.to(out_dtype), shape, weight, bias, eps);
    std::vector<int64_t> dims;
    for (int64_t d = input.dim() - static_cast<int64_t>(shape.size()); d < input.dim(); ++d) {
      dims.push_back(d);
    }
    const at::Tensor x = input.to(at::kFloat);
    at::Tensor y = x * (x.square().mean(dims, /*keepdim=*/true) + eps).rsqrt();
    if (weight.defined()) y = y * weight;
    return y.to(out_dtype);
  }
  const at::Tensor none = at::empty({0}, input.options());
  return NormFunction::apply(input, weight.defined() ? weight : none, bias.defined() ? bias : none,
                             g, eps, rms, mixed);
}

}  // namespace

at::Tensor fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return run("fused_layer_norm", input, normalized_shape, weight, bias, eps, false);
}

at::Tensor fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const at::Tensor& weight, double eps) {
  return run("fused_rms_norm", input, normalized_shape, weight, at::Tensor(), eps, true);
}

at::Tensor mixed_fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                  const at::Tensor& weight, const at::Tensor& bias, double eps) {
  return run("mixed_fused_layer_norm", input, normalized_shape, weight, bias, eps, false, true);
}

at::Tensor mixed_fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                const at::Tensor& weight, double eps) {
  return run("mixed_fused_rms_norm", input, normalized_shape, weight, at::Tensor(), eps, true,
             true);
}

}  // namespace apex::normalization
