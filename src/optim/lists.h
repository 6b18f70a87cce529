#pragma once

// Internal: where at::Tensor meets the kernels. Builds kernels::TensorLists from tensor lists after
// checking them, and runs a kernel on the backend of the lists' device.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/DeviceGuard.h>

#include <string>
#include <tuple>
#include <vector>

#include "kernels/multi_tensor.h"

namespace apex::optim::detail {

/// fp32, fp16 or bf16, else an error naming `who` and the dtype.
kernels::DType kernel_dtype(const at::Tensor& t, const char* who);
kernels::DType kernel_dtype(at::ScalarType t, const char* who);

/// Owns the pointer arrays a kernels::TensorLists refers to.
class ListBuilder {
 public:
  explicit ListBuilder(int num_lists) : num_lists_(num_lists) {}
  /// Appends tensor i of every list; absent optional lists pass undefined tensors.
  void add(std::initializer_list<at::Tensor> row);
  int64_t size() const { return static_cast<int64_t>(numel_.size()); }
  kernels::TensorLists view() const;

 private:
  int num_lists_;
  std::vector<int64_t> numel_;
  std::vector<void*> ptrs_[kernels::kMaxLists];
  kernels::DType dtype_[kernels::kMaxLists] = {};
  bool present_[kernels::kMaxLists] = {};
};

/// Checks one public list argument: non-empty, dense, one device, one fp32/fp16/bf16 dtype.
/// Messages name `who`, the argument and the offending index.
void check_list(const std::vector<at::Tensor>& list, const char* who, const char* arg);

/// Checks that `other` matches `ref` element-wise (same length, numel, device, layout).
void check_matching(const std::vector<at::Tensor>& ref, const std::vector<at::Tensor>& other,
                    const char* who, const char* ref_name, const char* other_name);

/// float* of a one-element fp32 tensor (kernel memory), or null for an undefined tensor.
float* scalar_ptr(const at::Tensor& t, c10::Device device, const char* who, const char* name);

/// Hyper-parameter checks shared by the optimizers: "<who>: <name> must be >= 0, got <value>"
/// and "<who>: betas[i] must be in [0, 1), got <value>".
void check_non_negative(const char* who, const char* name, double value);
void check_betas(const char* who, const std::tuple<double, double>& betas);
/// lr, eps, betas and weight_decay of the Adam-style optimizers (Adam, LAMB, NovoGrad).
template <class Options>
void check_adam_style(const char* who, const Options& o) {
  check_non_negative(who, "lr", o.lr());
  check_non_negative(who, "eps", o.eps());
  check_betas(who, o.betas());
  check_non_negative(who, "weight_decay", o.weight_decay());
}

/// The defined tensors of `tensors` grouped by (device, dtype): one multi-tensor call per group.
/// Groups keep first-seen order, so results do not depend on hashing.
std::vector<std::vector<at::Tensor>> by_device_and_dtype(const std::vector<at::Tensor>& tensors);

/// fp32 zeros with `param`'s shape, device and strides (optimizer state).
at::Tensor zeros_state(const at::Tensor& param);
/// `t` as fp32 with `param`'s device and strides; `t` itself when it already is.
at::Tensor conform_state(const at::Tensor& t, const at::Tensor& param);
/// An fp32 copy of `param` with its strides (a master weight).
at::Tensor master_copy(const at::Tensor& param);
/// `current` conformed to `param`, or a new master copy of `param` when undefined.
inline at::Tensor ensure_master(const at::Tensor& current, const at::Tensor& param) {
  return current.defined() ? conform_state(current, param) : master_copy(param);
}

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

}  // namespace apex::optim::detail
