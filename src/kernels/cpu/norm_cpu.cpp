// CPU driver of the fused norms: rows in parallel on ATen's thread pool, each row by the chunk
// kernels of the best instruction set (kernels/cpu/isa.h). Weight/bias gradients are summed per
// fixed block of rows in fp64 and the blocks combined in order: the result does not depend on
// the thread count.

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <new>
#include <utility>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/parallel.h"
#include "kernels/norm.h"

namespace apex::kernels::cpu {
namespace {

const MultiTensorKernels& convert() { return *cpu_kernels().multi_tensor; }
const NormKernels& table() { return *cpu_kernels().norm; }

// Uninitialized bytes starting on a cache line: a 64-byte load from a 16-byte aligned malloc
// block straddles two lines every time (the backward's loops ran at half speed on such buffers
// in a standalone test), and nothing here needs the zeroing std::vector would do (it cost a
// memset of every scratch row and of all the fp64 block sums on each call).
class LineBuffer {
 public:
  LineBuffer() = default;
  explicit LineBuffer(size_t bytes)
      : p_(static_cast<char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64))) {
    if (p_ == nullptr) throw std::bad_alloc();
  }
  char* data() const { return p_.get(); }

 private:
  struct Free {
    void operator()(char* p) const { std::free(p); }
  };
  std::unique_ptr<char, Free> p_;
};

// Work memory of a call, kept by each thread between calls and grown when a call needs more.
// One allocation per call and buffer had cost up to twice a small norm's time in a fragmented
// heap (apex-bench norm, 8x8192 bf16 forward: 20 us against 11 us, depending on which shapes
// ran before), and it is always the same few sizes in a training loop. Buffers over kKeepBytes
// (rows of ~100k columns and more) are released once the call is done with them
// (release_large_workspace), so that one huge call does not pin its memory for the thread's life.
enum class Slot { kWeight, kWeightDiv, kBias, kRows, kWeightSums, kBiasSums, kCount };
constexpr size_t kKeepBytes = size_t{8} << 20;

struct WorkBuffers {
  std::array<LineBuffer, static_cast<size_t>(Slot::kCount)> buf;
  std::array<size_t, static_cast<size_t>(Slot::kCount)> bytes{};
};

WorkBuffers& work_buffers() {
  thread_local WorkBuffers t;
  return t;
}

template <class T>
T* workspace(Slot slot, int64_t n) {
  WorkBuffers& t = work_buffers();
  const auto i = static_cast<size_t>(slot);
  const size_t bytes = static_cast<size_t>(n) * sizeof(T);
  if (t.bytes[i] < bytes) {
    t.buf[i] = LineBuffer(bytes);
    t.bytes[i] = bytes;
  }
  return reinterpret_cast<T*>(t.buf[i].data());
}

// Releases this thread's buffers over kKeepBytes: a task's scratch rows at the end of the task
// (only those: the calling thread runs a task too, while its other buffers are still in use by
// the other threads), everything at the end of the call.
void release_large_workspace(bool rows_only) {
  WorkBuffers& t = work_buffers();
  for (size_t i = 0; i < t.buf.size(); ++i) {
    if ((!rows_only || i == static_cast<size_t>(Slot::kRows)) && t.bytes[i] > kKeepBytes) {
      t.buf[i] = LineBuffer();
      t.bytes[i] = 0;
    }
  }
}

struct ReleaseAtEnd {
  ReleaseAtEnd() = default;
  ReleaseAtEnd(const ReleaseAtEnd&) = delete;
  ReleaseAtEnd& operator=(const ReleaseAtEnd&) = delete;
  ~ReleaseAtEnd() { release_large_workspace(false); }
};

// The affine parameters as fp32 [n] (null when absent): in place when they are fp32 on a cache
// line (as torch's CPU allocator returns them), otherwise converted into the calling thread's
// workspace.
const float* float_params(const void* p, DType t, int64_t n, Slot slot) {
  if (p == nullptr) return nullptr;
  if (t == DType::kFloat32 && reinterpret_cast<uintptr_t>(p) % 64 == 0) {
    return static_cast<const float*>(p);
  }
  float* out = workspace<float>(slot, n);
  convert().to_float(p, t, out, n);
  return out;
}

const float* filled(int64_t n, float v, Slot slot) {
  float* out = workspace<float>(slot, n);
  std::fill(out, out + n, v);
  return out;
}

