#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace apex::amp {

/// Whether `module` itself (not its children) is a BatchNorm1d/2d/3d with affine parameters.
bool is_affine_batchnorm(const torch::nn::Module& module);

/// Casts every floating parameter and buffer of `module` and its descendants to `dtype`, except
/// those of affine BatchNorm layers, which stay fp32 (apex's `convert_network`; batch statistics
/// in half precision lose accuracy). Tensors keep their identity (`set_data`), so optimizers that
/// hold them see the new dtype.
void convert_network(torch::nn::Module& module, c10::ScalarType dtype);

/// The parameters `optimizer` updates, in group order: after `initialize` with master weights
/// these are the fp32 masters (apex's `amp.master_params`).
std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer);

/// How fast LibTorch multiplies `dtype` (Half or BFloat16) matrices on this machine's CPU,
/// relative to fp32: a 128x128 by 128x128 matmul of each, timed once per process and dtype (about
/// 30 ms where the half dtype is slow, autocast off, nothing drawn from the random generators).
/// About 1 or more on CPUs with bf16/fp16 matrix instructions (AVX512-BF16, AMX) or where oneDNN
/// emulates them (AVX-512); about 0.02 on AVX2-only CPUs, where LibTorch multiplies bf16 and fp16
/// in a scalar loop. Mixed precision on the CPU trains faster than fp32 only where this is well
/// above 1; `initialize` warns when it is below kSlowHalfMatmulSpeed.
double cpu_half_matmul_speed(c10::ScalarType dtype);

/// Below this cpu_half_matmul_speed, O1-O3 on the CPU are slower than O0: `initialize` warns and
/// apex-train's default comparison runs O0 alone. The two classes of CPU lie ~50x apart.
inline constexpr double kSlowHalfMatmulSpeed = 0.25;

}  // namespace apex::amp
