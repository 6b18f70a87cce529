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

APEX_NO_CUDA(scale, const ScaleArgs&)
APEX_NO_CUDA(axpby, const AxpbyArgs&)
APEX_NO_CUDA(norm, const NormArgs&)
APEX_NO_CUDA(check_finite, float*)
APEX_NO_CUDA(adam, const AdamArgs&)
APEX_NO_CUDA(sgd, const SgdArgs&)
APEX_NO_CUDA(adagrad, const AdagradArgs&)
APEX_NO_CUDA(lamb_stage1, const LambArgs&)
APEX_NO_CUDA(lamb_stage2, const LambArgs&)
APEX_NO_CUDA(novograd, const NovoGradArgs&)

#undef APEX_NO_CUDA

void norm_forward(const NormForwardArgs&, void*) {
  TORCH_CHECK(false, "apex-cpp was built without CUDA kernels (norm_forward)");
}

void norm_backward(const NormBackwardArgs&, void*) {
  TORCH_CHECK(false, "apex-cpp was built without CUDA kernels (norm_backward)");
}

}  // namespace apex::kernels::cuda
