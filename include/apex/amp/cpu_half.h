#pragma once

// Half precision on CPUs, within a scope: where LibTorch has no fast half matrix products (every
// AVX2-only x86 CPU runs them in a scalar loop, tens of times slower than fp32; AVX-512 CPUs
// without AVX512-FP16 for fp16), the products, convolutions and recurrent layers are computed on
// exactly widened inputs (apex's own product or LibTorch's fp32 kernels), the result rounded once
// to the half dtype; and on every CPU whose kernel table has them, attention runs on apex's own
// half kernels (LibTorch's half attention is slow even where its half matmuls are fast). What a
// CPU gets is one decision from its flags (detail::decide_cpu_half). apex::amp turns the scope on
// by itself (Amp::forward, scaled-loss backward, AutocastGuard on the CPU); code that casts its
// model itself uses CpuHalfFallbackGuard.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

namespace apex::amp {

/// Whether the fallback applies to `dtype` (Half or BFloat16) in this process: LibTorch's
/// matmuls in it are slow on this CPU (cpu_half_matmul_is_fast(dtype) is false: decided from
/// cpuid; a CPU with AVX-512 but no AVX512-FP16 is fast in bf16 only) and
/// $APEX_CPU_HALF_FALLBACK is not "0" ("1": both dtypes, even where fast). Decided once per
/// process.
bool cpu_half_fallback_available(c10::ScalarType dtype);
/// ... for bf16 or fp16.
bool cpu_half_fallback_available();

/// Whether a CpuHalfFallbackGuard does anything in this process: the fallback serves a half dtype,
/// or attention's own kernels do (also where LibTorch's half matmuls are fast). C++'s guard and
/// Python's `apex.amp.cpu_half_fallback()` both ask this one question.
bool cpu_half_scope_available();

/// Whether it is on now, in this thread (a CpuHalfFallbackGuard that enabled it is alive).
bool cpu_half_fallback_active();

/// In this thread, while it lives: bf16 and fp16 mm, addmm, bmm, baddbmm, addbmm, addmv (so
/// linear, matmul, mv and conv_tbc; their in-place and out= forms too), LSTM, GRU and RNN layers,
/// convolution (forward and backward) and the CPU flash attention (forward and backward) on CPU
/// tensors run as LibTorch's fp32 kernels on exactly widened inputs, outputs rounded to the half
/// dtype (so at least as accurate as LibTorch's half kernels, which also accumulate in fp32, and
/// bit-identical between runs); GELU and SiLU (forward and backward) of dense half tensors read a
/// table per dtype (correctly rounded); `x += bias` of a half x and an fp32 bias (LibTorch's C++
/// Linear on an N-d input at O1) adds in one pass. Nested guards are fine; fp32/fp64 ops, CUDA
/// tensors and other mixed dtypes go to LibTorch's own kernels unchanged, and where the fallback is
/// not available the guard does nothing, but for attention: its own kernels (kernels/attention.h)
/// also serve CPUs whose half matmuls LibTorch runs fast, since its half attention there is not
/// (unless APEX_CPU_HALF_FALLBACK=0 or APEX_CPU_HALF_ATTENTION=0).
///
///   model->to(at::kBFloat16);
///   { apex::amp::CpuHalfFallbackGuard fast; loss = loss_fn(model->forward(x), y); loss.backward();
///   }
class CpuHalfFallbackGuard {
 public:
  explicit CpuHalfFallbackGuard(bool enabled = true);
  ~CpuHalfFallbackGuard();
  CpuHalfFallbackGuard(const CpuHalfFallbackGuard&) = delete;
  CpuHalfFallbackGuard& operator=(const CpuHalfFallbackGuard&) = delete;

 private:
  bool opened_;
};

/// Puts the fallback's kernels into LibTorch's dispatcher now, where the fallback is available
/// (else does nothing); otherwise the first CpuHalfFallbackGuard of the process does it. LibTorch's
/// dispatcher is not safe to change while other threads call the ops concerned (mm, convolution,
/// gelu, ...), so call this before starting threads that run such ops, as apex::amp::initialize
/// does at O1-O3. Once in, the kernels stay for the process: outside a guard they hand every call
/// to LibTorch's own CPU kernel (so an earlier override of these CPU kernels by another library
/// is bypassed from then on, for every dtype).
void prepare_cpu_half_fallback();

struct CpuHalfSupport;

namespace detail {
/// What the scope serves on a CPU: the fallback per dtype, attention's own kernels per dtype.
struct CpuHalfDecision {
  bool route_bf16 = false;
  bool route_fp16 = false;
  bool attention_bf16 = false;
  bool attention_fp16 = false;
  bool scope() const { return route_bf16 || route_fp16 || attention_bf16 || attention_fp16; }
};
/// The decision for a CPU with `support`, whose kernel table has apex's half product and
/// attention kernels (`own_kernels`: AVX2 and wider, unless APEX_CPU_HALF_GEMM=0), under the
/// values of APEX_CPU_HALF_FALLBACK and APEX_CPU_HALF_ATTENTION (nullptr: unset). The process
/// decides once with this CPU's cpuid and environment; tests ask it for every CPU family.
CpuHalfDecision decide_cpu_half(const CpuHalfSupport& support, bool own_kernels,
                                const char* fallback_env, const char* attention_env);
}  // namespace detail

}  // namespace apex::amp
