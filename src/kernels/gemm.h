// Kernel interface of products of bf16/fp16 CPU matrices with fp32 sums and a half result: the
// operands widened as they are packed into the product's fp32 panels, the result rounded once as
// it is stored. Used by amp's CPU half fallback (amp/cpu_half/) in place of widening both
// operands, LibTorch's fp32 product and a rounding pass (three passes over memory and four ATen
// calls).
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cpu {

/// C[b] = alpha * (sum over t < terms of A[b, t] B[b, t]) + beta * S[b] for b < batch, A [m, k],
/// B [k, n], C and S [m, n], all stored as t (bf16 or fp16), each element addressed by its strides
/// (in elements, any sign; 0 for a broadcast dimension of S; C must not overlap the others). Each
/// output's sum is fp32: each term's k in blocks of 256, each block one chain of fused
/// multiply-adds in k order, the blocks' sums added in order (terms in order), the same bits for
/// any thread count; alpha * sum + beta * s in fp32, rounded once to nearest even. S null or beta
/// 0: no S (NaN in it not propagated, as BLAS). m, n, k, batch, terms > 0. The terms are addbmm's
/// batches (batch 1), a convolution's taps, or the samples its weight gradient sums over.
struct HalfGemm {
  DType t = DType::kBFloat16;
  int64_t batch = 1, terms = 1, m = 0, n = 0, k = 0;
  const void* a = nullptr;
  int64_t a_b = 0, a_t = 0, a_m = 0, a_k = 0;
  const void* b = nullptr;
  int64_t b_b = 0, b_t = 0, b_k = 0, b_n = 0;
  void* c = nullptr;
  int64_t c_b = 0, c_m = 0, c_n = 0;
  const void* s = nullptr;
  int64_t s_b = 0, s_m = 0, s_n = 0;
  float alpha = 1.0f, beta = 0.0f;
};

/// Whether this CPU's kernel table has the product (AVX2 with FMA and F16C, or wider).
bool half_gemm_available();

/// The product, split over ATen's thread pool.
void half_gemm(const HalfGemm& g);

}  // namespace apex::kernels::cpu
