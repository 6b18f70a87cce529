// Stand-in where LibTorch is a CPU build or nccl.h was not found at configure time.
#include <c10/util/Exception.h>
#include <torch/version.h>

#include "parallel/backends.h"

namespace apex::parallel::detail {

bool have_nccl() { return false; }

c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, std::chrono::milliseconds) {
  TORCH_CHECK(false,
              "apex::parallel: the NCCL backend is not available in this build (it needs a "
              "CUDA build of LibTorch and nccl.h at configure time; this LibTorch is ",
              TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR, ")");
}

}  // namespace apex::parallel::detail
