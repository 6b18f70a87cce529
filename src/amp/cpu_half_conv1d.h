// 1-D convolutions of bf16/fp16 CPU tensors through apex's own half product (kernels/gemm.h):
// each output is a product summed over the kernel's taps, the input read in place through strides
// (no im2col), the fp32 sums rounded once. Used by the CPU half-precision route (cpu_half.cpp)
// where the product is available; empty results mean "not taken" (the route then widens).
#pragma once

#include <ATen/core/Tensor.h>

#include <array>
#include <optional>
#include <tuple>

namespace apex::amp::detail {

/// Sizes of a 1-D convolution the product takes.
struct Conv1dShape {
  int64_t n, c_in, length, c_out, taps, stride, padding, dilation, groups, out_length;
};

/// The shape where `input` [N, C, L] and `weight` [O, C / groups, K] (non-transposed, one
/// stride, padding, dilation and a zero output padding, positive sizes, a bias of O or none) make a
/// convolution the product does well: at least 16 output channels per group, 8 or more input
/// channels per group or a single one (then the taps are the product's k), an output of 16 or more
/// steps (shorter ones: widening + oneDNN was faster, measured). Otherwise empty, including every
/// case LibTorch refuses.
std::optional<Conv1dShape> conv1d_shape(const at::Tensor& input, const at::Tensor& weight,
                                        const at::Tensor& bias, c10::SymIntArrayRef stride,
                                        c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                        bool transposed, c10::SymIntArrayRef output_padding,
                                        const c10::SymInt& groups);

/// The convolution (bias added in fp32 before the one rounding), [N, O, L_out] contiguous.
at::Tensor conv1d_rounded(const Conv1dShape& s, const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& bias);

/// Its gradients (input, weight, bias) as convolution_backward returns them, each where
/// `mask` asks (undefined otherwise): input's and weight's through the product, bias's an fp32 sum.
std::tuple<at::Tensor, at::Tensor, at::Tensor> conv1d_backward_rounded(
    const Conv1dShape& s, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, std::array<bool, 3> mask);

}  // namespace apex::amp::detail
