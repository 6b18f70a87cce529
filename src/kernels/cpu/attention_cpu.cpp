// CPU driver of half-precision attention (kernels/attention.h): per (batch, head), the scores of
// every query and key in one fp32 block, the products by the half product's packs and register
// tile (isa.h, GemmKernels), the softmax's exp in vectors (GemmKernels::exp_shifted), each
// output rounded once as it is stored.
//
// The forward holds the scores transposed (a row per key): the softmax's maximum and sum over
// keys are then sums of rows (in vectors, no horizontal reductions), and P V takes P as its A
// operand with each packed row of a panel a contiguous run. The backward holds them a row per
// query: dV = P^T dO and dK = dS^T Q take P and dS the same way; dQ = dS K is the one product whose
// fp32 operand is packed across its rows.
#include <c10/util/Exception.h>
#include "kernels/cpu/parallel.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels/attention.h"
#include "kernels/cpu/half_bits.h"
#include "kernels/cpu/isa.h"

namespace apex::kernels::cpu {
namespace {

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Per-thread buffers, kept between calls (at most ~1.6 MiB: six blocks of 258 x 256 floats).
struct Buffers {
  std::vector<float> pa, pb, s, dp, c, rows, mask;
  // The packed operands' room: any product's A (rows rounded up to kGemmMr) and B.
  float* pack_a() { return sized(pa, (kAttentionMaxLength + kGemmMr) * kAttentionMaxLength); }
  float* pack_b() { return sized(pb, kAttentionMaxLength * kAttentionMaxLength); }
  static float* sized(std::vector<float>& v, int64_t n) {
    // 64-byte aligned (B's panels are loaded aligned), room past the end for the packs' stores.
    if (static_cast<int64_t>(v.size()) < n + 32) v.resize(static_cast<size_t>(n + 32));
    auto p = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
  }
};
thread_local Buffers buffers;

// A[i, l] = src[i * si + l * sl] (fp32) for i < mc, l < kc into the tile's panels of kGemmMr
// rows (out[(i / Mr) * kc * Mr + l * Mr + i % Mr]), zero past mc. With si 1 each packed row of a
// panel is one contiguous run.
void pack_a_f32(const float* src, int64_t si, int64_t sl, int64_t mc, int64_t kc, float* out) {
  for (int64_t i0 = 0; i0 < mc; i0 += kGemmMr, out += kGemmMr * kc) {
    const int64_t rows = std::min(kGemmMr, mc - i0);
    const float* p = src + i0 * si;
    for (int64_t l = 0; l < kc; ++l) {
      for (int64_t ii = 0; ii < kGemmMr; ++ii) {
        out[l * kGemmMr + ii] = ii < rows ? p[ii * si + l * sl] : 0.0f;
      }
    }
  }
}

const uint16_t* at_item(const HalfView& x, int64_t bi, int64_t hi) {
  return static_cast<const uint16_t*>(x.p) + bi * x.b + hi * x.h;
}
uint16_t* at_item(const HalfOut& x, int64_t bi, int64_t hi) {
  return static_cast<uint16_t*>(x.p) + bi * x.b + hi * x.h;
}

// One (batch, head) item of the parallel loops: its indices and its q, k and v.
struct Item {
  int64_t bi, hi;
  const uint16_t *q, *k, *v;
};
Item item_of(const HalfAttention& a, int64_t item) {
  const int64_t bi = item / a.heads, hi = item % a.heads;
  return {bi, hi, at_item(a.q, bi, hi), at_item(a.k, bi, hi), at_item(a.v, bi, hi)};
}

// n elements at src[j * stride] widened into dst.
void load_row(const MultiTensorKernels& mt, const uint16_t* src, int64_t stride, int64_t n, DType t,
              float* dst) {
  if (stride == 1) {
    mt.to_float(src, t, dst, n);
  } else {
    for (int64_t j = 0; j < n; ++j) dst[j] = half_bits_to_float(src[j * stride], t);
  }
}

// row[0, n) rounded once into dst[j * stride] (through `room`, n halves, where strided).
void store_row(const MultiTensorKernels& mt, const float* row, int64_t n, DType t, uint16_t* dst,
               int64_t stride, float* room) {
  if (stride == 1) {
    mt.from_float(row, t, dst, n);
  } else {
    auto* bits = reinterpret_cast<uint16_t*>(room);
    mt.from_float(row, t, bits, n);
    for (int64_t j = 0; j < n; ++j) dst[j * stride] = bits[j];
  }
}

// The rows of a product (c, ldc) times `alpha`, rounded into out's rows (rows r, columns c).
void store_rows(const MultiTensorKernels& mt, float* c, int64_t ldc, int64_t rows, int64_t cols,
                float alpha, DType t, uint16_t* out, int64_t sr, int64_t sc, float* room) {
  for (int64_t i = 0; i < rows; ++i) {
    float* row = c + i * ldc;
    if (alpha != 1.0f) {
      for (int64_t j = 0; j < cols; ++j) row[j] *= alpha;
    }
    store_row(mt, row, cols, t, out + i * sr, sc, room);
  }
}

void check(const HalfAttention& a) {
  TORCH_CHECK(a.t == DType::kBFloat16 || a.t == DType::kFloat16,
              "apex half_attention: expected bf16 or fp16 elements");
  TORCH_CHECK(a.batch > 0 && a.heads > 0 && a.lq > 0 && a.lk > 0 && a.d > 0 && a.dv > 0,
              "apex half_attention: empty attention");
  TORCH_CHECK(a.lq <= kAttentionMaxLength && a.lk <= kAttentionMaxLength &&
                  a.d <= kAttentionMaxLength && a.dv <= kAttentionMaxLength,
              "apex half_attention: sequences and heads up to ", kAttentionMaxLength, ", got ",
              a.lq, " queries, ", a.lk, " keys, head sizes ", a.d, " and ", a.dv);
  TORCH_CHECK(half_attention_available(), "apex half_attention: not available on this CPU");
}

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

// What the forward and the backward do alike to an item's scores before the exp, in either
// layout, per thread and call. The scores are scaled in place first where a mask is added after
// the scale, or where the scale is not positive (the largest scaled score is then not the scaled
// largest score); otherwise the scale is fused into the exp.
class Scores {
 public:
  Scores(const HalfAttention& a, Buffers& buf, const MultiTensorKernels& mt)
      : a_(a),
        mt_(mt),
        prescale_(a.mask.p != nullptr || !(a.scale > 0.0f)),
        wm_(a.mask.p != nullptr ? Buffers::sized(buf.mask, a.lq * a.lk) : nullptr) {}

