// The CPU half fallback's convolutions (fallback.h), forward and backward.
#include <ATen/ops/convolution_backward_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/convolution_compositeexplicitautograd_dispatch.h>
#include <torch/library.h>

#include "amp/cpu_half/conv1d.h"
#include "amp/cpu_half/fallback.h"

#include <algorithm>
#include <array>
#include <optional>
#include <tuple>

namespace apex::amp::cpu_half {
namespace {

// Convolutions: 1-D ones with enough channels through apex's own product (cpu_half_conv1d.h;
// wav2vec 2.0's feature encoder and positional convolution), the others widened around LibTorch's
// fp32 kernels (oneDNN's).
//
// A 1x1 2-D convolution with stride 1 and no padding (a bottleneck's, a pointwise one) on an
// NCHW input whose height and width are one run of memory is that 1-D convolution of kernel 1
// over H * W steps: its input and weight as 3-D views (channels-last inputs keep LibTorch's
// path, whose output is channels-last too).
struct Pointwise {
  at::Tensor input, weight;
  Conv1dShape shape;
};

std::optional<Pointwise> pointwise(const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& bias, c10::SymIntArrayRef stride,
                                   c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                   bool transposed, c10::SymIntArrayRef output_padding,
                                   const c10::SymInt& groups) {
  // (conv2d passes one value for both dimensions as it was given; LibTorch expands it later.)
  const auto all = [](c10::SymIntArrayRef v, int64_t x) {
    return (v.size() == 1 || v.size() == 2) &&
           std::all_of(v.begin(), v.end(), [x](const c10::SymInt& e) { return e == x; });
  };
  if (transposed || input.dim() != 4 || weight.dim() != 4 || weight.size(2) != 1 ||
      weight.size(3) != 1 || !all(stride, 1) || !all(padding, 0) || dilation.empty() ||
      dilation.size() > 2 || !all(output_padding, 0) ||
      input.suggest_memory_format() != at::MemoryFormat::Contiguous ||
      input.stride(2) != input.size(3) * input.stride(3)) {
    return std::nullopt;
  }
  Pointwise p{input.view({input.size(0), input.size(1), input.size(2) * input.size(3)}),
              weight.view({weight.size(0), weight.size(1), 1}),
              {}};
  const c10::SymInt one(1), zero(0);
  const auto shape = conv1d_shape(p.input, p.weight, bias, {&one, 1}, {&zero, 1}, {&one, 1}, false,
                                  {&zero, 1}, groups);
  if (!shape) return std::nullopt;
  p.shape = *shape;
  return p;
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                       c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool transposed,
                       c10::SymIntArrayRef output_padding, c10::SymInt groups) {
  const at::Tensor b = bias.value_or(at::Tensor());
  if (!take({&input, &weight, &b})) {
    return at::compositeexplicitautograd::convolution_symint(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups);
  }
  if (own_product()) {
    if (const auto s = conv1d_shape(input, weight, b, stride, padding, dilation, transposed,
                                    output_padding, groups)) {
      ++own_product_calls;
      return conv1d_rounded(*s, input, weight, b);
    }
    if (const auto p = pointwise(input, weight, b, stride, padding, dilation, transposed,
                                 output_padding, groups)) {
      ++own_product_calls;
      return conv1d_rounded(p->shape, p->input, p->weight, b)
          .view({input.size(0), weight.size(0), input.size(2), input.size(3)});
    }
  }
  const std::optional<at::Tensor> wb = b.defined() ? std::optional<at::Tensor>(wide(b)) : bias;
  return at::compositeexplicitautograd::convolution_symint(wide(input), wide(weight), wb, stride,
                                                           padding, dilation, transposed,
                                                           output_padding, groups)
      .to(input.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalSymIntArrayRef bias_sizes, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation, bool transposed, c10::SymIntArrayRef output_padding,
    c10::SymInt groups, std::array<bool, 3> output_mask) {
  if (!take({&grad_output, &input, &weight})) {
    return at::compositeexplicitautograd::convolution_backward_symint(
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
        output_padding, groups, output_mask);
  }
  if (own_product()) {
    if (const auto s = conv1d_shape(input, weight, at::Tensor(), stride, padding, dilation,
                                    transposed, output_padding, groups)) {
      ++own_product_calls;
      return conv1d_backward_rounded(*s, grad_output, input, weight, output_mask);
    }
    if (const auto p = pointwise(input, weight, at::Tensor(), stride, padding, dilation, transposed,
                                 output_padding, groups);
        p && grad_output.dim() == 4) {
      ++own_product_calls;
      auto [gi, gw, gb] = conv1d_backward_rounded(
          p->shape, grad_output.reshape({grad_output.size(0), grad_output.size(1), -1}), p->input,
          p->weight, output_mask);
      return {gi.defined() ? gi.view(input.sizes()) : gi,
              gw.defined() ? gw.view(weight.sizes()) : gw, gb};
    }
  }
  auto [gi, gw, gb] = at::compositeexplicitautograd::convolution_backward_symint(
      wide(grad_output), wide(input), wide(weight), bias_sizes, stride, padding, dilation,
      transposed, output_padding, groups, output_mask);
  const auto t = input.scalar_type();
  return {gi.defined() ? gi.to(t) : gi, gw.defined() ? gw.to(t) : gw, gb.defined() ? gb.to(t) : gb};
}

}  // namespace

void register_convolution(torch::Library& cpu) {
  cpu.impl("convolution", TORCH_FN(convolution));
  cpu.impl("convolution_backward", TORCH_FN(convolution_backward));
}

}  // namespace apex::amp::cpu_half
