// Per-ISA kernels of the half-precision matrix products (isa.h, GemmKernels; the driver:
// gemm_cpu.cpp): operands widened from bf16/fp16 as they are packed into fp32 panels, and a
// register-tiled fp32 multiply-add kernel, 6 x 16 sums in 256-bit registers (AVX2) or 6 x 32 in
// 512-bit ones (AVX-512). Compiled once per instruction set (vec.h); the tables of ISAs without
// AVX2's FMA and F16C are empty, and the fallback widens through LibTorch's sgemm there. Each sum
// is one chain of fused multiply-adds in k order on every ISA, so a result's bits do not depend on
// the ISA, the split or the tile.
#include <algorithm>

#include "kernels/cpu/vec.h"

namespace apex::kernels::cpu {
namespace {

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)

constexpr int64_t kMr = kGemmMr;
#if defined(__AVX512F__)
constexpr int64_t kNr = 32;
#else
constexpr int64_t kNr = 16;
#endif

// Eight half elements as fp32 lanes.
template <bool kBf16>
inline __m256 widen8(const uint16_t* p) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(x), 16));
  } else {
    return _mm256_cvtph_ps(x);
  }
}

// The eight even elements of p[0, 16) as fp32 lanes (a stride-2 operand; reads p[15] too).
template <bool kBf16>
inline __m256 widen8_even(const uint16_t* p) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  if constexpr (kBf16) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
  } else {
    const __m256i lo = _mm256_and_si256(x, _mm256_set1_epi32(0xFFFF));
    // Per 128-bit lane: its four values twice; then the two lanes' first quadwords together.
    const __m256i packed = _mm256_packus_epi32(lo, lo);
    return _mm256_cvtph_ps(_mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08)));
  }
}

// Eight elements at p[0], p[s], ..., p[7 * s] for s 1 or 2 (s 2 reads p[15] too).
template <bool kBf16>
inline __m256 widen8_strided(const uint16_t* p, int64_t s) {
  return s == 1 ? widen8<kBf16>(p) : widen8_even<kBf16>(p);
}

template <bool kBf16>
inline float widen1(uint16_t h) {
  if constexpr (kBf16) {
    return bf16_bits_to_float(h);
  } else {
    return _cvtsh_ss(h);
  }
}

// r[i] (lane j) -> r[j] (lane i) for 8 x 8 fp32 values.
inline void transpose8(__m256 r[8]) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
  }
}

// One panel of `w` lanes (lane i's element l at src[i * s_lane + l * s_k]) for l < kc, lanes past
// `lanes` zero: out[l * w + i]. `lanes_avail` lanes exist from src (reads may go past `lanes`
// up to it). Stores may run up to 8 floats past the panel (the caller's buffer has room; the next
// panel's stores come after and overwrite them). Stride-2 runs (a strided convolution's input)
// load 16 elements for 8: only where an element follows the run's last one.
template <bool kBf16, int64_t w>
void pack_panel(const uint16_t* src, int64_t s_lane, int64_t s_k, int64_t lanes,
                int64_t lanes_avail, int64_t kc, float* out) {
  int64_t l = 0;
  if (lanes == w && s_lane == 2 && w % 8 == 0 && lanes_avail > w) {
    for (; l < kc; ++l) {
      const uint16_t* p = src + l * s_k;
      for (int64_t i = 0; i < w; i += 8) {
        _mm256_storeu_ps(out + l * w + i, widen8_even<kBf16>(p + 2 * i));
      }
    }
  } else if (lanes == w && s_lane == 1) {
    // Lanes contiguous: a row of the panel is a run of w elements (8 more for w = 6 when the
    // matrix has them: then one load and an overlapping store).
    if constexpr (w % 8 == 0) {
      for (; l < kc; ++l) {
        const uint16_t* p = src + l * s_k;
        for (int64_t i = 0; i < w; i += 8) _mm256_storeu_ps(out + l * w + i, widen8<kBf16>(p + i));
      }
    } else if (lanes_avail >= 8) {
      for (; l < kc; ++l) _mm256_storeu_ps(out + l * w, widen8<kBf16>(src + l * s_k));
    }
  } else if (lanes == w && (s_k == 1 || s_k == 2)) {
    // Each lane contiguous (or every other element) in k: 8 x 8 blocks transposed in registers.
    for (; l + 8 + (s_k - 1) <= kc; l += 8) {
      for (int64_t i0 = 0; i0 < w; i0 += 8) {
        __m256 r[8];
        for (int64_t i = 0; i < 8; ++i) {
          r[i] = i0 + i < w ? widen8_strided<kBf16>(src + (i0 + i) * s_lane + l * s_k, s_k)
                            : _mm256_setzero_ps();
        }
        transpose8(r);
        // Rows in increasing order: for w = 6 each store's last two lanes are overwritten by the
        // next one's first (and the last one's land past the panel).
        for (int64_t j = 0; j < 8; ++j) _mm256_storeu_ps(out + (l + j) * w + i0, r[j]);
      }
    }
  }
  for (; l < kc; ++l) {
    for (int64_t i = 0; i < w; ++i) {
      out[l * w + i] = i < lanes ? widen1<kBf16>(src[i * s_lane + l * s_k]) : 0.0f;
    }
  }
}

