// CUDA backend of the fused LayerNorm / RMSNorm declared in kernels/norm.h. Math and statistics
// are fp32 whatever the storage dtypes.
//
// Rows of up to 16384 elements (8192 in the backward) are held in registers: a "team" of W warps
// (W = 1..32, a power of two) owns one row, each thread kN vectors of V elements (V = 16 bytes of
// x when every pointer is aligned and cols % V == 0, else 1), so x is read once. The forward
// takes the row mean and then the centered sum of squares from the registers (two passes over
// registers, no cancellation). Longer rows go to a block-per-row fallback that streams the row
// twice (Welford/Chan statistics, then the output).
//
// dw/db are deterministic: the backward runs a fixed number of blocks, each over a fixed range
// of rows; a thread accumulates its columns over the rows of its team in registers, the teams of
// a block are summed in team order into one fp32 partial row per block (scratch memory from
// cudaMallocAsync on the stream), and a second kernel sums the partial rows in block order.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <type_traits>

#include "kernels/cuda/common.cuh"
#include "kernels/norm.h"

namespace apex::kernels::cuda {
namespace {

using detail::kWarpSize;
using detail::TypeTag;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

/// Most elements a thread keeps per row and per array in the register kernels.
inline constexpr int kMaxRegElems = 16;
/// Threads per block of the fallback kernels (one row per block at a time).
inline constexpr int kBigThreads = 512;
/// Threads per block of the kernel that sums the dw/db partial rows: 32 columns x 8 slices.
inline constexpr int kReduceCols = 32;
inline constexpr int kReduceSlices = 8;

// ---------------------------------------------------------------------------------------------
// Typed vector accesses
// ---------------------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(N * sizeof(T)) Vec {
  T v[N];
};

/// Elements of T per access of at most 16 bytes when V elements are moved.
template <typename T, int V>
inline constexpr int kPackElems = (V * sizeof(T) <= 16) ? V : static_cast<int>(16 / sizeof(T));

/// r[0..V) = p[0..V) as float; p is aligned to min(16, V * sizeof(T)) bytes.
template <typename T, int V>
__device__ __forceinline__ void load_vec(float (&r)[V], const T* p) {
  constexpr int kP = kPackElems<T, V>;
#pragma unroll
  for (int a = 0; a < V / kP; ++a) {
    const Vec<T, kP> pack = reinterpret_cast<const Vec<T, kP>*>(p)[a];
#pragma unroll
    for (int i = 0; i < kP; ++i) r[a * kP + i] = detail::to_float(pack.v[i]);
  }
}

template <typename T, int V>
__device__ __forceinline__ void store_vec(T* p, const float (&r)[V]) {
  constexpr int kP = kPackElems<T, V>;
#pragma unroll
  for (int a = 0; a < V / kP; ++a) {
    Vec<T, kP> pack;
#pragma unroll
    for (int i = 0; i < kP; ++i) pack.v[i] = detail::from_float<T>(r[a * kP + i]);
    reinterpret_cast<Vec<T, kP>*>(p)[a] = pack;
  }
}

/// Calls f(TypeTag<T>{}) with the storage type of `dtype` (device side; dtype is uniform).
template <class F>
__device__ __forceinline__ void dtype_switch(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(TypeTag<float>{});
      return;
    case DType::kFloat16:
      f(TypeTag<__half>{});
      return;
    default:
      f(TypeTag<__nv_bfloat16>{});
      return;
  }
}

// ---------------------------------------------------------------------------------------------
// Register rows: slot k of team thread j holds elements [(k * team_threads + j) * V, +V)
// ---------------------------------------------------------------------------------------------

/// Where a thread sits: its team of W warps (one row) and its index j in the team.
struct Team {
  int warps;    ///< W
  int threads;  ///< W * 32
  int index;    ///< team in the block
  int count;    ///< teams per block
  int j;        ///< thread in the team
  int warp;     ///< warp in the block
  int lane;

  template <int kThreads>
  __device__ __forceinline__ static Team make(int warps) {
    Team t;
    t.warps = warps;
    t.threads = warps * kWarpSize;
    t.count = kThreads / t.threads;
    t.warp = static_cast<int>(threadIdx.x) / kWarpSize;
    t.lane = static_cast<int>(threadIdx.x) % kWarpSize;
    t.index = t.warp / warps;
    t.j = static_cast<int>(threadIdx.x) % t.threads;
    return t;
  }
  __device__ __forceinline__ int col(int k, int v) const { return (k * threads + j) * v; }
};

/// Loads the live slots of a row (row starts at base) into r; dead slots read as 0.
template <typename T, int V, int kN>
__device__ __forceinline__ void load_row(float (&r)[kN][V], const T* base, const Team& t, int cols,
                                         bool live) {
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const int c = t.col(k, V);
    if (live && c < cols) {
      load_vec<T, V>(r[k], base + c);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) r[k][i] = 0.0f;
    }
  }
}

