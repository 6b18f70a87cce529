// Products of a bf16/fp16 matrix and up to four fp32 vectors, for one instruction set (compiled
// once per ISA, see isa.h): the matrix is read where it lies and widened in registers, the sums
// kept in fp32. Each output element is summed in an order fixed by k and the number of vectors
// (lanes, the lanes added in order, then the tail), so results do not depend on how rows are
// split over threads.
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

float sum_lanes(Lanes v) {
  float s = 0;
  for (int j = 0; j < kVec; ++j) s += v[j];
  return s;
}

// NV (up to four) vectors at once, so that a few rows (a small batch) read the matrix once.
// Per row and vector, U independent sums of kVec lanes (four for one vector, to hide the add
// latency; two for more, which are independent already), added in order at the end.
template <bool kBf16, int NV>
void dot_rows_t(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v, int64_t ldv,
                float* y, int64_t ldy) {
  constexpr int U = NV == 1 ? 4 : 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* row = m + r * ld;
    Lanes acc[U][NV] = {};
    int64_t l = 0;
    for (; l + U * kVec <= k; l += U * kVec) {
      for (int u = 0; u < U; ++u) {
        const Lanes x = lanes_at<kBf16>(row + l + u * kVec);
        for (int i = 0; i < NV; ++i) acc[u][i] += x * get_lanes(v + i * ldv + l + u * kVec);
      }
    }
    for (; l + kVec <= k; l += kVec) {
      const Lanes x = lanes_at<kBf16>(row + l);
      for (int i = 0; i < NV; ++i) acc[0][i] += x * get_lanes(v + i * ldv + l);
    }
    const int64_t tail = l;
    for (int i = 0; i < NV; ++i) {
      Lanes total = acc[0][i];
      for (int u = 1; u < U; ++u) total += acc[u][i];
      float s = sum_lanes(total);
      for (l = tail; l < k; ++l) s += one<kBf16>(row + l) * v[i * ldv + l];
      y[i * ldy + r] = s;
    }
  }
}

// Rows in blocks of kGemvRowBlock (isa.h); within a block each column adds its scaled elements.
constexpr int64_t kBlock = kGemvRowBlock;

template <bool kBf16, int NV>
void axpy_cols_t(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v,
                 int64_t ldv, float* y, int64_t ldy) {
  for (int64_t r0 = 0; r0 < rows; r0 += kBlock) {
    const int64_t n = rows - r0 < kBlock ? rows - r0 : kBlock;
    const int64_t vn = n - n % kVec;
    for (int i = 0; i < NV; ++i) {
      std::memset(y + i * ldy + r0, 0, sizeof(float) * static_cast<size_t>(n));
    }
    for (int64_t l = 0; l < k; ++l) {
      const uint16_t* col = m + l * ld + r0;
      Lanes sv[NV];
      for (int i = 0; i < NV; ++i) sv[i] = Lanes{} + v[i * ldv + l];
      for (int64_t j = 0; j < vn; j += kVec) {
        const Lanes x = lanes_at<kBf16>(col + j);
        for (int i = 0; i < NV; ++i) {
          float* out = y + i * ldy + r0 + j;
          const Lanes acc = get_lanes(out) + x * sv[i];
          std::memcpy(out, &acc, sizeof acc);
        }
      }
      for (int64_t j = vn; j < n; ++j) {
        const float x = one<kBf16>(col + j);
        for (int i = 0; i < NV; ++i) y[i * ldy + r0 + j] += x * v[i * ldv + l];
      }
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