  /// The scale left to the exp: 1 where the scores were scaled in place.
  float exp_scale() const { return prescale_ ? 1.0f : a_.scale; }

  /// Item (bi, hi)'s scores, a row per query (`by_query`) or per key, rows `ld` apart: scaled in
  /// place where prescaled, the mask added, -inf for keys after a query where causal.
  void prepare(int64_t bi, int64_t hi, float* s, int64_t ld, bool by_query) {
    const float* m = mask(bi, hi);
    const int64_t rows = by_query ? a_.lq : a_.lk, cols = by_query ? a_.lk : a_.lq;
    // The mask's element for (row r, column c): it is held a row per query.
    const int64_t m_r = by_query ? a_.lk : 1, m_c = by_query ? 1 : a_.lk;
    for (int64_t r = 0; r < rows; ++r) {
      float* row = s + r * ld;
      if (m != nullptr) {
        for (int64_t c = 0; c < cols; ++c) row[c] = row[c] * a_.scale + m[r * m_r + c * m_c];
      } else if (prescale_) {
        for (int64_t c = 0; c < cols; ++c) row[c] *= a_.scale;
      }
      if (!a_.causal) continue;
      if (by_query) {  // query r sees keys up to r
        if (r + 1 < a_.lk) std::fill(row + r + 1, row + a_.lk, kMinusInf);
      } else {  // key r is seen by queries from r on
        std::fill(row, row + std::min(r, a_.lq), kMinusInf);
      }
    }
  }

 private:
  // The item's mask widened [lq, lk], a row per query (null: none), unless it is the one held
  // already (a broadcast mask is widened once per thread and call).
  const float* mask(int64_t bi, int64_t hi) {
    if (wm_ == nullptr) return nullptr;
    const uint16_t* m = at_item(a_.mask, bi, hi);
    if (m != held_) {
      for (int64_t i = 0; i < a_.lq; ++i) {
        load_row(mt_, m + i * a_.mask.r, a_.mask.c, a_.lk, a_.t, wm_ + i * a_.lk);
      }
      held_ = m;
    }
    return wm_;
  }

