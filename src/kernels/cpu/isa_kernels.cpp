// Chunk kernels, compiled once per instruction set (see isa.h). The math loops are plain fp32
// loops over restrict pointers that the compiler vectorizes for the target ISA; fp16/bf16 storage
// is converted tile by tile into L1-resident fp32 buffers, so one math loop serves every dtype.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/cpu/isa.h"

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef APEX_CPU_ISA
#define APEX_CPU_ISA baseline
#endif
#define APEX_CAT_(a, b) a##b
#define APEX_CAT(a, b) APEX_CAT_(a, b)

namespace apex::kernels::cpu {
namespace {

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

void half_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
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

void float_to_half(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
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

void bf16_to_float(const uint16_t* __restrict src, float* __restrict dst, int64_t n) {
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
// lanes: twice as slow on short rows). Never wider than the ISA's register: GCC lowers a 64-byte
// value on AVX2 through the stack and general registers (vpinsrq, spills), and the AVX2 LayerNorm
// forward then ran at 0.6x ATen's, slower than the baseline build (a Zen 3 VM, rows in L1).
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
// the ten or so of the bit arithmetic (one core, rows in L2: the bf16 LayerNorm forward took
// 0.083-0.097 ns per element instead of 0.125, its backward 0.184 instead of 0.21; fp32's forward
// takes 0.07-0.08). The instruction differs from bf16_round in two cases: it flushes denormal
// inputs to zero, and it keeps a NaN's sign and payload where c10 writes 0x7fc0. Lanes holding
// either are found by one class test and take the bit arithmetic, so the result is bf16_round's
// bit for bit. The class test sees denormals as zeros when MXCSR.DAZ is set, so with DAZ on
// (torch.set_flush_denormal, or a caller's own MXCSR) the loops keep to the bit arithmetic
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
// AVX2 has no rounding instruction, but the bit arithmetic written with intrinsics costs 9
// instructions per 8 lanes, where GCC's vectorization of bf16_round spent 11 and a half (the NaN
// test as and/min/compare/blend instead of one unordered compare and a blend, a mask before the
// pack that the unsigned pack does not need). With the widening load below, bf16 LayerNorm on one
// core of a Zen 3 VM, rows in cache (8x8192, 64x4096, 256x1024): forward 0.53 -> 0.42 ns per
// element, backward 0.81-0.93 -> 0.63-0.74 (fp32: 0.24 and 0.52-0.54, unchanged). Exact for every
// input, so usable whatever MXCSR holds.
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
// Whether bf16 rows take the Unpacked loops: on AVX2, where they cut the bf16 forward's
// instructions per element by about a third and the backward's by a fifth (see
// docs/benchmarks.md). AVX512-BF16 rounds with one instruction, and plain AVX-512 was not
// measured.
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
void to_unpacked(const float* __restrict src, float* __restrict dst, int64_t n) {
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

void float_to_bf16(const float* __restrict src, uint16_t* __restrict dst, int64_t n) {
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

// Tile walker: for each tile, the parameter the math works on (the master when `master` names a
// present list, else list 0) as fp32, then written back to every list that holds it.
struct ParamTile {
  float buf[kTile];
  float* p = nullptr;
  void begin(const Span& s, int master, int64_t off, int64_t n) {
    if (master >= 0 && s.p[master] != nullptr) {
      p = static_cast<float*>(s.p[master]) + off;
    } else {
      p = load(s.t[0], at(s.p[0], s.t[0], off), buf, n);
    }
  }
  void end(const Span& s, int64_t off, int64_t n) const {
    store(s.t[0], p, at(s.p[0], s.t[0], off), n);
  }
};

inline float* fp32_list(const Span& s, int l, int64_t off) {
  return static_cast<float*>(s.p[l]) + off;
}

// ---- primitives -------------------------------------------------------------------------------

bool any_non_finite(const float* __restrict x, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !(__builtin_fabsf(x[i]) <= kFloatMax);
  return bad != 0;
}

bool scale_chunk(const Span& s, float scale) {
  float in_buf[kTile];
  float out_buf[kTile];
  bool bad = false;
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    const float* x = load(s.t[0], at(s.p[0], s.t[0], off), in_buf, n);
    bad |= any_non_finite(x, n);
    float* y = s.t[1] == DType::kFloat32 ? fp32_list(s, 1, off) : out_buf;
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
    store(s.t[1], y, at(s.p[1], s.t[1], off), n);
  }
  return bad;
}

bool axpby_chunk(const Span& s, float a, float b, int arg_to_check) {
  float x_buf[kTile];
  float y_buf[kTile];
  float out_buf[kTile];
  bool bad = false;
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    const float* x = load(s.t[0], at(s.p[0], s.t[0], off), x_buf, n);
    const float* y = load(s.t[1], at(s.p[1], s.t[1], off), y_buf, n);
    if (arg_to_check != 1) bad |= any_non_finite(x, n);
    if (arg_to_check != 0) bad |= any_non_finite(y, n);
    float* out = s.t[2] == DType::kFloat32 ? fp32_list(s, 2, off) : out_buf;
    for (int64_t i = 0; i < n; ++i) out[i] = a * x[i] + b * y[i];
    store(s.t[2], out, at(s.p[2], s.t[2], off), n);
  }
  return bad;
}

bool non_finite_chunk(const Span& s) {
  float buf[kTile];
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    if (any_non_finite(load(s.t[0], at(s.p[0], s.t[0], off), buf, n), n)) return true;
  }
  return false;
}

// Sixteen independent fp32 lanes per tile (vectorizable without reassociation flags), summed
// into a double per tile: accurate and independent of the thread count.
double lane_sumsq(const float* __restrict x, int64_t n, float mul) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = x[i + j] * mul;
      acc[j] += v * v;
    }
  }
  for (; i < n; ++i) {
    const float v = x[i] * mul;
    acc[0] += v * v;
  }
  double total = 0.0;
  for (float a : acc) total += a;
  return total;
}