/// load_row for a pointer whose dtype is known at run time; `offset` is in elements.
template <int V, int kN>
__device__ __forceinline__ void load_row_any(float (&r)[kN][V], const void* p, DType dtype,
                                             int64_t offset, const Team& t, int cols, bool live) {
  dtype_switch(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    load_row<T, V, kN>(r, static_cast<const T*>(p) + offset, t, cols, live);
  });
}

template <typename T, int V, int kN>
__device__ __forceinline__ void store_row(T* base, const float (&r)[kN][V], const Team& t,
                                          int cols) {
#pragma unroll
  for (int k = 0; k < kN; ++k) {
    const int c = t.col(k, V);
    if (c < cols) store_vec<T, V>(base + c, r[k]);
  }
}

template <int kN, int V>
__device__ __forceinline__ void fill(float (&r)[kN][V], float value) {
#pragma unroll
  for (int k = 0; k < kN; ++k) {
#pragma unroll
    for (int i = 0; i < V; ++i) r[k][i] = value;
  }
}

/// Sums v[0..N) over the threads of the calling thread's team; every thread of the team gets the
/// same totals (butterfly in the warp, then the warps' results added in warp order). Every thread
/// of the block calls it the same number of times; `buf` alternates between calls so that one
/// __syncthreads per call is enough.
template <int N, int kWarps>
__device__ __forceinline__ void team_sum(float (&v)[N], float (&buf)[2][kWarps][N], int& phase,
                                         const Team& t) {
#pragma unroll
  for (int n = 0; n < N; ++n) v[n] = detail::warp_reduce(v[n], detail::SumOp{});
  if (t.warps == 1) return;
  float(&b)[kWarps][N] = buf[phase & 1];
  ++phase;
  if (t.lane == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) b[t.warp][n] = v[n];
  }
  __syncthreads();
  const int first = t.index * t.warps;
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float s = 0.0f;
    for (int w = 0; w < t.warps; ++w) s += b[first + w][n];
    v[n] = s;
  }
}

// ---------------------------------------------------------------------------------------------
// Forward
// ---------------------------------------------------------------------------------------------

struct FwdParams {
  int64_t rows;
  int64_t cols;
  float eps;
  bool rms;
  int warps_per_row;
  DType y_dtype;
  DType w_dtype;
  const void* x;
  const void* w;
  const void* b;
  void* y;
  float* mean;
  float* rstd;
};

template <typename Tx, int V, int kN, int kThreads>
__global__ void __launch_bounds__(kThreads) norm_fwd_reg_kernel(const FwdParams p) {
  constexpr int kWarps = kThreads / kWarpSize;
  __shared__ float red[2][kWarps][1];
  const Team t = Team::make<kThreads>(p.warps_per_row);
  const int cols = static_cast<int>(p.cols);
  const float inv_n = 1.0f / static_cast<float>(cols);
  int phase = 0;
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * t.count; first < p.rows;
       first += static_cast<int64_t>(gridDim.x) * t.count) {
    const int64_t row = first + t.index;
    const bool live = row < p.rows;
    const int64_t offset = (live ? row : 0) * p.cols;
    float x[kN][V];
    load_row<Tx, V, kN>(x, static_cast<const Tx*>(p.x) + offset, t, cols, live);

    float mean = 0.0f;
    if (!p.rms) {
      float s[1] = {0.0f};
#pragma unroll
      for (int k = 0; k < kN; ++k) {
#pragma unroll
        for (int i = 0; i < V; ++i) s[0] += x[k][i];
      }
      team_sum(s, red, phase, t);
      mean = s[0] * inv_n;
    }
    float q[1] = {0.0f};
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      if (t.col(k, V) < cols) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          const float d = x[k][i] - mean;
          q[0] += d * d;
        }
      }
    }
    team_sum(q, red, phase, t);
    const float rstd = 1.0f / sqrtf(q[0] * inv_n + p.eps);
    if (!live) continue;
    if (t.j == 0) {
      if (!p.rms && p.mean != nullptr) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }

#pragma unroll
    for (int k = 0; k < kN; ++k) {
#pragma unroll
      for (int i = 0; i < V; ++i) x[k][i] = (x[k][i] - mean) * rstd;
    }
    if (p.w != nullptr) {
      float w[kN][V];
      load_row_any(w, p.w, p.w_dtype, 0, t, cols, true);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
#pragma unroll
        for (int i = 0; i < V; ++i) x[k][i] *= w[k][i];
      }
    }
    if (p.b != nullptr) {
      float b[kN][V];
      load_row_any(b, p.b, p.w_dtype, 0, t, cols, true);
#pragma unroll
      for (int k = 0; k < kN; ++k) {
#pragma unroll
        for (int i = 0; i < V; ++i) x[k][i] += b[k][i];
      }
    }
    dtype_switch(p.y_dtype, [&](auto tag) {
      using Ty = typename decltype(tag)::type;
      store_row<Ty, V, kN>(static_cast<Ty*>(p.y) + offset, x, t, cols);
    });
  }
}

