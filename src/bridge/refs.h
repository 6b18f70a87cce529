#pragma once

// Internal: an at::Tensor as src/ops sees it (ops::TensorRef), for the regular library's glue.

#include <ATen/core/Tensor.h>

#include <vector>

#include "ops/tensor_ref.h"

namespace apex::bridge {

/// LibTorch's name of a layout, as c10 prints it.
const char* layout_name(c10::Layout layout);

/// What checks of shapes, dtypes and devices read (no data pointer, `dense` unset): cheaper, for
/// ops of a few microseconds (the norms of a few rows).
inline ops::TensorRef meta_ref(const at::Tensor& t) {
  ops::TensorRef r;
  if (!t.defined()) return r;
  r.defined = true;
  r.dtype = t.scalar_type();
  r.device_type = t.device().type();
  r.device_index = t.device().index();
  if (t.layout() != c10::kStrided) {
    r.strided = false;
    r.layout = layout_name(t.layout());
    return r;
  }
  r.sizes = t.sizes();
  r.strides = t.strides();
  r.numel = t.numel();
  return r;
}

/// What kernel arguments and list rows read after the checks (defined, dtype, numel and the
/// data pointer only).
inline ops::TensorRef data_ref(const at::Tensor& t) {
  ops::TensorRef r;
  if (!t.defined()) return r;
  r.defined = true;
  r.dtype = t.scalar_type();
  r.numel = t.numel();
  r.data = t.data_ptr();
  return r;
}

/// The view of `t` (undefined for an undefined tensor); sizes and strides only for strided ones.
inline ops::TensorRef ref(const at::Tensor& t) {
  ops::TensorRef r = meta_ref(t);
  if (!r.defined || !r.strided) return r;
  r.dense = t.is_non_overlapping_and_dense();
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  r.data = impl->has_storage() && impl->storage_initialized() ? t.data_ptr() : nullptr;
  return r;
}

inline ops::TensorRefs refs(const std::vector<at::Tensor>& ts) {
  ops::TensorRefs r;
  r.reserve(ts.size());
  for (const at::Tensor& t : ts) r.push_back(ref(t));
  return r;
}

}  // namespace apex::bridge
