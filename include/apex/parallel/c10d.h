#pragma once

// The c10d objects behind an apex::parallel::ProcessGroup, for code that calls c10d directly
// (its own collectives, comm hooks, a torch::distributed API we do not wrap). Includes c10d's
// ProcessGroup header: heavy, and not part of LibTorch's stable API.

#include <apex/parallel/process_group.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace apex::parallel {

/// The c10d process group (throws if `group` is not valid).
c10::intrusive_ptr<c10d::ProcessGroup> c10d_group(const ProcessGroup& group);

/// The group's store (the default_pg prefix applied), for out-of-band keys; null for a group made
/// by process_group_of.
c10::intrusive_ptr<c10d::Store> c10d_store(const ProcessGroup& group);

/// An apex::parallel::ProcessGroup over a c10d group someone else made (torch.distributed's, in
/// the Python package): its rank and size, Gloo or NCCL by its backend's name, tensors on `device`
/// (CPU for Gloo), collectives waited for at most `timeout`. It is not the default group and has
/// no store; destroy() forgets it without shutting the c10d group down.
ProcessGroup process_group_of(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device,
                              std::chrono::milliseconds timeout);

}  // namespace apex::parallel
