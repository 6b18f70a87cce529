// The CPU kernels' instruction-set table: the widest set this CPU has (cpuid), or a narrower one
// that APEX_CPU_ISA names; chosen once, on first use, for every CPU driver.

#include <cstdio>
#include <iterator>
#include <string>
#include <string_view>

#include "common/environment.h"
#include "kernels/cpu/isa.h"

namespace apex::kernels::cpu {
namespace {

struct IsaEntry {
  std::string_view name;
  bool runs;  // this CPU has every feature the ISA was compiled for
  CpuKernels kernels;
};

CpuKernels select_kernels() {
  __builtin_cpu_init();
  // Narrowest first: APEX_CPU_ISA picks the widest table up to the named one that this CPU runs.
#define APEX_ISA_ENTRY(name, runs)                                                   \
  IsaEntry{#name, runs,                                                              \
           CpuKernels{#name, &multi_tensor_kernels_##name(), &norm_kernels_##name(), \
                      &lookup_kernels_##name(), &gemv_kernels_##name(), &gemm_kernels_##name()}},
  const IsaEntry entries[] = {APEX_FOR_EACH_CPU_ISA(APEX_ISA_ENTRY)};
#undef APEX_ISA_ENTRY
  const size_t count = std::size(entries);
  const std::string forced = apex::detail::env("APEX_CPU_ISA").value_or("");
  const std::string_view want = forced;
  size_t top = count - 1;
  if (!want.empty()) {
    size_t i = 0;
    while (i < count && entries[i].name != want) ++i;
    if (i == count) {
      std::string names;
      for (const auto& e : entries) names += (names.empty() ? "" : ", ") + std::string(e.name);
      std::fprintf(stderr, "apex-cpp: ignoring APEX_CPU_ISA=%s (expected one of %s)\n",
                   forced.c_str(), names.c_str());
    } else {
      top = i;
    }
  }
  size_t pick = top;
  while (!entries[pick].runs) --pick;
  if (!want.empty() && pick != top && entries[top].name == want) {
    std::fprintf(stderr, "apex-cpp: this CPU lacks APEX_CPU_ISA=%s; using %s\n", forced.c_str(),
                 std::string(entries[pick].name).c_str());
  }
  return entries[pick].kernels;
}

}  // namespace

const CpuKernels& cpu_kernels() {
  static const CpuKernels k = select_kernels();
  return k;
}

const char* isa_name() { return cpu_kernels().isa; }

}  // namespace apex::kernels::cpu
