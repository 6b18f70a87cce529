// CPU driver of the half matrix-vector products (kernels/gemv.h): rows split over ATen's thread
// pool, each range by the gemv kernels of the best instruction set (kernels/cpu/isa.h).
#include <c10/util/Exception.h>
#include "kernels/cpu/parallel.h"

#include <vector>

#include "kernels/cpu/half_bits.h"
#include "kernels/cpu/isa.h"
#include "kernels/gemv.h"

namespace apex::kernels::cpu {

void half_gemv(const void* m, DType t, int64_t rows, int64_t k, bool k_contiguous, int64_t ld,
               const float* v, int64_t nv, float* y) {
  TORCH_CHECK(t == DType::kBFloat16 || t == DType::kFloat16,
              "apex half_gemv: expected bf16 or fp16 elements");
  const auto* kernels = cpu_kernels().gemv;
  const auto* base = static_cast<const uint16_t*>(m);
  const auto each_group = [&](int64_t r0, int64_t r1) {
    for (int64_t i = 0; i < nv; i += 4) {
      const int n = static_cast<int>(nv - i < 4 ? nv - i : 4);
      if (k_contiguous) {
        kernels->dot_rows(base + r0 * ld, ld, r1 - r0, k, v + i * k, k, n, y + i * rows + r0, rows,
                          t);
      } else {
        kernels->axpy_cols(base + r0, ld, r1 - r0, k, v + i * k, k, n, y + i * rows + r0, rows, t);
      }
    }
  };
  // About 64 Ki multiply-adds per task (a matrix of 64 Ki elements with 16 vectors is worth
  // splitting: single-threaded it took twice the fp32 product); column-major ranges are whole
  // kGemvRowBlock blocks (isa.h).
  const int64_t per_row = (k > 0 ? k : 1) * nv;
  if (k_contiguous) {
    parallel_for(0, rows, (int64_t{1} << 16) / per_row + 1, each_group);
    return;
  }
  constexpr int64_t kBlock = kGemvRowBlock;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  parallel_for(0, blocks, (int64_t{1} << 16) / (per_row * kBlock) + 1, [&](int64_t b, int64_t e) {
    each_group(b * kBlock, e * kBlock < rows ? e * kBlock : rows);
  });
}

void half_gemv_rounded(const void* m, DType t, int64_t rows, int64_t k, bool k_contiguous,
                       int64_t ld, const void* v, int64_t vs0, int64_t vs1, int64_t nv,
                       const void* bias, void* out) {
  TORCH_CHECK(t == DType::kBFloat16 || t == DType::kFloat16,
              "apex half_gemv_rounded: expected bf16 or fp16 elements");
  const auto& mt = *cpu_kernels().multi_tensor;
  const auto* vh = static_cast<const uint16_t*>(v);
  std::vector<float> vf(static_cast<size_t>(nv * k));
  for (int64_t i = 0; i < nv; ++i) {
    if (vs1 == 1 || k == 1) {
      mt.to_float(vh + i * vs0, t, vf.data() + i * k, k);
      continue;
    }
    for (int64_t l = 0; l < k; ++l) {
      vf[i * k + l] = half_bits_to_float(vh[i * vs0 + l * vs1], t);
    }
  }
  std::vector<float> y(static_cast<size_t>(nv * rows));
  half_gemv(m, t, rows, k, k_contiguous, ld, vf.data(), nv, y.data());
  // Row by row (the bias is per column of the output), rows split over the pool: rounded as
  // stored, with the bias through the multi-tensor axpby (1 * row + 1 * bias, as half_add_rows).
  auto* o = static_cast<uint16_t*>(out);
  parallel_for(0, nv, (int64_t{1} << 15) / (rows > 0 ? rows : 1) + 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      float* row = y.data() + i * rows;
      if (bias == nullptr) {
        mt.from_float(row, t, o + i * rows, rows);
        continue;
      }
      Span s;
      s.p[0] = row;
      s.t[0] = DType::kFloat32;
      s.p[1] = const_cast<void*>(bias);
      s.t[1] = t;
      s.p[2] = o + i * rows;
      s.t[2] = t;
      s.n = rows;
      mt.axpby(s, 1.0f, 1.0f, kAxpbyCheckNone);
    }
  });
}

}  // namespace apex::kernels::cpu
