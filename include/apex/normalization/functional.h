#pragma once

/// Functional fused LayerNorm and RMSNorm: one pass per row for the statistics and the output,
/// one for the gradients; statistics and math in fp32 whatever the storage dtype (fp32, fp16,
/// bf16; float64 tensors take an ATen float64 path with the same formulas, for gradcheck).
/// Differentiable with respect to input, weight and bias (a double backward fails with a message).
/// memory_efficient: save the output instead of the input for the backward, which recomputes
/// x_hat = (y - bias) / weight, the weight clamped by magnitude to at least eps as in apex's
/// memory_efficient (a weight of exactly zero then gets no gradient: keep this off for such).

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

namespace apex::normalization {

/// LayerNorm over the trailing `normalized_shape` dimensions of `input`:
/// (x - mean) / sqrt(var + eps) * weight + bias; weight and bias may be undefined. The same result
/// as at::layer_norm. The output has the input's dtype.
at::Tensor fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight = {}, const at::Tensor& bias = {},
                            double eps = 1e-5, bool memory_efficient = false);

/// RMSNorm over the trailing `normalized_shape` dimensions: x / sqrt(mean(x^2) + eps) * weight;
/// weight may be undefined. The output has the input's dtype.
at::Tensor fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const at::Tensor& weight = {}, double eps = 1e-5,
                          bool memory_efficient = false);

/// apex's mixed-dtype variants: weight (and bias) required, typically fp32 while the input is
/// fp16/bf16; statistics in fp32 and the output in the weight's dtype.
at::Tensor mixed_fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                  const at::Tensor& weight, const at::Tensor& bias,
                                  double eps = 1e-5, bool memory_efficient = false);
at::Tensor mixed_fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                const at::Tensor& weight, double eps = 1e-5,
                                bool memory_efficient = false);

}  // namespace apex::normalization
