#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <optional>
#include <string>
#include <string_view>
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

/// The instruction sets LibTorch's oneDNN can be limited to (its `ONEDNN_MAX_CPU_ISA` values), in
/// oneDNN's partial order: kSse41 < kAvx < kAvx2 <
/// kAvx2Vnni < kAvx2Vnni2; kAvx2 < kAvx512Core < kAvx512CoreVnni < kAvx512CoreBf16 <
/// kAvx512CoreFp16 (AVX10_1_512) < kAvx512CoreAmx < kAvx512CoreAmxFp16; kAvx2Vnni <
/// kAvx512CoreFp16. kAll: no limit (unset, DEFAULT, ALL).
enum class OnednnIsa {
  kSse41,
  kAvx,
  kAvx2,
  kAvx2Vnni,
  kAvx2Vnni2,
  kAvx512Core,
  kAvx512CoreVnni,
  kAvx512CoreBf16,
  kAvx512CoreFp16,
  kAvx512CoreAmx,
  kAvx512CoreAmxFp16,
  kAll,
};

/// The limit a value of `ONEDNN_MAX_CPU_ISA` names (any case; "AVX512_CORE_FP16" and
/// "AVX10_1_512" alike), or nullopt for one oneDNN does not know (and ignores).
std::optional<OnednnIsa> onednn_isa_from_name(std::string_view name);

/// Whether oneDNN limited to `limit` may use `isa` (`isa` at or below `limit` in the order above).
bool onednn_isa_allows(OnednnIsa limit, OnednnIsa isa);

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
  /// The limit oneDNN reads at start-up from `ONEDNN_MAX_CPU_ISA` (or the older
  /// `DNNL_MAX_CPU_ISA`): LibTorch still sends bf16 matmuls to oneDNN on an AVX-512 CPU when it
  /// is limited to AVX2, and oneDNN then multiplies them ~60x slower than fp32. (A limit set in
  /// code with `dnnl::set_max_cpu_isa` is not seen.)
  OnednnIsa onednn_max_isa = OnednnIsa::kAll;
};

/// This CPU's features as cpuid reports them; the same value for the whole process.
const CpuHalfSupport& cpu_half_support();

/// How LibTorch multiplies `dtype` (Half or BFloat16) matrices on a CPU: kFast at about fp32's
/// speed or better (bf16 with AVX512-BF16, AMX-BF16 or AVX-NE-CONVERT; fp16 with AVX512-FP16,
/// AMX-FP16 or AVX-NE-CONVERT; through oneDNN, where oneDNN's ISA limit allows those); kEmulated
/// through oneDNN's bf16 emulation on AVX-512 without AVX512-BF16 (Skylake to Ice Lake servers),
/// slower than fp32 (docs/perf-notes.md, "Thresholds in the code"); kScalar in a loop tens of
/// times slower than fp32 (every AVX2-only x86 CPU: Zen 2/3, most laptops; fp16 without
/// AVX512-FP16; no oneDNN).
enum class CpuHalfMatmul { kFast, kEmulated, kScalar };

/// This CPU's kind for `dtype`, from its features, never from a timing (a timing on a busy
/// machine once misjudged an AVX2 CPU as fast).
CpuHalfMatmul cpu_half_matmul_kind(c10::ScalarType dtype);

/// The same for a given set of features (tests, and what-ifs for other CPUs).
CpuHalfMatmul cpu_half_matmul_kind(c10::ScalarType dtype, const CpuHalfSupport& support);

/// Whether LibTorch multiplies `dtype` (Half or BFloat16) matrices on this CPU at about fp32 speed
/// or better (kind kFast); where not, apex's CPU half fallback (cpu_half.h) takes them.
/// `initialize` warns where neither is fast for an opt level that computes on CPU parameters in
/// `dtype`.
bool cpu_half_matmul_is_fast(c10::ScalarType dtype);

/// The same decision for a given set of features.
bool cpu_half_matmul_is_fast(c10::ScalarType dtype, const CpuHalfSupport& support);

/// Where cpu_half_matmul_is_fast(dtype) is false, how and why, for messages that continue
/// "LibTorch multiplies bf16 matrices ": "in a scalar loop on this CPU (it has fast ones only
/// with ...)", "through oneDNN's emulation on this CPU (...)", or, where the CPU has faster
/// instructions that ONEDNN_MAX_CPU_ISA keeps oneDNN from, the same with "here:
/// ONEDNN_MAX_CPU_ISA=... keeps oneDNN from this CPU's instructions for them". Empty where fast.
std::string cpu_half_matmul_slow_reason(c10::ScalarType dtype);

/// How fast LibTorch multiplies `dtype` (Half or BFloat16) matrices on this machine's CPU,
/// relative to fp32: a 128x128 by 128x128 matmul of each, timed once per process and dtype (about
/// 30 ms where the half dtype is slow, autocast off, nothing drawn from the random generators).
/// A measurement for reports and benchmarks only: decisions use cpu_half_matmul_is_fast, since a
/// timing depends on what else the machine is doing.
double cpu_half_matmul_speed(c10::ScalarType dtype);

}  // namespace apex::amp
