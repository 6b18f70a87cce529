#pragma once

// Internal, ATen-free: SyncBatchNorm's per-rank CPU pieces (kernels/batch_norm.h) written once for
// the regular library (parallel/batch_norm_ops.cpp) and the stable-ABI one
// (python/csrc/stable_ops.cpp). Each body is a template over the library's tensor glue L, which
// supplies, all static:
//
//   Tensor, ref(t)             the tensor type and its ops::TensorRef
//   in_layout(t, layout)       t as a dense tensor in the layout's memory order
//   values(t, dtype)           t's elements as a contiguous tensor of dtype
//   zeros(like, n, dtype)      n zeros of dtype
//   empty_in_layout(x, l)      a tensor shaped and laid out like x (in layout l)

#include <cstdint>

#include "kernels/batch_norm.h"
#include "ops/lists.h"

namespace apex::ops {

/// An (N, C, ...) input viewed as [outer, C, inner] in its own memory order: channels-last (C
/// innermost, as ATen's is_contiguous(ChannelsLast[3d]) reads a 4-d or 5-d tensor that is not
/// contiguous) or NC*.
struct BatchNormLayout {
  kernels::BatchNormShape shape;
  bool channels_last = false;
};

/// The layout of x; errors name `who`.
BatchNormLayout batch_norm_layout(const char* who, const TensorRef& x);

/// t's C per-channel values: an error naming `who` and `name` when there are not C of them.
void check_channel_values(const char* who, const TensorRef& t, int64_t c, const char* name);

/// [2C + 1] float64: per channel mean and M2 (sum of squared deviations), then the count.
template <class L>
typename L::Tensor batch_norm_stats(const char* who, const typename L::Tensor& input,
                                    const BatchNormLayout& l) {
  const auto x = L::in_layout(input, l);
  const TensorRef rx = L::ref(x);
  const int64_t c = l.shape.channels;
  auto out = L::zeros(x, 2 * c + 1, ScalarType::Double);
  double* o = static_cast<double*>(L::ref(out).data);
  kernels::BatchNormStatsArgs a;
  a.shape = l.shape;
  a.dtype = kernel_dtype(rx.dtype, who);
  a.x = rx.data;
  a.mean = o;
  a.m2 = o + c;
  kernels::cpu::batch_norm_stats(a);
  o[2 * c] = static_cast<double>(l.shape.outer * l.shape.inner);
  return out;
}

/// out = a * (u - mean) + b * v + k per channel (v and b optional: null), in u's dtype and
/// memory order.
template <class L>
typename L::Tensor batch_norm_elemt(const char* who, const typename L::Tensor& u,
                                    const typename L::Tensor* v, const typename L::Tensor& mean,
                                    const typename L::Tensor& a, const typename L::Tensor* b,
                                    const typename L::Tensor& k, const BatchNormLayout& l) {
  using Tensor = typename L::Tensor;
  const int64_t c = l.shape.channels;
  const Tensor x = L::in_layout(u, l);
  Tensor dy;
  if (v != nullptr) {
    require_backend(L::ref(*v), who);
    dy = L::in_layout(*v, l);
  }
  const auto channel = [&](const Tensor& t, const char* name) {
    check_channel_values(who, L::ref(t), c, name);
    return L::values(t, ScalarType::Float);
  };
  const Tensor mf = channel(mean, "mean");
  const Tensor af = channel(a, "a");
  const Tensor kf = channel(k, "k");
  const Tensor bf = b != nullptr ? channel(*b, "b") : Tensor();
  Tensor out = L::empty_in_layout(x, l);
  const TensorRef rx = L::ref(x);
  kernels::BatchNormElemtArgs e;
  e.shape = l.shape;
  e.u_dtype = e.out_dtype = kernel_dtype(rx.dtype, who);
  e.u = rx.data;
  if (v != nullptr) {
    const TensorRef rdy = L::ref(dy);
    e.v_dtype = kernel_dtype(rdy.dtype, who);
    e.v = rdy.data;
    e.b = static_cast<const float*>(L::ref(bf).data);
  }
  e.out = L::ref(out).data;
  e.a = static_cast<const float*>(L::ref(af).data);
  e.m = static_cast<const float*>(L::ref(mf).data);
  e.k = static_cast<const float*>(L::ref(kf).data);
  if (rx.numel > 0) kernels::cpu::batch_norm_elemt(e);
  return out;
}

/// [2C] float64: per channel sum(dy), then sum(dy * (x - mean)); mean given in float64.
template <class L>
typename L::Tensor batch_norm_backward_reduce(const char* who, const typename L::Tensor& grad_out,
                                              const typename L::Tensor& input,
                                              const typename L::Tensor& mean64,
                                              const BatchNormLayout& l) {
  const int64_t c = l.shape.channels;
  require_backend(L::ref(grad_out), who);
  require_backend(L::ref(mean64), who);
  const auto x = L::in_layout(input, l);
  const auto dy = L::in_layout(grad_out, l);
  const auto m = L::values(mean64, ScalarType::Double);
  auto sums = L::zeros(x, 2 * c, ScalarType::Double);
  const TensorRef rx = L::ref(x);
  const TensorRef rdy = L::ref(dy);
  double* o = static_cast<double*>(L::ref(sums).data);
  kernels::BatchNormBackwardReduceArgs r;
  r.shape = l.shape;
  r.x_dtype = kernel_dtype(rx.dtype, who);
  r.dy_dtype = kernel_dtype(rdy.dtype, who);
  r.x = rx.data;
  r.dy = rdy.data;
  r.mean = static_cast<const double*>(L::ref(m).data);
  r.sum_dy = o;
  r.sum_dy_xmu = o + c;
  kernels::cpu::batch_norm_backward_reduce(r);
  return sums;
}

/// The checks batch_norm_backward_reduce's callers make before choosing a route.
void check_backward_reduce(const char* who, const TensorRef& grad_out, const TensorRef& input,
                           const TensorRef& mean64, const BatchNormLayout& l);

/// The gradient of batch_norm_backward_elemt has the input's shape.
void check_gradient_shape(const char* who, const TensorRef* grad_out, const TensorRef& input);

}  // namespace apex::ops
