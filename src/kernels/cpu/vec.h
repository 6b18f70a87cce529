// Vector lanes and dtype conversions of the per-ISA CPU kernels (multi_tensor_kernels.cpp,
// norm_kernels.cpp). Included only by sources compiled once per instruction set (APEX_CPU_ISA set
// by src/CMakeLists.txt): everything here lives in a namespace named after that ISA, so a helper
// compiled for a wide ISA can never be picked by the linker for a narrower table (the classic ODR
// trap of per-ISA builds).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/cpu/isa.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef APEX_CPU_ISA
#error "kernels/cpu/vec.h belongs to the per-ISA kernel sources (APEX_CPU_ISA undefined)"
#endif
#define APEX_CAT_(a, b) a##b
#define APEX_CAT(a, b) APEX_CAT_(a, b)
#define APEX_STR_(x) #x
#define APEX_STR(x) APEX_STR_(x)
/// The per-ISA namespace: isa_baseline, isa_avx2, ...
#define APEX_ISA_NS APEX_CAT(isa_, APEX_CPU_ISA)

namespace apex::kernels::cpu {
inline namespace APEX_ISA_NS {

constexpr int64_t kTile = 512;
constexpr float kFloatMax = 3.40282346638528859811704183484516925e+38f;

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- dtype conversion ------------------------------------------------------------------------

inline void half_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i,
                     _mm512_maskz_cvtph_ps(
                         0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm256_storeu_ps(dst + i,
                     _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
  }
#endif
  for (; i < n; ++i) {
    _Float16 h;
    std::memcpy(&h, src + i, 2);
    dst[i] = static_cast<float>(h);
  }
}

inline void float_to_half(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(
        reinterpret_cast<__m256i*>(dst + i),
        _mm512_maskz_cvtps_ph(0xffff, _mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  }
#endif
  for (; i < n; ++i) {
    const auto h = static_cast<_Float16>(src[i]);
    std::memcpy(dst + i, &h, 2);
  }
}

// bf16 bits are the high half of the fp32 bits.
inline float bf16_bits_to_float(uint16_t h) { return float_of(static_cast<uint32_t>(h) << 16); }

inline void bf16_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(src[i]);
}

// Round to nearest even, NaN to the canonical quiet NaN (c10::BFloat16's rounding).
inline uint16_t bf16_round(float f) {
  const uint32_t u = bits_of(f);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const bool nan = (u & 0x7fffffffu) > 0x7f800000u;
  return static_cast<uint16_t>(nan ? 0x7fc0u : rounded);
}

// One vector register of fp32 lanes as one value (GCC's vector extension): sixteen lanes on
// AVX-512, eight on AVX2, four on the SSE2 baseline. The row reductions are written on it rather
// than left to the auto-vectorizer, which vectorized some of them across the outer loop (strided
// lanes). Never wider than the ISA's register: GCC lowers a wider value through the stack and
// general registers (docs/perf-notes.md).
#if defined(__AVX512F__)
constexpr int kVec = 16;
#elif defined(__AVX2__)
constexpr int kVec = 8;
#else
constexpr int kVec = 4;
#endif
typedef float Lanes __attribute__((vector_size(4 * kVec)));
typedef uint32_t Lanes32 __attribute__((vector_size(4 * kVec)));
typedef uint16_t Lanes16 __attribute__((vector_size(2 * kVec)));

inline float get(const float* p, int64_t i) { return p[i]; }
inline float get(const uint16_t* p, int64_t i) { return bf16_bits_to_float(p[i]); }
inline void put(float* p, int64_t i, float v) { p[i] = v; }
inline void put(uint16_t* p, int64_t i, float v) { p[i] = bf16_round(v); }

inline Lanes get_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline Lanes get_lanes(const uint16_t* p) {
#if defined(__AVX512F__)
  // One widening load (GCC 12 makes two half-width ones and an insert of the generic form). The
  // maskz forms with a full mask: the plain ones trip GCC 12's maybe-uninitialized warning.
  const __m512i u = _mm512_maskz_slli_epi32(
      0xffff,
      _mm512_maskz_cvtepu16_epi32(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
      16);
  return reinterpret_cast<Lanes>(u);
#elif defined(__AVX2__)
  // Likewise: GCC 12 widens the generic form with two 4-lane vpmovzxwd, a byte shift and an
  // insert.
  return reinterpret_cast<Lanes>(_mm256_slli_epi32(
      _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
#else
  Lanes16 h;
  std::memcpy(&h, p, sizeof h);
  const Lanes32 u = __builtin_convertvector(h, Lanes32) << 16;
  Lanes v;
  std::memcpy(&v, &u, sizeof v);
  return v;
#endif
}

// bf16_round of each lane, by the same bit arithmetic.
inline Lanes16 bf16_round_bits(Lanes v) {
  Lanes32 u;
  std::memcpy(&u, &v, sizeof u);
  const Lanes32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const Lanes32 nan_value = Lanes32{} + 0x7fc0u;
  return __builtin_convertvector((u & 0x7fffffffu) > 0x7f800000u ? nan_value : rounded, Lanes16);
}

// With AVX512-BF16 (kLanesBf16) one instruction rounds sixteen lanes to nearest even, in place of
// the ten or so of the bit arithmetic. The instruction differs from bf16_round in two cases: it
// flushes denormal inputs to zero, and it keeps a NaN's sign and payload where c10 writes 0x7fc0.
// Lanes holding either are found by one class test and take the bit arithmetic, so the result is
// bf16_round's bit for bit. The class test sees denormals as zeros when MXCSR.DAZ is set, so with
// DAZ on (torch.set_flush_denormal, or a caller's own MXCSR) the loops keep to the bit arithmetic
// (lanes_bf16_usable).
#if defined(__AVX512BF16__)
constexpr bool kLanesBf16 = true;
inline bool lanes_bf16_usable() {
  constexpr unsigned kDenormalsAreZero = 0x0040;
  return (_mm_getcsr() & kDenormalsAreZero) == 0;
}
inline Lanes16 bf16_round_lanes(Lanes v) {
  const auto f = static_cast<__m512>(v);
  const auto hw = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(f));
  constexpr int kQuietNan = 0x01;
  constexpr int kDenormal = 0x20;
  constexpr int kSignalingNan = 0x80;
  const __mmask16 odd = _mm512_fpclass_ps_mask(f, kQuietNan | kDenormal | kSignalingNan);
  if (__builtin_expect(odd == 0, 1)) return reinterpret_cast<Lanes16>(hw);
  return reinterpret_cast<Lanes16>(
      _mm256_mask_blend_epi16(odd, hw, reinterpret_cast<__m256i>(bf16_round_bits(v))));
}
#elif defined(__AVX2__) && !defined(__AVX512F__)
// AVX2 has no rounding instruction; the bit arithmetic written with intrinsics (one unordered
// compare and a blend for NaN, an unsigned pack) takes 9 instructions per 8 lanes where GCC's
// vectorization of bf16_round took 11.5. Exact for every input, so usable whatever MXCSR holds.
constexpr bool kLanesBf16 = true;
inline bool lanes_bf16_usable() { return true; }
inline Lanes16 bf16_round_lanes(Lanes v) {
  const auto f = static_cast<__m256>(v);
  const auto u = reinterpret_cast<__m256i>(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(f, f, _CMP_UNORD_Q));
  const __m256i bits = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
  // Every lane is below 2^16, so the signed-to-unsigned saturating pack keeps it exactly.
  return reinterpret_cast<Lanes16>(
      _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1)));
}
#else
constexpr bool kLanesBf16 = false;
inline bool lanes_bf16_usable() { return false; }
inline Lanes16 bf16_round_lanes(Lanes v) { return bf16_round_bits(v); }
#endif

inline void put_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof v); }
inline void put_lanes(uint16_t* p, Lanes v) {
  const Lanes16 h = bf16_round_lanes(v);
  std::memcpy(p, &h, sizeof h);
}

