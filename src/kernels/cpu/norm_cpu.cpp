// CPU driver of the fused norms: rows in parallel on ATen's thread pool, each row by the chunk
// kernels of the best instruction set (kernels/cpu/isa.h). Weight/bias gradients are summed per
// fixed block of rows in fp64 and the blocks combined in order: the result does not depend on
// the thread count.
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <utility>

#include "kernels/cpu/isa.h"
#include "kernels/norm.h"

namespace apex::kernels::cpu {
namespace {

const IsaTable& table() { return isa_table(); }

// An uninitialized buffer starting on a cache line: a 64-byte load from a 16-byte aligned
// malloc block straddles two lines every time (the backward's loops ran at half speed on such
// buffers in a standalone test), and nothing here needs the zeroing std::vector would do (it
// cost a memset of every scratch row and of all the fp64 block sums on each call).
template <class T>
class LineBuffer {
 public:
  LineBuffer() = default;
  explicit LineBuffer(size_t n) {  // n == 0: no buffer, data() is null
    if (n == 0) return;
    p_.reset(static_cast<T*>(std::aligned_alloc(64, (n * sizeof(T) + 63) / 64 * 64)));
    if (p_ == nullptr) throw std::bad_alloc();
  }
  T* data() const { return p_.get(); }

 private:
  struct Free {
    void operator()(T* p) const { std::free(p); }
  };
  std::unique_ptr<T, Free> p_;
};

// The affine parameters as fp32 [n]: in place when they are fp32 on a cache line (as torch's
// CPU allocator returns them), otherwise converted into a line-aligned copy once per call.
// data() is null when absent.
class FloatParams {
 public:
  FloatParams(const void* p, DType t, int64_t n) {
    if (p == nullptr) return;
    if (t == DType::kFloat32 && reinterpret_cast<uintptr_t>(p) % 64 == 0) {
      data_ = static_cast<const float*>(p);
      return;
    }
    copy_ = LineBuffer<float>(static_cast<size_t>(n));
    table().to_float(p, t, copy_.data(), n);
    data_ = copy_.data();
  }
  FloatParams(int64_t n, float fill) : copy_(static_cast<size_t>(n)), data_(copy_.data()) {
    std::fill(copy_.data(), copy_.data() + n, fill);
  }
  const float* data() const { return data_; }

