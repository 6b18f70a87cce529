// 1-D convolutions of bf16/fp16 CPU tensors through apex's own half product (kernels/gemm.h):
// each output is a product summed over the kernel's taps, the input read in place through strides
// (no im2col), the fp32 sums rounded once. Used by the CPU half fallback (convolution.cpp)
// where the product is available; empty results mean "not taken" (the fallback then widens).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace apex::amp::cpu_half {

/// Sizes of a 1-D convolution the product takes, as the non-transposed convolution: input
/// [n, c_in, length], output [n, c_out, out_length]. A transposed one is that convolution's input
/// gradient: its input is [n, c_out, out_length] and its output [n, c_in, length].
struct Conv1dShape {
  int64_t n, c_in, length, c_out, taps, stride, padding, dilation, groups, out_length;
  bool transposed;
};

/// The shape where `input` [N, C, L] and `weight` ([O, C / groups, K], or [C, O / groups, K]
/// transposed; one stride, padding, dilation and output padding; positive sizes; a bias of the
/// output's channels or none) make a convolution the product does well: at least 16 channels per
/// group on the product's row side (the convolution's output channels), 8 or more on its k side
/// (or, not transposed, a single input channel: then the taps are k), and 16 or more steps out
/// of the convolution (shorter ones: widening + oneDNN was faster, measured). Otherwise empty,
/// including every case LibTorch refuses.
std::optional<Conv1dShape> conv1d_shape(const at::Tensor& input, const at::Tensor& weight,
                                        const at::Tensor& bias, c10::SymIntArrayRef stride,
                                        c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                        bool transposed, c10::SymIntArrayRef output_padding,
                                        const c10::SymInt& groups);

/// The convolution, or the transposed one (bias added in fp32 before the one rounding),
/// contiguous.
at::Tensor conv1d_rounded(const Conv1dShape& s, const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& bias);

/// Its gradients (input, weight, bias) as convolution_backward returns them, each where
/// `mask` asks (undefined otherwise): input's and weight's through the product, bias's an fp32 sum.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv1d_backward_rounded(
    const Conv1dShape& s, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, std::array<bool, 3> mask);

}  // namespace apex::amp::cpu_half
