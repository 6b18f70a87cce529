#pragma once

/// Multi-tensor primitives: one pass over many tensors, on the CPU (threads + SIMD) or on CUDA
/// (one launch for many tensors). Lists hold dense fp32/fp16/bf16 tensors on one device; tensor i
/// of every list must have the same shape and strides. Math is done in fp32.
///
/// Overflow flags are one-element float32 tensors on the lists' device (the `found_inf` of
/// torch.amp.GradScaler): a primitive sets it to 1 when it meets an inf or NaN and never clears it.

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

namespace apex::optim {

/// out[i] = in[i] * scale, converting dtypes as needed (in place when out is in). Sets
/// `found_inf` when any input element is not finite.
///
///   auto flag = torch::zeros({1});
///   apex::optim::multi_tensor_scale(grads, grads, 1.0 / 1024, flag);
void multi_tensor_scale(const std::vector<at::Tensor>& in, const std::vector<at::Tensor>& out,
                        double scale, const at::Tensor& found_inf);

/// out[i] = a * x[i] + b * y[i]. `arg_to_check` selects which inputs set `found_inf` when not
/// finite: -1 both, 0 only x, 1 only y.
void multi_tensor_axpby(const std::vector<at::Tensor>& x, const std::vector<at::Tensor>& y,
                        const std::vector<at::Tensor>& out, double a, double b,
                        const at::Tensor& found_inf, int arg_to_check = -1);

/// L2 norm of all tensors together (0-dim fp32) and, when `per_tensor`, of each tensor
/// (1-D fp32 of size x.size(); else an undefined tensor). Accumulated in fp32 or better.
std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm(const std::vector<at::Tensor>& x,
                                                       bool per_tensor = false);

/// As multi_tensor_l2norm, of x * inv_scale, without writing x. `inv_scale` is a one-element
/// fp32 tensor on the lists' device (e.g. the reciprocal of a loss scale).
std::tuple<at::Tensor, at::Tensor> multi_tensor_unscale_l2norm(const std::vector<at::Tensor>& x,
                                                               const at::Tensor& inv_scale,
                                                               bool per_tensor = false);

/// Max-abs norm (norm_type = inf), total and per tensor. NaN propagates.
std::tuple<at::Tensor, at::Tensor> multi_tensor_max_norm(const std::vector<at::Tensor>& x,
                                                         bool per_tensor = false);

/// Sets `found_inf` when any element of `x` is not finite; reads x only.
void multi_tensor_check_finite(const std::vector<at::Tensor>& x, const at::Tensor& found_inf);

/// torch::nn::utils::clip_grad_norm_ on the multi-tensor kernels: the total norm of the
/// gradients of `parameters` (2 or infinity), then grads *= min(1, max_norm / (norm + 1e-6)).
/// Parameters without gradients are ignored; gradients may live on several devices and dtypes.
/// Returns the total norm, as LibTorch's version does.
double clip_grad_norm_(const std::vector<at::Tensor>& parameters, double max_norm,
                       double norm_type = 2.0, bool error_if_nonfinite = false);

/// The SIMD code path of the CPU kernels in use: "avx512bf16", "avx512", "avx2" or "baseline" (the
/// best this CPU supports; the environment variable APEX_CPU_ISA forces a narrower one).
const char* cpu_kernel_isa();

}  // namespace apex::optim