  const HalfAttention& a_;
  const MultiTensorKernels& mt_;
  bool prescale_;
  float* wm_;
  const uint16_t* held_ = nullptr;
};

}  // namespace

bool half_attention_available() {
  const GemmKernels& g = *cpu_kernels().gemm;
  return g.multiply != nullptr && g.exp_shifted != nullptr;
}

void half_attention_forward(const HalfAttention& a, const HalfOut& out, float* lse, int64_t lse_b,
                            int64_t lse_h, int64_t lse_q) {
  check(a);
  const GemmKernels& kern = *cpu_kernels().gemm;
  const MultiTensorKernels& mt = *cpu_kernels().multi_tensor;
  const DType t = a.t;
  const int64_t nq = round_up(a.lq, kern.nr), ndv = round_up(a.dv, kern.nr);
  parallel_for(0, a.batch * a.heads, 1, [&](int64_t begin, int64_t end) {
    Buffers& buf = buffers;
    float* pa = buf.pack_a();
    float* pb = buf.pack_b();
    float* s = Buffers::sized(buf.s, round_up(a.lk, kGemmMr) * nq);
    float* c = Buffers::sized(buf.c, round_up(a.lq, kGemmMr) * ndv);
    float* rows = Buffers::sized(buf.rows, 3 * nq + ndv);
    float* m = rows;          // per query: the largest score
    float* shift = m + nq;    // scale * m
    float* sum = shift + nq;  // the sum of exp(scale * score - shift)
    float* room = sum + nq;   // a rounded row
    Scores scores(a, buf, mt);
    const float scale = scores.exp_scale();
    for (int64_t item = begin; item < end; ++item) {
      const auto [bi, hi, q, k, v] = item_of(a, item);
      // S^T = K Q^T: a row per key, a column per query (padding columns zero).
      kern.pack_a(k, a.k.r, a.k.c, a.lk, a.lk, a.d, pa, t);
      kern.pack_b(q, a.q.c, a.q.r, a.lq, a.lq, a.d, pb, t);
      kern.multiply(pa, pb, a.lk, nq, a.d, s, nq, false);
      scores.prepare(bi, hi, s, nq, false);
      std::fill(m, m + nq, kMinusInf);
      for (int64_t r = 0; r < a.lk; ++r) {
        const float* row = s + r * nq;
        for (int64_t j = 0; j < nq; ++j) m[j] = std::max(m[j], row[j]);
      }
      // A query whose every key is masked (its maximum -inf) sums to 0: zeros out, lse 0.
      for (int64_t j = 0; j < nq; ++j) shift[j] = m[j] == kMinusInf ? 0.0f : m[j] * scale;
      std::fill(sum, sum + nq, 0.0f);
      for (int64_t r = 0; r < a.lk; ++r) {
        float* row = s + r * nq;
        kern.exp_shifted(row, shift, nq, scale);
        for (int64_t j = 0; j < nq; ++j) sum[j] += row[j];
      }
      // O = P V / sum: P's rows are S^T's columns (a contiguous run per packed row).
      pack_a_f32(s, 1, nq, a.lq, a.lk, pa);
      kern.pack_b(v, a.v.r, a.v.c, a.dv, a.dv, a.lk, pb, t);
      kern.multiply(pa, pb, a.lq, ndv, a.lk, c, ndv, false);
      uint16_t* o = at_item(out, bi, hi);
      for (int64_t i = 0; i < a.lq; ++i) {
        float* row = c + i * ndv;
        const bool none = sum[i] == 0.0f;
        for (int64_t j = 0; j < a.dv; ++j) row[j] = none ? 0.0f : row[j] / sum[i];
        store_row(mt, row, a.dv, t, o + i * out.r, out.c, room);
        lse[bi * lse_b + hi * lse_h + i * lse_q] = none ? 0.0f : shift[i] + std::log(sum[i]);
      }
    }
  });
}

void half_attention_backward(const HalfAttention& a, const HalfView& dout, const HalfView& out,
                             const float* lse, int64_t lse_b, int64_t lse_h, int64_t lse_q,
                             const HalfOut& dq, const HalfOut& dk, const HalfOut& dv) {
  check(a);
  const GemmKernels& kern = *cpu_kernels().gemm;
  const MultiTensorKernels& mt = *cpu_kernels().multi_tensor;
  const DType t = a.t;
  const int64_t nk = round_up(a.lk, kern.nr);
  const int64_t nd = round_up(a.d, kern.nr), ndv = round_up(a.dv, kern.nr);
  parallel_for(0, a.batch * a.heads, 1, [&](int64_t begin, int64_t end) {
    Buffers& buf = buffers;
    float* pa = buf.pack_a();
    float* pb = buf.pack_b();
    const int64_t lq6 = round_up(a.lq, kGemmMr);
    float* s = Buffers::sized(buf.s, lq6 * nk);
    float* dp = Buffers::sized(buf.dp, lq6 * nk);
    float* c = Buffers::sized(buf.c, round_up(std::max(a.lq, a.lk), kGemmMr) * std::max(nd, ndv));
    float* rows = Buffers::sized(buf.rows, nk + 2 * a.dv + a.lq + std::max({nd, ndv, nk}));
    float* shift = rows;        // lse of the row's query, for every key
    float* wo = shift + nk;     // a row of out, widened
    float* wdo = wo + a.dv;     // a row of dout, widened
    float* dsum = wdo + a.dv;   // per query: rowsum(dO * out)
    float* room = dsum + a.lq;  // a rounded row
    Scores scores(a, buf, mt);
    const float scale = scores.exp_scale();
    for (int64_t item = begin; item < end; ++item) {
      const auto [bi, hi, q, k, v] = item_of(a, item);
      const uint16_t* go = at_item(dout, bi, hi);
      const uint16_t* o = at_item(out, bi, hi);
      const float* l = lse + bi * lse_b + hi * lse_h;
      for (int64_t i = 0; i < a.lq; ++i) {
        load_row(mt, o + i * out.r, out.c, a.dv, t, wo);
        load_row(mt, go + i * dout.r, dout.c, a.dv, t, wdo);
        float d = 0.0f;
        for (int64_t j = 0; j < a.dv; ++j) d += wdo[j] * wo[j];
        dsum[i] = d;
      }
      // P = exp(scale * Q K^T - lse): a row per query.
      kern.pack_a(q, a.q.r, a.q.c, a.lq, a.lq, a.d, pa, t);
      kern.pack_b(k, a.k.c, a.k.r, a.lk, a.lk, a.d, pb, t);
      kern.multiply(pa, pb, a.lq, nk, a.d, s, nk, false);
      scores.prepare(bi, hi, s, nk, true);
      for (int64_t i = 0; i < a.lq; ++i) {
        float* row = s + i * nk;
        std::fill(shift, shift + nk, l[i * lse_q]);
        kern.exp_shifted(row, shift, nk, scale);
      }
      // dP = dO V^T, then dS = P (dP - rowsum(dO out)) in its place.
      kern.pack_a(go, dout.r, dout.c, a.lq, a.lq, a.dv, pa, t);
      kern.pack_b(v, a.v.c, a.v.r, a.lk, a.lk, a.dv, pb, t);
      kern.multiply(pa, pb, a.lq, nk, a.dv, dp, nk, false);
      for (int64_t i = 0; i < a.lq; ++i) {
        const float* p = s + i * nk;
        float* row = dp + i * nk;
        for (int64_t j = 0; j < a.lk; ++j) row[j] = p[j] * (row[j] - dsum[i]);
      }
      // dV = P^T dO: a row per key.
      pack_a_f32(s, 1, nk, a.lk, a.lq, pa);
      kern.pack_b(go, dout.r, dout.c, a.dv, a.dv, a.lq, pb, t);
      kern.multiply(pa, pb, a.lk, ndv, a.lq, c, ndv, false);
      store_rows(mt, c, ndv, a.lk, a.dv, 1.0f, t, at_item(dv, bi, hi), dv.r, dv.c, room);
      // dK = scale dS^T Q.
      pack_a_f32(dp, 1, nk, a.lk, a.lq, pa);
      kern.pack_b(q, a.q.r, a.q.c, a.d, a.d, a.lq, pb, t);
      kern.multiply(pa, pb, a.lk, nd, a.lq, c, nd, false);
      store_rows(mt, c, nd, a.lk, a.d, a.scale, t, at_item(dk, bi, hi), dk.r, dk.c, room);
      // dQ = scale dS K: dS packed across its rows.
      pack_a_f32(dp, nk, 1, a.lq, a.lk, pa);
      kern.pack_b(k, a.k.r, a.k.c, a.d, a.d, a.lk, pb, t);
      kern.multiply(pa, pb, a.lq, nd, a.lk, c, nd, false);
      store_rows(mt, c, nd, a.lq, a.d, a.scale, t, at_item(dq, bi, hi), dq.r, dq.c, room);
    }
  });
}

}  // namespace apex::kernels::cpu