double sumsq_chunk(const Span& s, float mul) {
  float buf[kTile];
  double total = 0.0;
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    total += lane_sumsq(load(s.t[0], at(s.p[0], s.t[0], off), buf, n), n, mul);
  }
  return total;
}

// NaN is sticky: once a lane holds NaN no comparison replaces it.
float absmax_chunk(const Span& s, float mul) {
  float buf[kTile];
  float acc[16] = {};
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    const float* x = load(s.t[0], at(s.p[0], s.t[0], off), buf, n);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (int j = 0; j < 16; ++j) {
        const float v = __builtin_fabsf(x[i + j] * mul);
        acc[j] = (v > acc[j] || v != v) ? v : acc[j];
      }
    }
    for (; i < n; ++i) {
      const float v = __builtin_fabsf(x[i] * mul);
      acc[0] = (v > acc[0] || v != v) ? v : acc[0];
    }
  }
  float m = 0.0f;
  for (float a : acc) {
    if (a != a) return a;
    m = a > m ? a : m;
  }
  return m;
}

// ---- optimizers -------------------------------------------------------------------------------

// The walk every optimizer shares: per tile, the parameter as fp32 (the master when present),
// the gradient as fp32 (when `with_grad`), fn(p, g, offset, n), then the parameter written back.
template <class Fn>
void for_each_param_tile(const Span& s, int master, bool with_grad, const Fn& fn) {
  ParamTile pt;
  float g_buf[kTile];
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    pt.begin(s, master, off, n);
    const float* g = with_grad ? load(s.t[1], at(s.p[1], s.t[1], off), g_buf, n) : nullptr;
    fn(pt.p, g, off, n);
    pt.end(s, off, n);
  }
}

void adam_math(float* __restrict p, const float* __restrict g, float* __restrict m,
               float* __restrict v, int64_t n, const AdamChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float gi = g[i] * a.inv + a.l2 * pi;
    const float mi = m[i] * a.beta1 + a.one_minus_beta1 * gi;
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = __builtin_sqrtf(vi) * (1.0f / a.bc2_sqrt) + a.eps;
    p[i] = pi * a.decay - a.step_size * (mi / denom);
  }
}

void adam_chunk(const Span& s, const AdamChunk& a) {
  for_each_param_tile(s, 4, true, [&](float* p, const float* g, int64_t off, int64_t n) {
    adam_math(p, g, fp32_list(s, 2, off), fp32_list(s, 3, off), n, a);
  });
}

// The common case (momentum buffer already seeded) in one loop: g, buf and p are each touched
// once per element.
template <bool kNesterov>
void sgd_momentum_math(float* __restrict p, const float* __restrict g, float* __restrict buf,
                       int64_t n, const SgdChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float gi = g[i] * a.inv + a.wd_before * pi;
    const float b = a.momentum * buf[i] + a.one_minus_dampening * gi;
    buf[i] = b;
    const float d = kNesterov ? gi + a.momentum * b : b;
    p[i] = pi - a.lr * (d + a.wd_after * pi);
  }
}

// No momentum, or the first step, which seeds the buffer with the gradient.
void sgd_plain_math(float* __restrict p, const float* __restrict g, float* __restrict buf,
                    int64_t n, const SgdChunk& a) {
  float d_buf[kTile];
  float* __restrict d = d_buf;
  for (int64_t i = 0; i < n; ++i) d[i] = g[i] * a.inv + a.wd_before * p[i];
  if (a.has_momentum) {
    for (int64_t i = 0; i < n; ++i) buf[i] = d[i];
    if (a.nesterov) {
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] + a.momentum * buf[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - a.lr * (d[i] + a.wd_after * p[i]);
}

void sgd_chunk(const Span& s, const SgdChunk& a) {
  for_each_param_tile(s, 3, true, [&](float* p, const float* g, int64_t off, int64_t n) {
    float* buf = a.has_momentum ? fp32_list(s, 2, off) : nullptr;
    if (!a.has_momentum || a.first_run) {
      sgd_plain_math(p, g, buf, n, a);
    } else if (a.nesterov) {
      sgd_momentum_math<true>(p, g, buf, n, a);
    } else {
      sgd_momentum_math<false>(p, g, buf, n, a);
    }
  });
}

void adagrad_math(float* __restrict p, const float* __restrict g, float* __restrict h, int64_t n,
                  const AdagradChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float gi = g[i] * a.inv + a.l2 * pi;
    const float hi = h[i] + gi * gi;
    h[i] = hi;
    p[i] = pi * a.decay - a.lr * (gi / (__builtin_sqrtf(hi) + a.eps));
  }
}

void adagrad_chunk(const Span& s, const AdagradChunk& a) {
  for_each_param_tile(s, 3, true, [&](float* p, const float* g, int64_t off, int64_t n) {
    adagrad_math(p, g, fp32_list(s, 2, off), n, a);
  });
}

inline float lamb_update(float m, float v, float p, const LambChunk& a) {
  return (m / a.bc1) / (__builtin_sqrtf(v / a.bc2) + a.eps) + a.wd_update * p;
}

void lamb_stage1_math(const float* __restrict p, const float* __restrict g, float* __restrict m,
                      float* __restrict v, float* __restrict u, int64_t n, const LambChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * a.g_mul + a.l2 * p[i];
    const float mi = a.beta1 * m[i] + a.beta3 * gi;
    const float vi = a.beta2 * v[i] + a.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    u[i] = lamb_update(mi, vi, p[i], a);
  }
}

void lamb_stage1_chunk(const Span& s, const LambChunk& a, double* u_sumsq, double* p_sumsq) {
  double u_total = 0.0;
  double p_total = 0.0;
  for_each_param_tile(s, 4, true, [&](float* p, const float* g, int64_t off, int64_t n) {
    float u[kTile];
    lamb_stage1_math(p, g, fp32_list(s, 2, off), fp32_list(s, 3, off), u, n, a);
    u_total += lane_sumsq(u, n, 1.0f);
    p_total += lane_sumsq(p, n, 1.0f);
  });
  *u_sumsq = u_total;
  *p_sumsq = p_total;
}

