#pragma once

// Internal, ATen-free: the fused norms' checks and kernel arguments, for the regular library
// (normalization/norm.cpp) and the stable-ABI one (python/csrc/stable_ops.cpp). The callers
// allocate; this says what is valid and what the kernels get.

#include <cstdint>

#include "kernels/norm.h"
#include "ops/tensor_ref.h"

namespace apex::ops {

struct NormGeometry {
  int64_t rows;
  int64_t cols;
};

/// "FusedRMSNorm" or "FusedLayerNorm": the Python ops' name in messages.
inline const char* norm_who(bool rms) { return rms ? "FusedRMSNorm" : "FusedLayerNorm"; }

/// Checks a norm's input, normalized_shape, weight and bias (undefined refs where absent) and eps;
/// the input viewed as rows x cols.
NormGeometry check_norm(const char* who, const TensorRef& x, Dims shape, const TensorRef& w,
                        const TensorRef& b, double eps);

/// Checks what a backward gets besides check_norm's: the gradient's shape, the saved statistics'
/// rows, the saved input's dtype.
void check_norm_backward(const char* who, NormGeometry g, const TensorRef& grad_out,
                         const TensorRef& saved, const TensorRef& mean, const TensorRef& rstd,
                         bool rms, bool memory_efficient, ScalarType input_dtype);

/// Weight and bias of one dtype (the kernels read both as one).
void check_param_dtypes(const char* who, const TensorRef& w, const TensorRef& b);

/// The forward kernel's arguments (from the refs' defined, dtype and data alone, so
/// bridge::data_ref suffices): x, w, b (contiguous; w, b undefined where absent) into y and
/// the statistics (mean undefined for RMSNorm).
kernels::NormForwardArgs norm_forward_args(const char* who, NormGeometry g, double eps, bool rms,
                                           const TensorRef& x, const TensorRef& w,
                                           const TensorRef& b, const TensorRef& y,
                                           const TensorRef& mean, const TensorRef& rstd);

/// The backward kernel's arguments: src is the saved input of x_dtype, or the output when
/// memory-efficient (then b is read too: x_hat = (y - b) / w); dx, dw, db undefined where not
/// wanted. dw and db are written in their own dtype.
kernels::NormBackwardArgs norm_backward_args(const char* who, NormGeometry g, double eps, bool rms,
                                             bool memory_efficient, ScalarType x_dtype,
                                             const TensorRef& dy, const TensorRef& src,
                                             const TensorRef& w, const TensorRef& b,
                                             const TensorRef& mean, const TensorRef& rstd,
                                             const TensorRef& dx, const TensorRef& dw,
                                             const TensorRef& db);

}  // namespace apex::ops
