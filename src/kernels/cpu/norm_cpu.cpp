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
  const int64_t y_elem = dtype_size(a.y_dtype);
  // Prefetching the next row pays when the input streams from memory: ~10 % at 32 MB and more
  // with two threads on the development VM. Below that the input is largely in the last-level
  // cache and the burst of prefetches only got in the way (12-16 MB inputs ran 15-30 % slower).
  const bool prefetch = a.rows * a.cols * elem >= (int64_t{32} << 20);
  at::parallel_for(0, a.rows, 1, [&](int64_t begin, int64_t end) {
    Floats scratch(static_cast<size_t>(2 * norm_scratch_stride(a.cols)));
    for (int64_t r = begin; r < end; ++r) {
      table().norm_forward_row(static_cast<const char*>(a.x) + r * a.cols * elem, a.x_dtype,
                               w.empty() ? nullptr : w.data(), b.empty() ? nullptr : b.data(),
                               static_cast<char*>(a.y) + r * a.cols * y_elem, a.y_dtype, a.cols,
                               a.rms, a.eps, scratch.data(), a.rms ? nullptr : a.mean + r,
                               a.rstd + r, prefetch);
    }
  });
}

void norm_backward(const NormBackwardArgs& a) {
  const bool from_output = a.y != nullptr;
  Floats w = to_float(a.w, a.w_dtype, a.cols);
  Floats b = from_output ? to_float(a.b, a.w_dtype, a.cols) : Floats{};
  // The row kernel always multiplies by w (and subtracts b when from the output).
  if (w.empty()) w.assign(static_cast<size_t>(a.cols), 1.0f);
  if (b.empty()) b.assign(static_cast<size_t>(a.cols), 0.0f);
  const void* src = from_output ? a.y : a.x;
  const DType src_dtype = from_output ? a.dy_dtype : a.x_dtype;
  const int64_t src_elem = dtype_size(src_dtype);
  const int64_t dx_elem = dtype_size(a.x_dtype);
  const int64_t dy_elem = dtype_size(a.dy_dtype);
  // Fixed blocks of rows, each with its own fp64 sums of dw/db; inside a block, fp32 partials
  // over groups of kGroup rows are added into them. The result does not depend on threads.
  constexpr int64_t kGroup = 64;
  const int64_t blocks = std::max<int64_t>(1, std::min<int64_t>(a.rows, 32));
  const int64_t per_block = (a.rows + blocks - 1) / blocks;
  const size_t cols = static_cast<size_t>(a.cols);
  const size_t sum_stride = (cols + 7) / 8 * 8;  // each block's sums start on a cache line
  const bool want = a.dw != nullptr || a.db != nullptr;
  Doubles dw_sum(want ? static_cast<size_t>(blocks) * sum_stride : 0, 0.0);
  Doubles db_sum(want ? static_cast<size_t>(blocks) * sum_stride : 0, 0.0);
  at::parallel_for(0, blocks, 1, [&](int64_t begin, int64_t end) {
    const auto stride = static_cast<size_t>(norm_scratch_stride(a.cols));
    Floats scratch(6 * stride);
    NormRowBackward row{};
    row.dy_dtype = a.dy_dtype;
    row.src_dtype = src_dtype;
    row.from_output = from_output;
    row.w = w.data();
    row.b = b.data();
    row.dx_dtype = a.x_dtype;
    row.cols = a.cols;
    row.rms = a.rms;
    row.scratch = scratch.data();
    row.dw_part = scratch.data() + 4 * stride;
    row.db_part = scratch.data() + 5 * stride;
    auto flush = [&](int64_t blk) {
      if (!want) return;
      table().add_to_double(row.dw_part, dw_sum.data() + static_cast<size_t>(blk) * sum_stride,
                            a.cols);
      table().add_to_double(row.db_part, db_sum.data() + static_cast<size_t>(blk) * sum_stride,
                            a.cols);
    };
    for (int64_t blk = begin; blk < end; ++blk) {
      const int64_t r_begin = blk * per_block;
      const int64_t r_end = std::min(a.rows, (blk + 1) * per_block);
      for (int64_t r = r_begin; r < r_end; ++r) {
        if ((r - r_begin) % kGroup == 0) {
          if (r != r_begin) flush(blk);
          std::fill(row.dw_part, row.dw_part + cols, 0.0f);
          std::fill(row.db_part, row.db_part + cols, 0.0f);
        }
        row.dy = static_cast<const char*>(a.dy) + r * a.cols * dy_elem;
        row.src = static_cast<const char*>(src) + r * a.cols * src_elem;
        row.mean = a.rms || from_output ? 0.0f : a.mean[r];
        row.rstd = a.rstd[r];
        row.dx = static_cast<char*>(a.dx) + r * a.cols * dx_elem;
        table().norm_backward_row(row);
      }
      if (r_end > r_begin) flush(blk);
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