// Sixteen elements of a bf16 row (2 * kVec) as two registers, in the order that interleaving the
// row's 16-bit words with zeros gives (vpunpcklwd/vpunpckhwd), which is also the order that the
// unsigned pack of two registers of rounded words puts back in place (vpackusdw): per 128-bit lane
// l, lo holds elements 8l..8l+3 and hi 8l+4..8l+7 (on AVX2: lo = 0-3, 8-11; hi = 4-7, 12-15).
// Zero in the low half of each 32-bit lane is the widening itself, so a register takes one
// instruction (against a widening load and a shift), and one pack and one store write 16 rounded
// elements (against an extract, a pack and a store per 8). fp32 rows read this way (w, the
// dw/db partials) are kept permuted to match (to_unpacked). kMayHoldNan false: the caller knows no
// lane is NaN, and the rounding skips its test (see row_is_nan_free).
template <bool kMayHoldNan>
struct Unpacked {
  Lanes lo;
  Lanes hi;
};
// Whether bf16 rows take the Unpacked loops: on AVX2 only, where they cut the instructions per
// element (docs/perf-notes.md); AVX512-BF16 rounds with one instruction.
#if defined(__AVX2__) && !defined(__AVX512F__)
constexpr bool kUnpackedRows = true;
#else
constexpr bool kUnpackedRows = false;
#endif
template <class W>
constexpr bool kIsUnpacked =
    std::is_same_v<W, Unpacked<true>> || std::is_same_v<W, Unpacked<false>>;