void lamb_stage2_math(float* __restrict p, const float* __restrict m, const float* __restrict v,
                      int64_t n, const LambChunk& a, float ratio) {
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - ratio * lamb_update(m[i], v[i], p[i], a);
}

void lamb_stage2_chunk(const Span& s, const LambChunk& a, float ratio) {
  for_each_param_tile(s, 4, false, [&](float* p, const float*, int64_t off, int64_t n) {
    lamb_stage2_math(p, fp32_list(s, 2, off), fp32_list(s, 3, off), n, a, ratio);
  });
}

void novograd_math(float* __restrict p, const float* __restrict g, float* __restrict m, int64_t n,
                   const NovoGradChunk& a) {
  if (a.reg_inside_moment) {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = (g[i] * a.inv) / a.denom + a.wd * p[i];
      const float mi = a.beta1 * m[i] + a.beta3 * gi;
      m[i] = mi;
      p[i] = p[i] - a.lr * (mi / a.bc1);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float mi = a.beta1 * m[i] + a.beta3 * (g[i] * a.inv);
      m[i] = mi;
      p[i] = p[i] - a.lr * ((mi / a.bc1) / a.denom + a.wd * p[i]);
    }
  }
}

void novograd_chunk(const Span& s, const NovoGradChunk& a) {
  for_each_param_tile(s, 3, true, [&](float* p, const float* g, int64_t off, int64_t n) {
    novograd_math(p, g, fp32_list(s, 2, off), n, a);
  });
}

// ---- normalization rows ---------------------------------------------------------------------
//
// The row kernels are templates over the storage of each row: float, or uint16_t holding bf16
// bits, which are widened and rounded in registers (a bf16 row is never copied into an fp32 row).
// fp16 rows are converted into an fp32 scratch row first and take the float path.

// Row reductions keep kLanes independent fp32 partial sums (four vector registers, whatever the
// ISA: the two sums of shifted_sums then take eight of AVX2's sixteen), so the adds pipeline
// instead of waiting on one register; the partials are combined by a pairwise tree in a fixed
// order.
constexpr int kLanes = 4 * kVec;

// Pairwise tree over the partials (halves added element-wise, so it vectorizes); fixed order.
// Each level has a compile-time width, so the whole tree unrolls into a few vector adds.
template <int N>
__attribute__((always_inline)) inline float combine_tree(float* acc) {
  if constexpr (N == 1) {
    return acc[0];
  } else {
    for (int j = 0; j < N / 2; ++j) acc[j] += acc[j + N / 2];
    return combine_tree<N / 2>(acc);
  }
}

// The V registers of partials, pairwise, then their kVec lanes.
template <int V>
__attribute__((always_inline)) inline float combine(Lanes (&acc)[V]) {
  for (int half = V / 2; half >= 1; half /= 2) {
    for (int j = 0; j < half; ++j) acc[j] += acc[j + half];
  }
  float lanes[kVec];
  std::memcpy(lanes, &acc[0], sizeof lanes);
  return combine_tree<kVec>(lanes);
}

// Sum of (x - c)^2 with V registers of partials (c = 0: the plain sum of squares; kSquare
// false: the sum of x).
template <int V, bool kSquare, class T>
float lane_reduce(const T* __restrict x, int64_t n, float c) {
  Lanes acc[V] = {};
  int64_t i = 0;
  for (; i + V * kVec <= n; i += V * kVec) {
    for (int v = 0; v < V; ++v) {
      const Lanes xv = get_lanes(x + i + v * kVec);
      const Lanes d = xv - c;
      acc[v] += kSquare ? d * d : xv;
    }
  }
  float tail = 0.0f;
  for (; i < n; ++i) {
    const float d = get(x, i) - c;
    tail += kSquare ? d * d : get(x, i);
  }
  return combine(acc) + tail;
}

// Sum of d and of d^2, d = x - k, in one pass (V registers of partials each).
template <int V, class T>
std::pair<float, float> shifted_sums(const T* __restrict x, int64_t n, float k) {
  Lanes acc1[V] = {};
  Lanes acc2[V] = {};
  int64_t i = 0;
  for (; i + V * kVec <= n; i += V * kVec) {
    for (int v = 0; v < V; ++v) {
      const Lanes d = get_lanes(x + i + v * kVec) - k;
      acc1[v] += d;
      acc2[v] += d * d;
    }
  }
  float t1 = 0.0f;
  float t2 = 0.0f;
  for (; i < n; ++i) {
    const float d = get(x, i) - k;
    t1 += d;
    t2 += d * d;
  }
  return {combine(acc1) + t1, combine(acc2) + t2};
}

// Short rows take one register of partials: the tree over four would cost more than the row.
template <bool kSquare, class T>
float row_reduce(const T* __restrict x, int64_t n, float c) {
  return n >= 4 * kLanes ? lane_reduce<kLanes / kVec, kSquare>(x, n, c)
                         : lane_reduce<1, kSquare>(x, n, c);
}

// Mean (0 for RMSNorm) and variance of a row. LayerNorm rows of 256 and more take one pass from
// memory: the sums of d and d^2, d = x - k, with k the mean of the row's first 64 elements, give
// mean = k + m and var = mean(d^2) - m^2, m = mean(d). The subtraction loses about
// (1 + m^2 / var) times the rounding of the sums, and since k is the mean of part of the row,
// m^2 <= (n / 64) var: up to 129x at 8192 columns. Rows with m^2 > var / 4 (whose first 64
// elements are unlike the rest) take the second, centred pass from cache instead, which bounds
// the loss at 2.4x the two-pass method's (checked against LibTorch's fp32 layer_norm on such
// rows in the tests). NaN and Inf fail that test and take the centred pass too.
template <class T>
std::pair<float, float> row_moments_fp32(const T* __restrict x, int64_t n, bool rms) {
  const float inv_n = 1.0f / static_cast<float>(n);
  constexpr int kPilot = 64;  // the elements k is the mean of (whatever the ISA)
  if (!rms && n >= 4 * kPilot) {
    Lanes pilot[1] = {get_lanes(x)};
    for (int i = kVec; i < kPilot; i += kVec) pilot[0] += get_lanes(x + i);
    const float k = combine(pilot) * (1.0f / kPilot);
    const auto [s1, s2] = shifted_sums<kLanes / kVec>(x, n, k);
    const float m = s1 * inv_n;
    const float var = s2 * inv_n - m * m;
    if (m * m <= 0.25f * var) return {k + m, var};
    return {k + m, row_reduce<true>(x, n, k + m) * inv_n};
  }
  const float mean = rms ? 0.0f : row_reduce<false>(x, n, 0.0f) * inv_n;
  return {mean, row_reduce<true>(x, n, mean) * inv_n};
}

