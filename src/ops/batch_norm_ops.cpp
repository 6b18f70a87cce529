#include "ops/batch_norm_ops.h"

#include <vector>

namespace apex::ops {
namespace {

// Whether x's strides are those of a dense tensor whose dimensions, innermost first, are `order`
// (size-1 dimensions' strides are never used).
bool strides_in_order(const TensorRef& x, const std::vector<size_t>& order) {
  int64_t expected = 1;
  for (size_t d : order) {
    if (x.sizes[d] != 1 && x.strides[d] != expected) return false;
    expected *= x.sizes[d];
  }
  return true;
}

}  // namespace

BatchNormLayout batch_norm_layout(const char* who, const TensorRef& x) {
  const size_t dim = x.sizes.size();
  APEX_OPS_CHECK(dim >= 2, who, ": expected an input of at least 2 dimensions (N, C, ...), got ",
                 Shape{x.sizes});
  require_backend(x, who);
  BatchNormLayout l;
  // A tensor contiguous both ways counts as NC*.
  if ((dim == 4 || dim == 5) && x.numel > 0) {
    std::vector<size_t> contiguous;
    for (size_t d = dim; d-- > 0;) contiguous.push_back(d);
    if (!strides_in_order(x, contiguous)) {
      std::vector<size_t> order{1};
      for (size_t d = dim - 1; d >= 2; --d) order.push_back(d);
      order.push_back(0);
      l.channels_last = strides_in_order(x, order);
    }
  }
  l.shape = kernels::batch_norm_shape(x.sizes[0], x.sizes[1], x.numel, l.channels_last);
  return l;
}

void check_channel_values(const char* who, const TensorRef& t, int64_t c, const char* name) {
  APEX_OPS_CHECK(t.numel == c, who, ": ", name, " has ", t.numel, " elements, expected ", c);
  require_backend(t, who);
}

void check_backward_reduce(const char* who, const TensorRef& grad_out, const TensorRef& input,
                           const TensorRef& mean64, const BatchNormLayout& l) {
  APEX_OPS_CHECK(grad_out.sizes == input.sizes, who, ": the gradient has shape ",
                 Shape{grad_out.sizes}, ", expected ", Shape{input.sizes});
  APEX_OPS_CHECK(mean64.numel == l.shape.channels, who, ": mean has ", mean64.numel,
                 " elements, expected ", l.shape.channels);
}

void check_gradient_shape(const char* who, const TensorRef* grad_out, const TensorRef& input) {
  APEX_OPS_CHECK(
      grad_out == nullptr || grad_out->sizes == input.sizes, who, ": the gradient has shape ",
      Shape{(grad_out != nullptr ? *grad_out : input).sizes}, ", expected ", Shape{input.sizes});
}

}  // namespace apex::ops
