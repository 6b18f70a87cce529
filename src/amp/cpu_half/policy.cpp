// What the CPU half fallback serves in this process: one decision from the CPU's features
// (cpu_support.cpp) and the environment, read once; tests may force another.
#include <apex/amp/cpu_half.h>
#include <apex/amp/cpu_half_testing.h>
#include <apex/amp/utils.h>
#include <c10/util/Exception.h>

#include "amp/cpu_half/fallback.h"
#include "common/environment.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"

#include <atomic>
#include <cstring>
#include <optional>
#include <string>

namespace apex::amp {
namespace cpu_half {
namespace {

// -1: decide; 0 nothing, 1 everything, 2 as a CPU whose half matmuls are fast (tests).
std::atomic<int> forced{-1};

// The decision in force: this process's (cpuid and the environment, read once), or a test's.
detail::CpuHalfDecision decision() {
  static const std::optional<std::string> fallback = apex::detail::env("APEX_CPU_HALF_FALLBACK");
  static const std::optional<std::string> attention = apex::detail::env("APEX_CPU_HALF_ATTENTION");
  static const bool own_kernels = own_product() && kernels::cpu::half_attention_available();
  const char* attention_env = attention ? attention->c_str() : nullptr;
  static const detail::CpuHalfDecision natural = detail::decide_cpu_half(
      cpu_half_support(), own_kernels, fallback ? fallback->c_str() : nullptr, attention_env);
  switch (forced.load()) {
    case 0:
      return {};
    case 1:
      return detail::decide_cpu_half(cpu_half_support(), own_kernels, "1", attention_env);
    case 2: {
      CpuHalfSupport fast;
      fast.onednn = fast.avx512_core = fast.avx512_bf16 = fast.avx512_fp16 = true;
      return detail::decide_cpu_half(fast, own_kernels, nullptr, attention_env);
    }
    default:
      return natural;
  }
}

}  // namespace

// Apex's own product (kernels/gemm.h), which widens the operands as it packs them and rounds the
// result as it stores it, where the CPU's kernel table has it (AVX2 and wider);
// APEX_CPU_HALF_GEMM=0 widens both operands for LibTorch's fp32 product instead (to compare).
// Why: docs/perf-notes.md, "Thresholds in the code".
bool own_product() {
  static const bool on =
      kernels::cpu::half_gemm_available() && !apex::detail::env_is("APEX_CPU_HALF_GEMM", "0");
  return on;
}

bool serves(at::ScalarType dtype) {
  const detail::CpuHalfDecision d = decision();
  return dtype == at::kBFloat16 ? d.route_bf16 : d.route_fp16;
}

bool serves_attention(at::ScalarType dtype) {
  const detail::CpuHalfDecision d = decision();
  return dtype == at::kBFloat16 ? d.attention_bf16 : d.attention_fp16;
}

}  // namespace cpu_half

bool cpu_half_fallback_available(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "apex::amp::cpu_half_fallback_available: expected Half or BFloat16, got ", dtype);
  return cpu_half::serves(dtype);
}

bool cpu_half_fallback_available() {
  return cpu_half::serves(at::kBFloat16) || cpu_half::serves(at::kHalf);
}

bool cpu_half_scope_available() {
  return cpu_half_fallback_available() || cpu_half::serves_attention(at::kBFloat16) ||
         cpu_half::serves_attention(at::kHalf);
}

namespace detail {

// Per dtype: a CPU can be fast in one and slow in the other (AVX512-BF16 without AVX512-FP16, as
// AMD Zen 4/5 and Intel Cooper Lake: bf16 through oneDNN, fp16 in a scalar loop). Intel's
// AVX-512 servers before them (Skylake to Ice Lake) take both: oneDNN's bf16 emulation there is
// slower than fp32 (utils.h, CpuHalfMatmul::kEmulated). APEX_CPU_HALF_FALLBACK "0" turns
// everything off, "1" the fallback on even where LibTorch's half path is fast (to compare or
// profile it there). Attention's own kernels serve wherever the fallback does, and also where
// LibTorch's half matmuls are fast (its half attention is not: docs/amp.md), unless
// APEX_CPU_HALF_ATTENTION is "0" or the kernel table lacks them.
CpuHalfDecision decide_cpu_half(const CpuHalfSupport& support, bool own_kernels,
                                const char* fallback_env, const char* attention_env) {
  const auto is = [](const char* v, const char* want) {
    return v != nullptr && std::strcmp(v, want) == 0;
  };
  CpuHalfDecision d;
  if (is(fallback_env, "0")) return d;
  const bool all = is(fallback_env, "1");
  d.route_bf16 = all || !cpu_half_matmul_is_fast(at::kBFloat16, support);
  d.route_fp16 = all || !cpu_half_matmul_is_fast(at::kHalf, support);
  const bool attention = own_kernels && !is(attention_env, "0");
  d.attention_bf16 = attention;
  d.attention_fp16 = attention;
  return d;
}

void force_cpu_half_fallback_available(std::optional<bool> value) {
  cpu_half::forced.store(value.has_value() ? (*value ? 1 : 0) : -1);
}

void force_cpu_half_attention_only() { cpu_half::forced.store(2); }

bool cpu_half_own_gemm() { return cpu_half::own_product(); }

bool cpu_half_attention_available(c10::ScalarType dtype) {
  return cpu_half::serves_attention(dtype);
}

}  // namespace detail
}  // namespace apex::amp
