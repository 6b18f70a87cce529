// The one translation unit that includes c10d's NCCL header. USE_C10D_NCCL comes with the CUDA
// torch target; nccl.h from the nvidia-nccl wheel a CUDA torch depends on (or the system's).
// ProcessGroupNCCL itself lives in libtorch_cuda: nothing here calls NCCL directly.
#include "parallel/backends.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

namespace apex::parallel::detail {

bool have_nccl() { return true; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout) {
  auto options = c10d::ProcessGroupNCCL::Options::create();
  options->timeout = timeout;
  return c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, options);
}

}  // namespace apex::parallel::detail