// The element of a block of 2 * kVec that position p (< kVec) of lo, or of hi, holds.
constexpr int unpacked_element(int p, bool hi) { return p / 4 * 8 + (hi ? 4 : 0) + p % 4; }

#define APEX_UNPACKED_OP(op)                                     \
  template <bool N>                                              \
  inline Unpacked<N> operator op(Unpacked<N> a, Unpacked<N> b) { \
    return {a.lo op b.lo, a.hi op b.hi};                         \
  }                                                              \
  template <bool N>                                              \
  inline Unpacked<N> operator op(Unpacked<N> a, float s) {       \
    return {a.lo op s, a.hi op s};                               \
  }                                                              \
  template <bool N>                                              \
  inline Unpacked<N> operator op(float s, Unpacked<N> a) {       \
    return {s op a.lo, s op a.hi};                               \
  }
APEX_UNPACKED_OP(+)
APEX_UNPACKED_OP(-)
APEX_UNPACKED_OP(*)
APEX_UNPACKED_OP(/)
#undef APEX_UNPACKED_OP

template <class W>
inline W get_unpacked(const float* p) {
  return {get_lanes(p), get_lanes(p + kVec)};
}
template <class W>
inline W get_unpacked(const uint16_t* p) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  const __m256i u = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  const __m256i zero = _mm256_setzero_si256();
  return {reinterpret_cast<Lanes>(_mm256_unpacklo_epi16(zero, u)),
          reinterpret_cast<Lanes>(_mm256_unpackhi_epi16(zero, u))};
#else
  static_assert(sizeof(W) == 0, "Unpacked rows are AVX2's only (kUnpackedRows)");
  return W{};
#endif
}
template <bool N>
inline void put_unpacked(float* p, Unpacked<N> v) {
  put_lanes(p, v.lo);
  put_lanes(p + kVec, v.hi);
}
// bf16_round of every lane, as in bf16_round_bits.
template <bool kMayHoldNan>
inline void put_unpacked(uint16_t* p, Unpacked<kMayHoldNan> v) {
#if defined(__AVX2__) && !defined(__AVX512F__)
  auto rounded = [](Lanes f) {
    const auto u = reinterpret_cast<Lanes32>(f);
    // Bit 16 by two shifts rather than a shift and a mask: one constant register fewer, which
    // the two-row loop (backward_out2) is short of.
    Lanes32 r = (u + 0x7fffu + ((u << 15) >> 31)) >> 16;
    if constexpr (kMayHoldNan) r = f != f ? Lanes32{} + 0x7fc0u : r;
    return reinterpret_cast<__m256i>(r);
  };
  // Every lane is below 2^16, so the signed-to-unsigned saturating pack keeps it exactly.
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm256_packus_epi32(rounded(v.lo), rounded(v.hi)));
#else
  static_assert(sizeof(v) == 0, "Unpacked rows are AVX2's only (kUnpackedRows)");
  (void)p;
#endif
}

// src's blocks of 2 * kVec in the order of Unpacked (lo's elements, then hi's; the tail as it is).
inline void to_unpacked(const float* __restrict src, float* __restrict dst, int64_t n) {
  int64_t i = 0;
  for (; i + 2 * kVec <= n; i += 2 * kVec) {
    for (int j = 0; j < kVec; ++j) {
      dst[i + j] = src[i + unpacked_element(j, false)];
      dst[i + kVec + j] = src[i + unpacked_element(j, true)];
    }
  }
  for (; i < n; ++i) dst[i] = src[i];
}

// Element i of a row as W: float (the element) or Lanes (kVec elements from i).
template <class W, class T>
inline W get_as(const T* p, int64_t i) {
  if constexpr (std::is_same_v<W, float>) {
    return get(p, i);
  } else if constexpr (kIsUnpacked<W>) {
    return get_unpacked<W>(p + i);
  } else {
    return get_lanes(p + i);
  }
}
template <class T, class W>
inline void put_as(T* p, int64_t i, W v) {
  if constexpr (std::is_same_v<W, float>) {
    put(p, i, v);
  } else if constexpr (kIsUnpacked<W>) {
    put_unpacked(p + i, v);
  } else {
    put_lanes(p + i, v);
  }
}

