#include "apex/normalization/functional.h"

#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>

#include <array>
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

struct Flags {
  bool rms;
  bool mixed;
  bool memory_efficient;
};

const char* op_name(bool rms) { return rms ? "FusedRMSNorm" : "FusedLayerNorm"; }

at::Tensor placeholder(const at::Tensor& t, const at::TensorOptions& like) {
  return t.defined() ? t : at::empty({0}, like);
}

// Statistics and output in float64 with ATen ops, for float64 tensors (gradcheck, references):
// the same formulas as the kernels. Returns {y, mean (LayerNorm), rstd}.
std::array<at::Tensor, 3> forward_f64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                      const Geometry& g, double eps, bool rms) {
  const at::Tensor x2 = x.view({g.rows, g.cols}).to(at::kDouble);
  const at::Tensor mean = rms ? at::Tensor() : x2.mean({1}, /*keepdim=*/true);
  const at::Tensor xc = rms ? x2 : x2 - mean;
  const at::Tensor rstd = (xc.square().mean({1}, /*keepdim=*/true) + eps).rsqrt();
  at::Tensor y = xc * rstd;
  if (w.defined()) y = y * w.reshape({g.cols}).to(at::kDouble);
  if (b.defined()) y = y + b.reshape({g.cols}).to(at::kDouble);
  return {y, rms ? at::Tensor() : mean.view({g.rows}), rstd.view({g.rows})};
}

// {dx, dw, db} in float64 from x_hat (already recomputed), dy and rstd.
std::array<at::Tensor, 3> backward_f64(const at::Tensor& xh, const at::Tensor& dy2,
                                       const at::Tensor& w, const at::Tensor& rstd, bool rms,
                                       bool want_b) {
  const at::Tensor gr = w.defined() ? dy2 * w : dy2;
  at::Tensor inner = gr - xh * (gr * xh).mean({1}, /*keepdim=*/true);
  if (!rms) inner = inner - gr.mean({1}, /*keepdim=*/true);
  return {rstd.view({-1, 1}) * inner, w.defined() ? (dy2 * xh).sum({0}) : at::Tensor(),
          want_b ? dy2.sum({0}) : at::Tensor()};
}

bool is_f64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const auto f64 = [](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kDouble;
  };
  return f64(x) || f64(w) || f64(b);
}

// The mixed variants return the parameters' dtype (apex's MixedFused* definition).
at::ScalarType output_dtype(const at::Tensor& x, const at::Tensor& weight, Flags f) {
  return f.mixed ? weight.scalar_type() : x.scalar_type();
}

// What the forward computes: y and the statistics the backward needs ({y, mean (LayerNorm),
// rstd}). x, w, b are contiguous; absent w/b undefined.
std::array<at::Tensor, 3> norm_forward(const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& b, const Geometry& g, double eps, Flags f,
                                       at::ScalarType out_dtype) {
  const char* who = op_name(f.rms);
  if (is_f64(x, w, b)) {
    auto [y64, mean64, rstd64] = forward_f64(x, w, b, g, eps, f.rms);
    return {y64.to(out_dtype).view(x.sizes()), mean64, rstd64};
  }
  at::Tensor y = at::empty_like(x, x.options().dtype(out_dtype), at::MemoryFormat::Contiguous);
  const auto stat_opts = x.options().dtype(at::kFloat);
  at::Tensor mean = f.rms ? at::Tensor() : at::empty({g.rows}, stat_opts);
  at::Tensor rstd = at::empty({g.rows}, stat_opts);
  kernels::NormForwardArgs a;
  a.rows = g.rows;
  a.cols = g.cols;
  a.rms = f.rms;
  a.eps = static_cast<float>(eps);
  a.x_dtype = optim::detail::kernel_dtype(x, who);
  a.y_dtype = optim::detail::kernel_dtype(y, who);
  if (w.defined()) a.w_dtype = optim::detail::kernel_dtype(w, who);
  if (b.defined()) a.w_dtype = optim::detail::kernel_dtype(b, who);
  TORCH_CHECK(!w.defined() || !b.defined() || w.scalar_type() == b.scalar_type(), who,
              ": weight and bias must have the same dtype, got ", w.scalar_type(), " and ",
              b.scalar_type());
  a.x = x.data_ptr();
  a.w = w.defined() ? w.data_ptr() : nullptr;
  a.b = b.defined() ? b.data_ptr() : nullptr;
  a.y = y.data_ptr();
  a.mean = f.rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  if (g.rows > 0 && g.cols > 0) {
    if (x.is_cuda()) {
      const c10::DeviceGuard guard(x.device());
      kernels::cuda::norm_forward(a, optim::detail::cuda_stream(x.device()));
    } else {
      kernels::cpu::norm_forward(a);
    }
  }
  return {y, mean, rstd};
}

