// The LayerNorm/RMSNorm row kernels of one instruction set (compiled once per ISA, see isa.h):
// a range of forward rows, and a block of the backward's fixed partition.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>

#include "kernels/cpu/vec.h"

namespace apex::kernels::cpu {
namespace {

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

// Which parameter-gradient partials a backward row adds to: none (no affine), dw only (RMSNorm,
// the common case: its db partial was an extra load and store per element for nothing), or both.
enum class Parts { kNone, kW, kWB };

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
template <bool kFromOutput, bool kUnp, Parts kParts, class TS, class TD, class TO>
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
    if constexpr (kParts != Parts::kNone) put_as(dw, k, mul_add(d, xh, get_as<W>(dw, k)));
    if constexpr (kParts == Parts::kWB) put_as(db, k, get_as<W>(db, k) + d);
  });
}

// The second pass of two consecutive rows at once: w and the dw/db partials are loaded and
// stored once for both (for wide rows they come from L2, and were 6 of the 11 accesses per
// element of a single row's pass). The partials take the first row's terms, then the second's,
// as two single rows would add them.
template <bool kFromOutput, bool kUnp, Parts kParts, class TS, class TD, class TO>
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
    if constexpr (kParts != Parts::kNone) {
      put_as(dw, k, mul_add(d1, xh1, mul_add(d0, xh0, get_as<W>(dw, k))));
    }
    if constexpr (kParts == Parts::kWB) put_as(db, k, get_as<W>(db, k) + d0 + d1);
  });
}