/// Count, mean and centered sum of squares of a set of values (Welford / Chan). For RMSNorm only
/// m2 is used, as the plain sum of squares.
struct Stat {
  float n;
  float m;
  float m2;
};

/// Merges b into a. Callers pass the operands in a fixed order, so results are reproducible.
__device__ __forceinline__ Stat merge(const Stat& a, const Stat& b, bool rms) {
  if (rms) return Stat{a.n + b.n, 0.0f, a.m2 + b.m2};
  const float n = a.n + b.n;
  if (n == 0.0f) return a;
  const float delta = b.m - a.m;
  const float f = __fdividef(b.n, n);  // a weight: the fast division is accurate enough
  return Stat{n, a.m + delta * f, a.m2 + b.m2 + delta * delta * a.n * f};
}

/// Statistics of one row over the whole block; every thread gets the same result.
template <int kThreads>
__device__ __forceinline__ Stat block_stat(Stat s, bool rms, Stat (&buf)[2][kThreads / kWarpSize],
                                           int& phase) {
  constexpr int kWarps = kThreads / kWarpSize;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const Stat o{__shfl_xor_sync(0xffffffffu, s.n, offset),
                 __shfl_xor_sync(0xffffffffu, s.m, offset),
                 __shfl_xor_sync(0xffffffffu, s.m2, offset)};
    // Both partners evaluate merge(lower lane, higher lane): the warp ends with one value.
    s = (lane & offset) != 0 ? merge(o, s, rms) : merge(s, o, rms);
  }
  Stat(&b)[kWarps] = buf[phase & 1];
  ++phase;
  if (lane == 0) b[warp] = s;
  __syncthreads();
  Stat r = b[0];
  for (int w = 1; w < kWarps; ++w) r = merge(r, b[w], rms);
  return r;
}

/// Fallback forward: one row per block at a time, statistics in a first pass over the row and the
/// output in a second.
template <typename Tx, typename Ty, typename Tw, int V>
__device__ __forceinline__ void fwd_big_rows(const FwdParams& p) {
  constexpr int kWarps = kBigThreads / kWarpSize;
  __shared__ Stat buf[2][kWarps];
  const int64_t vecs = p.cols / V;
  const int64_t tid = threadIdx.x;
  int phase = 0;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t offset = row * p.cols;
    const Tx* x = static_cast<const Tx*>(p.x) + offset;
    Stat s{0.0f, 0.0f, 0.0f};
    for (int64_t v = tid; v < vecs; v += kBigThreads) {
      float r[V];
      load_vec<Tx, V>(r, x + v * V);
      Stat l{static_cast<float>(V), 0.0f, 0.0f};
      if (!p.rms) {
#pragma unroll
        for (int i = 0; i < V; ++i) l.m += r[i];
        l.m *= 1.0f / static_cast<float>(V);
      }
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float d = r[i] - l.m;
        l.m2 += d * d;
      }
      s = merge(s, l, p.rms);
    }
    s = block_stat<kBigThreads>(s, p.rms, buf, phase);
    const float mean = p.rms ? 0.0f : s.m;
    const float rstd = 1.0f / sqrtf(s.m2 / static_cast<float>(p.cols) + p.eps);
    if (tid == 0) {
      if (!p.rms && p.mean != nullptr) p.mean[row] = mean;
      p.rstd[row] = rstd;
    }
    const Tw* w = static_cast<const Tw*>(p.w);
    const Tw* b = static_cast<const Tw*>(p.b);
    Ty* y = static_cast<Ty*>(p.y) + offset;
    for (int64_t v = tid; v < vecs; v += kBigThreads) {
      float r[V];
      load_vec<Tx, V>(r, x + v * V);
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = (r[i] - mean) * rstd;
      if (w != nullptr) {
        float wr[V];
        load_vec<Tw, V>(wr, w + v * V);
#pragma unroll
        for (int i = 0; i < V; ++i) r[i] *= wr[i];
      }
      if (b != nullptr) {
        float br[V];
        load_vec<Tw, V>(br, b + v * V);
#pragma unroll
        for (int i = 0; i < V; ++i) r[i] += br[i];
      }
      store_vec<Ty, V>(y + v * V, r);
    }
  }
}

template <typename Tx, int V>
__global__ void __launch_bounds__(kBigThreads) norm_fwd_big_kernel(const FwdParams p) {
  dtype_switch(p.y_dtype, [&](auto ty) {
    dtype_switch(p.w_dtype, [&](auto tw) {
      fwd_big_rows<Tx, typename decltype(ty)::type, typename decltype(tw)::type, V>(p);
    });
  });
}

// ---------------------------------------------------------------------------------------------
// Backward
// ---------------------------------------------------------------------------------------------

