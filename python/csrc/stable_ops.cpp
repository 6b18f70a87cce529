// The Python package's second op library, on LibTorch's stable ABI: the multi-tensor ops of
// apex.optimizers and amp_C, the norms' forward and backward and SyncBatchNorm's CPU pieces
// (namespace apex_cpp_stable, the same schemas as apex_cpp's) over the same CPU kernels, compiled
// with TORCH_TARGET_VERSION 2.10, so that one build loads into every torch from 2.10 on.
// python/apex/_ops.py uses it when _apex_cpp.so (regular ABI, every op) was built for another
// torch. It holds no ATen code: tensors are checked through the stable accessors, scalars live on
// the host (CPU tensors only), the kernels' thread pool is torch::stable::parallel_for
// (kernels/cpu/parallel.h).
//
// The multi-tensor ops' bodies, checks and messages are src/ops', shared with the regular library;
// StableGlue below is what they need of torch::stable::Tensor.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/batch_norm.h"
#include "kernels/multi_tensor.h"
#include "kernels/norm.h"
#include "ops/batch_norm_ops.h"
#include "ops/multi_tensor_ops.h"
#include "ops/norm_args.h"
#include "ops/scalars.h"
#include "schemas.h"

namespace apex::python::stable {
namespace {

using torch::headeronly::MemoryFormat;
using torch::headeronly::ScalarType;

using torch::stable::Tensor;
using TensorList = std::vector<Tensor>;

ops::TensorRef ref(const Tensor& t) {
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

ops::TensorRefs refs(const TensorList& l) {
  ops::TensorRefs r;
  r.reserve(l.size());
  for (const Tensor& t : l) r.push_back(ref(t));
  return r;
}

ops::TensorRef opt_ref(const std::optional<Tensor>& t) {
  return t.has_value() ? ref(*t) : ops::TensorRef();
}

double read_scalar(const Tensor& t) { return ops::read_scalar(ref(t)); }
void write_scalar(const Tensor& t, double v) { ops::write_scalar(ref(t), v); }

// The op bodies' view of torch::stable::Tensor (ops/multi_tensor_ops.h): CPU tensors, scalars
// and flags read and written on the host.
struct StableGlue {
  using Tensor = torch::stable::Tensor;
  using In = Tensor;  // the stable ABI boxes arguments by value
  using ListIn = TensorList;
  using OptIn = std::optional<Tensor>;

  static ops::TensorRef ref(const Tensor& t) { return stable::ref(t); }
  static ops::TensorRefs refs(const TensorList& l) { return stable::refs(l); }
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

// ---- norms -------------------------------------------------------------------------------------
// fused_norm_fwd / fused_norm_bwd for fp32, bf16 and fp16 CPU tensors: the regular library's
// glue (src/normalization/norm.cpp) without its float64 path, which apex._stable_norms computes
// with torch's ops. Autograd and autocast are Python's here (apex._stable_norms): the stable ABI
// registers kernels for backend keys, not autograd nodes.

// t, or a contiguous copy (each stable op call costs ~1 us through the dispatcher: skipped where
// the tensor already is).
Tensor as_contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}
std::optional<Tensor> as_contiguous(const std::optional<Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return as_contiguous(*t);
}

std::tuple<Tensor, Tensor, Tensor> fused_norm_fwd(Tensor input, std::vector<int64_t> shape,
                                                  std::optional<Tensor> weight,
                                                  std::optional<Tensor> bias, double eps, bool rms,
                                                  bool mixed, bool memory_efficient) {
  (void)memory_efficient;  // the forward is the same; the caller saves the output instead
  const char* who = ops::norm_who(rms);
  const ops::NormGeometry g =
      ops::check_norm(who, ref(input), shape, opt_ref(weight), opt_ref(bias), eps);
  APEX_OPS_CHECK(!mixed || weight.has_value(), who, ": the mixed-dtype variants need a weight");
  const Tensor x = as_contiguous(input);
  const std::optional<Tensor> w = as_contiguous(weight);
  const std::optional<Tensor> b = as_contiguous(bias);
  // The mixed variants return the parameters' dtype (apex's MixedFused* definition).
  const ScalarType out_dtype = mixed && w ? w->scalar_type() : x.scalar_type();
  ops::check_param_dtypes(who, opt_ref(w), opt_ref(b));
  Tensor y = torch::stable::new_empty(x, x.sizes(), out_dtype);
  Tensor mean = torch::stable::new_empty(x, {rms ? 0 : g.rows}, ScalarType::Float);
  Tensor rstd = torch::stable::new_empty(x, {g.rows}, ScalarType::Float);
  const kernels::NormForwardArgs a = ops::norm_forward_args(
      who, g, eps, rms, ref(x), opt_ref(w), opt_ref(b), ref(y), ref(mean), ref(rstd));
  if (g.rows > 0 && g.cols > 0) kernels::cpu::norm_forward(a);
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> fused_norm_bwd(
    Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, std::optional<Tensor> weight,
    std::optional<Tensor> bias, std::vector<int64_t> shape, double eps, bool rms, bool mixed,
    bool memory_efficient, ScalarType input_dtype, std::vector<bool> output_mask) {
  (void)mixed;  // the gradients' dtypes follow the tensors
  const char* who = ops::norm_who(rms);
  const ops::NormGeometry g =
      ops::check_norm(who, ref(saved), shape, opt_ref(weight), opt_ref(bias), eps);
  APEX_OPS_CHECK(output_mask.size() == 3, who, ": output_mask must have 3 entries");
  ops::check_norm_backward(who, g, ref(grad_out), ref(saved), ref(mean), ref(rstd), rms,
                           memory_efficient, input_dtype);
  ops::check_param_dtypes(who, opt_ref(weight), opt_ref(bias));
  const Tensor dy = as_contiguous(grad_out);
  const Tensor src = as_contiguous(saved);
  const std::optional<Tensor> w = as_contiguous(weight);
  const std::optional<Tensor> b = as_contiguous(bias);
  const Tensor mean_c = as_contiguous(mean);
  const Tensor rstd_c = as_contiguous(rstd);
  const bool want_dx = output_mask[0];
  const bool want_w = output_mask[1] && w.has_value();
  const bool want_b = output_mask[2] && b.has_value();
  // dw and db in the parameters' dtype (the weight's, or the bias's when there is no weight).
  const ScalarType w_dtype = w ? w->scalar_type() : b ? b->scalar_type() : ScalarType::Float;
  const int64_t cols = g.cols;
  Tensor empty = torch::stable::new_empty(src, {0});
  Tensor dx = want_dx ? torch::stable::new_empty(src, src.sizes(), input_dtype) : empty;
  Tensor dw = want_w ? torch::stable::new_empty(src, {cols}, w_dtype) : empty;
  Tensor db = want_b ? torch::stable::new_empty(src, {cols}, w_dtype) : empty;
  const ops::TensorRef none;
  const kernels::NormBackwardArgs a = ops::norm_backward_args(
      who, g, eps, rms, memory_efficient, input_dtype, ref(dy), ref(src), opt_ref(w), opt_ref(b),
      ref(mean_c), ref(rstd_c), want_dx ? ref(dx) : none, want_w ? ref(dw) : none,
      want_b ? ref(db) : none);
  if (g.rows > 0 && cols > 0) {
    kernels::cpu::norm_backward(a);
  } else {
    for (Tensor* t : {&dx, &dw, &db}) {
      if (t->numel() > 0) torch::stable::zero_(*t);
    }
  }
  const auto as_param = [&](Tensor& t) {
    return t.numel() > 0 || (t.dim() == 1 && cols == 0) ? torch::stable::reshape(t, shape) : t;
  };
  return {dx, want_w ? as_param(dw) : dw, want_b ? as_param(db) : db};
}

// ---- batch norm (SyncBatchNorm's per-rank pieces, CPU) ------------------------------------------
// src/parallel/batch_norm_ops.cpp's CPU route on the stable accessors (its ATen route serves CUDA
// input, which this library does not take): the input viewed as [outer, channels, inner], NC*
// or channels-last, as the regular library's.

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

Tensor batch_norm_stats(Tensor input) {
  constexpr const char* who = "batch_norm_stats";
  return ops::batch_norm_stats<StableBatchNormGlue>(who, input,
                                                    ops::batch_norm_layout(who, ref(input)));
}

Tensor elemt(const char* who, const Tensor& u, const Tensor* v, const Tensor& mean, const Tensor& a,
             const Tensor* b, const Tensor& k) {
  const ops::BatchNormLayout l = ops::batch_norm_layout(who, ref(u));
  const ops::TensorRef gradient = v != nullptr ? ref(*v) : ops::TensorRef();
  ops::check_gradient_shape(who, v != nullptr ? &gradient : nullptr, ref(u));
  return ops::batch_norm_elemt<StableBatchNormGlue>(who, u, v, mean, a, b, k, l);
}

Tensor batch_norm_elemt(Tensor input, Tensor mean, Tensor scale, Tensor shift) {
  return elemt("batch_norm_elemt", input, nullptr, mean, scale, nullptr, shift);
}

Tensor batch_norm_backward_elemt(Tensor grad_out, Tensor input, Tensor mean, Tensor a, Tensor b,
                                 Tensor k) {
  return elemt("batch_norm_backward_elemt", input, &grad_out, mean, a, &b, k);
}

Tensor batch_norm_backward_reduce(Tensor grad_out, Tensor input, Tensor mean64) {
  constexpr const char* who = "batch_norm_backward_reduce";
  const ops::BatchNormLayout l = ops::batch_norm_layout(who, ref(input));
  ops::check_backward_reduce(who, ref(grad_out), ref(input), ref(mean64), l);
  return ops::batch_norm_backward_reduce<StableBatchNormGlue>(who, grad_out, input, mean64, l);
}

void update_scale_hysteresis(Tensor scale, Tensor growth_tracker, Tensor hysteresis_tracker,
                             Tensor found_inf, double growth_factor, double backoff_factor,
                             int64_t growth_interval, int64_t hysteresis) {
  ops::update_scale_hysteresis(ref(scale), ref(growth_tracker), ref(hysteresis_tracker),
                               ref(found_inf), growth_factor, backoff_factor, growth_interval,
                               hysteresis);
}

std::string cpu_isa() { return kernels::cpu::isa_name(); }

}  // namespace
}  // namespace apex::python::stable

// The schemas are apex_cpp's (schemas.h), so that the Python layer calls either library the
// same way.
STABLE_TORCH_LIBRARY(apex_cpp_stable, m) {
#define APEX_PY_DEF(name, schema) m.def(schema);
  APEX_PY_MULTI_TENSOR_OPS(APEX_PY_DEF)
#undef APEX_PY_DEF
  m.def(APEX_PY_UPDATE_SCALE_HYSTERESIS_SCHEMA);
  m.def(APEX_PY_NORM_FWD_SCHEMA);
  m.def(APEX_PY_NORM_BWD_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_STATS_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_ELEMT_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_BACKWARD_REDUCE_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_BACKWARD_ELEMT_SCHEMA);
  m.def("cpu_isa() -> str");
}

namespace {
// Every op's kernel, for the CPU key and for the CUDA key: CUDA tensors reach the same functions,
// whose checks say that this library has CPU kernels only (rather than the dispatcher's "could
// not run ... with arguments from the 'CUDA' backend").
void register_kernels(torch::stable::detail::StableLibrary& m) {
  using namespace apex::python::stable;
#define APEX_PY_IMPL(name, schema) m.impl(#name, TORCH_BOX(&apex::ops::name<StableGlue>));
  APEX_PY_MULTI_TENSOR_OPS(APEX_PY_IMPL)
#undef APEX_PY_IMPL
  m.impl("update_scale_hysteresis", TORCH_BOX(&update_scale_hysteresis));
  m.impl("fused_norm_fwd", TORCH_BOX(&fused_norm_fwd));
  m.impl("fused_norm_bwd", TORCH_BOX(&fused_norm_bwd));
  m.impl("batch_norm_stats", TORCH_BOX(&batch_norm_stats));
  m.impl("batch_norm_elemt", TORCH_BOX(&batch_norm_elemt));
  m.impl("batch_norm_backward_reduce", TORCH_BOX(&batch_norm_backward_reduce));
  m.impl("batch_norm_backward_elemt", TORCH_BOX(&batch_norm_backward_elemt));
}
}  // namespace

STABLE_TORCH_LIBRARY_IMPL(apex_cpp_stable, CPU, m) { register_kernels(m); }
STABLE_TORCH_LIBRARY_IMPL(apex_cpp_stable, CUDA, m) { register_kernels(m); }

// No tensor arguments: a kernel for every dispatch key.
STABLE_TORCH_LIBRARY_IMPL(apex_cpp_stable, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&apex::python::stable::cpu_isa));
}