// Runs body(W{}, i) for the elements [0, n) of a loop whose stores go to TO: one element at a
// time (W = float), which the compiler vectorizes, except where TO is bf16 and this build rounds
// Lanes by hand (kLanesBf16: AVX512-BF16's instruction, AVX2's intrinsics), which the compiler's
// vectorizer would not produce: then Lanes steps first, and elements for the tail. No iteration
// stores to what another iteration loads (outputs are buffers of their own; the dw/db partials are
// read and written at the same index only), hence ivdep: without it, GCC's runtime alias checks for
// the backward's ten pointers exceeded its limit and left the fp32 loop scalar.
template <class TO, class F>
__attribute__((always_inline)) inline void for_each_out(int64_t n, F&& body) {
  int64_t i = 0;
  if constexpr (kLanesBf16 && std::is_same_v<TO, uint16_t>) {
    if (lanes_bf16_usable()) {
      for (; i + kVec <= n; i += kVec) body(Lanes{}, i);
    }
  }
#pragma GCC ivdep
  for (; i < n; ++i) body(float{}, i);
}

// The same over blocks of 2 * kVec elements as Unpacked (its rows permuted, see to_unpacked), then
// elements for the tail. nan_free: no value stored is NaN, or only NaNs that arithmetic made of
// finite values (see row_is_nan_free).
template <class F>
__attribute__((always_inline)) inline void for_each_unpacked(int64_t n, bool nan_free, F&& body) {
  int64_t i = 0;
  if (nan_free) {
    for (; i + 2 * kVec <= n; i += 2 * kVec) body(Unpacked<false>{}, i);
  } else {
    for (; i + 2 * kVec <= n; i += 2 * kVec) body(Unpacked<true>{}, i);
  }
#pragma GCC ivdep
  for (; i < n; ++i) body(float{}, i);
}

// Runs body over a row of n elements: as Unpacked blocks (kUnp) or as for_each_out does.
template <bool kUnp, class TO, class F>
__attribute__((always_inline)) inline void for_each_row(int64_t n, bool nan_free, F&& body) {
  if constexpr (kUnp) {
    for_each_unpacked(n, nan_free, body);
  } else {
    for_each_out<TO>(n, body);
  }
}

inline void float_to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
  for_each_out<uint16_t>(n,
                         [&](auto z, int64_t i) { put_as(dst, i, get_as<decltype(z)>(src, i)); });
}

// Returns a pointer to n fp32 values of src: src itself for fp32 storage, else buf filled.
inline float* load(DType t, void* src, float* buf, int64_t n) {
  switch (t) {
    case DType::kFloat32:
      return static_cast<float*>(src);
    case DType::kFloat16:
      half_to_float(static_cast<const uint16_t*>(src), buf, n);
      return buf;
    case DType::kBFloat16:
      bf16_to_float(static_cast<const uint16_t*>(src), buf, n);
      return buf;
  }
  return buf;
}

// Writes n fp32 values to dst in its storage dtype; a no-op when they are already there.
inline void store(DType t, const float* src, void* dst, int64_t n) {
  switch (t) {
    case DType::kFloat32:
      if (src != dst) std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
      return;
    case DType::kFloat16:
      float_to_half(src, static_cast<uint16_t*>(dst), n);
      return;
    case DType::kBFloat16:
      float_to_bf16(src, static_cast<uint16_t*>(dst), n);
      return;
  }
}

inline void* at(void* base, DType t, int64_t offset) {
  return static_cast<char*>(base) + offset * dtype_size(t);
}

// a * b + c as one fused multiply-add where the ISA has one, written out so that every loop
// computes it the same way: left to the compiler, the vector loop and the scalar one were fused
// differently in the sanitizer build, and a bf16 output then differed from its fp32 twin by more
// than the rounding (a small y = x_hat * w + b is a cancellation).
template <class W>
inline W mul_add(W a, W b, W c) {
#if defined(__FMA__)
  if constexpr (std::is_same_v<W, float>) {
    return __builtin_fmaf(a, b, c);
  }
#endif
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<W, Lanes>) {
    return reinterpret_cast<Lanes>(
        _mm512_fmadd_ps(static_cast<__m512>(a), static_cast<__m512>(b), static_cast<__m512>(c)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<W, Lanes>) {
    return reinterpret_cast<Lanes>(
        _mm256_fmadd_ps(static_cast<__m256>(a), static_cast<__m256>(b), static_cast<__m256>(c)));
  }
#endif
  return a * b + c;
}
template <bool N>
inline Unpacked<N> mul_add(Unpacked<N> a, Unpacked<N> b, Unpacked<N> c) {
  return {mul_add(a.lo, b.lo, c.lo), mul_add(a.hi, b.hi, c.hi)};
}

}  // namespace APEX_ISA_NS
}  // namespace apex::kernels::cpu
