#pragma once

// Internal: SyncBatchNorm's per-rank pieces on the CPU kernels (kernels/batch_norm.h), tensors in
// and out, for the two front doors that run the collectives between them: the C++ SyncBatchNorm
// (sync_batch_norm.cpp) and the Python package's ops (python/csrc/ops.cpp). CUDA input takes a
// route through ATen ops (float64 sums), which detail::force_sync_batch_norm_aten forces for CPU
// input too (the tests check it there). Statistics and sums come back on the CPU either way.

#include <ATen/core/Tensor.h>

#include "kernels/batch_norm.h"
#include "ops/batch_norm_ops.h"

namespace apex::parallel::detail {

/// x viewed as [outer, C, inner] in its own memory order (ops::BatchNormLayout), and that order
/// for tensors like it.
struct BatchNormLayout : ops::BatchNormLayout {
  at::MemoryFormat format = at::MemoryFormat::Contiguous;
};

/// The layout of an (N, C, ...) input; errors name `who`.
BatchNormLayout batch_norm_layout(const at::Tensor& x, const char* who);

/// [2C + 1] float64: per channel mean and M2 (sum of squared deviations), then the count.
at::Tensor batch_norm_stats(const at::Tensor& x, const char* who);

/// out = a * (u - mean) + b * v + k per channel (v and b optional: null), in u's dtype and
/// memory order. mean, a, b, k: C values, any float dtype.
at::Tensor batch_norm_elemt(const char* who, const at::Tensor& u, const at::Tensor* v,
                            const at::Tensor& mean, const at::Tensor& a, const at::Tensor* b,
                            const at::Tensor& k);

/// [2C] float64: per channel sum(dy), then sum(dy * (x - mean)); mean given in float64.
at::Tensor batch_norm_backward_reduce(const char* who, const at::Tensor& dy, const at::Tensor& x,
                                      const at::Tensor& mean64);

}  // namespace apex::parallel::detail
