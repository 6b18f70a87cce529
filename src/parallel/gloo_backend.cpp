// The one translation unit that includes c10d's Gloo header (with USE_C10D_GLOO, which the torch
// target defines, and Debian's gloo headers). Gloo itself lives inside libtorch_cpu, whose gloo is
// newer than those headers: every gloo type stays opaque here (nothing is constructed or called
// through them but the exported ProcessGroupGloo functions), see docs/distributed.md.
#include "parallel/backends.h"

#include <c10/util/Exception.h>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>

#include <cstdlib>
#include "common/environment.h"

namespace apex::parallel::detail {

bool have_gloo() { return true; }

c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& hostname) {
  auto options = c10d::ProcessGroupGloo::Options::create(timeout);
  if (const auto ifname = apex::detail::env("GLOO_SOCKET_IFNAME")) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForInterface(*ifname));
  } else if (!hostname.empty()) {
    options->devices.push_back(c10d::ProcessGroupGloo::createDeviceForHostname(hostname));
  } else {
    options->devices.push_back(c10d::ProcessGroupGloo::createDefaultDevice());
  }
  return c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
}

}  // namespace apex::parallel::detail
