#pragma once

// Process groups on LibTorch's own c10d: a TCPStore rendezvous, Gloo for CPU tensors and, in a
// build against a CUDA LibTorch with nccl.h, NCCL for CUDA tensors.
// c10d's headers stay out of this one (they are heavy and unstable); apex/parallel/c10d.h gives
// the underlying c10d::ProcessGroup to code that wants it.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <torch/arg.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace apex::parallel {

/// Which c10d backend carries the collectives.
enum class Backend {
  kAuto,  ///< Gloo for a CPU device, NCCL for CUDA
  kGloo,
  kNccl,
};

/// "gloo", "nccl" or "auto".
std::string to_string(Backend b);

/// How to join a group. Unset fields come from torchrun's environment (RANK, WORLD_SIZE,
/// MASTER_ADDR, MASTER_PORT, TORCHELASTIC_USE_AGENT_STORE) and, without it, make a group of one:
///
///   auto pg = apex::parallel::init_process_group();   // under torchrun, or alone
///   auto pg = apex::parallel::init_process_group(
///       apex::parallel::ProcessGroupOptions().rank(r).world_size(2).master_port(29511));
struct ProcessGroupOptions {
  /// This process's rank in [0, world_size); -1: $RANK, else 0.
  TORCH_ARG(int64_t, rank) = -1;
  /// Number of processes; -1: $WORLD_SIZE, else 1.
  TORCH_ARG(int64_t, world_size) = -1;
  /// The store's host; "": $MASTER_ADDR, else 127.0.0.1.
  TORCH_ARG(std::string, master_addr) = "";
  /// The store's port; -1: $MASTER_PORT, else 29500.
  TORCH_ARG(int64_t, master_port) = -1;
  /// Connect as a client to a store someone else holds (torchrun's agent): every rank, rank 0
  /// too. Unset: true when $TORCHELASTIC_USE_AGENT_STORE is "True". Otherwise rank 0 serves it.
  TORCH_ARG(std::optional<bool>, use_agent_store) = std::nullopt;
  TORCH_ARG(Backend, backend) = Backend::kAuto;
  /// The device whose tensors the group reduces (picks the backend when kAuto). With NCCL, CPU
  /// tensors of the same group go through Gloo where it is built.
  TORCH_ARG(c10::Device, device) = c10::kCPU;
  /// Longest wait for the rendezvous and for any one collective: a dead or missing rank makes the
  /// others fail after this, never hang. torch's default is 30 minutes. (With NCCL a collective
  /// does not block the host: NCCL's watchdog aborts the process after the timeout instead.)
  TORCH_ARG(std::chrono::milliseconds, timeout) = std::chrono::minutes(30);
};

namespace detail {
struct ProcessGroupState;
}

/// A joined group: rank, size and blocking collectives (each waits at most the group's timeout and
/// throws c10::Error naming the operation on failure). Copies share one group.
class ProcessGroup {
 public:
  ProcessGroup() = default;

  int64_t rank() const;
  int64_t size() const;
  Backend backend() const;
  c10::Device device() const;
  std::chrono::milliseconds timeout() const;
  /// False for a default-constructed or destroyed group.
  bool valid() const;

  /// In place: every rank ends with the sum over ranks of `tensor` (same shape and dtype).
  void all_reduce_(at::Tensor& tensor) const;
  /// In place: every rank ends with the max over ranks of `tensor`.
  void all_reduce_max_(at::Tensor& tensor) const;
  /// In place: every rank ends with `root`'s `tensor`.
  void broadcast_(at::Tensor& tensor, int64_t root = 0) const;
  /// Every rank's `tensor` (same shape and dtype on every rank), in rank order.
  std::vector<at::Tensor> all_gather(const at::Tensor& tensor) const;
  /// Every rank's `bytes` (of any length, different per rank), in rank order. Lengths travel
  /// first, so ranks that disagree cannot feed a collective of mismatched sizes: compare
  /// settings or layouts with it before collectives whose sizes depend on them.
  std::vector<std::string> all_gather_string(const std::string& bytes) const;
  /// Returns once every rank has called it.
  void barrier() const;

  /// Leaves the group (this copy and every other copy of it). Idempotent.
  void destroy();

  /// For apex/parallel/c10d.h.
  const std::shared_ptr<detail::ProcessGroupState>& state() const { return state_; }

  explicit ProcessGroup(std::shared_ptr<detail::ProcessGroupState> state);

 private:
  std::shared_ptr<detail::ProcessGroupState> state_;
};

/// Joins (or, for rank 0 without an agent store, hosts) the rendezvous and builds the group.
/// Also makes it the default group (default_process_group). Throws c10::Error with the address,
/// rank and what was expected when the options or environment are wrong or the rendezvous does
/// not complete within the timeout.
ProcessGroup init_process_group(const ProcessGroupOptions& options = {});

/// The group of the last init_process_group (invalid if none, or after destroy_process_group).
ProcessGroup default_process_group();

/// Destroys the default group.
void destroy_process_group();

/// Whether this LibTorch build and apex-cpp can create groups of `backend` (kAuto: always).
bool backend_available(Backend backend);

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed): a
/// MASTER_PORT for ranks this process starts on this machine (as torchrun --standalone picks one).
/// Throws c10::Error naming `who` when no socket can be had.
int free_loopback_port(const char* who = "apex::parallel::free_loopback_port");

}  // namespace apex::parallel
