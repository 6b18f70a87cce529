// CPU driver of the half matrix-vector products (kernels/gemv.h): rows split over ATen's thread
// pool, each range by the gemv kernels of the best instruction set (kernels/cpu/isa.h).
#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

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
    at::parallel_for(0, rows, (int64_t{1} << 16) / per_row + 1, each_group);
    return;
  }
  constexpr int64_t kBlock = kGemvRowBlock;
  const int64_t blocks = (rows + kBlock - 1) / kBlock;
  at::parallel_for(
      0, blocks, (int64_t{1} << 16) / (per_row * kBlock) + 1,
      [&](int64_t b, int64_t e) { each_group(b * kBlock, e * kBlock < rows ? e * kBlock : rows); });
}

}  // namespace apex::kernels::cpu