template <bool kBf16, int64_t w>
void pack(const uint16_t* src, int64_t s_lane, int64_t s_k, int64_t lanes, int64_t lanes_avail,
          int64_t kc, float* out) {
  for (int64_t i = 0; i < lanes; i += w) {
    pack_panel<kBf16, w>(src + i * s_lane, s_lane, s_k, std::min(w, lanes - i), lanes_avail - i, kc,
                         out + i * kc);
  }
}

template <int64_t w>
void pack_as(const uint16_t* src, int64_t s_lane, int64_t s_k, int64_t lanes, int64_t lanes_avail,
             int64_t kc, float* out, DType t) {
  (t == DType::kBFloat16 ? pack<true, w> : pack<false, w>)(src, s_lane, s_k, lanes, lanes_avail, kc,
                                                           out);
}

void pack_a(const uint16_t* a, int64_t sm, int64_t sk, int64_t mc, int64_t rows_avail, int64_t kc,
            float* out, DType t) {
  pack_as<kMr>(a, sm, sk, mc, rows_avail, kc, out, t);
}

void pack_b(const uint16_t* b, int64_t sk, int64_t sn, int64_t nc, int64_t cols_avail, int64_t kc,
            float* out, DType t) {
  pack_as<kNr>(b, sn, sk, nc, cols_avail, kc, out, t);
}

