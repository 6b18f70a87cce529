// Linked instead of the CUDA kernels when apex-cpp is built without a CUDA backend (no nvcc, or
// a CPU-only torch). Unreachable in practice: the host layer rejects CUDA tensors first.
#include <c10/util/Exception.h>

#include "kernels/multi_tensor.h"
#include "kernels/norm.h"

namespace apex::kernels::cuda {

#define APEX_NO_CUDA(name, Args)                                               \
  void name(const TensorLists&, Args, void*) {                                 \
    TORCH_CHECK(false, "apex-cpp was built without CUDA kernels (" #name ")"); \
  }

#define APEX_NO_CUDA_KERNEL(name, Args) APEX_NO_CUDA(name, const Args&)
APEX_MULTI_TENSOR_KERNELS(APEX_NO_CUDA_KERNEL)
#undef APEX_NO_CUDA_KERNEL
APEX_NO_CUDA(check_finite, float*)

#undef APEX_NO_CUDA

void norm_forward(const NormForwardArgs&, void*) {
  TORCH_CHECK(false, "apex-cpp was built without CUDA kernels (norm_forward)");
}

void norm_backward(const NormBackwardArgs&, void*) {
  TORCH_CHECK(false, "apex-cpp was built without CUDA kernels (norm_backward)");
}

}  // namespace apex::kernels::cuda
