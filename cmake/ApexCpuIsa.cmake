# The instruction sets the CPU kernels are built for: the one list, narrowest first. Each entry
# names its compiler flags and the cpuid features (GCC's __builtin_cpu_supports names) a CPU
# needs to run it. src/CMakeLists.txt compiles every per-ISA kernel source once per entry and
# generates kernels/cpu/isa_list.h from this list; the tests run the optimizer and norm suites on
# every entry but the widest (the default run takes the widest the CPU has).
set(APEX_CPU_ISAS baseline avx2 avx512 avx512bf16)

set(APEX_CPU_ISA_FLAGS_baseline "")
set(APEX_CPU_ISA_CPUID_baseline "")
set(APEX_CPU_ISA_FLAGS_avx2 -mavx2 -mfma -mf16c)
set(APEX_CPU_ISA_CPUID_avx2 avx2 fma f16c)
set(APEX_CPU_ISA_FLAGS_avx512 -mavx512f -mavx512bw -mavx512vl -mavx512dq -mfma -mf16c
    -mprefer-vector-width=512)
set(APEX_CPU_ISA_CPUID_avx512 avx512f avx512bw avx512vl avx512dq)
# AVX-512 with the BF16 conversions (Cooper Lake, Sapphire Rapids, Zen 4 and later): rounds bf16
# outputs in one instruction (see bf16_round_lanes in kernels/cpu/vec.h).
set(APEX_CPU_ISA_FLAGS_avx512bf16 ${APEX_CPU_ISA_FLAGS_avx512} -mavx512bf16)
set(APEX_CPU_ISA_CPUID_avx512bf16 ${APEX_CPU_ISA_CPUID_avx512} avx512bf16)

# Every ISA but the widest: the test runs that force a narrower kernel table (APEX_CPU_ISA).
set(APEX_CPU_ISAS_FORCED ${APEX_CPU_ISAS})
list(POP_BACK APEX_CPU_ISAS_FORCED)

# Writes `out`: APEX_FOR_EACH_CPU_ISA(X) expands X(name, runs_on_this_cpu) per ISA, in order.
function(apex_write_cpu_isa_list out)
  set(body "")
  foreach(isa ${APEX_CPU_ISAS})
    set(cond "true")
    foreach(feature ${APEX_CPU_ISA_CPUID_${isa}})
      string(APPEND cond " && __builtin_cpu_supports(\"${feature}\")")
    endforeach()
    string(APPEND body "  X(${isa}, ${cond}) \\\n")
  endforeach()
  file(CONFIGURE OUTPUT ${out} CONTENT
"// Generated from APEX_CPU_ISAS (cmake/ApexCpuIsa.cmake); do not edit.
#pragma once
// X(name, whether this CPU runs it), narrowest first.
#define APEX_FOR_EACH_CPU_ISA(X) \\
${body}
" @ONLY)
endfunction()
