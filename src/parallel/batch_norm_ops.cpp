#include "parallel/batch_norm_ops.h"

#include <ATen/ops/cat.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/var_mean.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

#include "bridge/bridge.h"

namespace apex::parallel::detail {
namespace {

at::Tensor channel_values(const at::Tensor& t, int64_t c, const char* who, const char* name) {
  TORCH_CHECK(t.numel() == c, who, ": ", name, " has ", t.numel(), " elements, expected ", c);
  return t.detach().to(at::kFloat).contiguous();
}

// ---- the device-generic route (ATen ops): CUDA input, and CPU input when forced ---------------
// Sums in float64 as the CPU kernels' (a float64 copy of the input for the reductions); results
// that the collectives carry ([2C+1] and [2C]) come back on the CPU, as the CPU route's.

std::atomic<bool> aten_forced{false};  // tests: force_sync_batch_norm_aten

bool use_aten(const at::Tensor& x) { return !x.is_cpu() || aten_forced.load(); }

// Every dimension but the channels'.
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// Per-channel values as [1, C, 1, ...] on x's device, to broadcast against x.
at::Tensor per_channel(const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype) {
  std::vector<int64_t> shape(static_cast<size_t>(x.dim()), 1);
  shape[1] = x.size(1);
  return t.detach().to(x.device(), dtype).reshape(shape);
}

at::Tensor aten_stats(const at::Tensor& x) {
  const int64_t c = x.size(1);
  const int64_t n = c > 0 ? x.numel() / c : 0;
  if (n == 0) return at::zeros({2 * c + 1}, at::kDouble);
  const auto [var, mean] = at::var_mean(x.to(at::kDouble), reduce_dims(x), /*correction=*/0);
  return at::cat({mean, var * static_cast<double>(n),
                  at::full({1}, static_cast<double>(n), var.options())})
      .cpu();
}

at::Tensor aten_backward_reduce(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& mean) {
  const auto dims = reduce_dims(x);
  const at::Tensor g = dy.to(at::kDouble);
  const at::Tensor xmu = x.to(at::kDouble) - per_channel(mean, x, at::kDouble);
  return at::cat({g.sum(dims), (g * xmu).sum(dims)}).cpu();
}

at::Tensor aten_elemt(const at::Tensor& u, const at::Tensor* v, const at::Tensor& mean,
                      const at::Tensor& a, const at::Tensor* b, const at::Tensor& k) {
  at::Tensor out =
      (u.to(at::kFloat) - per_channel(mean, u, at::kFloat)) * per_channel(a, u, at::kFloat) +
      per_channel(k, u, at::kFloat);
  if (v != nullptr) out = out + per_channel(*b, u, at::kFloat) * v->to(at::kFloat);
  return out.to(u.scalar_type()).contiguous(u.suggest_memory_format());
}

}  // namespace

BatchNormLayout batch_norm_layout(const at::Tensor& x, const char* who) {
  TORCH_CHECK(x.dim() >= 2, who, ": expected an input of at least 2 dimensions (N, C, ...), got ",
              x.sizes());
  TORCH_CHECK(x.device().is_cpu() || x.device().is_cuda(), who,
              ": expected a CPU or CUDA tensor, got one on ", x.device());
  BatchNormLayout l;
  const bool cl =
      (x.dim() == 4 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast)) ||
      (x.dim() == 5 && !x.is_contiguous() && x.is_contiguous(at::MemoryFormat::ChannelsLast3d));
  l.format = !cl            ? at::MemoryFormat::Contiguous
             : x.dim() == 4 ? at::MemoryFormat::ChannelsLast
                            : at::MemoryFormat::ChannelsLast3d;
  l.shape = kernels::batch_norm_shape(x.size(0), x.size(1), x.numel(), cl);
  return l;
}

at::Tensor batch_norm_stats(const at::Tensor& input, const char* who) {
  const BatchNormLayout l = batch_norm_layout(input, who);
  if (use_aten(input)) return aten_stats(input);
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
  if (use_aten(u)) {
    TORCH_CHECK(
        mean.numel() == c && a.numel() == c && k.numel() == c && (b == nullptr || b->numel() == c),
        who, ": expected ", c, " values per channel");
    return aten_elemt(u, v, mean, a, b, k);
  }
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
  if (use_aten(input)) return aten_backward_reduce(grad_out, input, mean64);
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

void force_sync_batch_norm_aten(bool on) { aten_forced.store(on); }

}  // namespace apex::parallel::detail