// Rows whose fp32 sums are not finite are summed again in fp64: values beyond ~FLT_MAX / 64
// overflow the fp32 sums (a row of 1e37s gave a NaN mean and row) where their mean and spread are
// finite, as at::layer_norm finds them. Rows holding NaN or Inf come here too and keep them. Out
// of line and cold, so that the common path's code stays as it was.
template <class T>
__attribute__((noinline, cold)) std::pair<float, float> row_moments_fp64(const T* __restrict x,
                                                                         int64_t n, bool rms) {
  double sum = 0.0;
  if (!rms) {
    for (int64_t i = 0; i < n; ++i) sum += static_cast<double>(get(x, i));
  }
  const double mean = sum / static_cast<double>(n);
  // NaN or Inf in the row: no second pass (the variance is NaN).
  if (!std::isfinite(mean))
    return {static_cast<float>(mean), std::numeric_limits<float>::quiet_NaN()};
  double sq = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    const double d = static_cast<double>(get(x, i)) - mean;
    sq += d * d;
  }
  return {static_cast<float>(mean), static_cast<float>(sq / static_cast<double>(n))};
}

template <class T>
inline std::pair<float, float> row_moments(const T* __restrict x, int64_t n, bool rms) {
  const auto fast = row_moments_fp32(x, n, rms);
  if (__builtin_expect(std::isfinite(fast.first) && std::isfinite(fast.second), 1)) return fast;
  return row_moments_fp64(x, n, rms);
}

void from_float_values(const float* src, DType t, void* dst, int64_t n) { store(t, src, dst, n); }

void to_float_values(const void* src, DType t, float* dst, int64_t n) {
  const float* p = load(t, const_cast<void*>(src), dst, n);
  if (p != dst) std::memcpy(dst, p, static_cast<size_t>(n) * sizeof(float));
}

// Rows are contiguous: ask for the next row while this one is worked on in L1, so that memory is
// busy during the passes that do not read it (prefetches never fault, so the row after the last
// one is harmless). Only the backward's short rows do it: on rows of 256 and more the hardware's
// stream prefetch does better alone (see docs/design.md, "Tried and dropped").
void prefetch_next_row(const void* row, DType t, int64_t cols) {
  const int64_t row_bytes = cols * dtype_size(t);
  // Integer arithmetic: after the last row the addresses lie past the tensor, where forming a
  // pointer would be undefined (a prefetch of them is not).
  const uintptr_t next = reinterpret_cast<uintptr_t>(row) + static_cast<uintptr_t>(row_bytes);
  for (int64_t off = 0; off < row_bytes; off += 64) {
    __builtin_prefetch(reinterpret_cast<const void*>(next + static_cast<uintptr_t>(off)));
  }
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

// y = (x - mean) * rstd [* w] [+ b] over n elements (either of w and b may be absent). kUnp: every
// row bf16, read as Unpacked; nan_free as for for_each_unpacked.
template <bool kUnp, class TX, class TY, class TW>
void norm_output(const TX* __restrict x, const TW* __restrict w, const TW* __restrict b,
                 TY* __restrict y, int64_t n, float mean, float rstd, bool nan_free) {
  auto rows = [&](auto has_w, auto has_b) {
    for_each_row<kUnp, TY>(n, nan_free, [&](auto z, int64_t i) {
      using W = decltype(z);
      W v = (get_as<W>(x, i) - mean) * rstd;
      if constexpr (has_w && has_b) {
        v = mul_add(v, get_as<W>(w, i), get_as<W>(b, i));
      } else if constexpr (has_w) {
        v = v * get_as<W>(w, i);
      } else if constexpr (has_b) {
        v = v + get_as<W>(b, i);
      }
      put_as(y, i, v);
    });
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (w != nullptr && b != nullptr) {
    rows(Yes{}, Yes{});
  } else if (w != nullptr) {
    rows(Yes{}, No{});
  } else if (b != nullptr) {
    rows(No{}, Yes{});
  } else {
    rows(No{}, No{});
  }
}

// Storage tags of a row: float, uint16_t (bf16 bits) or Half (fp16 bits, converted through an
// fp32 row).
struct Half {};
template <class S>
using stored_t = std::conditional_t<std::is_same_v<S, Half>, uint16_t, S>;

// Calls f with a value of the storage tag of t (float{}, uint16_t{} or Half{}): the one place a
// row's DType becomes a template argument.
template <class F>
void with_storage(DType t, F&& f) {
  switch (t) {
    case DType::kFloat32:
      return f(float{});
    case DType::kBFloat16:
      return f(uint16_t{});
    case DType::kFloat16:
      return f(Half{});
  }
}

// The row as the kernels read it: in place for fp32 and bf16, converted into buf for fp16.
template <class S>
inline auto row_view(const stored_t<S>* row, float* buf, int64_t n) {
  if constexpr (std::is_same_v<S, Half>) {
    half_to_float(row, buf, n);
    return static_cast<const float*>(buf);
  } else {
    return row;
  }
}

template <class S>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<S, float>) return DType::kFloat32;
  if constexpr (std::is_same_v<S, uint16_t>) return DType::kBFloat16;
  return DType::kFloat16;
}

// Whether n bf16 values (or none: p null) are all finite.
inline bool bf16_finite(const uint16_t* __restrict p, int64_t n) {
  if (p == nullptr) return true;
  uint16_t non_finite = 0;
  for (int64_t i = 0; i < n; ++i) non_finite |= (p[i] & 0x7fffu) >= 0x7f80u;
  return non_finite == 0;
}

