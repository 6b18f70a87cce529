// Kernel interface of SyncBatchNorm's per-channel pieces. Plain structs: src/parallel checks the
// tensors, runs the collectives between the calls and calls the CPU backend (kernels::cpu).
//
// The input is viewed as [outer, channels, inner], contiguous: NC* input has outer = N and
// inner = the spatial size; channels-last input has outer = N * spatial and inner = 1.
// Storage is fp32, fp16 or bf16; values are widened to fp32 and every sum is fp64, in a fixed
// order, so results do not depend on the thread count.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels {

struct BatchNormShape {
  int64_t outer = 0;
  int64_t channels = 0;
  int64_t inner = 0;
};

/// The view of an input of `numel` elements with n = size(0) and c = size(1): NC* input as
/// [n, c, the spatial size], channels-last input as [n * the spatial size, c, 1].
inline BatchNormShape batch_norm_shape(int64_t n, int64_t c, int64_t numel, bool channels_last) {
  BatchNormShape s;
  s.channels = c;
  if (channels_last) {
    s.outer = c > 0 ? numel / c : 0;
    s.inner = 1;
  } else {
    s.outer = n;
    s.inner = n * c > 0 ? numel / (n * c) : 1;
  }
  return s;
}

/// Per channel c over its count = outer * inner values: mean[c] and m2[c] = sum (x - mean)^2
/// (Welford's quantities: blocks of values summed around the block's own mean, then merged with
/// Chan's formula).
struct BatchNormStatsArgs {
  BatchNormShape shape;
  DType dtype = DType::kFloat32;
  const void* x = nullptr;
  double* mean = nullptr;  ///< [channels]
  double* m2 = nullptr;    ///< [channels]
};

/// out = a[c] * (u - m[c]) + b[c] * v + k[c], per element, in fp32; u, v and out in their own
/// dtypes (v optional). The forward is y = (w * invstd) * (x - mean) + bias; the input gradient
/// dx = (w * invstd) * dy - (w * invstd^3 * sum_dy_xmu / n) * (x - mean) - w * invstd * sum_dy / n.
struct BatchNormElemtArgs {
  BatchNormShape shape;
  DType u_dtype = DType::kFloat32;
  DType v_dtype = DType::kFloat32;
  DType out_dtype = DType::kFloat32;
  const void* u = nullptr;
  const void* v = nullptr;  ///< null: no v term
  void* out = nullptr;
  const float* a = nullptr;  ///< [channels]
  const float* m = nullptr;  ///< [channels]
  const float* b = nullptr;  ///< [channels]; unused when v is null
  const float* k = nullptr;  ///< [channels]
};

/// Per channel: sum_dy[c] = sum dy, sum_dy_xmu[c] = sum dy * (x - mean[c]).
struct BatchNormBackwardReduceArgs {
  BatchNormShape shape;
  DType x_dtype = DType::kFloat32;
  DType dy_dtype = DType::kFloat32;
  const void* x = nullptr;
  const void* dy = nullptr;
  /// [channels], in fp64: sum dy * (x - mean) cancels, and an fp32 mean's rounding error times
  /// sum dy would stand out of it.
  const double* mean = nullptr;
  double* sum_dy = nullptr;  ///< [channels]
  double* sum_dy_xmu = nullptr;
};

namespace cpu {
void batch_norm_stats(const BatchNormStatsArgs& a);
void batch_norm_elemt(const BatchNormElemtArgs& a);
void batch_norm_backward_reduce(const BatchNormBackwardReduceArgs& a);
}  // namespace cpu

}  // namespace apex::kernels
