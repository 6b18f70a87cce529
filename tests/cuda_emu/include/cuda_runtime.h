// apex-cpp's CUDA-on-CPU emulation: this header shadows the toolkit's cuda_runtime.h (its folder
// comes first on the include path of the emulated build) so that the project's .cu files compile
// unchanged with a host C++ compiler and run on the CPU, for correctness only.
//
// Each block runs as one fiber per CUDA thread, blocks one after another (runtime.cpp). It gives
// exactly what our kernels use, and fails the launch loudly on what a GPU would do wrongly or
// undefinedly: a __syncthreads that not every thread of the block reaches or that threads reach at
// different call sites, a shuffle whose mask names an exited lane or whose lanes disagree, a
// deadlock. The toolkit's own headers still provide the types (cudaError_t, dim3,
// cudaLaunchConfig_t: cuda_runtime_api.h) and the host-side __half/__nv_bfloat16 conversions.
#pragma once

#if defined(__CUDACC__)
#error "tests/cuda_emu/include/cuda_runtime.h is for host compilers only (the emulated build)"
#endif

#include <cuda_runtime_api.h>
#include <math.h>  // the C math functions in the global namespace, as CUDA has them
#include <vector_types.h>

#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <source_location>
#include <tuple>
#include <type_traits>
#include <utility>

#include "cuda_emu.h"

// ---------------------------------------------------------------------------------------------
// Qualifiers. __device__, __global__, __host__, __forceinline__ and __grid_constant__ come from the
// toolkit's host_defines.h (empty or always_inline for a host compiler).
// ---------------------------------------------------------------------------------------------

// One copy per kernel (function-scope statics), shared by every thread of the block. Blocks run
// in turn, so one copy serves them all.
#undef __shared__
#define __shared__ static
#ifndef __launch_bounds__
#define __launch_bounds__(...)
#endif

// isnan/isfinite on float in the global namespace, as device code calls them.
using std::isfinite;
using std::isinf;
using std::isnan;

inline constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Built-in variables: threadIdx/blockIdx are the running fiber's (set by the scheduler before it
// resumes a fiber), read through calls; gridDim/blockDim are the launch's. gridDim and blockDim
// cannot be macros (cudaLaunchConfig_t has members of those names), so they are variables.
// ---------------------------------------------------------------------------------------------

namespace cuda_emu::detail {
uint3 thread_idx();  // out of line: ThreadSanitizer must not see these reads (runtime.cpp)
uint3 block_idx();
}  // namespace cuda_emu::detail

extern thread_local dim3 gridDim;
extern thread_local dim3 blockDim;

#define threadIdx (::cuda_emu::detail::thread_idx())
#define blockIdx (::cuda_emu::detail::block_idx())

namespace cuda_emu::detail {

enum class ShuffleKind : int8_t { kIndex = 0, kXor = 1, kDown = 2, kUp = 3 };

/// The block barrier; `site` identifies the call (all threads must wait at the same one).
void barrier(const std::source_location& site);
/// The warp rendezvous behind every __shfl_*_sync: returns the 8 bytes of the source lane.
uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width,
                 const std::source_location& site);

/// Runs body(ctx) as the kernel of one launch: every thread of every block, in turn.
cudaError_t launch(const cudaLaunchConfig_t& config, void (*body)(void*), void* ctx);

/// Blocks of `threads` threads resident on one SM (occupancy without register limits).
int blocks_per_sm(int threads);

template <typename T>
T shuffle_as(unsigned mask, T var, ShuffleKind kind, int arg, int width,
             const std::source_location& site) {
  static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= 8, "shuffles move 4 or 8 bytes");
  uint64_t bits = 0;
  std::memcpy(&bits, &var, sizeof(T));
  bits = shuffle(mask, bits, kind, arg, width, site);
  T out;
  std::memcpy(&out, &bits, sizeof(T));
  return out;
}

}  // namespace cuda_emu::detail

// ---------------------------------------------------------------------------------------------
// Synchronization and warp intrinsics
// ---------------------------------------------------------------------------------------------

inline void __syncthreads(std::source_location site = std::source_location::current()) {
  ::cuda_emu::detail::barrier(site);
}

template <typename T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize,
                  std::source_location site = std::source_location::current()) {
  return ::cuda_emu::detail::shuffle_as(mask, var, ::cuda_emu::detail::ShuffleKind::kXor, lane_mask,
                                        width, site);
}

template <typename T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize,
              std::source_location site = std::source_location::current()) {
  return ::cuda_emu::detail::shuffle_as(mask, var, ::cuda_emu::detail::ShuffleKind::kIndex,
                                        src_lane, width, site);
}

template <typename T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                   std::source_location site = std::source_location::current()) {
  return ::cuda_emu::detail::shuffle_as(mask, var, ::cuda_emu::detail::ShuffleKind::kDown,
                                        static_cast<int>(delta), width, site);
}

template <typename T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize,
                 std::source_location site = std::source_location::current()) {
  return ::cuda_emu::detail::shuffle_as(mask, var, ::cuda_emu::detail::ShuffleKind::kUp,
                                        static_cast<int>(delta), width, site);
}

// Fibers of one block never run at the same time, but the sanitizers must see these as atomic.
inline float atomicAdd(float* address, float value) {
  return std::atomic_ref<float>(*address).fetch_add(value, std::memory_order_relaxed);
}
inline int atomicAdd(int* address, int value) {
  return std::atomic_ref<int>(*address).fetch_add(value, std::memory_order_relaxed);
}
inline unsigned atomicAdd(unsigned* address, unsigned value) {
  return std::atomic_ref<unsigned>(*address).fetch_add(value, std::memory_order_relaxed);
}

// ---------------------------------------------------------------------------------------------
// Math intrinsics: correctly rounded on the CPU (the GPU's fast forms are within an ulp or two;
// tests use tolerances, never bit equality with a GPU).
// ---------------------------------------------------------------------------------------------

inline float __fdividef(float a, float b) { return a / b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float rsqrtf(float a) { return 1.0f / std::sqrt(a); }

// ---------------------------------------------------------------------------------------------
// Launches and occupancy
// ---------------------------------------------------------------------------------------------

/// Runs kernel(args...) over config's grid before returning (every stream is synchronous). A
/// fault inside the kernel returns cudaErrorLaunchFailure; cudaGetErrorString then names it.
template <typename... ExpTypes, typename... ActTypes>
cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t* config, void (*kernel)(ExpTypes...),
                               ActTypes&&... args) {
  if (config == nullptr || kernel == nullptr) return cudaErrorInvalidValue;
  using Params = std::tuple<std::remove_cvref_t<ExpTypes>...>;
  struct Call {
    void (*kernel)(ExpTypes...);
    Params params;  // one copy per launch, as the GPU's parameter space; each thread copies it
  };
  Call call{kernel, Params(std::forward<ActTypes>(args)...)};
  return ::cuda_emu::detail::launch(
      *config,
      [](void* p) {
        Call* c = static_cast<Call*>(p);
        std::apply(c->kernel, c->params);
      },
      &call);
}

template <class T>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* num_blocks, T /*func*/,
                                                          int block_size,
                                                          std::size_t dynamic_smem_size) {
  if (num_blocks == nullptr || block_size <= 0 || block_size > 1024 || dynamic_smem_size != 0) {
    return cudaErrorInvalidValue;
  }
  *num_blocks = ::cuda_emu::detail::blocks_per_sm(block_size);
  return cudaSuccess;
}