// Rows [begin, end) of a forward. The loop over rows lives here, with every storage dispatch
// hoisted out of it, so that short rows cost no indirect call each and one row's reduction trees
// can overlap the next row's loads. TW: the parameters' storage, float or uint16_t (bf16).
template <class XS, class YS, class TW>
void forward_rows(const NormForwardArgs& a, int64_t begin, int64_t end, const TW* w, const TW* b,
                  float* scratch) {
  const int64_t cols = a.cols;
  // Every row bf16 (the parameters too, or absent): the Unpacked loops. Their output skips the
  // rounding's NaN test where the row's moments and the parameters are finite (these looked at
  // once per call of 4+ rows; an Inf weight over a zero x_hat gives the x86 default NaN, which the
  // unchecked rounding would write as 0xffc0).
  constexpr bool kUnp = kUnpackedRows && std::is_same_v<XS, uint16_t> &&
                        std::is_same_v<YS, uint16_t> && std::is_same_v<TW, uint16_t>;
  bool params_finite = false;
  if constexpr (kUnp) {
    params_finite = end - begin >= 4 && bf16_finite(w, cols) && bf16_finite(b, cols);
  }
  for (int64_t r = begin; r < end; ++r) {
    const stored_t<XS>* xs = static_cast<const stored_t<XS>*>(a.x) + r * cols;
    stored_t<YS>* ys = static_cast<stored_t<YS>*>(a.y) + r * cols;
    const auto* xr = row_view<XS>(xs, scratch, cols);
    const auto [mean, var] = row_moments(xr, cols, a.rms);
    const float rstd = 1.0f / __builtin_sqrtf(var + a.eps);
    if constexpr (std::is_same_v<YS, Half>) {
      // Tile by tile through an L1 buffer, so that a long row needs no second fp32 row.
      float* const tile = scratch + norm_scratch_stride(cols);
      for (int64_t i0 = 0; i0 < cols; i0 += kTile) {
        const int64_t n = std::min<int64_t>(kTile, cols - i0);
        norm_output<false>(xr + i0, w == nullptr ? nullptr : w + i0,
                           b == nullptr ? nullptr : b + i0, tile, n, mean, rstd, false);
        float_to_half(tile, ys + i0, n);
      }
    } else {
      // Finite moments: x holds no NaN or Inf, and |x_hat| <= sqrt(cols), so with finite w and
      // b no lane of y can be NaN.
      const bool nan_free =
          params_finite && std::isfinite(mean) && std::isfinite(var) && std::isfinite(rstd);
      norm_output<kUnp>(xr, w, b, ys, cols, mean, rstd, nan_free);
    }
    if (!a.rms) a.mean[r] = mean;
    a.rstd[r] = rstd;
  }
}

void norm_forward_rows(const NormForwardArgs& a, int64_t begin, int64_t end, const void* w,
                       const void* b, DType wb, float* scratch) {
  if (wb == DType::kBFloat16) {
    forward_rows<uint16_t, uint16_t>(a, begin, end, static_cast<const uint16_t*>(w),
                                     static_cast<const uint16_t*>(b), scratch);
    return;
  }
  with_storage(a.x_dtype, [&](auto xs) {
    with_storage(a.y_dtype, [&](auto ys) {
      forward_rows<decltype(xs), decltype(ys)>(a, begin, end, static_cast<const float*>(w),
                                               static_cast<const float*>(b), scratch);
    });
  });
}

// x_hat of element i of a backward row: from the input ((x - mean) * rstd), or (kFromOutput)
// from the output y ((y - b) / wd, wd: the weight clamped by magnitude, BackwardRow::wd).
template <bool kFromOutput, class W, class TS>
inline W x_hat(const TS* __restrict src, const float* __restrict wd, const float* __restrict b,
               float mean, float rstd, int64_t i) {
  if constexpr (kFromOutput) {
    return (get_as<W>(src, i) - get_as<W>(b, i)) / get_as<W>(wd, i);
  } else {
    return (get_as<W>(src, i) - mean) * rstd;
  }
}

// Everything one row of the backward needs besides its three rows.
struct BackwardRow {
  int64_t cols;
  bool rms;
  const float* w;   // fp32 [cols]: ones when the norm has none
  const float* wd;  // from the output: what y - b is divided by (w clamped to |w| >= eps)
  const float* b;   // fp32 [cols] from the output (zeros if no bias); null otherwise
  float* dw_part;   // fp32 partials [cols]
  float* db_part;
};

// The per-row constants of a backward row: dx = rstd * (dy * w - c_0 - x_hat * c_x).
struct RowCoef {
  float mean;
  float rstd;
  float c_0;  // mean(g), g = dy * w (0 for RMSNorm)
  float c_x;  // mean(g * x_hat)
};

template <class W>
inline W dx_of(const RowCoef& c, W dy, W w, W x_hat) {
  return c.rstd * (dy * w - c.c_0 - x_hat * c.c_x);
}

