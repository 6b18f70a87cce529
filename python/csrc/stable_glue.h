// The stable-ABI op library's glue (stable_ops.cpp registers, stable_glue.cpp computes): what
// src/ops' bodies need of torch::stable::Tensor (a TensorRef, allocation, host scalars and flags,
// the kernels' launch), and the entry points that are not one of src/ops' templates.
#pragma once

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "ops/batch_norm_ops.h"
#include "ops/lists.h"
#include "ops/multi_tensor_ops.h"
#include "ops/scalars.h"
#include "ops/tensor_ref.h"

namespace apex::python::stable {

using torch::headeronly::MemoryFormat;
using torch::headeronly::ScalarType;

using torch::stable::Tensor;
using TensorList = std::vector<Tensor>;

inline ops::TensorRef ref(const Tensor& t) {
  ops::TensorRef r;
  if (!t.defined()) return r;
  r.defined = true;
  r.dtype = t.scalar_type();
  r.device_type = t.is_cpu()    ? ops::DeviceType::CPU
                  : t.is_cuda() ? ops::DeviceType::CUDA
                                : ops::DeviceType::PrivateUse1;
  r.device_index = t.is_cpu() ? -1 : t.get_device_index();
  r.sizes = t.sizes();
  r.strides = t.strides();
  r.numel = t.numel();
  r.dense = ops::strides_dense(r.sizes, r.strides);
  r.data = t.mutable_data_ptr();
  return r;
}

inline ops::TensorRefs refs(const TensorList& l) {
  ops::TensorRefs r;
  r.reserve(l.size());
  for (const Tensor& t : l) r.push_back(ref(t));
  return r;
}

inline ops::TensorRef opt_ref(const std::optional<Tensor>& t) {
  return t.has_value() ? ref(*t) : ops::TensorRef();
}

inline double read_scalar(const Tensor& t) { return ops::read_scalar(ref(t)); }
inline void write_scalar(const Tensor& t, double v) { ops::write_scalar(ref(t), v); }

// The op bodies' view of torch::stable::Tensor (ops/multi_tensor_ops.h): CPU tensors, scalars
// and flags read and written on the host.
struct StableGlue {
  using Tensor = torch::stable::Tensor;
  using In = Tensor;  // the stable ABI boxes arguments by value
  using ListIn = TensorList;
  using OptIn = std::optional<Tensor>;

  static inline ops::TensorRef ref(const Tensor& t) { return stable::ref(t); }
  static inline ops::TensorRefs refs(const TensorList& l) { return stable::refs(l); }
  static Tensor float_zeros(const Tensor& like, int64_t n) {
    return torch::stable::new_zeros(like, {n}, ScalarType::Float);
  }
  static Tensor float_empty(const Tensor& like, int64_t n) {
    return torch::stable::new_empty(like, {n}, ScalarType::Float);
  }
  static Tensor float_full(const Tensor& like, double v) {
    Tensor t = float_empty(like, 1);
    *t.mutable_data_ptr<float>() = static_cast<float>(v);
    return t;
  }
  static Tensor as_float(const Tensor& t, const Tensor& /*like: every tensor is on the CPU*/) {
    const Tensor f =
        t.scalar_type() == ScalarType::Float ? t : torch::stable::to(t, ScalarType::Float);
    return f.is_contiguous() ? f : torch::stable::contiguous(f);
  }
  static float* floats(const Tensor& t) { return t.mutable_data_ptr<float>(); }
  static void raise_flag(const Tensor& noop, const Tensor& flag) {
    const float value = *flag.const_data_ptr<float>();
    if (value > read_scalar(noop)) write_scalar(noop, value);
  }
  static void raise_flag_if_nonfinite(const Tensor& noop, const Tensor& x) {
    if (!std::isfinite(*x.const_data_ptr<float>()) && 1.0 > read_scalar(noop)) {
      write_scalar(noop, 1.0);
    }
  }
  template <class Kernel, class Args>
  static void launch(const ops::TensorRef& /*on: the CPU*/, const kernels::TensorLists& lists,
                     const Args& args) {
    Kernel::cpu(lists, args);
  }
};

// t, or a contiguous copy (each stable op call costs ~1 us through the dispatcher: skipped where
// the tensor already is).
inline Tensor as_contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}
inline std::optional<Tensor> as_contiguous(const std::optional<Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return as_contiguous(*t);
}

// The batch-norm bodies' view of torch::stable::Tensor (ops/batch_norm_ops.h).
struct StableBatchNormGlue {
  using Tensor = torch::stable::Tensor;
  static ops::TensorRef ref(const Tensor& t) { return stable::ref(t); }
  static MemoryFormat format(const Tensor& t, const ops::BatchNormLayout& l) {
    return !l.channels_last ? MemoryFormat::Contiguous
           : t.dim() == 4   ? MemoryFormat::ChannelsLast
                            : MemoryFormat::ChannelsLast3d;
  }
  static Tensor in_layout(const Tensor& t, const ops::BatchNormLayout& l) {
    return l.channels_last ? torch::stable::contiguous(t, format(t, l)) : as_contiguous(t);
  }
  static Tensor values(const Tensor& t, ScalarType dtype) {
    return as_contiguous(t.scalar_type() == dtype ? t : torch::stable::to(t, dtype));
  }
  static Tensor zeros(const Tensor& like, int64_t n, ScalarType dtype) {
    return torch::stable::new_zeros(like, {n}, dtype);
  }
  static Tensor empty_in_layout(const Tensor& x, const ops::BatchNormLayout& l) {
    return torch::stable::empty(x.sizes(), x.scalar_type(), std::nullopt,
                                torch::stable::Device(torch::headeronly::DeviceType::CPU),
                                std::nullopt, format(x, l));
  }
};

// The norms' forward and backward (fp32, bf16 and fp16 CPU tensors), SyncBatchNorm's CPU pieces,
// the loss scaler's hysteresis rule and the kernels' ISA (stable_glue.cpp).
std::tuple<Tensor, Tensor, Tensor> fused_norm_fwd(Tensor input, std::vector<int64_t> shape,
                                                  std::optional<Tensor> weight,
                                                  std::optional<Tensor> bias, double eps, bool rms,
                                                  bool mixed, bool memory_efficient);
std::tuple<Tensor, Tensor, Tensor> fused_norm_bwd(
    Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, std::optional<Tensor> weight,
    std::optional<Tensor> bias, std::vector<int64_t> shape, double eps, bool rms, bool mixed,
    bool memory_efficient, ScalarType input_dtype, std::vector<bool> output_mask);
Tensor batch_norm_stats(Tensor input);
Tensor batch_norm_elemt(Tensor input, Tensor mean, Tensor scale, Tensor shift);
Tensor batch_norm_backward_elemt(Tensor grad_out, Tensor input, Tensor mean, Tensor a, Tensor b,
                                 Tensor k);
Tensor batch_norm_backward_reduce(Tensor grad_out, Tensor input, Tensor mean64);
void update_scale_hysteresis(Tensor scale, Tensor growth_tracker, Tensor hysteresis_tracker,
                             Tensor found_inf, double growth_factor, double backoff_factor,
                             int64_t growth_interval, int64_t hysteresis);
std::string cpu_isa();

}  // namespace apex::python::stable
