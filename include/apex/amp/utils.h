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

/// Whether `module` itself (not its children) is a BatchNorm1d/2d/3d or an
/// apex::parallel::SyncBatchNorm with affine parameters.
bool is_affine_batchnorm(const torch::nn::Module& module);

/// Casts every floating parameter and buffer of `module` and its descendants to `dtype`, except
/// those of affine BatchNorm layers, which stay fp32 (apex's `convert_network`; batch statistics
/// in half precision lose accuracy). Tensors keep their identity (`set_data`), so optimizers that
/// hold them see the new dtype.
void convert_network(torch::nn::Module& module, c10::ScalarType dtype);

/// The parameters `optimizer` updates, in group order: after `initialize` with master weights
/// these are the fp32 masters (apex's `amp.master_params`).
std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer);

/// What this machine's CPU can do for half-precision matrix products, read once from cpuid (and
/// the OS's XSAVE state: AVX-512 and AMX registers the kernel does not save count as absent).
struct CpuHalfSupport {
  bool avx512_core = false;     ///< AVX-512 F, BW, VL and DQ: oneDNN emulates bf16 on these
  bool avx512_bf16 = false;     ///< AVX512-BF16 (Cooper Lake, Sapphire Rapids, Zen 4 and later)
  bool amx_bf16 = false;        ///< AMX tiles with bf16
  bool avx512_fp16 = false;     ///< AVX512-FP16 (Sapphire Rapids and later)
  bool amx_fp16 = false;        ///< AMX tiles with fp16
  bool avx_ne_convert = false;  ///< AVX-NE-CONVERT (AVX2 hosts with bf16/fp16 conversions)
  bool onednn = false;          ///< LibTorch was built with oneDNN and it is enabled
};

/// This CPU's features as cpuid reports them; the same value for the whole process.
const CpuHalfSupport& cpu_half_support();

/// Whether LibTorch multiplies `dtype` (Half or BFloat16) matrices on this CPU at about fp32 speed
/// or better: decided from the CPU's features, never from a timing (a timing on a busy machine
/// once misjudged an AVX2 CPU as fast). LibTorch sends half matmuls to oneDNN only where oneDNN
/// has the dtype: bf16 on AVX-512 cores (emulated), AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT; fp16
/// on AVX512-FP16, AMX-FP16 or AVX-NE-CONVERT. Everywhere else (every AVX2-only x86 CPU: Zen 2/3,
/// most laptops) it runs a scalar loop ~35x slower than fp32. `initialize` warns where this is
/// false for an opt level that computes on CPU parameters in `dtype`.
bool cpu_half_matmul_is_fast(c10::ScalarType dtype);

/// How fast LibTorch multiplies `dtype` (Half or BFloat16) matrices on this machine's CPU,
/// relative to fp32: a 128x128 by 128x128 matmul of each, timed once per process and dtype (about
/// 30 ms where the half dtype is slow, autocast off, nothing drawn from the random generators).
/// A measurement for reports and benchmarks only: decisions use cpu_half_matmul_is_fast, since a
/// timing depends on what else the machine is doing.
double cpu_half_matmul_speed(c10::ScalarType dtype);

}  // namespace apex::amp
