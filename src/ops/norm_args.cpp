#include "ops/norm_args.h"

#include <algorithm>

#include "ops/lists.h"

namespace apex::ops {
namespace {

// c10::isFloatingType, which is not header-only.
bool floating(ScalarType t) {
  switch (t) {
    case ScalarType::Double:
    case ScalarType::Float:
    case ScalarType::Half:
    case ScalarType::BFloat16:
    case ScalarType::Float8_e5m2:
    case ScalarType::Float8_e5m2fnuz:
    case ScalarType::Float8_e4m3fn:
    case ScalarType::Float8_e4m3fnuz:
    case ScalarType::Float8_e8m0fnu:
    case ScalarType::Float4_e2m1fn_x2:
      return true;
    default:
      return false;
  }
}

}  // namespace

NormGeometry check_norm(const char* who, const TensorRef& x, Dims shape, const TensorRef& w,
                        const TensorRef& b, double eps) {
  APEX_OPS_CHECK(x.defined, who, ": input is undefined");
  APEX_OPS_CHECK(floating(x.dtype), who, ": input must be a floating-point tensor, got ",
                 DtypeName{x.dtype});
  APEX_OPS_CHECK(eps > 0, who, ": eps must be > 0, got ", eps);
  APEX_OPS_CHECK(!shape.empty(), who, ": normalized_shape must not be empty");
  const size_t nd = shape.size();
  APEX_OPS_CHECK(x.sizes.size() >= nd && x.sizes.slice(x.sizes.size() - nd) == shape, who,
                 ": normalized_shape ", Shape{shape},
                 " does not match the trailing dimensions of an input of shape ", Shape{x.sizes});
  for (const TensorRef* t : {&w, &b}) {
    if (!t->defined) continue;
    const char* name = t == &w ? "weight" : "bias";
    APEX_OPS_CHECK(t->sizes == shape, who, ": ", name, " must have shape ", Shape{shape}, ", got ",
                   Shape{t->sizes});
    require_backend(*t, who);
    APEX_OPS_CHECK(t->same_device(x), who, ": ", name, " is on ", DeviceOf{*t},
                   " but the input is on ", DeviceOf{x});
  }
  require_backend(x, who);
  int64_t cols = 1;
  for (int64_t d : shape) cols *= d;
  return {cols == 0 ? 0 : x.numel / cols, cols};
}

void check_norm_backward(const char* who, NormGeometry g, const TensorRef& grad_out,
                         const TensorRef& saved, const TensorRef& mean, const TensorRef& rstd,
                         bool rms, bool memory_efficient, ScalarType input_dtype) {
  APEX_OPS_CHECK(grad_out.sizes == saved.sizes, who, ": the gradient has shape ",
                 Shape{grad_out.sizes}, ", expected the output's ", Shape{saved.sizes});
  APEX_OPS_CHECK(rstd.numel == g.rows && (rms || memory_efficient || mean.numel == g.rows), who,
                 ": the saved statistics have ", rstd.numel, " rows, expected ", g.rows);
  require_backend(grad_out, who);
  // The kernels read the saved input as input_dtype.
  APEX_OPS_CHECK(memory_efficient || saved.dtype == input_dtype, who, ": the saved input is ",
                 DtypeName{saved.dtype}, " but input_dtype is ", DtypeName{input_dtype});
}

void check_param_dtypes(const char* who, const TensorRef& w, const TensorRef& b) {
  APEX_OPS_CHECK(!w.defined || !b.defined || w.dtype == b.dtype, who,
                 ": weight and bias must have the same dtype, got ", DtypeName{w.dtype}, " and ",
                 DtypeName{b.dtype});
}

kernels::NormForwardArgs norm_forward_args(const char* who, NormGeometry g, double eps, bool rms,
                                           const TensorRef& x, const TensorRef& w,
                                           const TensorRef& b, const TensorRef& y,
                                           const TensorRef& mean, const TensorRef& rstd) {
  check_param_dtypes(who, w, b);
  kernels::NormForwardArgs a;
  a.rows = g.rows;
  a.cols = g.cols;
  a.rms = rms;
  a.eps = static_cast<float>(eps);
  a.x_dtype = kernel_dtype(x.dtype, who);
  a.y_dtype = kernel_dtype(y.dtype, who);
  if (w.defined) a.w_dtype = kernel_dtype(w.dtype, who);
  if (b.defined) a.w_dtype = kernel_dtype(b.dtype, who);
  a.x = x.data;
  a.w = w.defined ? w.data : nullptr;
  a.b = b.defined ? b.data : nullptr;
  a.y = y.data;
  a.mean = rms ? nullptr : static_cast<float*>(mean.data);
  a.rstd = static_cast<float*>(rstd.data);
  return a;
}

kernels::NormBackwardArgs norm_backward_args(const char* who, NormGeometry g, double eps, bool rms,
                                             bool memory_efficient, ScalarType x_dtype,
                                             const TensorRef& dy, const TensorRef& src,
                                             const TensorRef& w, const TensorRef& b,
                                             const TensorRef& mean, const TensorRef& rstd,
                                             const TensorRef& dx, const TensorRef& dw,
                                             const TensorRef& db) {
  kernels::NormBackwardArgs a;
  a.rows = g.rows;
  a.cols = g.cols;
  a.rms = rms;
  a.eps = static_cast<float>(eps);
  a.x_dtype = kernel_dtype(x_dtype, who);
  a.dy_dtype = kernel_dtype(dy.dtype, who);
  APEX_OPS_CHECK(!memory_efficient || src.dtype == dy.dtype, who, ": the gradient's dtype ",
                 DtypeName{dy.dtype}, " differs from the output's ", DtypeName{src.dtype});
  const bool read_b = b.defined && memory_efficient;
  if (w.defined) a.w_dtype = kernel_dtype(w.dtype, who);
  if (read_b) a.w_dtype = kernel_dtype(b.dtype, who);
  a.dy = dy.data;
  a.x = memory_efficient ? nullptr : src.data;
  a.y = memory_efficient ? src.data : nullptr;
  a.w = w.defined ? w.data : nullptr;
  a.b = read_b ? b.data : nullptr;
  a.mean = rms || memory_efficient ? nullptr : static_cast<const float*>(mean.data);
  a.rstd = static_cast<const float*>(rstd.data);
  a.dx = dx.defined ? dx.data : nullptr;
  a.dw = dw.defined ? dw.data : nullptr;
  a.db = db.defined ? db.data : nullptr;
  if (dw.defined || db.defined) a.dwb_dtype = kernel_dtype(dw.defined ? dw.dtype : db.dtype, who);
  return a;
}

}  // namespace apex::ops
