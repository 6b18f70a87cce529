// Unary functions of 16-bit floats by table lookup, for one instruction set (compiled once per
// ISA, see isa.h). A bf16 or fp16 element is one of 65536 bit patterns, so a function of it is a
// table indexed by its bits: the forward reads its result there (correctly rounded when the table
// was built: kernels/activation.h), the backward multiplies the gradient by the derivative read
// there. AVX2 and AVX-512 read the tables with gathers, the baseline one element at a time.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/vec.h"

namespace apex::kernels::cpu {
namespace {

// y[i] = table[x[i]]. The table holds 65536 + 1 entries: the gathers read 32 bits at
// table + 2 * x[i] (the wanted entry in the low half), so the last index reads one past.
void map16(const uint16_t* x, uint16_t* y, int64_t n, const uint16_t* table) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const auto* base = reinterpret_cast<const int*>(table);
  for (; i + 16 <= n; i += 16) {
    const __m512i idx = _mm512_maskz_cvtepu16_epi32(
        0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i)));
    const __m512i v = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), 0xffff, idx, base, 2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), _mm512_maskz_cvtepi32_epi16(0xffff, v));
  }
#elif defined(__AVX2__)
  const auto* base = reinterpret_cast<const int*>(table);
  const __m256i low = _mm256_set1_epi32(0xffff);
  for (; i + 16 <= n; i += 16) {
    const __m256i a =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i)));
    const __m256i b =
        _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i + 8)));
    const __m256i ga = _mm256_and_si256(_mm256_i32gather_epi32(base, a, 2), low);
    const __m256i gb = _mm256_and_si256(_mm256_i32gather_epi32(base, b, 2), low);
    // packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order by the permute.
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i),
                        _mm256_permute4x64_epi64(_mm256_packus_epi32(ga, gb), 0xd8));
  }
#endif
  for (; i < n; ++i) y[i] = table[x[i]];
}

// One fp16 or bf16 element widened, and an fp32 value rounded to nearest even (vec.h's
// conversions: bit arithmetic for bf16, the ISA's or c10's for fp16).
float widen(uint16_t h, DType t) {
  if (t == DType::kBFloat16) return bf16_bits_to_float(h);
  float f;
  half_to_float(&h, &f, 1);
  return f;
}
uint16_t narrow(float f, DType t) {
  if (t == DType::kBFloat16) return bf16_round(f);
  uint16_t h;
  float_to_half(&f, &h, 1);
  return h;
}

// Lanes rounded to bf16 into p: the ISA's rounding where vec.h allows it (lanes_bf16_usable: not
// with MXCSR's denormals-are-zero on AVX512-BF16), else the bit arithmetic, which the scalar tail
// also uses, so an element's result does not depend on its position.
[[maybe_unused]] void put_bf16(uint16_t* p, Lanes v, bool usable) {
  const Lanes16 h = usable ? bf16_round_lanes(v) : bf16_round_bits(v);
  std::memcpy(p, &h, sizeof h);
}

// dx[i] = g[i] * table[x[i]] in fp32, rounded to t (bf16 or fp16).
void scale16(const uint16_t* g, const uint16_t* x, uint16_t* dx, int64_t n, const float* table,
             DType t) {
  int64_t i = 0;
  [[maybe_unused]] const bool usable = lanes_bf16_usable();
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    const __m256i xs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + i));
    const __m256i gs = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g + i));
    const __m512i idx = _mm512_maskz_cvtepu16_epi32(0xffff, xs);
    const __m512 d = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), 0xffff, idx, table, 4);
    if (t == DType::kBFloat16) {
      put_bf16(dx + i, get_lanes(g + i) * reinterpret_cast<Lanes>(d), usable);
    } else {
      const __m512 r = _mm512_mul_ps(_mm512_maskz_cvtph_ps(0xffff, gs), d);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dx + i),
                          _mm512_maskz_cvtps_ph(0xffff, r, _MM_FROUND_TO_NEAREST_INT));
    }
  }
#elif defined(__AVX2__)
  for (; i + 8 <= n; i += 8) {
    const __m128i xs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + i));
    const __m256 d = _mm256_i32gather_ps(table, _mm256_cvtepu16_epi32(xs), 4);
    if (t == DType::kBFloat16) {
      put_bf16(dx + i, get_lanes(g + i) * reinterpret_cast<Lanes>(d), usable);
    } else {
      const __m128i gs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g + i));
      const __m256 r = _mm256_mul_ps(_mm256_cvtph_ps(gs), d);
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dx + i),
                       _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT));
    }
  }
#endif
  for (; i < n; ++i) dx[i] = narrow(widen(g[i], t) * table[x[i]], t);
}

}  // namespace

const LookupKernels& APEX_CAT(lookup_kernels_, APEX_CPU_ISA)() {
  static constexpr LookupKernels kTable = {
      .map16 = map16,
      .scale16 = scale16,
  };
  return kTable;
}

}  // namespace apex::kernels::cpu