struct BwdParams {
  int64_t rows;
  int64_t cols;
  bool rms;
  int warps_per_row;
  int64_t per_block;  ///< row groups (register kernel) or rows (fallback) per block
  DType dy_dtype;
  DType w_dtype;
  const void* dy;
  const void* x;  ///< null: memory-efficient mode, x_hat from y
  const void* y;
  const void* w;
  const void* b;
  const float* mean;
  const float* rstd;
  void* dx;
  float* part_w;  ///< [gridDim.x][cols] or null
  float* part_b;
  float eps;  ///< memory-efficient: w is clamped by magnitude to at least eps
};

/// x_hat from x (or, memory-efficient, from y, b and w) and g = dy * w for one value; dy is
/// replaced by g.
struct BwdMath {
  bool from_y;
  bool has_w;
  bool has_b;
  float mean;
  float rstd;
  float eps;

  __device__ __forceinline__ float x_hat(float xy, float w, float b) const {
    if (!from_y) return (xy - mean) * rstd;
    const float centered = has_b ? xy - b : xy;
    return has_w ? centered / weight_divisor(w, eps) : centered;
  }
};

template <typename Tx, int V, int kN, int kThreads>
__global__ void __launch_bounds__(kThreads) norm_bwd_reg_kernel(const BwdParams p) {
  constexpr int kWarps = kThreads / kWarpSize;
  // Per-team transfer of the dw/db accumulators when several teams share the block. The host
  // uses blocks of more than 256 threads only for one team per block.
  constexpr int kTransfer = kThreads <= 256 ? kThreads / 2 * kN * V * 2 : 1;
  __shared__ float red[2][kWarps][2];
  __shared__ float transfer[kTransfer];
  const Team t = Team::make<kThreads>(p.warps_per_row);
  const int cols = static_cast<int>(p.cols);
  const float inv_n = 1.0f / static_cast<float>(cols);
  const bool from_y = p.x == nullptr;
  const bool want_w = p.part_w != nullptr;
  const bool want_b = p.part_b != nullptr;
  float acc_w[kN][V];
  float acc_b[kN][V];
  fill(acc_w, 0.0f);
  fill(acc_b, 0.0f);
  const int64_t groups = (p.rows + t.count - 1) / t.count;
  const int64_t g_begin = static_cast<int64_t>(blockIdx.x) * p.per_block;
  const int64_t g_end = g_begin + p.per_block < groups ? g_begin + p.per_block : groups;
  int phase = 0;
  for (int64_t g = g_begin; g < g_end; ++g) {
    const int64_t row = g * t.count + t.index;
    const bool live = row < p.rows;
    const int64_t offset = (live ? row : 0) * p.cols;
    float xh[kN][V];
    float d[kN][V];
    float w[kN][V];
    float b[kN][V];
    if (from_y) {
      load_row_any(xh, p.y, p.dy_dtype, offset, t, cols, live);
    } else {
      load_row<Tx, V, kN>(xh, static_cast<const Tx*>(p.x) + offset, t, cols, live);
    }
    load_row_any(d, p.dy, p.dy_dtype, offset, t, cols, live);
    if (p.w != nullptr) {
      load_row_any(w, p.w, p.w_dtype, 0, t, cols, live);
    } else {
      fill(w, 1.0f);
    }
    if (from_y && p.b != nullptr) {
      load_row_any(b, p.b, p.w_dtype, 0, t, cols, live);
    } else {
      fill(b, 0.0f);
    }
    BwdMath m{from_y, p.w != nullptr, p.b != nullptr, 0.0f, 0.0f, p.eps};
    if (live) {
      m.rstd = p.rstd[row];
      if (!from_y && !p.rms) m.mean = p.mean[row];
    }

    float s[2] = {0.0f, 0.0f};  // sum of g, sum of g * x_hat
#pragma unroll
    for (int k = 0; k < kN; ++k) {
      if (!live || t.col(k, V) >= cols) continue;  // slot stays 0
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float wi = w[k][i];
        xh[k][i] = m.x_hat(xh[k][i], wi, b[k][i]);
        if (want_w) acc_w[k][i] += d[k][i] * xh[k][i];
        if (want_b) acc_b[k][i] += d[k][i];
        d[k][i] *= wi;
        s[0] += d[k][i];
        s[1] += d[k][i] * xh[k][i];
      }
    }
    team_sum(s, red, phase, t);
    if (!live) continue;
    const float c_x = s[1] * inv_n;
    const float c_0 = p.rms ? 0.0f : s[0] * inv_n;
#pragma unroll
    for (int k = 0; k < kN; ++k) {
#pragma unroll
      for (int i = 0; i < V; ++i) d[k][i] = m.rstd * (d[k][i] - c_0 - xh[k][i] * c_x);
    }
    store_row<Tx, V, kN>(static_cast<Tx*>(p.dx) + offset, d, t, cols);
  }

  if (!want_w && !want_b) return;
  // Teams 1, 2, ... add their accumulators to team 0's in that order, through shared memory.
  const int slots = t.threads * kN * V;
  for (int src = 1; src < t.count; ++src) {
    if (t.index == src) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          transfer[(k * V + i) * t.threads + t.j] = acc_w[k][i];
          transfer[slots + (k * V + i) * t.threads + t.j] = acc_b[k][i];
        }
      }
    }
    __syncthreads();
    if (t.index == 0) {
#pragma unroll
      for (int k = 0; k < kN; ++k) {
#pragma unroll
        for (int i = 0; i < V; ++i) {
          acc_w[k][i] += transfer[(k * V + i) * t.threads + t.j];
          acc_b[k][i] += transfer[slots + (k * V + i) * t.threads + t.j];
        }
      }
    }
    __syncthreads();
  }
  if (t.index != 0) return;
  const int64_t part = static_cast<int64_t>(blockIdx.x) * p.cols;
  if (want_w) store_row<float, V, kN>(p.part_w + part, acc_w, t, cols);
  if (want_b) store_row<float, V, kN>(p.part_b + part, acc_b, t, cols);
}

