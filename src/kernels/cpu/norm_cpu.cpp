// CPU driver of the fused norms: rows in parallel on ATen's thread pool, each row by the chunk
// kernels of the best instruction set (kernels/cpu/isa.h). Weight/bias gradients are summed per
// fixed block of rows in fp64 and the blocks combined in order: the result does not depend on
// the thread count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <new>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernels/norm.h"

namespace apex::kernels::cpu {
namespace {

const IsaTable& table() { return isa_table(); }

// Buffers the row kernels read with full-width vector loads start on a cache line: a 64-byte
// load from a 16-byte aligned malloc block straddles two lines every time (the backward's loops
// ran at half speed on such buffers in a standalone test).
template <class T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <class U>
  explicit LineAllocator(const LineAllocator<U>& /*other*/) {}
  T* allocate(size_t n) {
    void* p = std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64);
    if (p == nullptr) throw std::bad_alloc();
    return static_cast<T*>(p);
  }
  void deallocate(T* p, size_t /*n*/) { std::free(p); }
  bool operator==(const LineAllocator& /*other*/) const { return true; }
};
using Floats = std::vector<float, LineAllocator<float>>;
using Doubles = std::vector<double, LineAllocator<double>>;

// The affine parameters as fp32 once per call (empty when absent).
Floats to_float(const void* p, DType t, int64_t n) {
  if (p == nullptr) return {};
  Floats out(static_cast<size_t>(n));
  table().to_float(p, t, out.data(), n);
  return out;
}

}  // namespace

void norm_forward(const NormForwardArgs& a) {
  const Floats w = to_float(a.w, a.w_dtype, a.cols);
  const Floats b = to_float(a.b, a.w_dtype, a.cols);
  const int64_t elem = dtype_size(a.x_dtype);
  // Prefetching the next row pays when the input streams from memory: ~10 % at 32 MB and more
  // with two threads on the development VM. Below that the input is largely in the last-level
  // cache and the burst of prefetches only got in the way (12-16 MB inputs ran 15-30 % slower).
  const bool prefetch = a.rows * a.cols * elem >= (int64_t{32} << 20);
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    Floats scratch(static_cast<size_t>(2 * norm_scratch_stride(a.cols)));
    table().norm_forward_rows(a, begin, end, w.empty() ? nullptr : w.data(),
                              b.empty() ? nullptr : b.data(), scratch.data(), prefetch);
  });
}

void norm_backward(const NormBackwardArgs& a) {
  const bool from_output = a.y != nullptr;
  Floats w = to_float(a.w, a.w_dtype, a.cols);
  Floats b = from_output ? to_float(a.b, a.w_dtype, a.cols) : Floats{};
  // The row kernel always multiplies by w (and subtracts b when from the output).
  if (w.empty()) w.assign(static_cast<size_t>(a.cols), 1.0f);
  if (b.empty()) b.assign(static_cast<size_t>(a.cols), 0.0f);
  // Fixed blocks of rows, each with its own fp64 sums of dw/db (the row kernels add fp32
  // partials over groups of rows into them), combined in order at the end: the result does not
  // depend on the thread count.
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(a.rows, 32));
  const int64_t per_block = (a.rows + blocks - 1) / blocks;
  const size_t cols = static_cast<size_t>(a.cols);
  const size_t sum_stride = (cols + 7) / 8 * 8;  // each block's sums start on a cache line
  const bool want = a.dw != nullptr || a.db != nullptr;
  Doubles dw_sum(want ? static_cast<size_t>(blocks) * sum_stride : 0, 0.0);
  Doubles db_sum(want ? static_cast<size_t>(blocks) * sum_stride : 0, 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    Floats scratch(5 * static_cast<size_t>(norm_scratch_stride(a.cols)));
    for (int64_t blk = begin; blk < end; ++blk) {
      NormBackwardBlock block;
      block.begin = blk * per_block;
      block.end = std::min(a.rows, (blk + 1) * per_block);
      block.w = w.data();
      block.b = b.data();
      block.scratch = scratch.data();
      block.dw_sum = want ? dw_sum.data() + static_cast<size_t>(blk) * sum_stride : nullptr;
      block.db_sum = want ? db_sum.data() + static_cast<size_t>(blk) * sum_stride : nullptr;
      table().norm_backward_block(a, block);
    }
  });
  for (size_t c = 0; c < cols && want; ++c) {
    double sw = 0.0;
    double sb = 0.0;
    for (int64_t blk = 0; blk < blocks; ++blk) {
      sw += dw_sum[static_cast<size_t>(blk) * sum_stride + c];
      sb += db_sum[static_cast<size_t>(blk) * sum_stride + c];
    }
    if (a.dw != nullptr) a.dw[c] = static_cast<float>(sw);
    if (a.db != nullptr) a.db[c] = static_cast<float>(sb);
  }
}

}  // namespace apex::kernels::cpu