#if defined(__AVX512F__)
using Reg = __m512;
inline Reg reg_zero() { return _mm512_setzero_ps(); }
inline Reg reg_load(const float* p) { return _mm512_load_ps(p); }
inline Reg reg_loadu(const float* p) { return _mm512_loadu_ps(p); }
inline void reg_storeu(float* p, Reg v) { _mm512_storeu_ps(p, v); }
inline Reg reg_splat(const float* p) { return _mm512_set1_ps(*p); }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return _mm512_fmadd_ps(a, b, c); }
inline Reg reg_add(Reg a, Reg b) { return _mm512_add_ps(a, b); }
inline Reg reg_sub(Reg a, Reg b) { return _mm512_sub_ps(a, b); }
// For the exp. The maskz forms with a full mask: the plain ones trip GCC 12's maybe-uninitialized
// warning.
constexpr __mmask16 kAll = 0xffff;
inline Reg reg_set(float v) { return _mm512_set1_ps(v); }
inline Reg reg_mul(Reg a, Reg b) { return _mm512_mul_ps(a, b); }
inline Reg reg_min(Reg a, Reg b) { return _mm512_maskz_min_ps(kAll, a, b); }
inline Reg reg_max(Reg a, Reg b) { return _mm512_maskz_max_ps(kAll, a, b); }
inline Reg reg_fnma(Reg a, Reg b, Reg c) { return _mm512_fnmadd_ps(a, b, c); }  // c - a b
inline Reg reg_round(Reg a) {
  return _mm512_maskz_roundscale_ps(kAll, a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// 2^n for whole n in [-126, 127].
inline Reg reg_pow2(Reg n) {
  const __m512i e = _mm512_add_epi32(_mm512_maskz_cvtps_epi32(kAll, n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll, e, 23));
}
// v, but 0 where t < low and t where t is NaN.
inline Reg reg_exp_edges(Reg t, Reg v, float low) {
  const __mmask16 nan = _mm512_cmp_ps_mask(t, t, _CMP_UNORD_Q);
  const __mmask16 below = _mm512_cmp_ps_mask(t, _mm512_set1_ps(low), _CMP_LT_OQ);
  return _mm512_mask_mov_ps(_mm512_maskz_mov_ps(static_cast<__mmask16>(~below), v), nan, t);
}
#else
using Reg = __m256;
inline Reg reg_zero() { return _mm256_setzero_ps(); }
inline Reg reg_load(const float* p) { return _mm256_load_ps(p); }
inline Reg reg_loadu(const float* p) { return _mm256_loadu_ps(p); }
inline void reg_storeu(float* p, Reg v) { _mm256_storeu_ps(p, v); }
inline Reg reg_splat(const float* p) { return _mm256_broadcast_ss(p); }
inline Reg reg_fma(Reg a, Reg b, Reg c) { return _mm256_fmadd_ps(a, b, c); }
inline Reg reg_add(Reg a, Reg b) { return _mm256_add_ps(a, b); }
inline Reg reg_sub(Reg a, Reg b) { return _mm256_sub_ps(a, b); }
// For the exp.
inline Reg reg_set(float v) { return _mm256_set1_ps(v); }
inline Reg reg_mul(Reg a, Reg b) { return _mm256_mul_ps(a, b); }
inline Reg reg_min(Reg a, Reg b) { return _mm256_min_ps(a, b); }
inline Reg reg_max(Reg a, Reg b) { return _mm256_max_ps(a, b); }
inline Reg reg_fnma(Reg a, Reg b, Reg c) { return _mm256_fnmadd_ps(a, b, c); }  // c - a b
inline Reg reg_round(Reg a) {
  return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
}
// 2^n for whole n in [-126, 127].
inline Reg reg_pow2(Reg n) {
  const __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
// v, but 0 where t < low and t where t is NaN.
inline Reg reg_exp_edges(Reg t, Reg v, float low) {
  const Reg nan = _mm256_cmp_ps(t, t, _CMP_UNORD_Q);
  const Reg below = _mm256_cmp_ps(t, _mm256_set1_ps(low), _CMP_LT_OQ);
  return _mm256_blendv_ps(_mm256_andnot_ps(below, v), t, nan);
}
#endif
constexpr int64_t kRegLanes = kNr / 2;

// c[i * ldc + j] (+)= sum over l < kc of a[l * 6 + i] * b[l * kNr + j]: 12 accumulators (two
// registers per row), two loads of b and six broadcasts of a per 12 multiply-adds. Named
// variables, not arrays: GCC 12 keeps an array of accumulators on the stack, storing each one at
// every step.
inline void tile(const float* __restrict a, const float* __restrict b, int64_t kc,
                 float* __restrict c, int64_t ldc, bool accumulate) {
  static_assert(kMr == 6, "the tile below is written for 6 rows");
  Reg c00 = reg_zero(), c01 = c00, c10 = c00, c11 = c00, c20 = c00, c21 = c00;
  Reg c30 = c00, c31 = c00, c40 = c00, c41 = c00, c50 = c00, c51 = c00;
  // One row of the tile: its two accumulators += a's element times b's two registers.
  const auto row = [](Reg x, Reg b0, Reg b1, Reg& lo, Reg& hi) {
    lo = reg_fma(x, b0, lo);
    hi = reg_fma(x, b1, hi);
  };
  for (int64_t l = 0; l < kc; ++l, a += kMr, b += kNr) {
    const Reg b0 = reg_load(b);
    const Reg b1 = reg_load(b + kRegLanes);
    row(reg_splat(a), b0, b1, c00, c01);
    row(reg_splat(a + 1), b0, b1, c10, c11);
    row(reg_splat(a + 2), b0, b1, c20, c21);
    row(reg_splat(a + 3), b0, b1, c30, c31);
    row(reg_splat(a + 4), b0, b1, c40, c41);
    row(reg_splat(a + 5), b0, b1, c50, c51);
  }
  const auto put = [&](int64_t i, Reg lo, Reg hi) {
    float* p = c + i * ldc;
    if (accumulate) {
      lo = reg_add(lo, reg_loadu(p));
      hi = reg_add(hi, reg_loadu(p + kRegLanes));
    }
    reg_storeu(p, lo);
    reg_storeu(p + kRegLanes, hi);
  };
  put(0, c00, c01);
  put(1, c10, c11);
  put(2, c20, c21);
  put(3, c30, c31);
  put(4, c40, c41);
  put(5, c50, c51);
}

void multiply(const float* a, const float* b, int64_t mc, int64_t ncp, int64_t kc, float* c,
              int64_t ldc, bool accumulate) {
  // A panel of b (kc x kNr) stays in L1 while the panels of a stream past it from L2.
  for (int64_t j = 0; j < ncp; j += kNr) {
    for (int64_t i = 0; i < mc; i += kMr) {
      tile(a + i * kc, b + j * kc, kc, c + i * ldc + j, ldc, accumulate);
    }
  }
}

// exp by range reduction: t = n ln2 + r with n = round(t / ln2), |r| <= ln2 / 2 (ln2 in two
// parts, the first exact in a few bits, so n ln2 is subtracted without error), e^r by its degree-6
// polynomial (the minimax coefficients of Cephes' expf), times 2^n built in the exponent bits.
// Arguments are clamped to [kExpLow, kExpHigh] (2^n then normal); below, 0; NaN stays NaN.
constexpr float kExpLow = -87.3f, kExpHigh = 88.3f;
inline Reg reg_exp(Reg t) {
  const Reg x = reg_min(reg_max(t, reg_set(kExpLow)), reg_set(kExpHigh));
  const Reg n = reg_round(reg_mul(x, reg_set(1.44269504f)));
  const Reg r = reg_fnma(n, reg_set(-2.12194440e-4f), reg_fnma(n, reg_set(0.693359375f), x));
  Reg p = reg_set(1.9875691500e-4f);
  p = reg_fma(p, r, reg_set(1.3981999507e-3f));
  p = reg_fma(p, r, reg_set(8.3334519073e-3f));
  p = reg_fma(p, r, reg_set(4.1665795894e-2f));
  p = reg_fma(p, r, reg_set(1.6666665459e-1f));
  p = reg_fma(p, r, reg_set(5.0000001201e-1f));
  const Reg y = reg_add(reg_fma(p, reg_mul(r, r), r), reg_set(1.0f));
  return reg_exp_edges(t, reg_mul(y, reg_pow2(n)), kExpLow);
}

void exp_shifted(float* x, const float* shift, int64_t n, float scale) {
  constexpr int64_t w = kRegLanes;
  const Reg s = reg_splat(&scale);
  const auto one = [&](const float* in, const float* sh, float* out) {
    reg_storeu(out, reg_exp(reg_fma(reg_loadu(in), s, reg_sub(reg_zero(), reg_loadu(sh)))));
  };
  int64_t j = 0;
  for (; j + w <= n; j += w) one(x + j, shift + j, x + j);
  if (j < n) {  // the tail through a full register's room: the same instructions, the same bits
    alignas(64) float in[w] = {}, sh[w] = {}, out[w];
    std::copy(x + j, x + n, in);
    std::copy(shift + j, shift + n, sh);
    one(in, sh, out);
    std::copy(out, out + (n - j), x + j);
  }
}

constexpr GemmKernels kTable = {
    .nr = kNr,
    .pack_a = pack_a,
    .pack_b = pack_b,
    .multiply = multiply,
    .exp_shifted = exp_shifted,
};

#else

constexpr GemmKernels kTable = {};

#endif

}  // namespace

const GemmKernels& APEX_CAT(gemm_kernels_, APEX_CPU_ISA)() { return kTable; }

}  // namespace apex::kernels::cpu
