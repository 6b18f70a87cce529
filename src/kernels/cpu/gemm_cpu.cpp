// CPU driver of the half-precision matrix products (kernels/gemm.h): blocks of the output split
// over ATen's thread pool, each packed and multiplied by the kernels of the best instruction set
// (kernels/cpu/isa.h, GemmKernels), its fp32 sums finished and rounded by the multi-tensor
// conversions.
#include <c10/util/Exception.h>
#include "kernels/cpu/parallel.h"

#include <algorithm>
#include <vector>

#include "kernels/cpu/half_bits.h"
#include "kernels/cpu/isa.h"
#include "kernels/gemm.h"

namespace apex::kernels::cpu {
namespace {

// B is packed whole over k for a chunk of columns, as wide as fits in this many floats (4 MiB:
// the chunk is reused by every block of rows, from L3), at least one panel.
constexpr int64_t kPackedB = int64_t{1} << 20;

int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

// Per-thread buffers, kept between calls (~8.3 MiB at most: B's chunk and a shared A's rows up to
// 4 MiB each, but for a k so long that one panel of B over all of k exceeds kPackedB: that one
// is released after its call).
struct Buffers {
  std::vector<float> a, a_rows, b, c, s;
  static float* sized(std::vector<float>& v, int64_t n) {
    // 64-byte aligned, 16 floats of room past the end (the packing's overlapping stores).
    if (static_cast<int64_t>(v.size()) < n + 32) v.resize(static_cast<size_t>(n + 32));
    auto p = reinterpret_cast<uintptr_t>(v.data());
    return reinterpret_cast<float*>((p + 63) & ~uintptr_t{63});
  }
};
thread_local Buffers buffers;

}  // namespace

bool half_gemm_available() { return cpu_kernels().gemm->multiply != nullptr; }

void half_gemm(const HalfGemm& g) {
  TORCH_CHECK(g.t == DType::kBFloat16 || g.t == DType::kFloat16,
              "apex half_gemm: expected bf16 or fp16 elements");
  TORCH_CHECK(g.m > 0 && g.n > 0 && g.k > 0 && g.batch > 0 && g.terms > 0,
              "apex half_gemm: empty product ", g.m, "x", g.k, " by ", g.k, "x", g.n, " (batch ",
              g.batch, ", terms ", g.terms, ")");
  const GemmKernels& kern = *cpu_kernels().gemm;
  TORCH_CHECK(kern.multiply != nullptr, "apex half_gemm: not available on this CPU");
  const MultiTensorKernels& mt = *cpu_kernels().multi_tensor;
  const DType t = g.t;
  // B's packed rows per column: every term's k, in blocks of kGemmKc (block q: term q / per_term,
  // rows from (q % per_term) * kGemmKc), laid out in that order.
  const auto ceil_div = [](int64_t x, int64_t y) { return (x + y - 1) / y; };
  const int64_t kp = g.terms * g.k;
  const int64_t per_term = ceil_div(g.k, kGemmKc), k_blocks = g.terms * per_term;
  // Two items per thread: batches first, then blocks of rows (each item packs its B chunk), then
  // chunks of columns (each packs its A blocks), B chunks never above kPackedB.
  const int64_t wanted = 2 * num_threads();
  const int64_t row_blocks = ceil_div(g.m, kGemmMc);
  const int64_t per_rows = std::clamp<int64_t>(ceil_div(wanted, g.batch), 1, row_blocks);
  const int64_t col_split = std::max<int64_t>(1, ceil_div(wanted, g.batch * per_rows));
  const int64_t chunk = std::min(round_up(ceil_div(g.n, col_split), kern.nr),
                                 std::max(kern.nr, kPackedB / kp / kern.nr * kern.nr));
  const int64_t chunks = ceil_div(g.n, chunk);
  const int64_t items = g.batch * chunks * per_rows;
  const bool with_s = g.s != nullptr && g.beta != 0.0f;
  const auto* a16 = static_cast<const uint16_t*>(g.a);
  const auto* b16 = static_cast<const uint16_t*>(g.b);
  const auto* s16 = static_cast<const uint16_t*>(g.s);
  auto* c16 = static_cast<uint16_t*>(g.c);

  // A column chunk of one batch: where its packed B lies, and its place in the output.
  struct Chunk {
    int64_t bi, j0, nc, ncp;
  };
  const auto chunk_of = [&](int64_t bi, int64_t ci) {
    const int64_t j0 = ci * chunk, nc = std::min(chunk, g.n - j0);
    return Chunk{bi, j0, nc, round_up(nc, kern.nr)};
  };
  // k block q: its term, first row of k, length, and first packed row.
  struct Block {
    int64_t ti, l, kc, row;
  };
  const auto block = [&](int64_t q) {
    const int64_t ti = q / per_term, l = q % per_term * kGemmKc;
    return Block{ti, l, std::min(kGemmKc, g.k - l), ti * g.k + l};
  };
  // Columns [j, j + w) of the chunk's B (w a multiple of nr, or the rest) over k block q.
  const auto pack_b_part = [&](const Chunk& ch, float* pb, int64_t q, int64_t j, int64_t w) {
    const Block kb = block(q);
    const uint16_t* b = b16 + ch.bi * g.b_b + kb.ti * g.b_t + (ch.j0 + j) * g.b_n + kb.l * g.b_k;
    kern.pack_b(b, g.b_k, g.b_n, std::min(w, ch.nc - j), g.n - ch.j0 - j, kb.kc,
                pb + kb.row * ch.ncp + j * kb.kc, t);
  };
  // Rows [i0, i0 + mc) of A, every k block, into pa: block q at kb.row * round_up(mc, kGemmMr).
  const auto pack_a_rows = [&](float* pa, int64_t i0, int64_t mc) {
    for (int64_t q = 0; q < k_blocks; ++q) {
      const Block kb = block(q);
      const uint16_t* a = a16 + kb.ti * g.a_t + i0 * g.a_m + kb.l * g.a_k;
      kern.pack_a(a, g.a_m, g.a_k, mc, g.m - i0, kb.kc, pa + kb.row * round_up(mc, kGemmMr), t);
    }
  };
  // Rows [i0, i0 + mc) of the chunk into c (ldc ncp), summed over every term and k block: A's
  // blocks packed one at a time into pa, or all there already (`a_ready`, from pack_a_rows).
  const auto multiply_rows = [&](const Chunk& ch, const float* pb, float* pa, bool a_ready,
                                 int64_t i0, int64_t mc, float* c) {
    for (int64_t q = 0; q < k_blocks; ++q) {
      const Block kb = block(q);
      if (!a_ready) {
        const uint16_t* a = a16 + ch.bi * g.a_b + kb.ti * g.a_t + i0 * g.a_m + kb.l * g.a_k;
        kern.pack_a(a, g.a_m, g.a_k, mc, g.m - i0, kb.kc, pa, t);
      }
      const float* pq = a_ready ? pa + kb.row * round_up(mc, kGemmMr) : pa;
      kern.multiply(pq, pb + kb.row * ch.ncp, mc, ch.ncp, kb.kc, c, ch.ncp, q > 0);
    }
  };
  // Rows [i0, i0 + rows) of the chunk's output from their sums in c, row by row: alpha, beta * S
  // in fp32, one rounding.
  const auto finish_rows = [&](const Chunk& ch, int64_t i0, int64_t rows, float* c, float* srow) {
    for (int64_t i = 0; i < rows; ++i) {
      float* row = c + i * ch.ncp;
      if (g.alpha != 1.0f) {
        for (int64_t j = 0; j < ch.nc; ++j) row[j] *= g.alpha;
      }
      if (with_s) {
        const uint16_t* s = s16 + ch.bi * g.s_b + (i0 + i) * g.s_m + ch.j0 * g.s_n;
        if (g.s_n == 1) {
          mt.to_float(s, t, srow, ch.nc);
        } else if (g.s_n == 0) {
          std::fill(srow, srow + ch.nc, half_bits_to_float(*s, t));
        } else {
          for (int64_t j = 0; j < ch.nc; ++j) srow[j] = half_bits_to_float(s[j * g.s_n], t);
        }
        for (int64_t j = 0; j < ch.nc; ++j) row[j] += g.beta * srow[j];
      }
      uint16_t* out = c16 + ch.bi * g.c_b + (i0 + i) * g.c_m + ch.j0 * g.c_n;
      if (g.c_n == 1) {
        mt.from_float(row, t, out, ch.nc);
      } else {  // rounded in vectors into srow's room (done with), then stored with the stride
        auto* bits = reinterpret_cast<uint16_t*>(srow);
        mt.from_float(row, t, bits, ch.nc);
        for (int64_t j = 0; j < ch.nc; ++j) out[j * g.c_n] = bits[j];
      }
    }
  };
  const auto release = [](Buffers& buf) {
    if (buf.b.size() > static_cast<size_t>(kPackedB + 64)) std::vector<float>().swap(buf.b);
    if (buf.c.size() > static_cast<size_t>(kPackedB + 64)) std::vector<float>().swap(buf.c);
    if (buf.a_rows.size() > static_cast<size_t>(kPackedB + 64))
      std::vector<float>().swap(buf.a_rows);
  };

  if (per_rows > 1) {
    // Rows split between threads: each chunk's B packed once, by all threads, into the calling
    // thread's buffer, then its blocks of rows shared out (two parallel regions per chunk: worth
    // it only where there are rows to split, so few batches).
    Buffers& mine = buffers;
    for (int64_t bi = 0; bi < g.batch; ++bi) {
      for (int64_t ci = 0; ci < chunks; ++ci) {
        const Chunk ch = chunk_of(bi, ci);
        float* pb = Buffers::sized(mine.b, kp * ch.ncp);
        const int64_t panels = ch.ncp / kern.nr;
        parallel_for(0, k_blocks * panels, 4, [&](int64_t p0, int64_t p1) {
          for (int64_t p = p0; p < p1; ++p)
            pack_b_part(ch, pb, p / panels, p % panels * kern.nr, kern.nr);
        });
        parallel_for(0, row_blocks, 1, [&](int64_t r0, int64_t r1) {
          Buffers& buf = buffers;
          float* pa = Buffers::sized(buf.a, kGemmMc * kGemmKc);
          float* c = Buffers::sized(buf.c, round_up(kGemmMc, kGemmMr) * ch.ncp);
          float* srow = Buffers::sized(buf.s, ch.ncp);
          for (int64_t r = r0; r < r1; ++r) {
            const int64_t i0 = r * kGemmMc, mc = std::min(kGemmMc, g.m - i0);
            multiply_rows(ch, pb, pa, false, i0, mc, c);
            finish_rows(ch, i0, mc, c, srow);
          }
        });
      }
    }
    release(mine);
    return;
  }

  // Otherwise items of (batch, column chunk, rows) per thread, each packing its own B chunk (a
  // thread's consecutive items of one chunk pack it once). An A that every batch shares (a_b 0:
  // a convolution's weight) is packed once per thread and range of rows where it fits.
  parallel_for(0, items, 1, [&](int64_t begin, int64_t end) {
    Buffers& buf = buffers;
    int64_t packed = -1;    // the chunk (bi * chunks + ci) whose B is in buf.b
    int64_t a_packed = -1;  // the range of rows whose A is in buf.a_rows
    for (int64_t item = begin; item < end; ++item) {
      const int64_t ci = item / per_rows % chunks;
      const int64_t ri = item % per_rows;
      const int64_t i_begin = row_blocks * ri / per_rows * kGemmMc;
      const int64_t i_end = std::min(g.m, row_blocks * (ri + 1) / per_rows * kGemmMc);
      const Chunk ch = chunk_of(item / (chunks * per_rows), ci);
      float* pa = Buffers::sized(buf.a, kGemmMc * kGemmKc);
      float* srow = Buffers::sized(buf.s, ch.ncp);
      float* pb = Buffers::sized(buf.b, kp * ch.ncp);
      if (packed != item / per_rows) {
        for (int64_t q = 0; q < k_blocks; ++q) pack_b_part(ch, pb, q, 0, ch.ncp);
        packed = item / per_rows;
      }
      const int64_t a_size = round_up(i_end - i_begin, kGemmMr) * kp;
      const bool keep_a = g.a_b == 0 && g.batch > 1 && a_size <= kPackedB;
      if (keep_a) {
        pa = Buffers::sized(buf.a_rows, a_size);
        for (int64_t i0 = i_begin; i0 < i_end && a_packed != ri; i0 += kGemmMc) {
          pack_a_rows(pa + (i0 - i_begin) * kp, i0, std::min(kGemmMc, i_end - i0));
        }
        a_packed = ri;
      }
      float* c = Buffers::sized(buf.c, round_up(kGemmMc, kGemmMr) * ch.ncp);
      for (int64_t i0 = i_begin; i0 < i_end; i0 += kGemmMc) {
        const int64_t mc = std::min(kGemmMc, i_end - i0);
        multiply_rows(ch, pb, keep_a ? pa + (i0 - i_begin) * kp : pa, keep_a, i0, mc, c);
        finish_rows(ch, i0, mc, c, srow);
      }
    }
    release(buf);
  });
}

}  // namespace apex::kernels::cpu
