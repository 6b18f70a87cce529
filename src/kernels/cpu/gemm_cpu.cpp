// CPU driver of the half-precision matrix products (kernels/gemm.h): blocks of the output split
// over ATen's thread pool, each packed and multiplied by the kernels of the best instruction set
// (kernels/cpu/isa.h, GemmKernels), its fp32 sums finished and rounded by the multi-tensor
// conversions.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernels/gemm.h"

namespace apex::kernels::cpu {
namespace {

// B is packed whole over k for a chunk of columns, as wide as fits in this many floats (4 MiB:
// the chunk is reused by every block of rows, from L3), at least one panel.
constexpr int64_t kPackedB = int64_t{1} << 20;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Per-thread buffers, kept between calls (~4.3 MiB at most, but for a k so long that one panel of
// B over all of k exceeds kPackedB: that one is released after its call).
struct Buffers {
  std::vector<float> a, b, c, s;
  static float* sized(std::vector<float>& v, int64_t n) {
    // 64-byte aligned, 16 floats of room past the end (the packing's overlapping stores).
    if (static_cast<int64_t>(v.size()) < n + 32) v.resize(static_cast<size_t>(n + 32));
    auto p = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
  }
};
thread_local Buffers buffers;

float half_to_float(uint16_t h, DType t) {
  return t == DType::kBFloat16 ? static_cast<float>(c10::BFloat16(h, c10::BFloat16::from_bits()))
                               : static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

uint16_t float_to_half(float f, DType t) {
  return t == DType::kBFloat16 ? c10::BFloat16(f).x : c10::Half(f).x;
}

}  // namespace

bool half_gemm_available() { return cpu_kernels().gemm->multiply != nullptr; }

void half_gemm(const HalfGemm& g) {
  TORCH_CHECK(g.t == DType::kBFloat16 || g.t == DType::kFloat16,
              "apex half_gemm: expected bf16 or fp16 elements");
  TORCH_CHECK(g.m > 0 && g.n > 0 && g.k > 0 && g.batch > 0, "apex half_gemm: empty product ", g.m,
              "x", g.k, " by ", g.k, "x", g.n, " (batch ", g.batch, ")");
  const GemmKernels& kern = *cpu_kernels().gemm;
  TORCH_CHECK(kern.multiply != nullptr, "apex half_gemm: not available on this CPU");
  const MultiTensorKernels& mt = *cpu_kernels().multi_tensor;
  const DType t = g.t;
  const int64_t kp = round_up(g.k, kGemmKc);
  // Two items per thread: batches first, then blocks of rows (each item packs its B chunk), then
  // chunks of columns (each packs its A blocks), B chunks never above kPackedB.
  const int64_t wanted = 2 * static_cast<int64_t>(at::get_num_threads());
  const auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  const int64_t row_blocks = ceil_div(g.m, kGemmMc);
  // Batches summed into one output (addbmm) are not split: each item sums all of them.
  const int64_t item_batches = g.sum_batches ? 1 : g.batch;
  const int64_t per_rows = std::clamp<int64_t>(ceil_div(wanted, item_batches), 1, row_blocks);
  const int64_t col_split = std::max<int64_t>(1, ceil_div(wanted, item_batches * per_rows));
  const int64_t chunk = std::min(round_up(ceil_div(g.n, col_split), kern.nr),
                                 std::max(kern.nr, kPackedB / kp / kern.nr * kern.nr));
  const int64_t chunks = ceil_div(g.n, chunk);
  const int64_t items = item_batches * chunks * per_rows;
  const bool with_s = g.s != nullptr && g.beta != 0.0f;
  const auto* a16 = static_cast<const uint16_t*>(g.a);
  const auto* b16 = static_cast<const uint16_t*>(g.b);
  const auto* s16 = static_cast<const uint16_t*>(g.s);
  auto* c16 = static_cast<uint16_t*>(g.c);

  at::parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Buffers& buf = buffers;
    int64_t packed = -1;  // the (batch, chunk) whose B is in buf.b: consecutive items share it
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ci = item / per_rows % chunks;
      const int64_t ri = item % per_rows;
      const int64_t j0 = ci * chunk, nc = std::min(chunk, g.n - j0), ncp = round_up(nc, kern.nr);
      const int64_t i_begin = row_blocks * ri / per_rows * kGemmMc;
      const int64_t i_end = std::min(g.m, row_blocks * (ri + 1) / per_rows * kGemmMc);
      float* pa = Buffers::sized(buf.a, kGemmMc * kGemmKc);
      float* srow = Buffers::sized(buf.s, ncp);
      // B's chunk of batch bi packed whole over k (unless this thread has it already).
      const auto pack_b = [&](int64_t bi, int64_t key) {
        float* pb = Buffers::sized(buf.b, kp * ncp);
        const uint16_t* b = b16 + bi * g.b_b + j0 * g.b_n;
        for (int64_t l = 0; l < g.k && packed != key; l += kGemmKc) {
          kern.pack_b(b + l * g.b_k, g.b_k, g.b_n, nc, g.n - j0, std::min(kGemmKc, g.k - l),
                      pb + l * ncp, t);
        }
        packed = key;
        return pb;
      };
      // Rows [i0, i0 + mc) of batch bi into c (ldc ncp), added to what c holds if `accumulate`.
      const auto multiply_rows = [&](int64_t bi, const float* pb, int64_t i0, int64_t mc, float* c,
                                     bool accumulate) {
        const uint16_t* a = a16 + bi * g.a_b;
        for (int64_t l = 0; l < g.k; l += kGemmKc) {
          const int64_t kc = std::min(kGemmKc, g.k - l);
          kern.pack_a(a + i0 * g.a_m + l * g.a_k, g.a_m, g.a_k, mc, g.m - i0, kc, pa, t);
          kern.multiply(pa, pb + l * ncp, mc, ncp, kc, c, ncp, accumulate || l > 0);
        }
      };
      // Rows [i0, i0 + rows) of output batch bi from their sums in c, row by row: alpha,
      // beta * S in fp32, one rounding.
      const auto finish_rows = [&](int64_t bi, int64_t i0, int64_t rows, float* c) {
        for (int64_t i = 0; i < rows; ++i) {
          float* row = c + i * ncp;
          if (g.alpha != 1.0f) {
            for (int64_t j = 0; j < nc; ++j) row[j] *= g.alpha;
          }
          if (with_s) {
            const uint16_t* s = s16 + bi * g.s_b + (i0 + i) * g.s_m + j0 * g.s_n;
            if (g.s_n == 1) {
              mt.to_float(s, t, srow, nc);
            } else {
              for (int64_t j = 0; j < nc; ++j) srow[j] = half_to_float(s[j * g.s_n], t);
            }
            for (int64_t j = 0; j < nc; ++j) row[j] += g.beta * srow[j];
          }
          uint16_t* out = c16 + bi * g.c_b + (i0 + i) * g.c_m + j0 * g.c_n;
          if (g.c_n == 1) {
            mt.from_float(row, t, out, nc);
          } else {
            for (int64_t j = 0; j < nc; ++j) out[j * g.c_n] = float_to_half(row[j], t);
          }
        }
      };
      if (g.sum_batches) {
        // The item's rows summed over the batches (in batch order) in one buffer.
        float* c = Buffers::sized(buf.c, round_up(i_end - i_begin, kGemmMr) * ncp);
        for (int64_t bi = 0; bi < g.batch; ++bi) {
          const float* pb = pack_b(bi, -2 - (bi * chunks + ci));  // keys apart from the others
          for (int64_t i0 = i_begin; i0 < i_end; i0 += kGemmMc) {
            multiply_rows(bi, pb, i0, std::min(kGemmMc, i_end - i0), c + (i0 - i_begin) * ncp,
                          bi > 0);
          }
        }
        finish_rows(0, i_begin, i_end - i_begin, c);
        continue;
      }
      const int64_t bi = item / (chunks * per_rows);
      const float* pb = pack_b(bi, item / per_rows);
      float* c = Buffers::sized(buf.c, round_up(kGemmMc, kGemmMr) * ncp);
      for (int64_t i0 = i_begin; i0 < i_end; i0 += kGemmMc) {
        const int64_t mc = std::min(kGemmMc, i_end - i0);
        multiply_rows(bi, pb, i0, mc, c, false);
        finish_rows(bi, i0, mc, c);
      }
    }
    if (buf.b.size() > static_cast<size_t>(kPackedB + 64)) std::vector<float>().swap(buf.b);
    if (buf.c.size() > static_cast<size_t>(kPackedB + 64)) std::vector<float>().swap(buf.c);
  });
}

}  // namespace apex::kernels::cpu