// dw/db of a row when dx is not wanted: one pass, no row sums. The same terms as the second pass
// adds (backward_out), so the same bits.
template <bool kFromOutput, Parts kParts, class TS, class TD>
inline void backward_params(const BackwardRow& r, float mean, float rstd, const TS* __restrict src,
                            const TD* __restrict dy) {
  float* __restrict dw = r.dw_part;
  float* __restrict db = r.db_part;
#pragma GCC ivdep
  for (int64_t k = 0; k < r.cols; ++k) {
    const float d = get(dy, k);
    const float xh = x_hat<kFromOutput, float>(src, r.wd, r.b, mean, rstd, k);
    dw[k] = mul_add(d, xh, dw[k]);
    if constexpr (kParts == Parts::kWB) db[k] = db[k] + d;
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
class BackwardBlock {
  using SS = std::conditional_t<kFromOutput, DS, OS>;
  // bf16 rows with a dx to write take the Unpacked loops (out_row_), with w (and from the output
  // wd and b) permuted into scratch regions 0-2, which only fp16 rows use otherwise, and the
  // partials in the same order. The sums' pass and the dx-less loop keep the natural order.
  static constexpr bool kUnp = kUnpackedRows && std::is_same_v<SS, uint16_t> &&
                               std::is_same_v<DS, uint16_t> && std::is_same_v<OS, uint16_t>;
  // Wide rows take their second pass two rows at a time when a row's three rows (src, dy, dx)
  // fill L1 (48 KB here): then w and the partials come from L2, and a pair halves that traffic.
  // Narrower rows ran slower in pairs (docs/perf-notes.md, "Backward pairs"). Not fp16, whose
  // rows are converted through single scratch rows.
  static constexpr bool kMayPair =
      V > 1 && !std::is_same_v<SS, Half> && !std::is_same_v<DS, Half> && !std::is_same_v<OS, Half>;
  static constexpr int64_t kPairBytes = 48 << 10;

 public:
  BackwardBlock(const NormBackwardArgs& a, const NormBackwardBlock& blk)
      : a_(a),
        blk_(blk),
        cols_(a.cols),
        stride_(norm_scratch_stride(a.cols)),
        row_(make_row()),
        out_row_(row_),
        unpacked_(kUnp && a.dx != nullptr),
        // dx's lines are requested during the first pass for rows of 2048 and more; shorter rows
        // are covered by the hardware's own stream (docs/perf-notes.md).
        prefetch_dx_(a.cols >= 2048),
        pairs_(kMayPair &&
               a.cols * static_cast<int64_t>(sizeof(stored_t<SS>) + sizeof(stored_t<DS>) +
                                             sizeof(stored_t<OS>)) >=
                   kPairBytes) {
    if (unpacked_) {
      to_unpacked(blk.w, blk.scratch, cols_);
      out_row_.w = blk.scratch;
      if constexpr (kFromOutput) {
        to_unpacked(blk.wd, blk.scratch + stride_, cols_);
        to_unpacked(blk.b, blk.scratch + 2 * stride_, cols_);
        out_row_.wd = blk.scratch + stride_;
        out_row_.b = blk.scratch + 2 * stride_;
      }
    }
  }

  void run() {
    // db partials only where db is wanted (below: a bias-only norm computes dw partials too).
    if (blk_.db_sum != nullptr) {
      run_rows<Parts::kWB>();
    } else if (blk_.dw_sum != nullptr) {
      run_rows<Parts::kW>();
    } else {
      run_rows<Parts::kNone>();
    }
  }

 private:
  template <Parts kP>
  void run_rows() {
    if (a_.dx == nullptr) {
      if constexpr (kP != Parts::kNone) params_only<kP>();
      return;
    }
    for (int64_t r = blk_.begin; r < blk_.end;) {
      start_group(r);
      if constexpr (kMayPair) {
        // Groups have an even number of rows, so a pair never straddles two.
        if (pairs_ && r + 1 < blk_.end) {
          row_pair<kP>(r);
          r += 2;
          continue;
        }
      }
      single_row<kP>(r);
      ++r;
    }
    finish();
  }

  // The dw/db partials are loaded and stored in the loop that stores dx. Where their addresses
  // lie just below dx's modulo 4 KB, their loads wait on the dx stores in flight (4K aliasing).
  // They are placed half a page from the block's first dx row instead (the scratch has a page of
  // slack).
  // (dx is null when only dw/db are wanted.)
  BackwardRow make_row() const {
    float* const parts = std::is_same_v<OS, Half> || a_.dx == nullptr
                             ? blk_.scratch + 3 * stride_
                             : half_a_page_from(blk_.scratch + 3 * stride_, dx_at(blk_.begin));
    return {cols_, a_.rms, blk_.w, blk_.wd, blk_.b, parts, parts + stride_};
  }

  const stored_t<SS>* src_at(int64_t r) const {
    return static_cast<const stored_t<SS>*>(kFromOutput ? a_.y : a_.x) + r * cols_;
  }
  const stored_t<DS>* dy_at(int64_t r) const {
    return static_cast<const stored_t<DS>*>(a_.dy) + r * cols_;
  }
  stored_t<OS>* dx_at(int64_t r) const { return static_cast<stored_t<OS>*>(a_.dx) + r * cols_; }

  // The row's mean as x_hat takes it (none for RMSNorm, or from the output).
  float mean_of(int64_t r) const { return a_.rms || kFromOutput ? 0.0f : a_.mean[r]; }

  template <class TS, class TD>
  RowCoef coef(int64_t r, const TS* src_row, const TD* dy_row) const {
    return backward_sums<kFromOutput, V, kUnp>(
        kUnp && V == 2 ? out_row_ : row_, mean_of(r), a_.rstd[r], src_row, dy_row,
        prefetch_dx_ ? reinterpret_cast<const char*>(dx_at(r)) : nullptr,
        static_cast<int64_t>(sizeof(stored_t<OS>)));
  }

  // The partials of a group of kNormGroup rows into the block's fp64 sums: the first group's are
  // stored, later ones added.
  void flush(bool first) const {
    for (auto [part, sum] :
         {std::pair{row_.dw_part, blk_.dw_sum}, std::pair{row_.db_part, blk_.db_sum}}) {
      if (sum == nullptr) continue;
      unpacked_ ? add_to_double_unpacked(part, sum, cols_, first)
                : add_to_double(part, sum, cols_, first);
    }
  }

  void start_group(int64_t r) const {
    if ((r - blk_.begin) % kNormGroup == 0) {
      if (r != blk_.begin) flush(r - blk_.begin == kNormGroup);
      if (blk_.dw_sum != nullptr || blk_.db_sum != nullptr) {
        std::fill(row_.dw_part, row_.dw_part + cols_, 0.0f);
      }
      if (blk_.db_sum != nullptr) std::fill(row_.db_part, row_.db_part + cols_, 0.0f);
    }
  }

  void finish() const {
    if (blk_.end > blk_.begin) flush(blk_.end - blk_.begin <= kNormGroup);
  }

  // dw/db only (no dx wanted): one pass per row.
  template <Parts kP>
  void params_only() const {
    for (int64_t r = blk_.begin; r < blk_.end; ++r) {
      start_group(r);
      backward_params<kFromOutput, kP>(row_, mean_of(r), a_.rstd[r],
                                       row_view<SS>(src_at(r), blk_.scratch, cols_),
                                       row_view<DS>(dy_at(r), blk_.scratch + stride_, cols_));
    }
    finish();
  }

  template <Parts kP>
  void row_pair(int64_t r) const {
    const RowCoef c0 = coef(r, src_at(r), dy_at(r));
    const RowCoef c1 = coef(r + 1, src_at(r + 1), dy_at(r + 1));
    backward_out2<kFromOutput, kUnp, kP>(out_row_, c0, c1, src_at(r), src_at(r + 1), dy_at(r),
                                         dy_at(r + 1), dx_at(r), dx_at(r + 1));
  }

  template <Parts kP>
  void single_row(int64_t r) const {
    if constexpr (V == 1) {
      prefetch_next_row(src_at(r), dtype_of<SS>(), cols_);
      prefetch_next_row(dy_at(r), dtype_of<DS>(), cols_);
    }
    const auto* src_row = row_view<SS>(src_at(r), blk_.scratch, cols_);
    const auto* dy_row = row_view<DS>(dy_at(r), blk_.scratch + stride_, cols_);
    const RowCoef c = coef(r, src_row, dy_row);
    if constexpr (std::is_same_v<OS, Half>) {
      float* const tmp = blk_.scratch + 2 * stride_;
      backward_out<kFromOutput, false, kP>(row_, c, src_row, dy_row, tmp);
      float_to_half(tmp, dx_at(r), cols_);
    } else {
      backward_out<kFromOutput, kUnp, kP>(out_row_, c, src_row, dy_row, dx_at(r));
    }
  }

  const NormBackwardArgs& a_;
  const NormBackwardBlock& blk_;
  const int64_t cols_;
  const int64_t stride_;
  const BackwardRow row_;
  BackwardRow out_row_;
  const bool unpacked_;
  const bool prefetch_dx_;
  const bool pairs_;
};

template <bool kFromOutput, int V, class DS, class OS>
void backward_block(const NormBackwardArgs& a, const NormBackwardBlock& blk) {
  BackwardBlock<kFromOutput, V, DS, OS>(a, blk).run();
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

}  // namespace

const NormKernels& APEX_CAT(norm_kernels_, APEX_CPU_ISA)() {
  static constexpr NormKernels kTable = {
      .forward_rows = norm_forward_rows,
      .backward_block = norm_backward_block,
      .bf16_unpacked = kUnpackedRows,
  };
  return kTable;
}

}  // namespace apex::kernels::cpu
