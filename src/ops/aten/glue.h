// The regular library's view of at::Tensor for src/ops' multi-tensor bodies
// (ops/multi_tensor_ops.h): CPU or CUDA tensors, scalars and flags on the tensors' device (no host
// sync), the kernels launched on the tensors' backend (bridge/bridge.h). src/ops/aten/ holds the
// regular (ATen) library's op entry points; src/ops itself stays ATen-free for the stable one.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <optional>
#include <vector>

#include "bridge/bridge.h"
#include "bridge/refs.h"
#include "kernels/multi_tensor.h"
#include "ops/tensor_ref.h"

namespace apex::ops {

struct AtenGlue {
  using Tensor = at::Tensor;
  using In = const Tensor&;
  using TensorList = std::vector<Tensor>;
  using ListIn = const TensorList&;
  using OptIn = const std::optional<Tensor>&;

  static ops::TensorRef ref(const Tensor& t) { return bridge::ref(t); }
  static ops::TensorRefs refs(const TensorList& l) { return bridge::refs(l); }
  static Tensor float_zeros(const Tensor& like, int64_t n) {
    return at::zeros({n}, like.options().dtype(at::kFloat));
  }
  static Tensor float_empty(const Tensor& like, int64_t n) {
    return at::empty({n}, like.options().dtype(at::kFloat));
  }
  static Tensor float_full(const Tensor& like, double v) {
    return at::full({1}, v, like.options().dtype(at::kFloat));
  }
  static Tensor as_float(const Tensor& t, const Tensor& like) {
    return t.to(like.options().dtype(at::kFloat)).reshape({-1}).contiguous();
  }
  static float* floats(const Tensor& t) { return t.data_ptr<float>(); }
  static void raise_flag(const Tensor& noop, const Tensor& flag) {
    const Tensor merged = at::maximum(noop.reshape({1}).to(at::kFloat), flag.to(noop.device()));
    noop.copy_(merged.reshape(noop.sizes()).to(noop.scalar_type()));
  }
  static void raise_flag_if_nonfinite(const Tensor& noop, const Tensor& x) {
    raise_flag(noop, at::logical_not(at::isfinite(x.reshape({1}))).to(at::kFloat));
  }
  template <class Kernel, class Args>
  static void launch(const ops::TensorRef& on, const kernels::TensorLists& lists,
                     const Args& args) {
    const c10::Device device(on.device_type, static_cast<c10::DeviceIndex>(on.device_index));
    bridge::on_backend(
        device, [&] { Kernel::cpu(lists, args); },
        [&](void* stream) { Kernel::cuda(lists, args, stream); });
  }
};

}  // namespace apex::ops
