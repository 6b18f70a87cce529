#pragma once

// Internal: the norms' kernels without the C++ autograd node, for front doors that record
// autograd themselves (the Python package's custom ops, whose traced route records it through
// the dispatcher), and the library's own autograd route for their eager calls.
// Checks and dtype rules are the functional API's (apex/normalization/functional.h).

#include <ATen/core/Tensor.h>

#include <array>

namespace apex::normalization::ops {

/// {y, mean, rstd}: y in the input's dtype (the weight's when `mixed`), the statistics fp32 [rows]
/// (mean undefined for RMSNorm).
std::array<at::Tensor, 3> forward(const char* who, const at::Tensor& input,
                                  at::IntArrayRef normalized_shape, const at::Tensor& weight,
                                  const at::Tensor& bias, double eps, bool rms, bool mixed,
                                  bool memory_efficient);

/// forward() with the C++ library's own autograd: y's history is its NormBackward node (the
/// kernels called directly, no dispatcher) when GradMode is on and an input requires a gradient;
/// the statistics carry no history. For eager CPU/CUDA tensors only: a traced call (fake or
/// functional tensors) must take the ops through the dispatcher.
std::array<at::Tensor, 3> forward_autograd(const char* who, const at::Tensor& input,
                                           at::IntArrayRef normalized_shape,
                                           const at::Tensor& weight, const at::Tensor& bias,
                                           double eps, bool rms, bool mixed, bool memory_efficient);

/// {dx, dw, db} of forward(), each only where `want` says. `saved` is the input, or the output
/// when memory_efficient (then `bias` is needed to recompute x_hat); `input_dtype` is dx's.
std::array<at::Tensor, 3> backward(const char* who, const at::Tensor& grad_out,
                                   const at::Tensor& saved, const at::Tensor& mean,
                                   const at::Tensor& rstd, const at::Tensor& weight,
                                   const at::Tensor& bias, at::IntArrayRef normalized_shape,
                                   double eps, bool rms, bool mixed, bool memory_efficient,
                                   at::ScalarType input_dtype, std::array<bool, 3> want);

}  // namespace apex::normalization::ops
