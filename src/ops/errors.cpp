// The two things src/ops leaves to the op library it is compiled into: its error type and the
// devices it has kernels for. The regular library (libapex) throws c10::Error, as TORCH_CHECK
// does; the stable-ABI library (APEX_KERNELS_STABLE_ABI, python/csrc/stable_ops.cpp) may not use
// c10's symbols, so it throws std::runtime_error. Both reach Python as a RuntimeError carrying the
// message alone.
#include <string>

#include "ops/tensor_ref.h"

#ifdef APEX_KERNELS_STABLE_ABI
#include <stdexcept>
#else
#include <c10/util/Exception.h>
#endif

namespace apex::ops {

void fail(const std::string& message) {
#ifdef APEX_KERNELS_STABLE_ABI
  throw std::runtime_error(message);
#else
  C10_THROW_ERROR(Error, message);
#endif
}

void require_backend(const TensorRef& t, const char* who) {
#ifdef APEX_KERNELS_STABLE_ABI
  APEX_OPS_CHECK(
      t.is_cpu(), who, ": apex-cpp's stable-ABI op library runs on CPU tensors, got a tensor on ",
      DeviceOf{t}, " (the regular op library, built for this torch, has the CUDA kernels)");
#else
  (void)t;
  (void)who;
#endif
}

}  // namespace apex::ops