/// Fallback backward: one row at a time per block over the block's fixed range of rows; the
/// sums of the row in a first pass, dx and the block's dw/db partial row (owned column by column
/// by one thread, so plain read-modify-write) in a second.
template <typename Tx, typename Tdy, typename Tw, int V>
__device__ __forceinline__ void bwd_big_rows(const BwdParams& p) {
  constexpr int kWarps = kBigThreads / kWarpSize;
  __shared__ float red[2][kWarps][2];
  const Team t = Team::make<kBigThreads>(kWarps);
  const int64_t vecs = p.cols / V;
  const int64_t tid = threadIdx.x;
  const float inv_n = 1.0f / static_cast<float>(p.cols);
  const bool from_y = p.x == nullptr;
  const Tw* wp = static_cast<const Tw*>(p.w);
  const Tw* bp = static_cast<const Tw*>(p.b);
  const int64_t r_begin = static_cast<int64_t>(blockIdx.x) * p.per_block;
  const int64_t r_end = r_begin + p.per_block < p.rows ? r_begin + p.per_block : p.rows;
  float* part_w = p.part_w == nullptr ? nullptr : p.part_w + blockIdx.x * p.cols;
  float* part_b = p.part_b == nullptr ? nullptr : p.part_b + blockIdx.x * p.cols;
  int phase = 0;

  // Loads vector v of the row: x_hat into xh, dy into d, w (or 1) into w.
  const auto load = [&](int64_t offset, const BwdMath& m, int64_t v, float(&xh)[V], float(&d)[V],
                        float(&w)[V]) {
    if (from_y) {
      load_vec<Tdy, V>(xh, static_cast<const Tdy*>(p.y) + offset + v * V);
    } else {
      load_vec<Tx, V>(xh, static_cast<const Tx*>(p.x) + offset + v * V);
    }
    load_vec<Tdy, V>(d, static_cast<const Tdy*>(p.dy) + offset + v * V);
    float b[V] = {};
    if (wp != nullptr) {
      load_vec<Tw, V>(w, wp + v * V);
    } else {
#pragma unroll
      for (int i = 0; i < V; ++i) w[i] = 1.0f;
    }
    if (from_y && bp != nullptr) load_vec<Tw, V>(b, bp + v * V);
#pragma unroll
    for (int i = 0; i < V; ++i) xh[i] = m.x_hat(xh[i], w[i], b[i]);
  };

  for (int64_t row = r_begin; row < r_end; ++row) {
    const int64_t offset = row * p.cols;
    BwdMath m{from_y, wp != nullptr, bp != nullptr, 0.0f, p.rstd[row], p.eps};
    if (!from_y && !p.rms) m.mean = p.mean[row];
    float s[2] = {0.0f, 0.0f};
    for (int64_t v = tid; v < vecs; v += kBigThreads) {
      float xh[V], d[V], w[V];
      load(offset, m, v, xh, d, w);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float g = d[i] * w[i];
        s[0] += g;
        s[1] += g * xh[i];
      }
    }
    team_sum(s, red, phase, t);
    const float c_x = s[1] * inv_n;
    const float c_0 = p.rms ? 0.0f : s[0] * inv_n;
    const bool first = row == r_begin;
    Tx* dx = static_cast<Tx*>(p.dx) + offset;
    for (int64_t v = tid; v < vecs; v += kBigThreads) {
      float xh[V], d[V], w[V], r[V];
      load(offset, m, v, xh, d, w);
#pragma unroll
      for (int i = 0; i < V; ++i) r[i] = m.rstd * (d[i] * w[i] - c_0 - xh[i] * c_x);
      store_vec<Tx, V>(dx + v * V, r);
      if (part_w != nullptr) {
        float a[V];
        if (first) {
#pragma unroll
          for (int i = 0; i < V; ++i) a[i] = 0.0f;
        } else {
          load_vec<float, V>(a, part_w + v * V);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) a[i] += d[i] * xh[i];
        store_vec<float, V>(part_w + v * V, a);
      }
      if (part_b != nullptr) {
        float a[V];
        if (first) {
#pragma unroll
          for (int i = 0; i < V; ++i) a[i] = 0.0f;
        } else {
          load_vec<float, V>(a, part_b + v * V);
        }
#pragma unroll
        for (int i = 0; i < V; ++i) a[i] += d[i];
        store_vec<float, V>(part_b + v * V, a);
      }
    }
  }
}