// A backward row is two passes over src (x or y) and dy. The first (this one) reads the row from
// memory and only loads: sum(g) and sum(g * x_hat), in V registers of partials each. The second
// (backward_out) finds the row in cache, writes dx and adds dy * x_hat and dy to the dw/db
// partials. `out` (dx's row, or null): its lines are requested for writing along the way, so that
// their write-allocate reads overlap this pass's loads instead of stalling the second pass's
// stores. kUnp: bf16 rows read as Unpacked (w permuted to match), for V = 2 only: then each lane
// of the two registers adds the same elements in the same order as the fp32 rows' (each register
// holds half of each), and the lanes are put back in place before they are combined, so the sums
// are the fp32 rows' bit for bit and a bf16 dx is the fp32 dx rounded. (Summed as even and odd
// elements, as a first version did, c_0 and c_x differed in their last bits, and a dx cancelling
// to near zero by more than its rounding: test Bf16BackwardSumsAsFp32.) Products are added with
// mul_add here and in the dw partials, not left to the compiler's contraction, so that the loops
// whose bits must agree (the fp32 and the Unpacked sums; the full and the dx-less backward's dw)
// fuse them alike.
template <bool kFromOutput, int V, bool kUnp, class TS, class TD>
inline RowCoef backward_sums(const BackwardRow& r, float mean, float rstd, const TS* __restrict src,
                             const TD* __restrict dy, const char* out, int64_t out_elem) {
  constexpr bool kU = kUnp && V == 2;
  using P = std::conditional_t<kU, Unpacked<true>, Lanes>;
  constexpr int kRegs = kU ? 1 : V;
  constexpr int kStep = kU ? 2 * kVec : kVec;
  const int64_t cols = r.cols;
  const float* __restrict w = r.w;
  const float* __restrict b = r.b;
  P acc_g[kRegs] = {};
  P acc_gx[kRegs] = {};
  int64_t i = 0;
  for (; i + V * kVec <= cols; i += V * kVec) {
    if (out != nullptr) {
      for (int64_t l = 0; l < V * kVec * out_elem; l += 64) {
        __builtin_prefetch(out + i * out_elem + l, 1);
      }
    }
    for (int v = 0; v < kRegs; ++v) {
      const int64_t k = i + v * kStep;
      const P g = get_as<P>(dy, k) * get_as<P>(w, k);
      acc_g[v] = acc_g[v] + g;
      acc_gx[v] = mul_add(g, x_hat<kFromOutput, P>(src, r.wd, b, mean, rstd, k), acc_gx[v]);
    }
  }
  float tail_g = 0.0f;
  float tail_gx = 0.0f;
  for (; i < cols; ++i) {
    const float g = get(dy, i) * w[i];
    tail_g += g;
    tail_gx = mul_add(g, x_hat<kFromOutput, float>(src, r.wd, b, mean, rstd, i), tail_gx);
  }
  // The partials as V registers in the natural order, then combined. (Not through memory: a
  // memcpy of the accumulators made GCC keep them in memory through the loop.)
  auto natural = [](P(&acc)[kRegs]) {
    if constexpr (kU) {
#if defined(__AVX2__) && !defined(__AVX512F__)
      // The 128-bit halves: lo holds elements 0-3 and 8-11, hi 4-7 and 12-15.
      Lanes regs[V] = {__builtin_shufflevector(acc[0].lo, acc[0].hi, 0, 1, 2, 3, 8, 9, 10, 11),
                       __builtin_shufflevector(acc[0].lo, acc[0].hi, 4, 5, 6, 7, 12, 13, 14, 15)};
      return combine(regs);
#else
      static_assert(!kU, "Unpacked rows are AVX2's only (kUnpackedRows)");
      return 0.0f;
#endif
    } else {
      return combine(acc);
    }
  };
  const float inv_n = 1.0f / static_cast<float>(cols);
  return {mean, rstd, r.rms ? 0.0f : (natural(acc_g) + tail_g) * inv_n,
          (natural(acc_gx) + tail_gx) * inv_n};
}

// A row whose dx rounds to bf16 without the NaN test: its sums are finite, so every g and x_hat
// is (an Inf or NaN among them would make sum(g * x_hat) Inf or NaN), and so are the constants.
// dx can then be NaN only where its terms overflow (Inf - Inf, with gradients near FLT_MAX): that
// NaN is the x86 default one, 0xffc00000, which the unchecked rounding writes as 0xffc0 (a NaN)
// where c10 writes 0x7fc0.
inline bool row_is_nan_free(const RowCoef& c) {
  return std::isfinite(c.mean) && std::isfinite(c.rstd) && std::isfinite(c.c_0) &&
         std::isfinite(c.c_x);
}

// The second pass of one row. The row constants are taken by value and the pointers copied, so
// that the loop keeps them in registers: from a reference, each iteration loaded them again, since
// its stores might alias them.
template <bool kFromOutput, bool kUnp, class TS, class TD, class TO>
inline void backward_out(const BackwardRow& r, const RowCoef c, const TS* __restrict src,
                         const TD* __restrict dy, TO* __restrict out) {
  const float* __restrict w = r.w;
  const float* __restrict wd = r.wd;
  const float* __restrict b = r.b;
  float* __restrict dw = r.dw_part;
  float* __restrict db = r.db_part;
  for_each_row<kUnp, TO>(r.cols, row_is_nan_free(c), [&](auto z, int64_t k) {
    using W = decltype(z);
    const W d = get_as<W>(dy, k);
    const W xh = x_hat<kFromOutput, W>(src, wd, b, c.mean, c.rstd, k);
    put_as(out, k, dx_of(c, d, get_as<W>(w, k), xh));
    put_as(dw, k, mul_add(d, xh, get_as<W>(dw, k)));
    put_as(db, k, get_as<W>(db, k) + d);
  });
}

// The second pass of two consecutive rows at once: w and the dw/db partials are loaded and
// stored once for both (for wide rows they come from L2, and were 6 of the 11 accesses per
// element of a single row's pass). The partials take the first row's terms, then the second's,
// as two single rows would add them.
template <bool kFromOutput, bool kUnp, class TS, class TD, class TO>
inline void backward_out2(const BackwardRow& r, const RowCoef c0, const RowCoef c1,
                          const TS* __restrict src0, const TS* __restrict src1,
                          const TD* __restrict dy0, const TD* __restrict dy1, TO* __restrict out0,
                          TO* __restrict out1) {
  const float* __restrict w = r.w;
  const float* __restrict wd = r.wd;
  const float* __restrict b = r.b;
  float* __restrict dw = r.dw_part;
  float* __restrict db = r.db_part;
  const bool nan_free = row_is_nan_free(c0) && row_is_nan_free(c1);
  for_each_row<kUnp, TO>(r.cols, nan_free, [&](auto z, int64_t k) {
    using W = decltype(z);
    const W wk = get_as<W>(w, k);
    const W d0 = get_as<W>(dy0, k);
    const W d1 = get_as<W>(dy1, k);
    const W xh0 = x_hat<kFromOutput, W>(src0, wd, b, c0.mean, c0.rstd, k);
    const W xh1 = x_hat<kFromOutput, W>(src1, wd, b, c1.mean, c1.rstd, k);
    put_as(out0, k, dx_of(c0, d0, wk, xh0));
    put_as(out1, k, dx_of(c1, d1, wk, xh1));
    put_as(dw, k, mul_add(d1, xh1, mul_add(d0, xh0, get_as<W>(dw, k))));
    put_as(db, k, get_as<W>(db, k) + d0 + d1);
  });
}

