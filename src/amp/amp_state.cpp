// amp's state (amp_state.h): loss scaling around each backward, the overflow checks, the masters'
// copies, the optimizers' steps.
#include "amp/amp_state.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <apex/optim/fused_optimizer.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <iostream>
#include <string>

#include "amp/unscale.h"
#include "common/environment.h"

namespace apex::amp::detail {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_set<const torch::optim::Optimizer*>& registry() {
  static std::unordered_set<const torch::optim::Optimizer*> r;
  return r;
}

AmpState::~AmpState() {
  std::lock_guard<std::mutex> lock(registry_mutex());
  for (const auto& e : entries) registry().erase(e.optimizer);
}

bool AmpState::log_rank() const {
  if (verbosity >= 2) return true;
  const std::optional<std::string> rank = apex::detail::env("RANK");
  return !rank || *rank == "0";
}

void AmpState::rethrow_deferred() {
  if (deferred) {
    auto e = deferred;
    deferred = nullptr;
    std::rethrow_exception(e);
  }
}

std::vector<size_t> AmpState::targets_of(const ScaleLossOptions& options) const {
  std::vector<size_t> targets = options.optimizers();
  if (targets.empty()) {
    for (size_t i = 0; i < entries.size(); ++i) targets.push_back(i);
  }
  for (size_t t : targets) {
    TORCH_CHECK(t < entries.size(), "Amp::scale_loss: optimizer index ", t,
                " out of range; initialize received ", entries.size(), " optimizer(s)");
  }
  std::sort(targets.begin(), targets.end());
  targets.erase(std::unique(targets.begin(), targets.end()), targets.end());
  return targets;
}

void AmpState::resolve(c10::function_ref<bool(const PendingCheck&)> pred) {
  std::vector<size_t> idx;
  for (size_t i = 0; i < pending.size(); ++i) {
    if (pred(pending[i])) idx.push_back(i);
  }
  if (idx.empty()) return;
  // One host synchronization for all checks: their totals are gathered on one device first.
  c10::Device device(c10::kCPU);
  for (size_t i : idx) {
    if (!pending[i].flags.empty()) {
      device = pending[i].flags.front().device();
      break;
    }
  }
  std::vector<at::Tensor> totals;
  totals.reserve(idx.size());
  for (size_t i : idx) totals.push_back(sum_flags(pending[i].flags, device));
  const at::Tensor values = at::cat(totals).to(c10::kCPU);
  const float* v = values.const_data_ptr<float>();
  for (size_t k = 0; k < idx.size(); ++k) {
    const PendingCheck& check = pending[idx[k]];
    const bool overflow = v[k] != 0.0f;
    auto& scaler = scalers[static_cast<size_t>(check.loss_id)];
    scaler.update(overflow);
    if (overflow) {
      for (size_t t : check.targets) {
        auto& e = entries[t];
        // One skipped step per overflowing window under amp.step(); under the user's own step()
        // every overflowing scope is followed by a step() that the cleared gradients skip.
        if (!e.overflowed || !e.amp_steps) e.skipped += 1;
        e.overflowed = true;
        // Undefined gradients: the next optimizer.step(), amp's or the user's, skips them (as
        // LibTorch's and apex's optimizers skip a parameter without a gradient).
        clear_grads(e);
      }
      if (verbosity > 0 && log_rank()) {
        std::cerr << "apex::amp: gradient overflow, skipping step; loss scaler " << check.loss_id
                  << " now at loss scale " << scaler.loss_scale() << '\n';
      }
    }
  }
  for (size_t k = idx.size(); k-- > 0;) {
    pending.erase(pending.begin() + static_cast<std::ptrdiff_t>(idx[k]));
  }
}

void AmpState::materialize_deferred(OptimizerEntry& e) {
  if (!e.deferred_inv.defined()) return;
  const at::NoGradGuard no_grad;
  for (auto& s : e.slots) {
    at::Tensor& g = s.model.mutable_grad();
    if (g.defined()) g.mul_(e.deferred_inv.to(g.device()));
  }
  e.deferred_inv = at::Tensor();
}

bool AmpState::can_defer(const OptimizerEntry& e) const {
  // Only for amp.step(), which passes the factor: the user's own step() would not.
  if (!unscale_in_optimizer || !e.amp_steps ||
      dynamic_cast<optim::FusedOptimizer*>(e.optimizer) == nullptr) {
    return false;
  }
  return std::none_of(e.slots.begin(), e.slots.end(),
                      [](const Slot& s) { return s.copy || s.stash.defined(); });
}

void AmpState::prepare_backward(size_t target, int64_t loss_id) {
  auto& e = entries[target];
  // Gradients left scaled for the optimizer are unscaled before anything accumulates onto them.
  materialize_deferred(e);
  if (e.scaled_pending) {
    // Accumulating onto gradients a delay_unscale scope left scaled by the same scaler.
    TORCH_CHECK(e.pending_loss_id == loss_id, "Amp::scale_loss: optimizer ", target,
                " holds gradients still scaled by loss scaler ", e.pending_loss_id,
                " (delay_unscale=true); the next scale_loss for it must use loss_id ",
                e.pending_loss_id, ", got ", loss_id);
    return;
  }
  for (auto& s : e.slots) {
    if (s.copy) {
      // The model gradient was folded into the master gradient. If the user cleared or zeroed it
      // since (model->zero_grad()), the master gradient restarts too, as an fp32 parameter's
      // gradient would; optimizer.zero_grad() clears the master gradient itself.
      at::Tensor& g = s.model.mutable_grad();
      const bool kept = s.folded_grad.defined() && g.defined() &&
                        g.unsafeGetTensorImpl() == s.folded_grad.unsafeGetTensorImpl() &&
                        g._version() == s.folded_version;
      if (!kept) s.master.mutable_grad() = at::Tensor();
      s.folded_grad = at::Tensor();
      g = at::Tensor();
    } else {
      // A gradient that shares its storage (a view into DistributedDataParallel's bucket under
      // gradient_as_bucket_view, or its detached alias after zero_grad(false)) is stashed as a
      // copy: the Reducer writes this backward's gradient into that bucket, which would
      // overwrite a stash that aliases it.
      at::Tensor& g = s.model.mutable_grad();
      const bool shared = g.defined() && !g.is_sparse() && g.has_storage() &&
                          (g.is_view() || g.storage().use_count() > 1);
      s.stash = shared ? g.clone() : std::move(g);
      g = at::Tensor();
    }
  }
}

void AmpState::post_backward(const std::vector<size_t>& targets, int64_t loss_id) {
  std::vector<at::Tensor> to_unscale;
  std::vector<at::Tensor> to_check;  // left scaled for a fused optimizer: only checked
  std::vector<std::pair<Slot*, at::Tensor>> converted;
  const double scale = scalers[static_cast<size_t>(loss_id)].loss_scale();
  for (size_t t : targets) {
    if (can_defer(entries[t])) {
      for (auto& s : entries[t].slots) {
        const at::Tensor& g = s.model.grad();
        if (!g.defined()) continue;
        TORCH_CHECK(!g.is_sparse(), "Amp: sparse gradients are not supported (parameter of shape ",
                    s.model.sizes(), ")");
        to_check.push_back(g);
      }
      // The reciprocal in double, rounded once to fp32, as LossScaler::unscale_ takes it.
      entries[t].deferred_inv = at::full({}, 1.0 / scale, at::TensorOptions().dtype(at::kFloat));
      continue;
    }
    for (auto& s : entries[t].slots) {
      const at::Tensor& g = s.model.grad();
      if (!g.defined()) continue;
      TORCH_CHECK(!g.is_sparse(), "Amp: sparse gradients are not supported (parameter of shape ",
                  s.model.sizes(), ")");
      if (s.copy) {
        at::Tensor g32 = g.to(at::kFloat);
        to_unscale.push_back(g32);
        converted.emplace_back(&s, std::move(g32));
      } else {
        to_unscale.push_back(g);
      }
    }
  }
  PendingCheck check{loss_id, targets, {}};
  scalers[static_cast<size_t>(loss_id)].unscale_(to_unscale, check.flags);
  check_finite_(to_check, check.flags);
  for (auto& [slot, g32] : converted) {
    at::Tensor& mg = slot->master.mutable_grad();
    if (mg.defined()) {
      mg.add_(g32);
    } else {
      mg = g32;
    }
    // The model gradient stays (as an fp32 parameter's would) and marks the fold: prepare_backward
    // sees whether the user cleared it since.
    slot->folded_grad = slot->model.grad();
    slot->folded_version = slot->folded_grad._version();
  }
  for (size_t t : targets) {
    auto& e = entries[t];
    for (auto& s : e.slots) {
      if (s.copy || !s.stash.defined()) continue;
      at::Tensor& g = s.model.mutable_grad();
      if (g.defined()) {
        g.add_(s.stash);
      } else {
        g = s.stash;
      }
      s.stash = at::Tensor();
    }
    e.scaled_pending = false;
    e.pending_loss_id = -1;
    e.backward_since_step = true;
    e.dirty = true;
  }
  pending.push_back(std::move(check));
  // Read now unless every target is stepped by amp.step() (which reads it, with the others, at
  // one host synchronization): the user's own step() comes next, with no amp call before it.
  const bool eager =
      std::any_of(targets.begin(), targets.end(), [&](size_t t) { return !entries[t].amp_steps; });
  if (eager) resolve([&](const PendingCheck& c) { return c.loss_id == loss_id; });
}

void AmpState::abandon(const std::vector<size_t>& targets) {
  // The scope ended without a usable backward: drop partial gradients, restore what was stashed.
  for (size_t t : targets) {
    auto& e = entries[t];
    if (e.scaled_pending) continue;
    for (auto& s : e.slots) {
      if (s.copy) {
        s.model.mutable_grad() = at::Tensor();
      } else {
        s.model.mutable_grad() = std::move(s.stash);
        s.stash = at::Tensor();
      }
    }
  }
}

void AmpState::clear_grads(OptimizerEntry& e) {
  e.deferred_inv = at::Tensor();
  for (auto& s : e.slots) {
    s.model.mutable_grad() = at::Tensor();
    s.master.mutable_grad() = at::Tensor();
    s.stash = at::Tensor();
    s.folded_grad = at::Tensor();
  }
  e.scaled_pending = false;
  e.pending_loss_id = -1;
}

void AmpState::copy_masters_to_model(OptimizerEntry& e) {
  std::vector<at::Tensor> dst;
  std::vector<at::Tensor> src;
  for (auto& s : e.slots) {
    if (!s.copy) continue;
    dst.push_back(s.model);
    src.push_back(s.master);
  }
  if (!dst.empty()) {
    at::NoGradGuard no_grad;
    at::_foreach_copy_(dst, src);
  }
  record_versions(e);
}

void AmpState::record_versions(OptimizerEntry& e) {
  for (auto& s : e.slots) s.master_version = s.master._version();
}

bool AmpState::sync(OptimizerEntry& e) {
  const bool changed = std::any_of(e.slots.begin(), e.slots.end(), [](const Slot& s) {
    return s.master._version() != s.master_version;
  });
  if (changed || (e.dirty && !e.amp_steps)) {
    copy_masters_to_model(e);
    e.dirty = false;
  }
  return changed;
}

void AmpState::sync_all() {
  for (auto& e : entries) sync(e);
}

bool AmpState::step(const std::vector<size_t>& indices) {
  rethrow_deferred();
  for (size_t i : indices) {
    auto& e = entries[i];
    // Seen where the optimizer bumps its parameters' version counters (torch::optim's Adam,
    // AdamW, Adagrad, RMSprop; apex's fused optimizers), not through .data() (torch::optim::SGD).
    const bool stepped_already = sync(e) && e.backward_since_step;
    TORCH_CHECK(!stepped_already, "Amp::step: optimizer ", i,
                " was already stepped after the last backward (its own optimizer.step()); call "
                "either optimizer.step() or amp.step() once per iteration, not both");
    TORCH_CHECK(!e.scaled_pending, "Amp::step: optimizer ", i,
                " still holds scaled gradients (the last scale_loss used delay_unscale=true); "
                "end the accumulation with a scale_loss without delay_unscale before stepping");
    TORCH_CHECK(e.backward_since_step, "Amp::step: no backward since the last step for optimizer ",
                i, "; run amp.scale_loss(loss).backward() first");
  }
  resolve([&](const PendingCheck& c) {
    return std::any_of(c.targets.begin(), c.targets.end(), [&](size_t t) {
      return std::find(indices.begin(), indices.end(), t) != indices.end();
    });
  });
  bool all_stepped = true;
  for (size_t i : indices) {
    auto& e = entries[i];
    e.amp_steps = true;
    if (e.overflowed) {
      clear_grads(e);  // counted in resolve()
      all_stepped = false;
    } else if (e.deferred_inv.defined()) {
      // The kernel does not write the gradients: they stay scaled, and deferred_inv stays as the
      // marker, so a backward that accumulates onto them without zero_grad() unscales them first.
      static_cast<optim::FusedOptimizer*>(e.optimizer)
          ->step(optim::GradScaling{e.deferred_inv, at::Tensor()});
      record_versions(e);
    } else {
      e.optimizer->step();
      copy_masters_to_model(e);
    }
    e.dirty = false;
    e.backward_since_step = false;
    e.overflowed = false;
  }
  return all_stepped;
}

}  // namespace apex::amp::detail