template <typename Tx, int V>
__global__ void __launch_bounds__(kBigThreads) norm_bwd_big_kernel(const BwdParams p) {
  dtype_switch(p.dy_dtype, [&](auto tdy) {
    dtype_switch(p.w_dtype, [&](auto tw) {
      bwd_big_rows<Tx, typename decltype(tdy)::type, typename decltype(tw)::type, V>(p);
    });
  });
}

/// dw[c] / db[c] = sum over partial rows in row order. Thread (lane, slice) sums the partial rows
/// slice, slice + kReduceSlices, ... of column c; the slices are then added in slice order.
__global__ void __launch_bounds__(kReduceCols* kReduceSlices)
    norm_grad_reduce_kernel(const float* part_w, const float* part_b, int64_t parts, int64_t cols,
                            float* dw, float* db) {
  __shared__ float sums[2][kReduceSlices][kReduceCols];
  const int lane = static_cast<int>(threadIdx.x) % kReduceCols;
  const int slice = static_cast<int>(threadIdx.x) / kReduceCols;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kReduceCols + lane;
  float sw = 0.0f;
  float sb = 0.0f;
  if (c < cols) {
    for (int64_t r = slice; r < parts; r += kReduceSlices) {
      if (part_w != nullptr) sw += part_w[r * cols + c];
      if (part_b != nullptr) sb += part_b[r * cols + c];
    }
  }
  sums[0][slice][lane] = sw;
  sums[1][slice][lane] = sb;
  __syncthreads();
  if (slice != 0 || c >= cols) return;
  for (int s = 1; s < kReduceSlices; ++s) {
    sw += sums[0][s][lane];
    sb += sums[1][s][lane];
  }
  if (dw != nullptr) dw[c] = sw;
  if (db != nullptr) db[c] = sb;
}

// ---------------------------------------------------------------------------------------------
// Host side
// ---------------------------------------------------------------------------------------------

/// Whether p allows the vector accesses of V elements of dtype t (null counts as aligned).
bool vec_aligned(const void* p, DType t, int v) {
  const std::size_t bytes = static_cast<std::size_t>(v) * static_cast<std::size_t>(dtype_size(t));
  const std::size_t need = bytes < 16 ? bytes : 16;
  return reinterpret_cast<std::uintptr_t>(p) % need == 0;
}

/// Register layout of a row of `vecs` vectors: the smallest team of W <= max_warps warps whose
/// threads hold at most kMaxRegElems elements each. False when the row does not fit.
bool pick_layout(int64_t vecs, int v, int max_warps, int& warps, int& kn) {
  const int max_kn = v == 1 ? 4 : kMaxRegElems / v;
  for (int w = 1; w <= max_warps; w *= 2) {
    const int64_t team = static_cast<int64_t>(w) * kWarpSize;
    const int64_t n = (vecs + team - 1) / team;
    if (n <= max_kn) {
      warps = w;
      kn = static_cast<int>(n);
      return true;
    }
  }
  return false;
}

template <int N>
using IntC = std::integral_constant<int, N>;

/// Calls f(IntC<kN>{}) for the kN in 1..4 with kN * V <= kMaxRegElems (any kN <= 4 when V = 1).
template <int V, class F>
void with_kn(const char* name, int kn, F&& f) {
  switch (kn) {
    case 1:
      f(IntC<1>{});
      return;
    case 2:
      if constexpr (2 * V <= kMaxRegElems || V == 1) {
        f(IntC<2>{});
        return;
      }
      break;
    case 3:
      if constexpr (3 * V <= kMaxRegElems || V == 1) {
        f(IntC<3>{});
        return;
      }
      break;
    case 4:
      if constexpr (4 * V <= kMaxRegElems || V == 1) {
        f(IntC<4>{});
        return;
      }
      break;
    default:
      break;
  }
  detail::fail(name, "internal error: no register layout with " + std::to_string(kn) + " vectors");
}

/// Calls f(IntC<V>{}) with the vector width of Tx (16 bytes) or 1.
template <typename Tx, class F>
void with_width(bool vec, F&& f) {
  if (vec) {
    f(IntC<static_cast<int>(16 / sizeof(Tx))>{});
  } else {
    f(IntC<1>{});
  }
}

