// Kernel interface of scaled dot-product attention on bf16/fp16 CPU tensors with fp32 sums and
// softmax, each output rounded once to the half dtype: per (batch, head), every product by the
// half product's packs and tile (kernels/gemm.h), the scores of all keys of all queries held at
// once in fp32 (so sequences up to kAttentionMaxLength). Used by amp's CPU half fallback
// (amp/cpu_half/) in place of widening the inputs for LibTorch's fp32 flash attention.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cpu {

/// The longest query or key sequence and head size the kernels take (their scores, products and
/// packed operands are each one block of k).
constexpr int64_t kAttentionMaxLength = 256;

/// One half-precision tensor of [batch, heads, rows, cols] by its strides (in elements).
struct HalfView {
  const void* p = nullptr;
  int64_t b = 0, h = 0, r = 0, c = 0;
};
struct HalfOut {
  void* p = nullptr;
  int64_t b = 0, h = 0, r = 0, c = 0;
};

/// softmax(scale * Q K^T + M (keys after a query masked where causal: key > query), over keys) V,
/// Q [lq, d], K [lk, d], V [lk, dv] per (batch, head), M an additive mask [lq, lk] in the same
/// dtype (optional; zero strides for broadcast dimensions); its log-sum-exp per query (natural
/// log of the sum of exp(scale * score + M)) into lse [batch, heads, lq] by strides, fp32. A query
/// whose every key is masked gets zeros and a log-sum-exp of 0 (as LibTorch's kernel). Every
/// size >= 1, lq, lk, d, dv <= kAttentionMaxLength.
struct HalfAttention {
  DType t = DType::kBFloat16;
  int64_t batch = 0, heads = 0, lq = 0, lk = 0, d = 0, dv = 0;
  HalfView q, k, v, mask;  // mask.p null: none
  float scale = 1.0f;
  bool causal = false;
};

/// Whether this CPU's kernel table has what the kernels need (the half product's, kernels/gemm.h).
bool half_attention_available();

/// out [lq, dv] and lse by strides (lse_b, lse_h, lse_q), split over ATen's thread pool by
/// (batch, head).
void half_attention_forward(const HalfAttention& a, const HalfOut& out, float* lse, int64_t lse_b,
                            int64_t lse_h, int64_t lse_q);

/// The gradients of Q, K and V from the output's gradient `dout` [lq, dv], the output `out` (the
/// rounded one the forward gave) and the forward's lse: P recomputed from Q, K and lse, dP = dO
/// V^T, dS = P (dP - rowsum(dO out)), dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO.
void half_attention_backward(const HalfAttention& a, const HalfView& dout, const HalfView& out,
                             const float* lse, int64_t lse_b, int64_t lse_h, int64_t lse_q,
                             const HalfOut& dq, const HalfOut& dk, const HalfOut& dv);

}  // namespace apex::kernels::cpu
