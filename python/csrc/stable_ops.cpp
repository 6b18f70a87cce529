// The Python package's second op library, on LibTorch's stable ABI: the multi-tensor ops of
// apex.optimizers and amp_C, the norms' forward and backward and SyncBatchNorm's CPU pieces
// (namespace apex_cpp_stable, the same schemas as apex_cpp's) over the same CPU kernels, compiled
// with TORCH_TARGET_VERSION 2.10, so that one build loads into every torch from 2.10 on.
// python/apex/_ops.py uses it when _apex_cpp.so (regular ABI, every op) was built for another
// torch. It holds no ATen code: tensors are checked through the stable accessors, scalars live on
// the host (CPU tensors only), the kernels' thread pool is torch::stable::parallel_for
// (kernels/cpu/parallel.h).
//
// This file is the registrations only. The multi-tensor ops' bodies, checks and messages are
// src/ops', shared with the regular library; what they need of torch::stable::Tensor, and the
// entry points that are not src/ops templates, are stable_glue.{h,cpp}.
#include <torch/csrc/stable/library.h>

#include "ops/multi_tensor_ops.h"
#include "schemas.h"
#include "stable_glue.h"

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
