// Backend factories, each in its own translation unit (its c10d header needs a define and
// headers of its own). Everything else sees only c10d::Backend.
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

#include <chrono>
#include <string>

namespace apex::parallel::detail {

/// Whether this build has the Gloo backend (found the gloo headers at configure time).
bool have_gloo();

/// A Gloo backend for `store`, its sockets on `hostname`'s address ($GLOO_SOCKET_IFNAME's if set;
/// this host's default address if `hostname` is empty).
c10::intrusive_ptr<c10d::Backend> make_gloo_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout,
                                                    const std::string& hostname);

/// Whether Gloo's transport thread calls our handler around a pair's events (an exception there
/// becomes the pair's error instead of std::terminate; gloo_transport_guard.cpp). False where this
/// build has no Gloo, or where the process did not bind Gloo's names to ours.
bool gloo_transport_guarded();

/// Whether this build has the NCCL backend (a CUDA LibTorch and nccl.h at configure time).
bool have_nccl();

/// An NCCL backend for `store` (CUDA tensors; each rank on the device its tensors live on).
c10::intrusive_ptr<c10d::Backend> make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                    int rank, int size,
                                                    std::chrono::milliseconds timeout);

}  // namespace apex::parallel::detail
