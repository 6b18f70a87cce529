// CPU driver of kernels/half_add.h: the flat range of elements split over ATen's thread pool, each
// row segment by the multi-tensor axpby kernel of the best instruction set (kernels/cpu/isa.h),
// which converts tile by tile in L1.
#include <c10/util/Exception.h>
#include "kernels/cpu/parallel.h"

#include <algorithm>

#include "kernels/cpu/isa.h"
#include "kernels/half_add.h"

namespace apex::kernels::cpu {

void half_add_rows(void* x, DType t, int64_t rows, int64_t n, const float* v, float alpha) {
  TORCH_CHECK(t == DType::kBFloat16 || t == DType::kFloat16,
              "apex half_add_rows: expected bf16 or fp16 elements");
  if (rows <= 0 || n <= 0) return;
  const auto axpby = cpu_kernels().multi_tensor->axpby;
  auto* base = static_cast<uint16_t*>(x);
  parallel_for(0, rows * n, int64_t{1} << 15, [&](int64_t begin, int64_t end) {
    while (begin < end) {
      const int64_t col = begin % n;
      const int64_t len = std::min(end - begin, n - col);
      Span s;
      s.p[0] = s.p[2] = base + begin;
      s.t[0] = s.t[2] = t;
      s.p[1] = const_cast<float*>(v + col);
      s.t[1] = DType::kFloat32;
      s.n = len;
      axpby(s, 1.0f, alpha, kAxpbyCheckNone);
      begin += len;
    }
  });
}

}  // namespace apex::kernels::cpu