int device_sm_count(const char* name) {
  int device = 0;
  detail::check_cuda(name, cudaGetDevice(&device));
  int sms = 0;
  detail::check_cuda(name, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms > 0 ? sms : 1;
}

/// Blocks of `kernel` that run at once on the device (at least one per SM). Queried once per
/// (device, block size) and kept: every backward call needs it.
template <typename Kernel>
int64_t resident_blocks(const char* name, Kernel kernel, int threads) {
  int device = 0;
  detail::check_cuda(name, cudaGetDevice(&device));
  static std::mutex mutex;
  static std::map<std::pair<int, int>, int64_t> cache;
  const std::pair<int, int> key{device, threads};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int per_sm = 0;
  detail::check_cuda(name,
                     cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t blocks = static_cast<int64_t>(device_sm_count(name)) * (per_sm > 0 ? per_sm : 1);
  const std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, blocks);
  return blocks;
}

inline constexpr int64_t kMaxGrid = int64_t{1} << 30;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace

void norm_forward(const NormForwardArgs& args, void* stream_ptr) {
  constexpr const char* kName = "apex::kernels::cuda::norm_forward";
  if (args.rows < 0 || args.cols < 0) detail::fail(kName, "negative shape");
  if (args.rows == 0 || args.cols == 0) return;
  if (args.x == nullptr || args.y == nullptr || args.rstd == nullptr) {
    detail::fail(kName, "x, y and rstd are required");
  }
  if (!args.rms && args.mean == nullptr) detail::fail(kName, "mean is required for LayerNorm");
  const cudaStream_t stream = as_stream(stream_ptr);

  FwdParams p{};
  p.rows = args.rows;
  p.cols = args.cols;
  p.eps = args.eps;
  p.rms = args.rms;
  p.y_dtype = args.y_dtype;
  p.w_dtype = args.w_dtype;
  p.x = args.x;
  p.w = args.w;
  p.b = args.b;
  p.y = args.y;
  p.mean = args.mean;
  p.rstd = args.rstd;

  detail::dispatch_dtype(kName, args.x_dtype, [&](auto tx) {
    using Tx = typename decltype(tx)::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(Tx));
    const bool vec = args.cols % kVec == 0 && vec_aligned(args.x, args.x_dtype, kVec) &&
                     vec_aligned(args.y, args.y_dtype, kVec) &&
                     vec_aligned(args.w, args.w_dtype, kVec) &&
                     vec_aligned(args.b, args.w_dtype, kVec);
    with_width<Tx>(vec, [&](auto vc) {
      constexpr int V = decltype(vc)::value;
      int warps = 0;
      int kn = 0;
      if (pick_layout(args.cols / V, V, 32, warps, kn)) {
        p.warps_per_row = warps;
        with_kn<V>(kName, kn, [&](auto nc) {
          constexpr int kN = decltype(nc)::value;
          const auto run = [&](auto threads_c) {
            constexpr int kThreads = decltype(threads_c)::value;
            const int64_t teams = kThreads / (warps * kWarpSize);
            const int64_t grid = std::min(ceil_div(args.rows, teams), kMaxGrid);
            detail::launch("apex::kernels::cuda::norm_fwd_reg",
                           norm_fwd_reg_kernel<Tx, V, kN, kThreads>, static_cast<unsigned>(grid),
                           kThreads, stream, p);
          };
          if (warps <= 8) {
            run(IntC<256>{});
          } else {
            run(IntC<1024>{});
          }
        });
      } else {
        p.warps_per_row = kBigThreads / kWarpSize;
        const int64_t grid = std::min(args.rows, kMaxGrid);
        detail::launch("apex::kernels::cuda::norm_fwd_big", norm_fwd_big_kernel<Tx, V>,
                       static_cast<unsigned>(grid), kBigThreads, stream, p);
      }
    });
  });
}