// dw/db of a row when dx is not wanted: one pass, no row sums. The same terms as the second pass
// adds (backward_out), so the same bits.
template <bool kFromOutput, class TS, class TD>
inline void backward_params(const BackwardRow& r, float mean, float rstd, const TS* __restrict src,
                            const TD* __restrict dy) {
  float* __restrict dw = r.dw_part;
  float* __restrict db = r.db_part;
#pragma GCC ivdep
  for (int64_t k = 0; k < r.cols; ++k) {
    const float d = get(dy, k);
    const float xh = x_hat<kFromOutput, float>(src, r.wd, r.b, mean, rstd, k);
    dw[k] = mul_add(d, xh, dw[k]);
    db[k] = db[k] + d;
  }
}

void add_to_double(const float* __restrict src, double* __restrict dst, int64_t n, bool first) {
  if (first) {
    for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<double>(src[i]);
  } else {
    for (int64_t i = 0; i < n; ++i) dst[i] += static_cast<double>(src[i]);
  }
}

// add_to_double of partials kept in the order of Unpacked (to_unpacked), into dst's natural order.
void add_to_double_unpacked(const float* __restrict src, double* __restrict dst, int64_t n,
                            bool first) {
  int64_t i = 0;
  for (; i + 2 * kVec <= n; i += 2 * kVec) {
    for (int j = 0; j < 2 * kVec; ++j) {
      const int64_t e = i + unpacked_element(j % kVec, j >= kVec);
      dst[e] = first ? static_cast<double>(src[i + j]) : dst[e] + src[i + j];
    }
  }
  for (; i < n; ++i) dst[i] = first ? static_cast<double>(src[i]) : dst[i] + src[i];
}

// base moved forward by whole lines (less than a page) to lie half a page from `other` modulo
// 4 KB.
inline float* half_a_page_from(float* base, const void* other) {
  const uintptr_t b = reinterpret_cast<uintptr_t>(base) % 4096;
  const uintptr_t want = (reinterpret_cast<uintptr_t>(other) + 2048) % 4096;
  const uintptr_t shift = (want + 4096 - b) % 4096 / 64 * 64;
  return base + shift / sizeof(float);
}

// Rows per group of fp32 dw/db partials before they are added into the block's fp64 sums.
constexpr int64_t kNormGroup = 64;

