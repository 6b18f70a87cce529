#pragma once

// Internal: where at::Tensor meets the kernels, for every area (amp, optim, normalization,
// parallel, the Python ops). Checks tensor lists and builds kernels::TensorLists from them, maps
// dtypes, and runs a kernel on the backend of the tensors' device. Nothing here is specific to an
// optimizer or a norm.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>

#include <initializer_list>
#include <vector>

#include "kernels/multi_tensor.h"
#include "ops/lists.h"

namespace apex::bridge {

/// fp32, fp16 or bf16, else an error naming `who` and the dtype.
kernels::DType kernel_dtype(const at::Tensor& t, const char* who);
kernels::DType kernel_dtype(at::ScalarType t, const char* who);

/// Owns the pointer arrays a kernels::TensorLists refers to (ops::ListBuilder over at::Tensor).
class ListBuilder : public ops::ListBuilder {
 public:
  using ops::ListBuilder::ListBuilder;
  /// Appends tensor i of every list; absent optional lists pass undefined tensors.
  void add(at::ArrayRef<at::Tensor> row);
};

/// Checks one public list argument: non-empty, dense, one device, one fp32/fp16/bf16 dtype.
/// Messages name `who`, the argument and the offending index (ops::check_list).
void check_list(const std::vector<at::Tensor>& list, const char* who, const char* arg);

/// Whether two dense tensors of `sizes` lay their elements out in the same order
/// (ops::same_memory_order).
inline bool same_memory_order(c10::IntArrayRef sizes, c10::IntArrayRef a, c10::IntArrayRef b) {
  return ops::same_memory_order(sizes, a, b);
}

/// Checks that `other` matches `ref` element-wise (same length, numel, device, layout).
void check_matching(const std::vector<at::Tensor>& ref, const std::vector<at::Tensor>& other,
                    const char* who, const char* ref_name, const char* other_name);

/// float* of a one-element fp32 tensor (kernel memory), or null for an undefined tensor.
float* scalar_ptr(const at::Tensor& t, c10::Device device, const char* who, const char* name);

/// The defined tensors of `tensors` grouped by (device, dtype): one multi-tensor call per group.
/// Groups keep first-seen order, so results do not depend on hashing.
std::vector<std::vector<at::Tensor>> by_device_and_dtype(const std::vector<at::Tensor>& tensors);

/// The current CUDA stream of `device` as a cudaStream_t; errors when apex-cpp was built without
/// CUDA support.
void* cuda_stream(c10::Device device);

/// Calls cpu() or cuda(stream) for `device`.
template <class Cpu, class Cuda>
void on_backend(c10::Device device, const Cpu& cpu, const Cuda& cuda) {
  if (device.is_cpu()) {
    cpu();
  } else {
    const c10::DeviceGuard guard(device);
    cuda(cuda_stream(device));
  }
}

/// True when kernels for `device` exist in this build.
bool backend_available(c10::Device device);

/// Runs kernel `cpu` or `cuda` (the same kernel of the two backends) on `lists` for `device`.
template <class Args>
void launch(c10::Device device, void (*cpu)(const kernels::TensorLists&, const Args&),
            void (*cuda)(const kernels::TensorLists&, const Args&, void*),
            const kernels::TensorLists& lists, const Args& args) {
  on_backend(
      device, [&] { cpu(lists, args); }, [&](void* stream) { cuda(lists, args, stream); });
}

}  // namespace apex::bridge
