// Products of a bf16/fp16 matrix and up to four fp32 vectors, for one instruction set (compiled
// once per ISA, see isa.h): the matrix is read where it lies and widened in registers, the sums
// kept in fp32 in register tiles. Each output element is summed in an order fixed by k alone
// (one chain in k's order; see the tiles below), so results do not depend on how rows are split
// over threads or how many vectors share a pass.
#include <cstdint>
#include <cstring>

#include "kernels/cpu/vec.h"

namespace apex::kernels::cpu {
namespace {

// kVec elements from p, widened: bf16 by vec.h's shift, fp16 by the ISA's conversion.
template <bool kBf16>
Lanes lanes_at(const uint16_t* p) {
  if constexpr (kBf16) {
    return get_lanes(p);
  } else {
#if defined(__AVX512F__)
    return reinterpret_cast<Lanes>(
        _mm512_maskz_cvtph_ps(0xffff, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
    return reinterpret_cast<Lanes>(
        _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
    float f[kVec];
    half_to_float(p, f, kVec);
    return get_lanes(f);
#endif
  }
}

template <bool kBf16>
float one(const uint16_t* p) {
  if constexpr (kBf16) {
    return bf16_bits_to_float(*p);
  } else {
    float f;
    half_to_float(p, &f, 1);
    return f;
  }
}

// s in every lane, one broadcast (`Lanes{} + s` is an add, since +0 does not fold, and GCC 12
// builds a lane-by-lane splat with inserts).
Lanes splat(float s) {
#if defined(__AVX512F__)
  return reinterpret_cast<Lanes>(_mm512_set1_ps(s));
#elif defined(__AVX2__)
  return reinterpret_cast<Lanes>(_mm256_set1_ps(s));
#else
  return Lanes{} + s;
#endif
}

// The sums of the lanes of acc[0..4) into s, each as the tree of adjacent pairs
// (((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)) on AVX2, the two halves' trees added on
// AVX-512): four sums in a few horizontal adds rather than a scalar loop each, the same tree for
// every result.
void sum_lanes4(const Lanes* acc, float* s) {
#if defined(__AVX2__)
  const auto tree4 = [](__m256 p, __m256 q, __m256 r, __m256 t) {
    const __m256 all = _mm256_hadd_ps(_mm256_hadd_ps(p, q), _mm256_hadd_ps(r, t));
    return _mm_add_ps(_mm256_castps256_ps128(all), _mm256_extractf128_ps(all, 1));
  };
#if defined(__AVX512F__)
  __m256 lo[4], hi[4];
  for (int i = 0; i < 4; ++i) {  // (the cast and extract intrinsics trip GCC 12's warnings)
    std::memcpy(&lo[i], &acc[i], sizeof lo[i]);
    std::memcpy(&hi[i], reinterpret_cast<const char*>(&acc[i]) + sizeof lo[i], sizeof hi[i]);
  }
  _mm_storeu_ps(s,
                _mm_add_ps(tree4(lo[0], lo[1], lo[2], lo[3]), tree4(hi[0], hi[1], hi[2], hi[3])));
#else
  _mm_storeu_ps(s, tree4(reinterpret_cast<__m256>(acc[0]), reinterpret_cast<__m256>(acc[1]),
                         reinterpret_cast<__m256>(acc[2]), reinterpret_cast<__m256>(acc[3])));
#endif
#else
  for (int i = 0; i < 4; ++i) {
    float l[kVec];
    std::memcpy(l, &acc[i], sizeof l);
    for (int w = 1; w < kVec; w *= 2) {
      for (int j = 0; j + w < kVec; j += 2 * w) l[j] += l[j + w];
    }
    s[i] = l[0];
  }
#endif
}

// Register tiles: as many independent sums as the ISA's registers hold beside the operands
// (16 vector registers below AVX-512, 32 with it), NV (up to four) vectors at once so that a small
// batch reads the matrix once per four vectors. Every result is one chain of fused multiply-adds
// in k's order (in lanes for the dot form, then the lanes' tree and the tail), whatever the tile.
constexpr int kRegs = kVec == 16 ? 32 : 16;

// Matrix registers per tile (dot form: rows, axpy form: registers of rows) for NV vectors: tile x
// NV sums, tile matrix values and one vector value in the registers.
template <int NV>
constexpr int kTileRegs = NV == 1       ? 8
                          : kRegs == 32 ? (NV == 2 ? 8 : 6)
                          : NV == 2     ? 4
                                        : 3;

// Dot form (rows contiguous): R rows by NV vectors, one kVec-lane sum each.

template <bool kBf16, int R, int NV>
void dot_tile(const uint16_t* m, int64_t ld, int64_t k, const float* v, int64_t ldv, float* y,
              int64_t ldy) {
  // acc[r * NV + i], padded with zero sums to a multiple of four for sum_lanes4.
  constexpr int kSums = (R * NV + 3) / 4 * 4;
  Lanes acc[kSums] = {};
  int64_t l = 0;
  for (; l + kVec <= k; l += kVec) {
    Lanes x[R];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) x[r] = lanes_at<kBf16>(m + r * ld + l);
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      const Lanes b = get_lanes(v + i * ldv + l);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) acc[r * NV + i] += x[r] * b;
    }
  }
  float sums[kSums];
  for (int q = 0; q < kSums; q += 4) sum_lanes4(acc + q, sums + q);
  for (int r = 0; r < R; ++r) {
    for (int i = 0; i < NV; ++i) {
      float s = sums[r * NV + i];
      for (int64_t t = l; t < k; ++t) s += one<kBf16>(m + r * ld + t) * v[i * ldv + t];
      y[i * ldy + r] = s;
    }
  }
}

template <bool kBf16, int NV>
void dot_rows_t(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v, int64_t ldv,
                float* y, int64_t ldy) {
  constexpr int R = kTileRegs<NV>;
  int64_t r = 0;
  for (; r + R <= rows; r += R) dot_tile<kBf16, R, NV>(m + r * ld, ld, k, v, ldv, y + r, ldy);
  for (; r < rows; ++r) dot_tile<kBf16, 1, NV>(m + r * ld, ld, k, v, ldv, y + r, ldy);
}

// Axpy form (columns contiguous): J registers of rows by NV vectors, each column's kVec-row pieces
// scaled by the vectors' elements and added in registers; the results stored once.

template <bool kBf16, int J, int NV>
void axpy_tile(const uint16_t* m, int64_t ld, int64_t k, const float* v, int64_t ldv, float* y,
               int64_t ldy) {
  Lanes acc[J][NV] = {};
  for (int64_t l = 0; l < k; ++l) {
    const uint16_t* col = m + l * ld;
    Lanes x[J];
#pragma GCC unroll 8
    for (int j = 0; j < J; ++j) x[j] = lanes_at<kBf16>(col + j * kVec);
#pragma GCC unroll 4
    for (int i = 0; i < NV; ++i) {
      const Lanes b = splat(v[i * ldv + l]);
#pragma GCC unroll 8
      for (int j = 0; j < J; ++j) acc[j][i] += x[j] * b;
    }
  }
  for (int j = 0; j < J; ++j) {
    for (int i = 0; i < NV; ++i) std::memcpy(y + i * ldy + j * kVec, &acc[j][i], sizeof(Lanes));
  }
}

template <bool kBf16, int NV>
void axpy_cols_t(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v,
                 int64_t ldv, float* y, int64_t ldy) {
  constexpr int J = kTileRegs<NV>;
  int64_t r = 0;
  for (; r + J * kVec <= rows; r += J * kVec) {
    axpy_tile<kBf16, J, NV>(m + r, ld, k, v, ldv, y + r, ldy);
  }
  for (; r + kVec <= rows; r += kVec) axpy_tile<kBf16, 1, NV>(m + r, ld, k, v, ldv, y + r, ldy);
  // The last rows (fewer than kVec, at the end of the matrix only: the driver splits on blocks
  // of kGemvRowBlock): one chain per result, as in the lanes.
  for (; r < rows; ++r) {
    for (int i = 0; i < NV; ++i) {
      float s = 0;
      for (int64_t l = 0; l < k; ++l) s += one<kBf16>(m + l * ld + r) * v[i * ldv + l];
      y[i * ldy + r] = s;
    }
  }
}

template <template <bool, int> class K, class... A>
void by_count(DType t, int nv, A... a) {
  const bool bf16 = t == DType::kBFloat16;
  switch (nv) {
    case 1:
      return bf16 ? K<true, 1>::run(a...) : K<false, 1>::run(a...);
    case 2:
      return bf16 ? K<true, 2>::run(a...) : K<false, 2>::run(a...);
    case 3:
      return bf16 ? K<true, 3>::run(a...) : K<false, 3>::run(a...);
    default:
      return bf16 ? K<true, 4>::run(a...) : K<false, 4>::run(a...);
  }
}

template <bool kBf16, int NV>
struct DotRows {
  static void run(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v,
                  int64_t ldv, float* y, int64_t ldy) {
    dot_rows_t<kBf16, NV>(m, ld, rows, k, v, ldv, y, ldy);
  }
};
template <bool kBf16, int NV>
struct AxpyCols {
  static void run(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v,
                  int64_t ldv, float* y, int64_t ldy) {
    axpy_cols_t<kBf16, NV>(m, ld, rows, k, v, ldv, y, ldy);
  }
};

void dot_rows(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v, int64_t ldv,
              int nv, float* y, int64_t ldy, DType t) {
  by_count<DotRows>(t, nv, m, ld, rows, k, v, ldv, y, ldy);
}

void axpy_cols(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v, int64_t ldv,
               int nv, float* y, int64_t ldy, DType t) {
  by_count<AxpyCols>(t, nv, m, ld, rows, k, v, ldv, y, ldy);
}

}  // namespace

const GemvKernels& APEX_CAT(gemv_kernels_, APEX_CPU_ISA)() {
  static constexpr GemvKernels kTable = {
      .dot_rows = dot_rows,
      .axpy_cols = axpy_cols,
  };
  return kTable;
}

}  // namespace apex::kernels::cpu
