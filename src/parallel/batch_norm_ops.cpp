#include "parallel/batch_norm_ops.h"

#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include "bridge/bridge.h"

namespace apex::parallel::detail {
namespace {

at::Tensor channel_values(const at::Tensor& t, int64_t c, const char* who, const char* name) {
  TORCH_CHECK(t.numel() == c, who, ": ", name, " has ", t.numel(), " elements, expected ", c);
  return t.detach().to(at::kFloat).contiguous();
}

}  // namespace

BatchNormLayout batch_norm_layout(const at::Tensor& x, const char* who) {
  TORCH_CHECK(x.dim() >= 2, who, ": expected an input of at least 2 dimensions (N, C, ...), got ",
              x.sizes());
  TORCH_CHECK(x.device().is_cpu(), who, ": these kernels run on the CPU, got a tensor on ",
              x.device());
  BatchNormLayout l;
  const int64_t n = x.size(0);
  const int64_t c = x.size(1);
  const int64_t numel = x.numel();
  const bool cl =
      (x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
      (x.dim() == 5 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast3d));
  l.format = !cl            ? at::MemoryFormat::Contiguous
             : x.dim() == 4 ? at::MemoryFormat::ChannelsLast
                            : at::MemoryFormat::ChannelsLast3d;
  l.shape.channels = c;
  if (cl) {
    l.shape.outer = c > 0 ? numel / c : 0;
    l.shape.inner = 1;
  } else {
    l.shape.outer = n;
    l.shape.inner = n * c > 0 ? numel / (n * c) : 1;
  }
  return l;
}

at::Tensor batch_norm_stats(const at::Tensor& input, const char* who) {
  const BatchNormLayout l = batch_norm_layout(input, who);
  const at::Tensor x = input.contiguous(l.format);
  const int64_t c = l.shape.channels;
  at::Tensor out = at::zeros({2 * c + 1}, input.options().dtype(at::kDouble));
  kernels::BatchNormStatsArgs a;
  a.shape = l.shape;
  a.dtype = bridge::kernel_dtype(x, who);
  a.x = x.data_ptr();
  a.mean = out.data_ptr<double>();
  a.m2 = out.data_ptr<double>() + c;
  kernels::cpu::batch_norm_stats(a);
  out.data_ptr<double>()[2 * c] = static_cast<double>(l.shape.outer * l.shape.inner);
  return out;
}

at::Tensor batch_norm_elemt(const char* who, const at::Tensor& u, const at::Tensor* v,
                            const at::Tensor& mean, const at::Tensor& a, const at::Tensor* b,
                            const at::Tensor& k) {
  const BatchNormLayout l = batch_norm_layout(u, who);
  const int64_t c = l.shape.channels;
  TORCH_CHECK(v == nullptr || v->sizes() == u.sizes(), who, ": the gradient has shape ",
              v == nullptr ? u.sizes() : v->sizes(), ", expected ", u.sizes());
  const at::Tensor x = u.contiguous(l.format);
  const at::Tensor dy = v != nullptr ? v->contiguous(l.format) : at::Tensor();
  const at::Tensor mf = channel_values(mean, c, who, "mean");
  const at::Tensor af = channel_values(a, c, who, "a");
  const at::Tensor kf = channel_values(k, c, who, "k");
  const at::Tensor bf = b != nullptr ? channel_values(*b, c, who, "b") : at::Tensor();
  at::Tensor out = at::empty_like(x, x.options(), l.format);
  kernels::BatchNormElemtArgs e;
  e.shape = l.shape;
  e.u_dtype = e.out_dtype = bridge::kernel_dtype(x, who);
  e.u = x.data_ptr();
  if (v != nullptr) {
    e.v_dtype = bridge::kernel_dtype(dy, who);
    e.v = dy.data_ptr();
    e.b = bf.data_ptr<float>();
  }
  e.out = out.data_ptr();
  e.a = af.data_ptr<float>();
  e.m = mf.data_ptr<float>();
  e.k = kf.data_ptr<float>();
  if (x.numel() > 0) kernels::cpu::batch_norm_elemt(e);
  return out;
}

at::Tensor batch_norm_backward_reduce(const char* who, const at::Tensor& grad_out,
                                      const at::Tensor& input, const at::Tensor& mean64) {
  const BatchNormLayout l = batch_norm_layout(input, who);
  const int64_t c = l.shape.channels;
  TORCH_CHECK(grad_out.sizes() == input.sizes(), who, ": the gradient has shape ", grad_out.sizes(),
              ", expected ", input.sizes());
  TORCH_CHECK(mean64.numel() == c, who, ": mean has ", mean64.numel(), " elements, expected ", c);
  const at::Tensor x = input.contiguous(l.format);
  const at::Tensor dy = grad_out.contiguous(l.format);
  const at::Tensor m = mean64.detach().to(at::kDouble).contiguous();
  at::Tensor sums = at::zeros({2 * c}, input.options().dtype(at::kDouble));
  kernels::BatchNormBackwardReduceArgs r;
  r.shape = l.shape;
  r.x_dtype = bridge::kernel_dtype(x, who);
  r.dy_dtype = bridge::kernel_dtype(dy, who);
  r.x = x.data_ptr();
  r.dy = dy.data_ptr();
  r.mean = m.data_ptr<double>();
  r.sum_dy = sums.data_ptr<double>();
  r.sum_dy_xmu = sums.data_ptr<double>() + c;
  kernels::cpu::batch_norm_backward_reduce(r);
  return sums;
}

}  // namespace apex::parallel::detail
