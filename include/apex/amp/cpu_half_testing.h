#pragma once

// Test hooks of the CPU half fallback (apex/amp/cpu_half.h): forcing the decision, and per-thread
// counters that tell the fallback's result from LibTorch's half kernel's (which may agree to one
// unit). Not API: for apex-cpp's own tests, the Python package's test ops and benchmarks.

#include <c10/core/ScalarType.h>

#include <cstdint>
#include <optional>

namespace apex::amp::detail {

/// Tests only: decide availability as `forced` (nullopt: from the CPU and the environment again;
/// false: nothing, as APEX_CPU_HALF_FALLBACK=0; true: the fallback and attention for both dtypes).
void force_cpu_half_fallback_available(std::optional<bool> forced);
/// Tests only: as a CPU whose half matmuls LibTorch runs fast (AVX512-BF16 and AVX512-FP16, or
/// AMX): no fallback, attention's own kernels for both dtypes (where the kernel table has them).
void force_cpu_half_attention_only();
/// Tests only: how many op calls in this thread the fallback has computed (not handed to LibTorch).
uint64_t cpu_half_route_calls();
/// Tests only: whether products with more than 32 rows and columns take apex's own product
/// (AVX2 and wider, unless APEX_CPU_HALF_GEMM=0), and how many op calls in this thread it took.
bool cpu_half_own_gemm();
uint64_t cpu_half_gemm_calls();
/// Tests only: whether attention's own kernels (kernels/attention.h) serve `dtype` in the scope:
/// wherever the fallback does, and where LibTorch's half matmuls are fast too (its half attention
/// is not), unless APEX_CPU_HALF_FALLBACK=0 or APEX_CPU_HALF_ATTENTION=0.
bool cpu_half_attention_available(c10::ScalarType dtype);
}  // namespace apex::amp::detail
