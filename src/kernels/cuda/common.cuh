// Helpers every CUDA kernel file of apex-cpp shares: errors and launches, storage types and their
// fp32 conversions, warp reductions and stream-ordered scratch memory. Only the CUDA runtime and
// the standard library are used (kernels know nothing of tensors).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cuda::detail {

inline constexpr int kWarpSize = 32;
/// Kernel parameters are limited to 4096 bytes (the portable limit).
inline constexpr std::size_t kParamLimit = 4096;

// ---------------------------------------------------------------------------------------------
// Errors and launches
// ---------------------------------------------------------------------------------------------

[[noreturn]] inline void fail(const char* name, const std::string& what) {
  throw std::runtime_error(std::string(name) + ": " + what);
}

inline void check_cuda(const char* name, cudaError_t err) {
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error so that it is not reported twice
    fail(name, std::string("CUDA error: ") + cudaGetErrorString(err));
  }
}

/// Enqueues kernel<<<grid, block, 0, stream>>>(args...) and reports launch errors as
/// std::runtime_error naming the kernel.
template <typename... Params, typename... Args>
void launch(const char* name, void (*kernel)(Params...), unsigned grid, unsigned block,
            cudaStream_t stream, Args&&... args) {
  static_assert((sizeof(Params) + ... + 0) <= kParamLimit, "kernel parameters exceed 4 KB");
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  config.attrs = nullptr;
  config.numAttrs = 0;
  cudaError_t err = cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
  if (err == cudaSuccess) err = cudaGetLastError();
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    fail(name, std::string("kernel launch failed: ") + cudaGetErrorString(err));
  }
}

// ---------------------------------------------------------------------------------------------
// Storage types
// ---------------------------------------------------------------------------------------------

template <typename T>
struct TypeTag {
  using type = T;
};

/// Calls f(TypeTag<T>{}) with the storage type of `dtype`.
template <class F>
void dispatch_dtype(const char* name, DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(TypeTag<float>{});
      return;
    case DType::kFloat16:
      f(TypeTag<__half>{});
      return;
    case DType::kBFloat16:
      f(TypeTag<__nv_bfloat16>{});
      return;
  }
  fail(name, "unknown dtype " + std::to_string(static_cast<int>(dtype)));
}

/// Calls f(TypeTag<A>{}, TypeTag<B>{}) with the storage types of `a` and `b`.
template <class F>
void dispatch_dtypes(const char* name, DType a, DType b, F&& f) {
  dispatch_dtype(name, a, [&](auto ta) { dispatch_dtype(name, b, [&](auto tb) { f(ta, tb); }); });
}

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) {
  return x;
}
template <>
__device__ __forceinline__ __half from_float<__half>(float x) {
  return __float2half_rn(x);
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

/// kILP consecutive elements moved by one vector access (16 bytes for fp32, 8 for fp16/bf16).
// ---------------------------------------------------------------------------------------------
// Warp reductions
// ---------------------------------------------------------------------------------------------

struct SumOp {
  __device__ __forceinline__ float operator()(float a, float b) const { return a + b; }
};

/// max that propagates NaN from either side (fmaxf would drop it).
struct MaxNanOp {
  __device__ __forceinline__ float operator()(float a, float b) const {
    return (isnan(a) || a > b) ? a : b;
  }
};

/// Butterfly reduction over the lanes of a full warp: every lane gets the result.
template <class Combine>
__device__ __forceinline__ float warp_reduce(float v, Combine combine) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    v = combine(v, __shfl_xor_sync(0xffffffffu, v, offset));
  }
  return v;
}

// ---------------------------------------------------------------------------------------------
// Scratch memory
// ---------------------------------------------------------------------------------------------

/// Device scratch memory of the stream, allocated and freed in stream order.
class StreamBuffer {
 public:
  StreamBuffer(const char* name, std::size_t bytes, cudaStream_t stream) : stream_(stream) {
    check_cuda(name, cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~StreamBuffer() { (void)cudaFreeAsync(ptr_, stream_); }
  StreamBuffer(const StreamBuffer&) = delete;
  StreamBuffer& operator=(const StreamBuffer&) = delete;

  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
  cudaStream_t stream_;
};

}  // namespace apex::kernels::cuda::detail