// Elements a parallel task should have at least: waking the second thread costs about a
// microsecond, as much as a forward over ~10k elements, so smaller calls run on one thread.
constexpr int64_t kGrainElements = 16384;

// Fixed blocks of backward rows, each with its own fp64 dw/db sums: at most kMaxBlocks (enough
// to balance the threads), with kMinBlockRows rows and kMinBlockElements elements or more each,
// because every block costs a few passes over [cols] of its own (its partials and sums, and its
// share of the final combination): 16 blocks of 8 rows made 128 x 768 spend a fifth of its
// backward there. But two blocks from two rows on once the call is large enough for two
// threads, so that a few wide rows still use both. A function of the shape only: the sums do
// not depend on the thread count.
constexpr int64_t kMaxBlocks = 32;
constexpr int64_t kMinBlockRows = 8;
constexpr int64_t kMinBlockElements = 16384;

int64_t backward_blocks(int64_t rows, int64_t cols) {
  const int64_t min_rows = std::max(kMinBlockRows, (kMinBlockElements + cols - 1) / cols);
  const int64_t by_rows = std::min((rows + min_rows - 1) / min_rows, kMaxBlocks);
  const int64_t pair = rows * cols >= 2 * kGrainElements ? std::min<int64_t>(rows, 2) : 1;
  return std::max({by_rows, pair, int64_t{1}});
}

int64_t grain(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

}  // namespace

void norm_forward(const NormForwardArgs& a) {
  if (a.rows <= 0 || a.cols <= 0) return;
  const ReleaseAtEnd release;
  // bf16 parameters of a bf16 norm are read in place (widened per row) by wide rows streaming
  // from memory, instead of converted to fp32 once per call. The fp32 copies are read at 4 bytes
  // per element while y is written at 2, so their loads keep meeting y's stores in flight at the
  // same address modulo 4 KB (4K aliasing), wherever either lies; bf16 parameters advance with y.
  // From cache the widening costs more than it saves, except on the AVX2 kernels, which widen
  // with one instruction per register (table().bf16_unpacked). Figures: docs/perf-notes.md.
  const bool in_place =
      a.w_dtype == DType::kBFloat16 && a.x_dtype == DType::kBFloat16 &&
      a.y_dtype == DType::kBFloat16 &&
      (table().bf16_unpacked || (a.cols >= 2048 && a.rows * a.cols * 2 >= (int64_t{16} << 20)));
  const DType wb = in_place ? DType::kBFloat16 : DType::kFloat32;
  const void* w = in_place ? a.w : float_params(a.w, a.w_dtype, a.cols, Slot::kWeight);
  const void* b = in_place ? a.b : float_params(a.b, a.w_dtype, a.cols, Slot::kBias);
  // Scratch rows are used only to convert fp16 rows.
  const bool scratch = a.x_dtype == DType::kFloat16 || a.y_dtype == DType::kFloat16;
  parallel_for(0, a.rows, grain(a.cols), [&](int64_t begin, int64_t end) {
    float* rows =
        scratch ? workspace<float>(Slot::kRows, 2 * norm_scratch_stride(a.cols)) : nullptr;
    table().forward_rows(a, begin, end, w, b, wb, rows);
    release_large_workspace(/*rows_only=*/true);
  });
}

