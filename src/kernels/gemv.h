// Kernel interface of products of bf16/fp16 CPU matrices with a few fp32 vectors: fp32 sums, the
// matrix read in place. Used by amp's CPU half fallback (amp/cpu_half/) for products with
// a few rows or columns (small-batch `linear`), where widening the whole matrix for them cost
// 2-5x the fp32 product.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cpu {

/// Y[i, r] = sum over l < k of M[r, l] * V[i, l] for r < rows and i < nv, M stored as t (bf16
/// or fp16) at m with element (r, l) at m[r * ld + l] (k_contiguous) or m[l * ld + r]
/// (otherwise); V [nv, k] and Y [nv, rows] fp32, contiguous. The matrix is read once per four
/// vectors. Parallel over rows on ATen's thread pool; each result is summed in an order fixed by
/// k, the same for any split and any nv.
void half_gemv(const void* m, DType t, int64_t rows, int64_t k, bool k_contiguous, int64_t ld,
               const float* v, int64_t nv, float* y);

/// The same product finished in the half dtype, for small calls where ATen's widening and
/// rounding around half_gemv would cost as much as the product: V given as t elements, element
/// (i, l) at v[i * vs0 + l * vs1]; out[i * rows + r] = Y[i, r] (+ bias[r], t elements, if bias is
/// not null) in fp32, rounded once to t (nearest even); out [nv, rows] contiguous.
void half_gemv_rounded(const void* m, DType t, int64_t rows, int64_t k, bool k_contiguous,
                       int64_t ld, const void* v, int64_t vs0, int64_t vs1, int64_t nv,
                       const void* bias, void* out);

}  // namespace apex::kernels::cpu
