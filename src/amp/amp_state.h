// amp's state behind an Amp handle (apex/amp/initialize.h): per optimizer its parameters' slots
// (model and fp32 master), per loss its scaler, the overflow checks not yet read. amp.cpp holds the
// handle and ScaledLoss, amp_state.cpp this state's steps, amp_checkpoint.cpp its state dict.
#pragma once

#include <apex/amp/initialize.h>
#include <apex/amp/loss_scaler.h>
#include <apex/amp/options.h>

#include <ATen/core/Tensor.h>
#include <c10/util/FunctionRef.h>

#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_set>
#include <vector>

#include "amp/half_model_check.h"

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace apex::amp::detail {

/// One parameter the optimizer updates. `copy` slots hold a half model parameter and its fp32
/// master (O2); otherwise model and master are the same tensor.
struct Slot {
  at::Tensor model;
  at::Tensor master;
  bool copy = false;
  at::Tensor stash;  // unscaled gradient set aside while a new backward runs
  // The master's version when the model last matched it: a different one means something else
  // (the user's own optimizer.step()) changed it since.
  int64_t master_version = 0;
  // Copy slots: the model gradient left after its fold into the master gradient, and its version.
  // If the user clears or zeroes it (model->zero_grad()), the master gradient starts afresh too.
  at::Tensor folded_grad;
  int64_t folded_version = 0;
};

struct OptimizerEntry {
  torch::optim::Optimizer* optimizer = nullptr;
  std::vector<Slot> slots;
  bool scaled_pending = false;  // a delay_unscale scope left scaled gradients
  int64_t pending_loss_id = -1;
  bool backward_since_step = false;
  bool overflowed = false;  // a resolved overflow check hit this optimizer since its last step
  int64_t skipped = 0;
  // amp.step() steps this optimizer (it was called once). Until then the user's own
  // optimizer.step() may: overflow checks are read at the end of each scale_loss scope, so that
  // such a step already finds the gradients cleared, and O2's masters are copied into the model
  // at the next forward or scale_loss after a backward (`dirty`), since LibTorch's optimizers
  // have no step hooks and not all of them bump their parameters' version counters.
  bool amp_steps = false;
  bool dirty = false;
  // Options::unscale_in_optimizer: the gradients are still scaled; this 0-dim fp32 tensor is the
  // factor the fused optimizer applies in its kernel.
  at::Tensor deferred_inv;
};

/// The overflow flags one scale_loss scope produced, not yet read on the host.
struct PendingCheck {
  int64_t loss_id;
  std::vector<size_t> targets;
  std::vector<at::Tensor> flags;
};

struct AmpState {
  Properties props;
  std::vector<std::shared_ptr<torch::nn::Module>> models;
  std::vector<OptimizerEntry> entries;
  std::vector<LossScaler> scalers;
  std::vector<PendingCheck> pending;
  std::exception_ptr deferred;
  int verbosity = 1;
  // Static scale 1.0 without master weights: apex's fast path, no unscale and no check.
  bool fast_path = false;
  bool unscale_in_optimizer = false;
  // O2/O3: the models cast to half get amp's message when called with fp32 input outside
  // forward(), and are saved in fp32 by apex::save_module.
  std::optional<HalfModelCheck> half_model_check;

  ~AmpState();
  /// Whether this process prints amp's messages: verbosity 1 prints on rank 0 of a job only
  /// (RANK, as torchrun and apex-train set it), verbosity 2 on every rank.
  bool log_rank() const;
  void rethrow_deferred();
  std::vector<size_t> targets_of(const ScaleLossOptions& options) const;
  /// Reads the pending overflow checks `pred` selects (one host synchronization for all).
  void resolve(c10::function_ref<bool(const PendingCheck&)> pred);
  void prepare_backward(size_t target, int64_t loss_id);
  void post_backward(const std::vector<size_t>& targets, int64_t loss_id);
  void abandon(const std::vector<size_t>& targets);
  void clear_grads(OptimizerEntry& e);
  void copy_masters_to_model(OptimizerEntry& e);
  static void record_versions(OptimizerEntry& e);
  /// Copies the fp32 masters into the model where something else changed them since the last
  /// copy (their version counters moved), or, until amp.step() is used, after every backward (the
  /// user's own optimizer.step() may not move them: torch::optim::SGD writes through .data()).
  /// Returns whether the masters' versions had moved.
  bool sync(OptimizerEntry& e);
  void sync_all();
  static void materialize_deferred(OptimizerEntry& e);
  bool can_defer(const OptimizerEntry& e) const;
  bool step(const std::vector<size_t>& indices);
};

/// The optimizers some live Amp handle manages (one handle per optimizer), and its lock.
std::mutex& registry_mutex();
std::unordered_set<const torch::optim::Optimizer*>& registry();

/// Whether amp is on and the model computes in half: autocast (O1) or a half model (O2, O3).
inline bool computes_in_half(const Properties& p) {
  return p.enabled &&
         (p.patch_torch_functions || (p.cast_model_type && *p.cast_model_type != at::kFloat));
}

}  // namespace apex::amp::detail