void norm_backward(const NormBackwardArgs& a) {
  if (a.rows <= 0 || a.cols <= 0) {
    // Nothing to normalize: the weight/bias gradients of no rows are zeros.
    if (a.cols > 0) {
      const ReleaseAtEnd release;
      const float* zeros = filled(a.cols, 0.0f, Slot::kWeight);
      if (a.dw != nullptr) convert().from_float(zeros, a.dwb_dtype, a.dw, a.cols);
      if (a.db != nullptr) convert().from_float(zeros, a.dwb_dtype, a.db, a.cols);
    }
    return;
  }
  const bool want = a.dw != nullptr || a.db != nullptr;
  if (a.dx == nullptr && !want) return;
  const ReleaseAtEnd release;
  const bool from_output = a.y != nullptr;
  // The row kernel always multiplies by w; it reads b only to recompute x_hat from the output.
  const float* w = a.w != nullptr ? float_params(a.w, a.w_dtype, a.cols, Slot::kWeight)
                                  : filled(a.cols, 1.0f, Slot::kWeight);
  const float* b = !from_output     ? nullptr
                   : a.b != nullptr ? float_params(a.b, a.w_dtype, a.cols, Slot::kBias)
                                    : filled(a.cols, 0.0f, Slot::kBias);
  // From the output, x_hat = (y - b) / w with w clamped by magnitude to at least eps, as apex
  // does: where w is 0, y - b is 0 and x_hat 0 (so that weight gets no gradient), instead of
  // 0/0 = NaN in every row's dx. Without a weight nothing is divided.
  const float* wd = w;
  if (from_output && a.w != nullptr) {
    float* c = workspace<float>(Slot::kWeightDiv, a.cols);
    for (int64_t i = 0; i < a.cols; ++i) c[i] = weight_divisor(w[i], a.eps);
    wd = c;
  }
  // Fixed blocks of rows, each with its own fp64 sums of dw/db (the row kernels add fp32
  // partials over groups of rows into them), combined in order at the end: the result does not
  // depend on the thread count.
  const int64_t blocks = backward_blocks(a.rows, a.cols);
  const int64_t per_block = (a.rows + blocks - 1) / blocks;
  const int64_t used = (a.rows + per_block - 1) / per_block;  // blocks with rows (<= blocks)
  const int64_t cols = a.cols;
  const int64_t sum_stride = (cols + 7) / 8 * 8;  // each block's sums start on a cache line
  // Written by each block's first group (not added to), so not cleared here.
  // Only the sums wanted (the row kernels skip the partials of the others).
  double* const dw_sum =
      a.dw != nullptr ? workspace<double>(Slot::kWeightSums, used * sum_stride) : nullptr;
  double* const db_sum =
      a.db != nullptr ? workspace<double>(Slot::kBiasSums, used * sum_stride) : nullptr;
  parallel_for(0, used, grain(per_block * cols), [&](int64_t begin, int64_t end) {
    float* const scratch = workspace<float>(Slot::kRows, 5 * norm_scratch_stride(cols) + 1024);
    for (int64_t blk = begin; blk < end; ++blk) {
      NormBackwardBlock block;
      block.begin = blk * per_block;
      block.end = std::min(a.rows, (blk + 1) * per_block);
      block.w = w;
      block.wd = wd;
      block.b = b;
      block.scratch = scratch;
      block.dw_sum = dw_sum != nullptr ? dw_sum + blk * sum_stride : nullptr;
      block.db_sum = db_sum != nullptr ? db_sum + blk * sum_stride : nullptr;
      table().backward_block(a, block);
    }
    release_large_workspace(/*rows_only=*/true);
  });
  if (!want) return;
  // The blocks' sums in block order, per column (contiguous along the columns), rounded once
  // to fp32 and written in the parameters' dtype. Split by columns once there are a few thousand
  // sums to add (32 x 4096 spent a tenth of its backward here on one thread while the other
  // waited). Each column's sums are added in block order whatever the split.
  const int64_t elem = dtype_size(a.dwb_dtype);
  const int64_t combine_grain = std::max<int64_t>(256, kGrainElements / (2 * used) / 256 * 256);
  parallel_for(0, cols, combine_grain, [&](int64_t c0, int64_t c1) {
    for (double* const sum : {dw_sum, db_sum}) {
      if (sum == nullptr) continue;
      // Block 0's sums and a later block's never overlap (restrict: the loop vectorizes).
      double* __restrict to = sum;
      for (int64_t blk = 1; blk < used; ++blk) {
        const double* __restrict from = sum + blk * sum_stride;
        for (int64_t c = c0; c < c1; ++c) to[c] += from[c];
      }
    }
    float tile[256];
    for (int64_t t0 = c0; t0 < c1; t0 += 256) {
      const int64_t n = std::min<int64_t>(256, c1 - t0);
      for (auto [sum, out] : {std::pair{dw_sum, a.dw}, std::pair{db_sum, a.db}}) {
        if (out == nullptr) continue;
        for (int64_t i = 0; i < n; ++i) tile[i] = static_cast<float>(sum[t0 + i]);
        convert().from_float(tile, a.dwb_dtype, static_cast<char*>(out) + t0 * elem, n);
      }
    }
  });
}

}  // namespace apex::kernels::cpu
