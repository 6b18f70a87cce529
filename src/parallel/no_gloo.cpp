// Stand-in where the gloo headers were not found at configure time: groups of one only.
#include <c10/util/Exception.h>

#include "parallel/backends.h"

namespace apex::parallel::detail {

bool have_gloo() { return false; }

bool gloo_transport_guarded() { return false; }

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>&, int,
                                                    int, std::chrono::milliseconds,
                                                    const std::string&) {
  TORCH_CHECK(false,
              "apex::parallel: this apex-cpp was built without the Gloo backend (the gloo "
              "headers were not found; install Debian's libgloo-dev and reconfigure)");
}

}  // namespace apex::parallel::detail
