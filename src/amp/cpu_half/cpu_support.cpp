// The CPU's features for half-precision matrix products (apex/amp/utils.h): cpuid and the OS's
// XSAVE state, oneDNN's ISA limit from the environment, and how LibTorch multiplies bf16/fp16
// matrices there. The CPU half fallback's policy (policy.cpp) decides from them.
#include <apex/amp/utils.h>

#include <ATen/Context.h>
#include <ATen/ops/linspace.h>
#include <ATen/ops/matmul.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/grad_mode.h>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include <algorithm>
#include <cctype>
#include <chrono>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "common/environment.h"

namespace apex::amp {
namespace {

// Seconds per call of a 128^3 matmul in `dtype`: the best of five batches, each of enough calls
// to last ~2 ms, so that a moment descheduled on a busy machine does not decide the result.
// Deterministic inputs: nothing is drawn from the global generator, whose sequence the caller's
// seeded code may depend on.
double matmul_seconds(c10::ScalarType dtype) {
  const at::Tensor a = at::linspace(-1.0, 1.0, 128 * 128).view({128, 128}).to(dtype);
  const at::Tensor b = a.t().contiguous();
  using Clock = std::chrono::steady_clock;
  const auto batch = [&](int64_t calls) {
    const auto t0 = Clock::now();
    for (int64_t i = 0; i < calls; ++i) at::matmul(a, b);
    return std::chrono::duration<double>(Clock::now() - t0).count() / static_cast<double>(calls);
  };
  // Doubled until a batch lasts 2 ms (its first, short batches are the untimed warm-up: thread
  // pool start, first-call costs).
  int64_t calls = 1;
  while (calls < 4096 && batch(calls) * static_cast<double>(calls) < 2e-3) calls *= 2;
  double best = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 5; ++i) best = std::min(best, batch(calls));
  return best;
}

#if defined(__x86_64__) || defined(__i386__)
struct CpuidRegs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

CpuidRegs cpuid(unsigned leaf, unsigned subleaf) {
  CpuidRegs r;
  if (__get_cpuid_count(leaf, subleaf, &r.a, &r.b, &r.c, &r.d) == 0) return {};
  return r;
}

bool bit(unsigned value, int i) { return ((value >> i) & 1U) != 0; }

CpuHalfSupport detect() {
  CpuHalfSupport s;
  const CpuidRegs l1 = cpuid(1, 0);
  if (!bit(l1.c, 27)) return s;  // no OSXSAVE: the OS saves no AVX state at all
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
  const bool os_avx = (xcr0_lo & 0x6U) == 0x6U;                 // XMM and YMM state
  const bool os_avx512 = os_avx && (xcr0_lo & 0xe0U) == 0xe0U;  // opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = ((xcr0_lo >> 17) & 0x3U) == 0x3U;         // XTILECFG, XTILEDATA
  const CpuidRegs l7 = cpuid(7, 0);
  const CpuidRegs l71 = l7.a >= 1 ? cpuid(7, 1) : CpuidRegs{};
  s.avx512_core = os_avx512 && bit(l7.b, 16) && bit(l7.b, 17) && bit(l7.b, 30) && bit(l7.b, 31);
  s.avx512_bf16 = s.avx512_core && bit(l71.a, 5);
  s.avx512_fp16 = s.avx512_core && bit(l7.d, 23);
  s.amx_bf16 = os_amx && bit(l7.d, 24) && bit(l7.d, 22);
  s.amx_fp16 = os_amx && bit(l7.d, 24) && bit(l71.a, 21);
  s.avx_ne_convert = os_avx && bit(l71.d, 5);
  return s;
}
#else
CpuHalfSupport detect() { return {}; }
#endif

// The variable oneDNN reads its ISA limit from, as it does: ONEDNN_MAX_CPU_ISA, else the older
// DNNL_MAX_CPU_ISA (an empty one as unset); no value where neither is set.
struct OnednnLimitEnv {
  const char* name;
  std::optional<std::string> value;
};
OnednnLimitEnv onednn_limit_env() {
  for (const char* name : {"ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"}) {
    std::optional<std::string> value = apex::detail::env(name);
    if (value) return {name, std::move(value)};
  }
  return {"ONEDNN_MAX_CPU_ISA", std::nullopt};
}

// A name oneDNN does not know leaves it unlimited.
OnednnIsa onednn_limit_from_env() {
  const OnednnLimitEnv env = onednn_limit_env();
  if (!env.value) return OnednnIsa::kAll;
  return onednn_isa_from_name(*env.value).value_or(OnednnIsa::kAll);
}

}  // namespace

