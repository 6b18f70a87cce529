#pragma once

// Internal, ATen-free: what the op glue needs to know of a tensor. Both op libraries produce it,
// the regular one from an at::Tensor (bridge/refs.h), the stable-ABI one from a
// torch::stable::Tensor (python/csrc/stable_ops.cpp), so that the checks, the kernels' lists and
// their messages are written once (src/ops) and cannot drift apart.

#include <torch/headeronly/core/DeviceType.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/HeaderOnlyArrayRef.h>

#include <cstdint>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

namespace apex::ops {

using ScalarType = torch::headeronly::ScalarType;  // the type c10::ScalarType names
using DeviceType = torch::headeronly::DeviceType;
using Dims = torch::headeronly::IntHeaderOnlyArrayRef;

/// A non-owning view of a tensor, valid while the tensor lives.
struct TensorRef {
  void* data = nullptr;
  Dims sizes;
  Dims strides;
  int64_t numel = 0;
  ScalarType dtype = ScalarType::Undefined;
  DeviceType device_type = DeviceType::CPU;
  int device_index = -1;
  bool defined = false;
  /// Strided layout; else `layout` names the other (Sparse, SparseCsr, ...).
  bool strided = true;
  const char* layout = "Strided";
  /// Non-overlapping and dense: some order of the dimensions makes the strides contiguous ones.
  bool dense = false;

  bool same_device(const TensorRef& o) const {
    return device_type == o.device_type && device_index == o.device_index;
  }
  bool is_cpu() const { return device_type == DeviceType::CPU; }
};
using TensorRefs = std::vector<TensorRef>;

/// Whether strides describe a non-overlapping, dense tensor of `sizes` (size-1 dimensions'
/// strides are never used).
bool strides_dense(Dims sizes, Dims strides);

/// Printing helpers for messages, each as LibTorch prints the same thing ("[2, 3]", "cpu",
/// "cuda:0", "Float").
struct Shape {
  Dims dims;
};
inline std::ostream& operator<<(std::ostream& s, Shape d) {
  s << "[";
  for (size_t i = 0; i < d.dims.size(); ++i) s << (i ? ", " : "") << d.dims[i];
  return s << "]";
}
struct DeviceOf {
  const TensorRef& t;
};
std::ostream& operator<<(std::ostream& s, DeviceOf d);
struct DtypeName {
  ScalarType t;
};
inline std::ostream& operator<<(std::ostream& s, DtypeName d) { return s << c10::toString(d.t); }

/// Throws the library's error (c10::Error in the regular library, std::runtime_error in the
/// stable-ABI one: both a RuntimeError in Python) with `message` alone.
[[noreturn]] void fail(const std::string& message);

template <class... Args>
[[noreturn]] void fail_with(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  fail(s.str());
}

/// Refuses a tensor on a device this library has no kernels for, naming `who`. The regular
/// library leaves that to the launch (CPU, and CUDA when built with it); the stable-ABI library
/// takes CPU tensors only.
void require_backend(const TensorRef& t, const char* who);

}  // namespace apex::ops

#define APEX_OPS_CHECK(cond, ...)                     \
  do {                                                \
    if (!(cond)) ::apex::ops::fail_with(__VA_ARGS__); \
  } while (false)