// What the backward needs besides the saved tensors, kept as one saved_data entry (each entry
// is a hashed string key: nine of them cost about as much as a small norm's kernel).
struct Meta {
  bool rms;
  bool memory_efficient;
  bool f64;
  bool has_bias;
  int64_t rows;
  int64_t cols;
  at::ScalarType x_dtype;
  at::ScalarType bias_dtype;
  std::vector<int64_t> shape;

  std::vector<int64_t> encode() const {
    std::vector<int64_t> v = {rms,
                              memory_efficient,
                              f64,
                              has_bias,
                              rows,
                              cols,
                              static_cast<int64_t>(x_dtype),
                              static_cast<int64_t>(bias_dtype)};
    v.insert(v.end(), shape.begin(), shape.end());
    return v;
  }
  static Meta decode(const std::vector<int64_t>& v) {
    return {v[0] != 0,
            v[1] != 0,
            v[2] != 0,
            v[3] != 0,
            v[4],
            v[5],
            static_cast<at::ScalarType>(v[6]),
            static_cast<at::ScalarType>(v[7]),
            std::vector<int64_t>(v.begin() + 8, v.end())};
  }
};

struct NormFunction : public torch::autograd::Function<NormFunction> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& input, const at::Tensor& weight,
                            const at::Tensor& bias, Geometry g, double eps, Flags f) {
    // Absent weight/bias arrive as 0-element placeholders (autograd inputs must be defined).
    const at::Tensor x = input.contiguous();
    const at::Tensor w = weight.numel() > 0 ? weight.contiguous() : at::Tensor();
    const at::Tensor b = bias.numel() > 0 ? bias.contiguous() : at::Tensor();
    auto [y, mean, rstd] = norm_forward(x, w, b, g, eps, f, output_dtype(x, weight, f));
    const auto none = x.options();
    // memory_efficient keeps the output (which the next layer usually keeps anyway) instead of
    // the input, and recomputes x_hat = (y - bias) / weight in the backward.
    if (f.memory_efficient) {
      ctx->save_for_backward({y, placeholder(w, none), placeholder(b, none), rstd});
    } else {
      ctx->save_for_backward({x, placeholder(w, none), placeholder(mean, none), rstd});
    }
    const Meta meta{
        f.rms,
        f.memory_efficient,
        is_f64(x, w, b),
        b.defined(),
        g.rows,
        g.cols,
        x.scalar_type(),
        b.defined() ? b.scalar_type() : at::kFloat,
        std::vector<int64_t>(x.sizes().begin() + (x.dim() - static_cast<int64_t>(g.shape_dims)),
                             x.sizes().end())};
    ctx->saved_data["meta"] = meta.encode();
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    TORCH_CHECK(!at::GradMode::is_enabled(),
                "FusedLayerNorm/FusedRMSNorm: double backward is not supported");
    const auto saved = ctx->get_saved_variables();
    const Meta meta = Meta::decode(ctx->saved_data["meta"].toIntVector());
    const bool rms = meta.rms;
    const bool mem_eff = meta.memory_efficient;
    const bool f64 = meta.f64;
    const int64_t rows = meta.rows;
    const int64_t cols = meta.cols;
    const bool has_bias = meta.has_bias;
    const auto x_dtype = meta.x_dtype;
    const auto& shape = meta.shape;
    const at::Tensor& src = saved[0];  // x, or y when memory-efficient
    const at::Tensor w = saved[1].numel() > 0 ? saved[1] : at::Tensor();
    const at::Tensor b = mem_eff && saved[2].numel() > 0 ? saved[2] : at::Tensor();
    const at::Tensor& mean = saved[2];
    const at::Tensor& rstd = saved[3];
    const at::Tensor dy = grads[0].contiguous();
    at::Tensor dx;
    at::Tensor dw;
    at::Tensor db;
    if (f64) {
      const auto d = [&](const at::Tensor& t) { return t.reshape({-1, cols}).to(at::kDouble); };
      at::Tensor xh;
      if (mem_eff) {
        xh = d(src);
        if (b.defined()) xh = xh - d(b);
        if (w.defined()) xh = xh / d(w);
      } else {
        xh = (rms ? d(src) : d(src) - mean.view({-1, 1})) * rstd.view({-1, 1});
      }
      auto r = backward_f64(xh, d(dy), w.defined() ? d(w) : at::Tensor(), rstd, rms, has_bias);
      dx = r[0].to(x_dtype).view(src.sizes());
      dw = r[1];
      db = r[2];
    } else {
      dx = at::empty(src.sizes(), src.options().dtype(x_dtype));
      // The CPU backend writes dw/db in the parameters' dtype; the CUDA one in fp32 (cast below).
      const auto param_dtype = w.defined() ? w.scalar_type() : meta.bias_dtype;
      const auto dwb = src.options().dtype(src.is_cuda() ? at::kFloat : param_dtype);
      dw = w.defined() ? at::empty({cols}, dwb) : at::Tensor();
      db = has_bias ? at::empty({cols}, dwb) : at::Tensor();
      const char* who = op_name(rms);
      kernels::NormBackwardArgs a;
      a.rows = rows;
      a.cols = cols;
      a.rms = rms;
      a.x_dtype = optim::detail::kernel_dtype(dx, who);
      a.dy_dtype = optim::detail::kernel_dtype(dy, who);
      TORCH_CHECK(!mem_eff || src.scalar_type() == dy.scalar_type(), who, ": the gradient's dtype ",
                  dy.scalar_type(), " differs from the output's ", src.scalar_type());
      if (w.defined()) a.w_dtype = optim::detail::kernel_dtype(w, who);
      if (b.defined()) a.w_dtype = optim::detail::kernel_dtype(b, who);
      a.dy = dy.data_ptr();
      a.x = mem_eff ? nullptr : src.data_ptr();
      a.y = mem_eff ? src.data_ptr() : nullptr;
      a.w = w.defined() ? w.data_ptr() : nullptr;
      a.b = b.defined() ? b.data_ptr() : nullptr;
      a.mean = rms || mem_eff ? nullptr : mean.data_ptr<float>();
      a.rstd = rstd.data_ptr<float>();
      a.dx = dx.data_ptr();
      a.dw = dw.defined() ? dw.data_ptr() : nullptr;
      a.db = db.defined() ? db.data_ptr() : nullptr;
      if (dw.defined() || db.defined())
        a.dwb_dtype = optim::detail::kernel_dtype(dw.defined() ? dw : db, who);
      if (rows > 0 && cols > 0) {
        if (src.is_cuda()) {
          const c10::DeviceGuard guard(src.device());
          // The dw/db partial rows come from torch's caching allocator (on the current stream),
          // which already holds the device's memory; freed after the work is enqueued, as usual.
          at::Tensor workspace;
          a.workspace = [&](std::size_t bytes) {
            workspace = at::empty({static_cast<int64_t>(bytes)}, src.options().dtype(at::kByte));
            return workspace.data_ptr();
          };
          kernels::cuda::norm_backward(a, optim::detail::cuda_stream(src.device()));
        } else {
          kernels::cpu::norm_backward(a);
        }
      } else {
        dx.zero_();
        if (dw.defined()) dw.zero_();
        if (db.defined()) db.zero_();
      }
    }
    if (dw.defined()) dw = dw.view(shape).to(w.scalar_type());
    if (db.defined()) {
      db = db.view(shape).to(meta.bias_dtype);
    }
    return {dx, dw, db, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

at::Tensor run(const char* who, const at::Tensor& input, at::IntArrayRef shape,
               const at::Tensor& weight, const at::Tensor& bias, double eps, Flags f) {
  const Geometry g = check_inputs(who, input, shape, weight, bias, eps);
  TORCH_CHECK(!f.mixed || weight.defined(), who, ": the mixed-dtype variants need a weight");
  TORCH_CHECK(input.device().is_cpu() || input.device().is_cuda(), who,
              ": expected a CPU or CUDA tensor, got one on ", input.device());
  const bool grad = at::GradMode::is_enabled() &&
                    (input.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                     (bias.defined() && bias.requires_grad()));
  // Forward-mode tangents (dual tensors) go through the autograd Function too, which rejects
  // them with LibTorch's message; the plain path would drop them silently.
  const auto tangent = [](const at::Tensor& t) {
    return t.defined() && t._fw_grad(/*level=*/0).defined();
  };
  if (!grad && !tangent(input) && !tangent(weight) && !tangent(bias)) {
    // Nothing to record (inference, or no_grad): the kernels without the autograd node, its
    // saved tensors and metadata, which cost more than the kernel itself on small inputs.
    const at::Tensor w = weight.defined() ? weight.contiguous() : at::Tensor();
    const at::Tensor b = bias.defined() ? bias.contiguous() : at::Tensor();
    return norm_forward(input.contiguous(), w, b, g, eps, f, output_dtype(input, weight, f))[0];
  }
  const at::TensorOptions opts = input.options();
  return NormFunction::apply(input, placeholder(weight, opts), placeholder(bias, opts), g, eps, f);
}

}  // namespace

at::Tensor fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, const at::Tensor& bias, double eps,
                            bool memory_efficient) {
  return run("fused_layer_norm", input, normalized_shape, weight, bias, eps,
             {false, false, memory_efficient});
}

at::Tensor fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const at::Tensor& weight, double eps, bool memory_efficient) {
  return run("fused_rms_norm", input, normalized_shape, weight, at::Tensor(), eps,
             {true, false, memory_efficient});
}

at::Tensor mixed_fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                  const at::Tensor& weight, const at::Tensor& bias, double eps,
                                  bool memory_efficient) {
  return run("mixed_fused_layer_norm", input, normalized_shape, weight, bias, eps,
             {false, true, memory_efficient});
}

at::Tensor mixed_fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                const at::Tensor& weight, double eps, bool memory_efficient) {
  return run("mixed_fused_rms_norm", input, normalized_shape, weight, at::Tensor(), eps,
             {true, true, memory_efficient});
}

}  // namespace apex::normalization
