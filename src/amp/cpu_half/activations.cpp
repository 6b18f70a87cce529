// The CPU half fallback's activations (fallback.h): GELU and SiLU of dense half tensors, forward
// and backward, by apex's table kernels (kernels/activation.h).
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu_backward_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/silu_backward_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <torch/library.h>

#include "amp/cpu_half/fallback.h"
#include "bridge/bridge.h"
#include "kernels/activation.h"

#include <optional>

namespace apex::amp::cpu_half {
namespace {

// GELU: LibTorch's bf16/fp16 kernel on AVX2 takes 1.6-1.8x the time of its fp32 one (which is
// oneDNN's), forward and backward; ours (kernels/activation.h) widens in registers and is more
// accurate. Dense tensors of any layout (the output takes the input's strides); others, and
// approximate modes LibTorch refuses, go to LibTorch's kernel.
std::optional<bool> gelu_tanh(c10::string_view approximate) {
  if (approximate == "none") return false;
  if (approximate == "tanh") return true;
  return std::nullopt;
}

// The table kernels' backward reads the gradient and the input element by element alike: a
// dense input and a gradient of its sizes and strides.
bool dense_alike(const at::Tensor& grad, const at::Tensor& x) {
  return x.is_non_overlapping_and_dense() && grad.sizes() == x.sizes() &&
         grad.strides() == x.strides();
}

at::Tensor gelu(const at::Tensor& x, c10::string_view approximate) {
  const auto tanh = gelu_tanh(approximate);
  if (!take({&x}) || !tanh || !x.is_non_overlapping_and_dense()) {
    return at::cpu::gelu(x, approximate);
  }
  at::Tensor y = at::empty_like(x);
  kernels::cpu::gelu(x.const_data_ptr(), y.mutable_data_ptr(), bridge::kernel_dtype(x, "gelu"),
                     x.numel(), *tanh);
  return y;
}

at::Tensor gelu_backward(const at::Tensor& grad, const at::Tensor& x,
                         c10::string_view approximate) {
  const auto tanh = gelu_tanh(approximate);
  if (!take({&grad, &x}) || !tanh || !dense_alike(grad, x)) {
    return at::cpu::gelu_backward(grad, x, approximate);
  }
  at::Tensor dx = at::empty_like(x);
  kernels::cpu::gelu_backward(grad.const_data_ptr(), x.const_data_ptr(), dx.mutable_data_ptr(),
                              bridge::kernel_dtype(x, "gelu"), x.numel(), *tanh);
  return dx;
}

// SiLU likewise (LibTorch's bf16 kernel on AVX2: 1.5-1.6x its fp32 time); in place too, which
// nn.SiLU(inplace=true) calls.
at::Tensor silu(const at::Tensor& x) {
  if (!take({&x}) || !x.is_non_overlapping_and_dense()) return at::cpu::silu(x);
  at::Tensor y = at::empty_like(x);
  kernels::cpu::silu(x.const_data_ptr(), y.mutable_data_ptr(), bridge::kernel_dtype(x, "silu"),
                     x.numel());
  return y;
}

at::Tensor& silu_(at::Tensor& x) {
  if (!take({&x}) || !x.is_non_overlapping_and_dense()) return at::cpu::silu_(x);
  kernels::cpu::silu(x.const_data_ptr(), x.mutable_data_ptr(), bridge::kernel_dtype(x, "silu"),
                     x.numel());
  return x;
}

at::Tensor silu_backward(const at::Tensor& grad, const at::Tensor& x) {
  if (!take({&grad, &x}) || !dense_alike(grad, x)) return at::cpu::silu_backward(grad, x);
  at::Tensor dx = at::empty_like(x);
  kernels::cpu::silu_backward(grad.const_data_ptr(), x.const_data_ptr(), dx.mutable_data_ptr(),
                              bridge::kernel_dtype(x, "silu"), x.numel());
  return dx;
}

}  // namespace

void register_activations(torch::Library& cpu) {
  cpu.impl("gelu", TORCH_FN(gelu));
  cpu.impl("gelu_backward", TORCH_FN(gelu_backward));
  cpu.impl("silu", TORCH_FN(silu));
  cpu.impl("silu_", TORCH_FN(silu_));
  cpu.impl("silu_backward", TORCH_FN(silu_backward));
}

}  // namespace apex::amp::cpu_half