std::optional<OnednnIsa> onednn_isa_from_name(std::string_view name) {
  static constexpr std::pair<std::string_view, OnednnIsa> kNames[] = {
      {"SSE41", OnednnIsa::kSse41},
      {"AVX", OnednnIsa::kAvx},
      {"AVX2", OnednnIsa::kAvx2},
      {"AVX2_VNNI", OnednnIsa::kAvx2Vnni},
      {"AVX2_VNNI_2", OnednnIsa::kAvx2Vnni2},
      {"AVX512_CORE", OnednnIsa::kAvx512Core},
      {"AVX512_CORE_VNNI", OnednnIsa::kAvx512CoreVnni},
      {"AVX512_CORE_BF16", OnednnIsa::kAvx512CoreBf16},
      {"AVX512_CORE_FP16", OnednnIsa::kAvx512CoreFp16},
      {"AVX10_1_512", OnednnIsa::kAvx512CoreFp16},
      {"AVX512_CORE_AMX", OnednnIsa::kAvx512CoreAmx},
      {"AVX10_1_512_AMX", OnednnIsa::kAvx512CoreAmx},
      {"AVX512_CORE_AMX_FP16", OnednnIsa::kAvx512CoreAmxFp16},
      {"AVX10_1_512_AMX_FP16", OnednnIsa::kAvx512CoreAmxFp16},
      {"DEFAULT", OnednnIsa::kAll},
      {"ALL", OnednnIsa::kAll},
  };
  const auto same = [](std::string_view a, std::string_view b) {
    return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
             return std::toupper(static_cast<unsigned char>(x)) == y;
           });
  };
  for (const auto& [known, isa] : kNames) {
    if (same(name, known)) return isa;
  }
  return std::nullopt;
}

bool onednn_isa_allows(OnednnIsa limit, OnednnIsa isa) {
  using I = OnednnIsa;
  if (limit == I::kAll || isa == limit) return true;
  // Two chains that share the sets up to AVX2 (and AVX2_VNNI below AVX10.1/512): the AVX2 one
  // with VNNI and the AVX-NE-CONVERT set, and the AVX-512 one.
  const auto rank = [](I x) { return static_cast<int>(x); };
  const bool limit_avx512 = rank(limit) >= rank(I::kAvx512Core);
  const bool isa_avx512 = rank(isa) >= rank(I::kAvx512Core);
  if (isa == I::kAll) return false;
  if (limit_avx512 && isa_avx512) return rank(isa) < rank(limit);
  if (!limit_avx512 && !isa_avx512) return rank(isa) < rank(limit);
  if (isa_avx512) return false;  // an AVX2-chain limit excludes every AVX-512 set
  // An AVX-512 limit and an AVX2-chain set: up to AVX2 always, AVX2_VNNI from AVX10.1/512 on,
  // AVX2_VNNI_2 never.
  if (rank(isa) <= rank(I::kAvx2)) return true;
  if (isa == I::kAvx2Vnni) return rank(limit) >= rank(I::kAvx512CoreFp16);
  return false;
}

const CpuHalfSupport& cpu_half_support() {
  static const CpuHalfSupport support = [] {
    CpuHalfSupport s = detect();
    s.onednn = at::hasMKLDNN() && at::globalContext().userEnabledMkldnn();
    s.onednn_max_isa = onednn_limit_from_env();
    return s;
  }();
  return support;
}

