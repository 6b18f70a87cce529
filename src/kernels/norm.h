// Kernel interface of the fused LayerNorm / RMSNorm. Plain structs: the host layer
// (src/normalization) checks tensors and calls the CPU backend (namespace kernels::cpu) or the
// CUDA backend (kernels/cuda/norm.cu) with the same declarations. Rows are contiguous; math is in
// fp32.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

#include "kernels/multi_tensor.h"

#if defined(__CUDACC__)
#define APEX_NORM_HOST_DEVICE __host__ __device__
#else
#define APEX_NORM_HOST_DEVICE
#endif

namespace apex::kernels {

/// What memory-efficient mode divides y - b by: the weight clamped by magnitude to at least eps,
/// as apex does (|w| < eps gives eps of w's sign, +eps for zeros; NaN stays NaN). One definition
/// for the CPU and CUDA backends.
APEX_NORM_HOST_DEVICE inline float weight_divisor(float w, float eps) {
  return w >= 0.0f ? (w < eps ? eps : w) : (w > -eps ? -eps : w);
}

/// y = (x - mean) * rstd * w + b per row (LayerNorm), or x * rstd * w (RMSNorm, no mean).
/// mean (LayerNorm only) and rstd are written per row in fp32.
struct NormForwardArgs {
  int64_t rows = 0;
  int64_t cols = 0;
  bool rms = false;
  float eps = 1e-5f;
  DType x_dtype = DType::kFloat32;
  DType y_dtype = DType::kFloat32;  ///< x's dtype, or the parameters' for the mixed variants
  DType w_dtype = DType::kFloat32;  ///< w and b
  const void* x = nullptr;
  const void* w = nullptr;  ///< null: no affine weight
  const void* b = nullptr;  ///< null: no bias
  void* y = nullptr;
  float* mean = nullptr;  ///< [rows]; unused for RMSNorm
  float* rstd = nullptr;  ///< [rows]
};

/// Gradients of the forward above from dy and the saved x, mean, rstd:
///   x_hat = (x - mean) * rstd;  g = dy * w
/// or, memory-efficient (y set, x and mean unused), from the saved output:
///   x_hat = (y - b) / w   (b, w each optional; w clamped by magnitude to at least eps, as apex
///                          does, so that a zero weight gives x_hat = 0 rather than 0/0)
///   LayerNorm: dx = rstd * (g - mean(g) - x_hat * mean(g * x_hat))
///   RMSNorm:   dx = rstd * (g - x_hat * mean(g * x_hat))
///   dw = sum over rows of dy * x_hat;  db = sum over rows of dy
/// dw/db are [cols] (null when not wanted); partial sums per fixed block of rows are combined in
/// a fixed order, so results do not depend on scheduling.
struct NormBackwardArgs {
  int64_t rows = 0;
  int64_t cols = 0;
  bool rms = false;
  float eps = 1e-5f;  ///< the forward's: memory-efficient mode divides by w clamped to |w| >= eps
  DType x_dtype = DType::kFloat32;   ///< x and dx
  DType dy_dtype = DType::kFloat32;  ///< the forward output's dtype: dy and y
  DType w_dtype = DType::kFloat32;   ///< w and b
  const void* dy = nullptr;
  const void* x = nullptr;  ///< null in memory-efficient mode
  const void* y = nullptr;  ///< set: memory-efficient mode (x_hat from the output)
  const void* w = nullptr;
  const void* b = nullptr;  ///< read only in memory-efficient mode
  const float* mean = nullptr;
  const float* rstd = nullptr;
  /// Null (CPU backend only): dx is not wanted, and each row is read once for dw/db alone.
  void* dx = nullptr;
  void* dw = nullptr;  ///< [cols] in dwb_dtype, or null
  void* db = nullptr;
  /// dw and db's dtype. The CPU backend writes any of the three (its fp64 sums rounded to fp32,
  /// then to the dtype, as a cast of an fp32 result would); the CUDA backend writes fp32 only.
  DType dwb_dtype = DType::kFloat32;
  /// CUDA backend: device scratch for the dw/db partial rows. Called at most once with the bytes
  /// needed; must return memory usable on the call's stream by the work this call enqueues (the
  /// framework's caching allocator: it is what already holds the device's memory). Empty: the
  /// backend allocates its own with cudaMallocAsync. Unused by the CPU backend.
  std::function<void*(std::size_t)> workspace;
};

namespace cpu {
void norm_forward(const NormForwardArgs& args);
void norm_backward(const NormBackwardArgs& args);
}  // namespace cpu

namespace cuda {
// Same semantics as the CPU backend, enqueued on `stream` (a cudaStream_t) of the current device.
// dw/db are deterministic (fixed partial blocks, no atomics).
void norm_forward(const NormForwardArgs& args, void* stream);
void norm_backward(const NormBackwardArgs& args, void* stream);
}  // namespace cuda

}  // namespace apex::kernels
