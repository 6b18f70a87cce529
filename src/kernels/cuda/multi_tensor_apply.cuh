// Multi-tensor apply engine of the CUDA backend: packs the host tensor lists of a call into
// per-launch tables passed by value as the kernel parameter, and runs one block of kBlockSize
// threads per chunk of kChunkSize elements. Device helpers for vector loads and stores, ILP
// frames and block reductions live here too; what every kernel file shares is in common.cuh.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/common.cuh"

namespace apex::kernels::cuda::detail {

inline constexpr int kChunkSize = 65536;  ///< elements handled by one block
inline constexpr int kBlockSize = 512;    ///< threads per block of the apply kernels
inline constexpr int kILP = 4;            ///< elements per thread and per step
inline constexpr int kMaxBlocksPerLaunch = 320;
/// A launch table stays within kTableBudget so that the functor passed next to it has 256 bytes
/// of the kParamLimit.
inline constexpr std::size_t kTableBudget = 3840;
/// Chunk indices within a tensor are stored as int32.
inline constexpr int64_t kMaxNumel = (int64_t{1} << 31) * kChunkSize;

template <typename T>
struct alignas(kILP * sizeof(T)) Pack {
  T v[kILP];
};

template <typename T>
__device__ __forceinline__ bool is_aligned(const T* p) {
  return reinterpret_cast<std::uintptr_t>(p) % alignof(Pack<T>) == 0;  // null counts as aligned
}

// ---------------------------------------------------------------------------------------------
// Frames: the kILP elements a thread handles in one step
// ---------------------------------------------------------------------------------------------

/// Elements first + i*stride of the chunk for i < count (count <= kILP). When vec is set they
/// are contiguous (stride 1, count kILP) and every list is aligned for one vector access.
struct Frame {
  int first;
  int stride;
  int count;
  bool vec;
};

__device__ __forceinline__ int min_int(int a, int b) { return a < b ? a : b; }

/// Calls body(frame) for each frame of this thread in a chunk of n elements. With `aligned`, a
/// thread takes kILP contiguous elements per step (vector accesses, the chunk's last partial
/// group element by element); otherwise kILP elements kBlockSize apart (coalesced scalars).
template <class Body>
__device__ __forceinline__ void for_each_frame(int n, bool aligned, Body&& body) {
  const int tid = static_cast<int>(threadIdx.x);
  if (aligned) {
    for (int first = tid * kILP; first < n; first += kBlockSize * kILP) {
      const int count = min_int(kILP, n - first);
      body(Frame{first, 1, count, count == kILP});
    }
  } else {
    for (int first = tid; first < n; first += kBlockSize * kILP) {
      const int count = min_int(kILP, (n - first + kBlockSize - 1) / kBlockSize);
      body(Frame{first, kBlockSize, count, false});
    }
  }
}

/// r[i] = element i of the frame as float; lanes past f.count read as 0.
template <typename T>
__device__ __forceinline__ void load(float (&r)[kILP], const T* p, const Frame& f) {
  if (f.vec) {
    const Pack<T> pack = *reinterpret_cast<const Pack<T>*>(p + f.first);
#pragma unroll
    for (int i = 0; i < kILP; ++i) r[i] = to_float(pack.v[i]);
  } else {
#pragma unroll
    for (int i = 0; i < kILP; ++i) r[i] = i < f.count ? to_float(p[f.first + i * f.stride]) : 0.0f;
  }
}

/// Stores the first f.count values of r, rounded to T.
template <typename T>
__device__ __forceinline__ void store(T* p, const float (&r)[kILP], const Frame& f) {
  if (f.vec) {
    Pack<T> pack;
#pragma unroll
    for (int i = 0; i < kILP; ++i) pack.v[i] = from_float<T>(r[i]);
    *reinterpret_cast<Pack<T>*>(p + f.first) = pack;
  } else {
#pragma unroll
    for (int i = 0; i < kILP; ++i) {
      if (i < f.count) p[f.first + i * f.stride] = from_float<T>(r[i]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Block reductions
// ---------------------------------------------------------------------------------------------

/// Reduces v[k] over the kBlockSize threads of the block; thread 0 holds the results. Every
/// thread of the block must call it, at most once per kernel (the shared buffer is not reused).
template <int N, class Combine>
__device__ __forceinline__ void block_reduce(float (&v)[N], Combine combine) {
  constexpr int kWarps = kBlockSize / kWarpSize;
  static_assert(kWarps <= kWarpSize && (kWarps & (kWarps - 1)) == 0);
  __shared__ float warp_results[N][kWarps];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
#pragma unroll
  for (int k = 0; k < N; ++k) v[k] = warp_reduce(v[k], combine);
  if (lane == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) warp_results[k][warp] = v[k];
  }
  __syncthreads();
  if (warp == 0) {
#pragma unroll
    for (int k = 0; k < N; ++k) {
      // Lanes 0..kWarps-1 combine among themselves only (xor offsets below kWarps); the other
      // lanes hold copies so that the whole warp takes part in the shuffles.
      float x = warp_results[k][lane % kWarps];
#pragma unroll
      for (int offset = kWarps / 2; offset > 0; offset /= 2) {
        x = combine(x, __shfl_xor_sync(0xffffffffu, x, offset));
      }
      v[k] = x;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launch tables
// ---------------------------------------------------------------------------------------------

/// Tensors per launch for `depth` lists: 8 bytes per list pointer, 8 for the element count and
/// 4 for the tensor index, after the per-block maps and the header.
constexpr int max_tensors_per_launch(int depth) {
  const std::size_t fixed = 16 + kMaxBlocksPerLaunch * (sizeof(int32_t) + sizeof(uint8_t));
  const std::size_t per_tensor = 8 * static_cast<std::size_t>(depth) + 8 + 4;
  const std::size_t n = (kTableBudget - fixed) / per_tensor;
  return static_cast<int>(n < 256 ? n : 256);  // slots are indexed by uint8
}

/// Kernel parameter of one launch. Block b handles chunk chunk[b] of the tensor in slot
/// slot[b]; its chunk is number first_chunk + b among all chunks of the call (norm partials).
template <int Depth>
struct ChunkTable {
  static constexpr int kMaxTensors = max_tensors_per_launch(Depth);
  void* addr[Depth][kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t first_chunk;
  int32_t tensor[kMaxTensors];  ///< index of the slot's tensor in the TensorLists
  int32_t chunk[kMaxBlocksPerLaunch];
  uint8_t slot[kMaxBlocksPerLaunch];
};

/// What a block works on: n elements from element `start` of tensor `tensor`.
template <int Depth>
struct Chunk {
  void* base[Depth];  ///< tensor start per list, null for absent lists
  int64_t start;
  int64_t ordinal;  ///< number of this chunk among all chunks of the call
  int32_t tensor;
  int n;

  template <typename T>
  __device__ __forceinline__ T* ptr(int list) const {
    return base[list] == nullptr ? nullptr : static_cast<T*>(base[list]) + start;
  }
};

template <int Depth, class Op>
__global__ void __launch_bounds__(kBlockSize)
    apply_kernel(const __grid_constant__ ChunkTable<Depth> table, const Op op) {
  const int slot = table.slot[blockIdx.x];
  Chunk<Depth> chunk;
  chunk.start = static_cast<int64_t>(table.chunk[blockIdx.x]) * kChunkSize;
  chunk.ordinal = table.first_chunk + static_cast<int64_t>(blockIdx.x);
  chunk.tensor = table.tensor[slot];
  const int64_t left = table.numel[slot] - chunk.start;
  chunk.n = left < kChunkSize ? static_cast<int>(left) : kChunkSize;
#pragma unroll
  for (int l = 0; l < Depth; ++l) chunk.base[l] = table.addr[l][slot];
  op(chunk);
}

inline int64_t chunks_of(int64_t numel) {
  return numel / kChunkSize + (numel % kChunkSize != 0 ? 1 : 0);
}

/// Checks what the kernels rely on: counts, required lists, per-tensor pointers of present
/// lists, and fp32 storage for the state lists.
inline void check_lists(const char* name, const TensorLists& lists, int depth,
                        std::initializer_list<int> required, std::initializer_list<int> fp32) {
  if (lists.num_tensors < 0 || lists.num_tensors > INT32_MAX) {
    fail(name, "invalid num_tensors " + std::to_string(lists.num_tensors));
  }
  if (lists.numel == nullptr) fail(name, "numel is null");
  for (int l : required) {
    if (lists.ptrs[l] == nullptr) fail(name, "list " + std::to_string(l) + " is required");
  }
  for (int l : fp32) {
    if (lists.ptrs[l] != nullptr && lists.dtype[l] != DType::kFloat32) {
      fail(name, "list " + std::to_string(l) + " must be float32");
    }
  }
  for (int64_t t = 0; t < lists.num_tensors; ++t) {
    const int64_t numel = lists.numel[t];
    if (numel < 0 || numel > kMaxNumel) {
      fail(name, "tensor " + std::to_string(t) + " has invalid numel " + std::to_string(numel));
    }
    if (numel == 0) continue;
    for (int l = 0; l < depth; ++l) {
      if (lists.ptrs[l] != nullptr && lists.ptrs[l][t] == nullptr) {
        fail(name,
             "list " + std::to_string(l) + ", tensor " + std::to_string(t) + ": null data pointer");
      }
    }
  }
}

/// Runs op on every chunk of every non-empty tensor of lists 0..Depth-1. A launch fires when its
/// block map is full, when its tensor slots are full at a tensor boundary, and at the end; a
/// tensor cut by a launch continues in slot 0 of the next one.
template <int Depth, class Op>
void apply(const char* name, const TensorLists& lists, const Op& op, cudaStream_t stream) {
  using Table = ChunkTable<Depth>;
  static_assert(sizeof(Table) <= kTableBudget, "launch table over budget");
  static_assert(Table::kMaxTensors >= 1);

  Table table = {};
  int slots = 0;
  int blocks = 0;
  int64_t ordinal = 0;  // chunks queued so far over all launches
  table.first_chunk = 0;
  const auto fire = [&] {
    launch(name, apply_kernel<Depth, Op>, static_cast<unsigned>(blocks), kBlockSize, stream, table,
           op);
    table.first_chunk = ordinal;
    blocks = 0;
  };

  for (int64_t t = 0; t < lists.num_tensors; ++t) {
    const int64_t numel = lists.numel[t];
    if (numel == 0) continue;
    for (int l = 0; l < Depth; ++l) {
      table.addr[l][slots] = lists.ptrs[l] == nullptr ? nullptr : lists.ptrs[l][t];
    }
    table.numel[slots] = numel;
    table.tensor[slots] = static_cast<int32_t>(t);
    ++slots;

    const int64_t chunks = chunks_of(numel);
    for (int64_t c = 0; c < chunks; ++c) {
      table.slot[blocks] = static_cast<uint8_t>(slots - 1);
      table.chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      ++ordinal;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocksPerLaunch || (last_chunk && slots == Table::kMaxTensors)) {
        fire();
        if (last_chunk) {
          slots = 0;
        } else {  // carry the unfinished tensor over to slot 0
          for (int l = 0; l < Depth; ++l) table.addr[l][0] = table.addr[l][slots - 1];
          table.numel[0] = table.numel[slots - 1];
          table.tensor[0] = table.tensor[slots - 1];
          slots = 1;
        }
      }
    }
  }
  if (blocks > 0) fire();
}

}  // namespace apex::kernels::cuda::detail