// A block of backward rows: the loop over rows lives here with every storage dispatch hoisted
// out of it (see forward_rows). src is x, or y when kFromOutput; its storage is dx's (x) or dy's
// (y). Short rows (V = 1) also ask for the next rows early.
template <bool kFromOutput, int V, class DS, class OS>
void backward_block(const NormBackwardArgs& a, const NormBackwardBlock& blk) {
  using SS = std::conditional_t<kFromOutput, DS, OS>;
  const int64_t cols = a.cols;
  const int64_t stride = norm_scratch_stride(cols);
  // The dw/db partials are loaded and stored in the loop that stores dx. Where their addresses
  // lie just below dx's modulo 4 KB, their loads wait on the dx stores in flight (4K aliasing):
  // 1024-column fp32 rows ran 20 % slower or faster with where the heap had put dx. They are
  // placed half a page from the block's first dx row instead (the scratch has a page of slack).
  // (dx is null when only dw/db are wanted.)
  float* const parts = std::is_same_v<OS, Half> || a.dx == nullptr
                           ? blk.scratch + 3 * stride
                           : half_a_page_from(blk.scratch + 3 * stride,
                                              static_cast<stored_t<OS>*>(a.dx) + blk.begin * cols);
  const BackwardRow row{cols, a.rms, blk.w, blk.wd, blk.b, parts, parts + stride};
  // bf16 rows with a dx to write take the Unpacked loops (out_row), with w
  // (and from the output wd and b) permuted into scratch regions 0-2, which only fp16 rows use
  // otherwise, and the partials in the same order. The sums' pass and the dx-less loop keep the
  // natural order.
  constexpr bool kUnp = kUnpackedRows && std::is_same_v<SS, uint16_t> &&
                        std::is_same_v<DS, uint16_t> && std::is_same_v<OS, uint16_t>;
  const bool unpacked = kUnp && a.dx != nullptr;
  BackwardRow out_row = row;
  if (unpacked) {
    to_unpacked(blk.w, blk.scratch, cols);
    out_row.w = blk.scratch;
    if constexpr (kFromOutput) {
      to_unpacked(blk.wd, blk.scratch + stride, cols);
      to_unpacked(blk.b, blk.scratch + 2 * stride, cols);
      out_row.wd = blk.scratch + stride;
      out_row.b = blk.scratch + 2 * stride;
    }
  }
  const void* src_base = kFromOutput ? a.y : a.x;
  // The first group's partials are stored into the block's sums, later ones added.
  auto flush = [&](bool first) {
    if (blk.dw_sum == nullptr) return;
    for (auto [part, sum] :
         {std::pair{row.dw_part, blk.dw_sum}, std::pair{row.db_part, blk.db_sum}}) {
      unpacked ? add_to_double_unpacked(part, sum, cols, first)
               : add_to_double(part, sum, cols, first);
    }
  };
  auto src_at = [&](int64_t r) { return static_cast<const stored_t<SS>*>(src_base) + r * cols; };
  auto dy_at = [&](int64_t r) { return static_cast<const stored_t<DS>*>(a.dy) + r * cols; };
  auto dx_at = [&](int64_t r) { return static_cast<stored_t<OS>*>(a.dx) + r * cols; };
  // dx's lines are requested during the first pass for rows of 2048 and more: in-process A/B,
  // 2 threads, 4096x4096 15-25 % and 8192x2048 10-22 % faster backwards (fp32 and bf16); at 1024
  // columns it was -6 to +25 % (worse for bf16 from memory), where the row is short enough for
  // the hardware's own stream to cover it.
  const bool prefetch_dx = cols >= 2048;
  // The row's mean as x_hat takes it (none for RMSNorm, or from the output).
  auto mean_of = [&](int64_t r) { return a.rms || kFromOutput ? 0.0f : a.mean[r]; };
  auto coef = [&](int64_t r, const auto* src_row, const auto* dy_row) {
    return backward_sums<kFromOutput, V, kUnp>(
        kUnp && V == 2 ? out_row : row, mean_of(r), a.rstd[r], src_row, dy_row,
        prefetch_dx ? reinterpret_cast<const char*>(dx_at(r)) : nullptr,
        static_cast<int64_t>(sizeof(stored_t<OS>)));
  };
  // Wide rows take their second pass two rows at a time when a row's three rows (src, dy, dx)
  // fill L1 (48 KB here): then w and the partials come from L2, and a pair halves that traffic
  // (in-process A/B on the development VM: fp32 4096-8192 columns 4-17 % faster, bf16 8192
  // columns 8-12 %). Narrower rows ran slower in pairs (fp32 1024 columns by 15 %, bf16 1024-4096
  // from memory by 10-50 %); the threshold gives fp32 from 4096 columns and bf16 from 8192, the
  // measured sides. Not fp16, whose rows are converted through single scratch rows.
  constexpr bool kMayPair =
      V > 1 && !std::is_same_v<SS, Half> && !std::is_same_v<DS, Half> && !std::is_same_v<OS, Half>;
  constexpr int64_t kPairBytes = 48 << 10;
  const bool pairs =
      kMayPair && cols * static_cast<int64_t>(sizeof(stored_t<SS>) + sizeof(stored_t<DS>) +
                                              sizeof(stored_t<OS>)) >=
                      kPairBytes;
  auto start_group = [&](int64_t r) {
    if ((r - blk.begin) % kNormGroup == 0) {
      if (r != blk.begin) flush(r - blk.begin == kNormGroup);
      std::fill(row.dw_part, row.dw_part + cols, 0.0f);
      std::fill(row.db_part, row.db_part + cols, 0.0f);
    }
  };
  if (a.dx == nullptr) {
    for (int64_t r = blk.begin; r < blk.end; ++r) {
      start_group(r);
      backward_params<kFromOutput>(row, mean_of(r), a.rstd[r],
                                   row_view<SS>(src_at(r), blk.scratch, cols),
                                   row_view<DS>(dy_at(r), blk.scratch + stride, cols));
    }
    if (blk.end > blk.begin) flush(blk.end - blk.begin <= kNormGroup);
    return;
  }
  for (int64_t r = blk.begin; r < blk.end;) {
    start_group(r);
    if constexpr (kMayPair) {
      // Groups have an even number of rows, so a pair never straddles two.
      if (pairs && r + 1 < blk.end) {
        const RowCoef c0 = coef(r, src_at(r), dy_at(r));
        const RowCoef c1 = coef(r + 1, src_at(r + 1), dy_at(r + 1));
        backward_out2<kFromOutput, kUnp>(out_row, c0, c1, src_at(r), src_at(r + 1), dy_at(r),
                                         dy_at(r + 1), dx_at(r), dx_at(r + 1));
        r += 2;
        continue;
      }
    }
    if constexpr (V == 1) {
      prefetch_next_row(src_at(r), dtype_of<SS>(), cols);
      prefetch_next_row(dy_at(r), dtype_of<DS>(), cols);
    }
    const auto* src_row = row_view<SS>(src_at(r), blk.scratch, cols);
    const auto* dy_row = row_view<DS>(dy_at(r), blk.scratch + stride, cols);
    const RowCoef c = coef(r, src_row, dy_row);
    if constexpr (std::is_same_v<OS, Half>) {
      float* const tmp = blk.scratch + 2 * stride;
      backward_out<kFromOutput, false>(row, c, src_row, dy_row, tmp);
      float_to_half(tmp, dx_at(r), cols);
    } else {
      backward_out<kFromOutput, kUnp>(out_row, c, src_row, dy_row, dx_at(r));
    }
    ++r;
  }
  if (blk.end > blk.begin) flush(blk.end - blk.begin <= kNormGroup);
}

void norm_backward_block(const NormBackwardArgs& a, const NormBackwardBlock& blk) {
  with_storage(a.dy_dtype, [&](auto ds) {
    with_storage(a.x_dtype, [&](auto os) {
      using DS = decltype(ds);
      using OS = decltype(os);
      // Short rows take one register of partials per sum: the trees over two cost more than
      // such a row.
      constexpr int kWide = kLanes / kVec / 2;
      const bool from_output = a.y != nullptr;
      if (a.cols >= 4 * kLanes) {
        from_output ? backward_block<true, kWide, DS, OS>(a, blk)
                    : backward_block<false, kWide, DS, OS>(a, blk);
      } else {
        from_output ? backward_block<true, 1, DS, OS>(a, blk)
                    : backward_block<false, 1, DS, OS>(a, blk);
      }
    });
  });
}

#define APEX_STR_(x) #x
#define APEX_STR(x) APEX_STR_(x)

const IsaTable kTable = {
    APEX_STR(APEX_CPU_ISA), scale_chunk,    axpby_chunk,     non_finite_chunk,  sumsq_chunk,
    absmax_chunk,           adam_chunk,     sgd_chunk,       adagrad_chunk,     lamb_stage1_chunk,
    lamb_stage2_chunk,      novograd_chunk, to_float_values, from_float_values, norm_forward_rows,
    norm_backward_block,    kUnpackedRows,
};

}  // namespace

const IsaTable& APEX_CAT(isa_table_, APEX_CPU_ISA)() { return kTable; }

}  // namespace apex::kernels::cpu
