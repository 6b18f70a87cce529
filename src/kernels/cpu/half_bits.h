// One bf16/fp16 element as its 16 bits, to and from fp32 (c10's conversions: exact widening,
// rounding to nearest even), for the CPU drivers' scalar paths (strided elements, tables). The
// per-ISA kernels convert in vector registers instead (vec.h).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cpu {

inline float half_bits_to_float(uint16_t bits, DType t) {
  return t == DType::kBFloat16 ? static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()))
                               : static_cast<float>(c10::Half(bits, c10::Half::from_bits()));
}

inline uint16_t float_to_half_bits(float f, DType t) {
  return t == DType::kBFloat16 ? c10::BFloat16(f).x : c10::Half(f).x;
}

}  // namespace apex::kernels::cpu