 private:
  LineBuffer<float> copy_;
  const float* data_ = nullptr;
};

// Fixed blocks of backward rows, each with its own fp64 dw/db sums: at most kMaxBlocks (enough
// to balance the threads), with kMinBlockRows rows or more each, because every block costs a
// few passes over [cols] of its own (its partials and sums, and its share of the final
// combination): with always 32 blocks, 32 rows of 4096 ran 4x slower than ATen's backward, and
// blocks of 4 rows cost 8-15 % at 128 rows of 4096-8192. But at least two blocks from two rows
// on, so that a few wide rows still use two threads. A function of the rows only: the sums do
// not depend on the thread count.
constexpr int64_t kMaxBlocks = 32;
constexpr int64_t kMinBlockRows = 8;

int64_t backward_blocks(int64_t rows) {
  const int64_t by_rows = std::min((rows + kMinBlockRows - 1) / kMinBlockRows, kMaxBlocks);
  return std::max({by_rows, std::min<int64_t>(rows, 2), int64_t{1}});
}

// Elements a parallel task should have at least: waking the second thread costs about a
// microsecond, as much as a forward over ~10k elements, so smaller calls run on one thread.
constexpr int64_t kGrainElements = 16384;

int64_t grain(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

}  // namespace

void norm_forward(const NormForwardArgs& a) {
  const FloatParams w(a.w, a.w_dtype, a.cols);
  const FloatParams b(a.b, a.w_dtype, a.cols);
  // Scratch rows are used only to convert fp16 rows.
  const bool scratch = a.x_dtype == DType::kFloat16 || a.y_dtype == DType::kFloat16;
  const int64_t elem = dtype_size(a.x_dtype);
  // Prefetching the next row pays when the input streams from memory: ~10 % at 32 MB and more
  // with two threads on the development VM. Below that the input is largely in the last-level
  // cache and the burst of prefetches only got in the way (12-16 MB inputs ran 15-30 % slower).
  const bool prefetch = a.rows * a.cols * elem >= (int64_t{32} << 20);
  at::parallel_for(0, a.rows, grain(a.cols), [&](int64_t begin, int64_t end) {
    const LineBuffer<float> rows(scratch ? static_cast<size_t>(2 * norm_scratch_stride(a.cols))
                                         : 0);
    table().norm_forward_rows(a, begin, end, w.data(), b.data(), rows.data(), prefetch);
  });
}

void norm_backward(const NormBackwardArgs& a) {
  const bool from_output = a.y != nullptr;
  // The row kernel always multiplies by w (and subtracts b when from the output).
  const FloatParams w =
      a.w != nullptr ? FloatParams(a.w, a.w_dtype, a.cols) : FloatParams(a.cols, 1.0f);
  const FloatParams b = from_output && a.b != nullptr ? FloatParams(a.b, a.w_dtype, a.cols)
                                                      : FloatParams(a.cols, 0.0f);
  // Fixed blocks of rows, each with its own fp64 sums of dw/db (the row kernels add fp32
  // partials over groups of rows into them), combined in order at the end: the result does not
  // depend on the thread count.
  const int64_t blocks = backward_blocks(a.rows);
  const int64_t per_block = (a.rows + blocks - 1) / blocks;
  const int64_t used = (a.rows + per_block - 1) / per_block;  // blocks with rows (<= blocks)
  const int64_t cols = a.cols;
  const int64_t sum_stride = (cols + 7) / 8 * 8;  // each block's sums start on a cache line
  const bool want = a.dw != nullptr || a.db != nullptr;
  // Written by each block's first group (not added to), so left uninitialized here.
  const LineBuffer<double> dw_sum(want ? static_cast<size_t>(used * sum_stride) : 0);
  const LineBuffer<double> db_sum(want ? static_cast<size_t>(used * sum_stride) : 0);
  at::parallel_for(0, used, grain(per_block * cols), [&](int64_t begin, int64_t end) {
    const LineBuffer<float> scratch(5 * static_cast<size_t>(norm_scratch_stride(cols)));
    for (int64_t blk = begin; blk < end; ++blk) {
      NormBackwardBlock block;
      block.begin = blk * per_block;
      block.end = std::min(a.rows, (blk + 1) * per_block);
      block.w = w.data();
      block.b = b.data();
      block.scratch = scratch.data();
      block.dw_sum = want ? dw_sum.data() + blk * sum_stride : nullptr;
      block.db_sum = want ? db_sum.data() + blk * sum_stride : nullptr;
      table().norm_backward_block(a, block);
    }
  });
  if (!want) return;
  // The blocks' sums in block order, per column (contiguous along the columns), rounded once
  // to fp32 and written in the parameters' dtype.
  const int64_t elem = dtype_size(a.dwb_dtype);
  at::parallel_for(0, cols, 4096, [&](int64_t c0, int64_t c1) {
    for (int64_t blk = 1; blk < used; ++blk) {
      for (int64_t c = c0; c < c1; ++c) {
        dw_sum.data()[c] += dw_sum.data()[blk * sum_stride + c];
        db_sum.data()[c] += db_sum.data()[blk * sum_stride + c];
      }
    }
    float tile[256];
    for (int64_t t0 = c0; t0 < c1; t0 += 256) {
      const int64_t n = std::min<int64_t>(256, c1 - t0);
      for (auto [sum, out] : {std::pair{dw_sum.data(), a.dw}, std::pair{db_sum.data(), a.db}}) {
        if (out == nullptr) continue;
        for (int64_t i = 0; i < n; ++i) tile[i] = static_cast<float>(sum[t0 + i]);
        table().from_float(tile, a.dwb_dtype, static_cast<char*>(out) + t0 * elem, n);
      }
    }
  });
}

}  // namespace apex::kernels::cpu