void norm_backward(const NormBackwardArgs& args, void* stream_ptr) {
  constexpr const char* kName = "apex::kernels::cuda::norm_backward";
  if (args.rows < 0 || args.cols < 0) detail::fail(kName, "negative shape");
  if (args.rows == 0 || args.cols == 0) return;
  const bool from_y = args.y != nullptr;
  if (args.dy == nullptr || args.dx == nullptr || args.rstd == nullptr) {
    detail::fail(kName, "dy, dx and rstd are required");
  }
  if (!from_y && args.x == nullptr) detail::fail(kName, "x (or y, memory-efficient) is required");
  if (!from_y && !args.rms && args.mean == nullptr) {
    detail::fail(kName, "mean is required for LayerNorm");
  }
  const cudaStream_t stream = as_stream(stream_ptr);
  if ((args.dw != nullptr || args.db != nullptr) && args.dwb_dtype != DType::kFloat32) {
    detail::fail(kName, "dw and db must be fp32");
  }
  const bool want_w = args.dw != nullptr;
  const bool want_b = args.db != nullptr;

  BwdParams p{};
  p.rows = args.rows;
  p.cols = args.cols;
  p.rms = args.rms;
  p.dy_dtype = args.dy_dtype;
  p.w_dtype = args.w_dtype;
  p.dy = args.dy;
  p.x = from_y ? nullptr : args.x;
  p.y = from_y ? args.y : nullptr;
  p.w = args.w;
  p.b = from_y ? args.b : nullptr;
  p.mean = from_y ? nullptr : args.mean;
  p.rstd = args.rstd;
  p.dx = args.dx;
  p.eps = args.eps;

  // Enqueues the kernel over `blocks` blocks, with the partial rows of dw/db when wanted, then
  // sums the partial rows.
  const auto run = [&](auto kernel, int64_t blocks, int threads, const char* kernel_name) {
    if (!want_w && !want_b) {
      p.part_w = nullptr;
      p.part_b = nullptr;
      detail::launch(kernel_name, kernel, static_cast<unsigned>(blocks), threads, stream, p);
      return;
    }
    const std::size_t part_elems =
        static_cast<std::size_t>(blocks) * static_cast<std::size_t>(args.cols);
    const std::size_t bytes = part_elems * sizeof(float) * ((want_w ? 1 : 0) + (want_b ? 1 : 0));
    // The caller's allocator when it gives one (torch's caching allocator), else our own.
    std::optional<detail::StreamBuffer> own;
    float* parts = nullptr;
    if (args.workspace) {
      parts = static_cast<float*>(args.workspace(bytes));
      if (parts == nullptr) detail::fail(kName, "the workspace callback returned null");
    } else {
      own.emplace(kName, bytes, stream);
      parts = own->as<float>();
    }
    p.part_w = want_w ? parts : nullptr;
    p.part_b = want_b ? parts + (want_w ? part_elems : 0) : nullptr;
    detail::launch(kernel_name, kernel, static_cast<unsigned>(blocks), threads, stream, p);
    {
      detail::launch("apex::kernels::cuda::norm_grad_reduce", norm_grad_reduce_kernel,
                     static_cast<unsigned>(ceil_div(args.cols, kReduceCols)),
                     kReduceCols * kReduceSlices, stream, static_cast<const float*>(p.part_w),
                     static_cast<const float*>(p.part_b), blocks, args.cols,
                     static_cast<float*>(args.dw), static_cast<float*>(args.db));
    }
  };

  detail::dispatch_dtype(kName, args.x_dtype, [&](auto tx) {
    using Tx = typename decltype(tx)::type;
    constexpr int kVec = static_cast<int>(16 / sizeof(Tx));
    const bool vec =
        args.cols % kVec == 0 && vec_aligned(args.x, args.x_dtype, kVec) &&
        vec_aligned(args.dx, args.x_dtype, kVec) && vec_aligned(args.dy, args.dy_dtype, kVec) &&
        vec_aligned(args.y, args.dy_dtype, kVec) && vec_aligned(args.w, args.w_dtype, kVec) &&
        vec_aligned(args.b, args.w_dtype, kVec);
    with_width<Tx>(vec, [&](auto vc) {
      constexpr int V = decltype(vc)::value;
      int warps = 0;
      int kn = 0;
      if (pick_layout(args.cols / V, V, 16, warps, kn)) {
        p.warps_per_row = warps;
        with_kn<V>(kName, kn, [&](auto nc) {
          constexpr int kN = decltype(nc)::value;
          const auto go = [&](auto threads_c) {
            constexpr int kThreads = decltype(threads_c)::value;
            const auto kernel = norm_bwd_reg_kernel<Tx, V, kN, kThreads>;
            // A fixed partition of the row groups over at most the resident blocks.
            const int64_t teams = kThreads / (warps * kWarpSize);
            const int64_t groups = ceil_div(args.rows, teams);
            int64_t blocks = std::min(groups, resident_blocks(kName, kernel, kThreads));
            p.per_block = ceil_div(groups, blocks);
            blocks = ceil_div(groups, p.per_block);
            run(kernel, blocks, kThreads, "apex::kernels::cuda::norm_bwd_reg");
          };
          if (warps <= 8) {
            go(IntC<256>{});
          } else {
            go(IntC<512>{});
          }
        });
      } else {
        p.warps_per_row = kBigThreads / kWarpSize;
        const auto kernel = norm_bwd_big_kernel<Tx, V>;
        int64_t blocks = std::min(args.rows, resident_blocks(kName, kernel, kBigThreads));
        if (want_w || want_b) {  // keep the partial rows within 256 MiB
          const int64_t cap = (int64_t{256} << 20) / (args.cols * 8);
          blocks = std::max<int64_t>(1, std::min(blocks, cap));
        }
        p.per_block = ceil_div(args.rows, blocks);
        blocks = ceil_div(args.rows, p.per_block);
        run(kernel, blocks, kBigThreads, "apex::kernels::cuda::norm_bwd_big");
      }
    });
  });
}

}  // namespace apex::kernels::cuda