CpuHalfMatmul cpu_half_matmul_kind(c10::ScalarType dtype, const CpuHalfSupport& s) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "apex::amp::cpu_half_matmul_is_fast: expected Half or BFloat16, got ", dtype);
  if (!s.onednn) return CpuHalfMatmul::kScalar;
  const auto allowed = [&](OnednnIsa isa) { return onednn_isa_allows(s.onednn_max_isa, isa); };
  const bool ne_convert = s.avx_ne_convert && allowed(OnednnIsa::kAvx2Vnni2);
  if (dtype == at::kBFloat16) {
    if ((s.avx512_bf16 && allowed(OnednnIsa::kAvx512CoreBf16)) ||
        (s.amx_bf16 && allowed(OnednnIsa::kAvx512CoreAmx)) || ne_convert) {
      return CpuHalfMatmul::kFast;
    }
    // AVX-512 without its bf16 instructions: oneDNN converts in integer code around fp32 FMAs,
    // slower than fp32 and than apex's route (docs/perf-notes.md, "Thresholds in the code").
    if (s.avx512_core && allowed(OnednnIsa::kAvx512Core)) return CpuHalfMatmul::kEmulated;
    return CpuHalfMatmul::kScalar;
  }
  if ((s.avx512_fp16 && allowed(OnednnIsa::kAvx512CoreFp16)) ||
      (s.amx_fp16 && allowed(OnednnIsa::kAvx512CoreAmxFp16)) || ne_convert) {
    return CpuHalfMatmul::kFast;
  }
  return CpuHalfMatmul::kScalar;
}

CpuHalfMatmul cpu_half_matmul_kind(c10::ScalarType dtype) {
  return cpu_half_matmul_kind(dtype, cpu_half_support());
}

bool cpu_half_matmul_is_fast(c10::ScalarType dtype, const CpuHalfSupport& s) {
  return cpu_half_matmul_kind(dtype, s) == CpuHalfMatmul::kFast;
}

bool cpu_half_matmul_is_fast(c10::ScalarType dtype) {
  return cpu_half_matmul_is_fast(dtype, cpu_half_support());
}

std::string cpu_half_matmul_slow_reason(c10::ScalarType dtype) {
  const CpuHalfMatmul kind = cpu_half_matmul_kind(dtype);
  if (kind == CpuHalfMatmul::kFast) return "";
  std::string how = kind == CpuHalfMatmul::kScalar
                        ? "in a scalar loop"
                        : "through oneDNN's emulation, at 0.6-0.85x fp32's speed,";
  CpuHalfSupport unlimited = cpu_half_support();
  unlimited.onednn_max_isa = OnednnIsa::kAll;
  if (cpu_half_matmul_kind(dtype, unlimited) != kind) {
    const OnednnLimitEnv env = onednn_limit_env();
    return how + " here: " + env.name + "=" + env.value.value_or("") +
           " keeps oneDNN from this CPU's instructions for them";
  }
  if (kind == CpuHalfMatmul::kEmulated) return how + " on this CPU (AVX-512 without AVX512-BF16)";
  return how + " on this CPU (it has fast ones only with AVX512-BF16, AVX512-FP16, AMX or " +
         "AVX-NE-CONVERT)";
}

double cpu_half_matmul_speed(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kHalf || dtype == at::kBFloat16,
              "apex::amp::cpu_half_matmul_speed: expected Half or BFloat16, got ", dtype);
  static std::mutex mutex;
  static std::map<c10::ScalarType, double> measured;
  const std::lock_guard<std::mutex> lock(mutex);
  const auto it = measured.find(dtype);
  if (it != measured.end()) return it->second;
  const torch::NoGradGuard no_grad;
  // The caller's autocast must not turn the fp32 reference into a bf16 matmul.
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(
      c10::DispatchKeySet(c10::DispatchKey::AutocastCPU));
  const double speed = matmul_seconds(at::kFloat) / matmul_seconds(dtype);
  measured.emplace(dtype, speed);
  return speed;
}

}  // namespace apex::amp
