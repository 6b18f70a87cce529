// The stable-ABI op library's entry points that are not one of src/ops' multi-tensor templates
// (stable_glue.h): the norms' allocation around src/ops' checks and Args, SyncBatchNorm's CPU
// pieces through ops/batch_norm_ops.h, the loss scaler's host rule, the ISA name.
#include "stable_glue.h"

#include <torch/csrc/stable/ops.h>

#include "ops/norm_args.h"

namespace apex::python::stable {

// ---- norms -------------------------------------------------------------------------------------
// fused_norm_fwd / fused_norm_bwd for fp32, bf16 and fp16 CPU tensors: the regular library's
// glue (src/normalization/norm.cpp) without its float64 path, which apex._stable_norms computes
// with torch's ops. Autograd and autocast are Python's here (apex._stable_norms): the stable ABI
// registers kernels for backend keys, not autograd nodes.

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

Tensor batch_norm_stats(Tensor input) {
  constexpr const char* who = "batch_norm_stats";
  return ops::batch_norm_stats<StableBatchNormGlue>(who, input,
                                                    ops::batch_norm_layout(who, ref(input)));
}

namespace {
Tensor elemt(const char* who, const Tensor& u, const Tensor* v, const Tensor& mean, const Tensor& a,
             const Tensor* b, const Tensor& k) {
  const ops::BatchNormLayout l = ops::batch_norm_layout(who, ref(u));
  const ops::TensorRef gradient = v != nullptr ? ref(*v) : ops::TensorRef();
  ops::check_gradient_shape(who, v != nullptr ? &gradient : nullptr, ref(u));
  return ops::batch_norm_elemt<StableBatchNormGlue>(who, u, v, mean, a, b, k, l);
}
}  // namespace

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

}  // namespace apex::python::stable
