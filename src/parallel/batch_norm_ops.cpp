#include "ops/aten/batch_norm.h"

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
#include "bridge/refs.h"

namespace apex::parallel::detail {
namespace {

// The bodies' view of at::Tensor (ops/batch_norm_ops.h).
struct AtenGlue {
  using Tensor = at::Tensor;
  static apex::ops::TensorRef ref(const Tensor& t) { return bridge::ref(t); }
  static at::MemoryFormat format(const Tensor& t, const apex::ops::BatchNormLayout& l) {
    return !l.channels_last ? at::MemoryFormat::Contiguous
           : t.dim() == 4   ? at::MemoryFormat::ChannelsLast
                            : at::MemoryFormat::ChannelsLast3d;
  }
  static Tensor in_layout(const Tensor& t, const apex::ops::BatchNormLayout& l) {
    return t.contiguous(format(t, l));
  }
  static Tensor values(const Tensor& t, at::ScalarType dtype) {
    return t.detach().to(dtype).contiguous();
  }
  static Tensor zeros(const Tensor& like, int64_t n, at::ScalarType dtype) {
    return at::zeros({n}, like.options().dtype(dtype));
  }
  static Tensor empty_in_layout(const Tensor& x, const apex::ops::BatchNormLayout& l) {
    return at::empty_like(x, x.options(), format(x, l));
  }
};

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
  BatchNormLayout l;
  static_cast<apex::ops::BatchNormLayout&>(l) =
      apex::ops::batch_norm_layout(who, bridge::meta_ref(x));
  TORCH_CHECK(x.device().is_cpu() || x.device().is_cuda(), who,
              ": expected a CPU or CUDA tensor, got one on ", x.device());
  l.format = AtenGlue::format(x, l);
  return l;
}

at::Tensor batch_norm_stats(const at::Tensor& input, const char* who) {
  const BatchNormLayout l = batch_norm_layout(input, who);
  if (use_aten(input)) return aten_stats(input);
  return apex::ops::batch_norm_stats<AtenGlue>(who, input, l);
}

at::Tensor batch_norm_elemt(const char* who, const at::Tensor& u, const at::Tensor* v,
                            const at::Tensor& mean, const at::Tensor& a, const at::Tensor* b,
                            const at::Tensor& k) {
  const BatchNormLayout l = batch_norm_layout(u, who);
  const apex::ops::TensorRef gradient = v != nullptr ? bridge::ref(*v) : apex::ops::TensorRef();
  apex::ops::check_gradient_shape(who, v != nullptr ? &gradient : nullptr, bridge::ref(u));
  if (use_aten(u)) {
    const int64_t c = l.shape.channels;
    TORCH_CHECK(
        mean.numel() == c && a.numel() == c && k.numel() == c && (b == nullptr || b->numel() == c),
        who, ": expected ", c, " values per channel");
    return aten_elemt(u, v, mean, a, b, k);
  }
  return apex::ops::batch_norm_elemt<AtenGlue>(who, u, v, mean, a, b, k, l);
}

at::Tensor batch_norm_backward_reduce(const char* who, const at::Tensor& grad_out,
                                      const at::Tensor& input, const at::Tensor& mean64) {
  const BatchNormLayout l = batch_norm_layout(input, who);
  apex::ops::check_backward_reduce(who, bridge::ref(grad_out), bridge::ref(input),
                                   bridge::ref(mean64), l);
  if (use_aten(input)) return aten_backward_reduce(grad_out, input, mean64);
  return apex::ops::batch_norm_backward_reduce<AtenGlue>(who, grad_out, input, mean64, l);
}

void force_sync_batch_norm_aten(bool on) { aten_forced.store(on); }

}  // namespace apex::parallel::detail
