#include <apex/amp/initialize.h>
#include <apex/amp/utils.h>

#include "amp/half_model_check.h"
#include "amp/unscale.h"
#include "common/io.h"
#include "common/no_sync.h"

#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/full.h>
#include <apex/io.h>
#include <apex/optim/fused_optimizer.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <mutex>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include "common/environment.h"

namespace apex::amp {
namespace detail {

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
  template <typename Pred>
  void resolve(Pred&& pred);
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

namespace {

std::mutex& registry_mutex() {
  static std::mutex m;
  return m;
}
std::unordered_set<const torch::optim::Optimizer*>& registry() {
  static std::unordered_set<const torch::optim::Optimizer*> r;
  return r;
}

// Whether amp is on and the model computes in half: autocast (O1) or a half model (O2, O3).
bool computes_in_half(const Properties& p) {
  return p.enabled &&
         (p.patch_torch_functions || (p.cast_model_type && *p.cast_model_type != at::kFloat));
}

}  // namespace

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

template <typename Pred>
void AmpState::resolve(Pred&& pred) {
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

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// ScaledLoss

ScaledLoss::ScaledLoss(detail::AmpState* state, at::Tensor scaled, int64_t loss_id,
                       std::vector<size_t> targets, bool delay_unscale)
    : state_(state),
      scaled_(std::move(scaled)),
      loss_id_(loss_id),
      targets_(std::move(targets)),
      delay_unscale_(delay_unscale),
      uncaught_at_entry_(std::uncaught_exceptions()) {}

ScaledLoss::~ScaledLoss() {
  if (finished_) return;
  try {
    finish();
  } catch (...) {
    // Destructors must not throw; the next call on the Amp handle raises this.
    if (!state_->deferred) state_->deferred = std::current_exception();
  }
}

void ScaledLoss::backward(bool retain_graph) {
  TORCH_CHECK(!finished_, "ScaledLoss::backward: this scale_loss scope has already finished");
  TORCH_CHECK(!backward_done_,
              "ScaledLoss::backward: backward was already called in this scale_loss scope; "
              "start a new scope for another backward pass");
  {
    // The backward of half matmuls, on CPUs without fast ones (no-op elsewhere).
    const CpuHalfFallbackGuard half_fallback(detail::computes_in_half(state_->props));
    scaled_.backward({}, retain_graph);
  }
  backward_done_ = true;
}

void ScaledLoss::finish() {
  if (finished_) return;
  finished_ = true;
  auto& st = *state_;
  const auto& targets = targets_;
  if (std::uncaught_exceptions() > uncaught_at_entry_ || !backward_done_) {
    if (!st.fast_path) st.abandon(targets);
    return;
  }
  if (st.fast_path) {
    for (size_t t : targets) st.entries[t].backward_since_step = true;
    return;
  }
  if (delay_unscale_) {
    for (size_t t : targets) {
      st.entries[t].scaled_pending = true;
      st.entries[t].pending_loss_id = loss_id_;
    }
    return;
  }
  st.post_backward(targets, loss_id_);
}

// ---------------------------------------------------------------------------------------------
// Amp

namespace {

// O1-O3 on a CPU without bf16/fp16 matrix instructions: LibTorch multiplies the half dtype in a
// scalar loop there (1.1 GFLOP/s against 63 for fp32 on an AVX2 Zen 3), or through oneDNN's
// emulation (AVX-512 without AVX512-BF16: below fp32's speed). apex computes those matmuls
// through fp32 instead (cpu_half.h); only with that turned off is the step slower than at O0,
// and each such initialize says so. Decided from the CPU's features.
void warn_if_half_matmuls_are_slow(const detail::AmpState& st) {
  const auto& p = st.props;
  const bool cast = p.cast_model_type && *p.cast_model_type != at::kFloat;
  if (st.verbosity == 0 || !st.log_rank() || !p.enabled || (!cast && !p.patch_torch_functions)) {
    return;
  }
  bool on_cpu = false;
  for (const auto& m : st.models) {
    for (const auto& t : m->parameters()) on_cpu = on_cpu || t.device().is_cpu();
  }
  if (!on_cpu) return;
  const c10::ScalarType t = cast ? *p.cast_model_type : p.half_dtype;
  if (!cpu_half_matmul_is_fast(t) && !cpu_half_fallback_available(t)) {
    const bool scalar = cpu_half_matmul_kind(t) == CpuHalfMatmul::kScalar;
    TORCH_WARN("apex::amp: ", to_string(p.opt_level), " computes matmuls in ", t,
               ", which LibTorch multiplies ", cpu_half_matmul_slow_reason(t),
               ", and APEX_CPU_HALF_FALLBACK=0 turns off apex's fp32 route for them, so training "
               "will be ",
               scalar ? "tens of times slower than at O0 here" : "slower than at O0 here");
  }
}

}  // namespace

Amp::Amp(std::vector<std::shared_ptr<torch::nn::Module>> models,
         std::vector<torch::optim::Optimizer*> optimizers, const Options& options)
    : state_(std::make_unique<detail::AmpState>()) {
  auto& st = *state_;
  // An unset half_dtype follows the models' device (fp16 on CUDA, bf16 on the CPU).
  c10::DeviceType device = c10::kCPU;
  for (const auto& m : models) {
    if (m != nullptr && !m->parameters().empty()) {
      device = device_type_of(*m);
      break;
    }
  }
  st.props = Properties::resolve(options, device);
  st.verbosity = options.verbosity();
  st.unscale_in_optimizer = options.unscale_in_optimizer();
  const auto& p = st.props;

  // Every check first: a failed initialize changes nothing.
  for (size_t i = 0; i < models.size(); ++i) {
    TORCH_CHECK(models[i] != nullptr, "apex::amp::initialize: model ", i, " is null");
    if (!p.enabled) continue;
    for (const auto& np : models[i]->named_parameters()) {
      TORCH_CHECK(!np.value().is_floating_point() || np.value().scalar_type() == at::kFloat,
                  "apex::amp::initialize: model ", i, " parameter '", np.key(), "' has dtype ",
                  np.value().scalar_type(),
                  "; initialize expects an fp32 model (it casts the model itself as the "
                  "opt level requires)");
    }
    for (const auto& nb : models[i]->named_buffers()) {
      TORCH_CHECK(!nb.value().is_floating_point() || nb.value().scalar_type() == at::kFloat,
                  "apex::amp::initialize: model ", i, " buffer '", nb.key(), "' has dtype ",
                  nb.value().scalar_type(), "; initialize expects an fp32 model");
    }
  }
  const int64_t n_losses = options.num_losses();
  for (int64_t i = 0; i < n_losses; ++i) {
    LossScalerOptions so;
    so.dynamic(p.loss_scale.is_dynamic())
        .init_scale(p.loss_scale.is_dynamic() ? options.init_loss_scale() : p.loss_scale.value())
        .growth_interval(options.growth_interval())
        .hysteresis(options.hysteresis())
        .min_scale(options.min_loss_scale())
        .max_scale(options.max_loss_scale());
    st.scalers.emplace_back(so);
  }

  {
    std::lock_guard<std::mutex> lock(detail::registry_mutex());
    std::unordered_set<const torch::optim::Optimizer*> seen;
    for (size_t i = 0; i < optimizers.size(); ++i) {
      TORCH_CHECK(optimizers[i] != nullptr, "apex::amp::initialize: optimizer ", i, " is null");
      TORCH_CHECK(seen.insert(optimizers[i]).second && !detail::registry().count(optimizers[i]),
                  "apex::amp::initialize: optimizer ", i,
                  " was already passed to initialize; each optimizer may be initialized once");
    }
    for (auto* o : optimizers) detail::registry().insert(o);
  }

  // Masters take the exact fp32 values the parameters had before the cast (apex copied them from
  // the already-rounded half parameters).
  std::unordered_map<const c10::TensorImpl*, at::Tensor> fp32_values;
  if (p.master_weights && p.cast_model_type && *p.cast_model_type != at::kFloat) {
    for (auto* opt : optimizers) {
      for (auto& group : opt->param_groups()) {
        for (auto& param : group.params()) {
          if (param.is_floating_point() && param.scalar_type() == at::kFloat) {
            fp32_values.emplace(param.unsafeGetTensorImpl(), param.detach().clone());
          }
        }
      }
    }
  }
  if (p.cast_model_type) {
    for (auto& m : models) {
      if (p.keep_batchnorm_fp32) {
        convert_network(*m, *p.cast_model_type);
      } else {
        m->to(*p.cast_model_type);
      }
    }
  }
  st.models = std::move(models);
  if (p.enabled && p.cast_model_type && *p.cast_model_type != at::kFloat) {
    st.half_model_check.emplace(st.models);
  }

  bool any_copy = false;
  for (auto* opt : optimizers) {
    detail::OptimizerEntry e;
    e.optimizer = opt;
    for (auto& group : opt->param_groups()) {
      for (auto& param : group.params()) {
        detail::Slot s;
        s.model = param;
        if (p.master_weights && param.is_floating_point() && param.scalar_type() != at::kFloat) {
          auto saved = fp32_values.find(param.unsafeGetTensorImpl());
          at::Tensor master =
              saved != fp32_values.end() ? saved->second : param.detach().to(at::kFloat).clone();
          master.set_requires_grad(true);
          // The optimizer's state (if it stepped before) follows its parameter to the master.
          auto& state = opt->state();
          auto it = state.find(param.unsafeGetTensorImpl());
          if (it != state.end()) {
            auto moved = std::move(it->second);
            state.erase(it);
            state[master.unsafeGetTensorImpl()] = std::move(moved);
          }
          param = master;
          s.master = master;
          s.master_version = master._version();
          s.copy = true;
          any_copy = true;
        } else {
          s.master = param;
          s.master_version = param._version();
        }
        e.slots.push_back(std::move(s));
      }
    }
    st.entries.push_back(std::move(e));
  }
  st.fast_path = !p.loss_scale.is_dynamic() && p.loss_scale.value() == 1.0 && !any_copy;
  if (st.verbosity > 0 && p.enabled && st.log_rank()) {
    std::cerr << "apex::amp: initialized with\n" << p.describe();
  }
  warn_if_half_matmuls_are_slow(st);
  // The route's kernels go into the dispatcher now, at setup, rather than on the first forward,
  // while a data loader's or a second model's threads may be running the same ops.
  if (detail::computes_in_half(p)) prepare_cpu_half_fallback();
}

Amp::~Amp() = default;
Amp::Amp(Amp&&) noexcept = default;
Amp& Amp::operator=(Amp&&) noexcept = default;

const Properties& Amp::properties() const { return state_->props; }

bool Amp::computes_in_half() const { return detail::computes_in_half(state_->props); }

bool Amp::autocast_enabled() const {
  return state_->props.enabled && state_->props.patch_torch_functions;
}

const std::optional<c10::ScalarType>& Amp::input_cast_type() const {
  return state_->props.cast_model_type;
}

c10::DeviceType Amp::device_type_of(const torch::nn::Module& module) {
  for (const auto& p : module.parameters()) return p.device().type();
  for (const auto& b : module.buffers()) return b.device().type();
  return c10::kCPU;
}

at::Tensor Amp::cast_tensor(const at::Tensor& t, c10::ScalarType dtype) const {
  if (!t.defined() || !t.is_floating_point() || t.scalar_type() == dtype) return t;
  return t.to(dtype);
}

ScaledLoss Amp::scale_loss(const at::Tensor& loss, int64_t loss_id,
                           const ScaleLossOptions& options) {
  auto& st = *state_;
  st.rethrow_deferred();
  TORCH_CHECK(loss.defined(), "Amp::scale_loss: loss is an undefined tensor");
  TORCH_CHECK(loss.numel() == 1, "Amp::scale_loss: loss must be a scalar (one element), got shape ",
              loss.sizes(), "; reduce it first (e.g. mean())");
  TORCH_CHECK(loss.is_floating_point(), "Amp::scale_loss: loss must be floating point, got ",
              loss.scalar_type());
  TORCH_CHECK(loss_id >= 0 && loss_id < static_cast<int64_t>(st.scalers.size()),
              "Amp::scale_loss: loss_id ", loss_id, " out of range; initialize made ",
              st.scalers.size(), " loss scaler(s) (num_losses)");
  // Inside a NoSyncGuard the backward is not all-reduced: its gradients must stay in place, scaled,
  // for the next synchronised backward to reduce. Unscaling here would stash them before that
  // backward and add them back after it, never reduced (ranks drift apart, and an overflow in
  // them would skip the step on one rank only).
  TORCH_CHECK(st.fast_path || options.delay_unscale() || apex::detail::open_no_sync_scopes() == 0,
              "Amp::scale_loss: inside apex::parallel::NoSyncGuard (gradient accumulation without "
              "all-reduce) use ScaleLossOptions().delay_unscale(true), so that the accumulated "
              "gradients stay scaled in place for the next synchronised backward to reduce");
  const auto targets = st.targets_of(options);
  st.sync_all();
  // This scaler's scale must reflect every earlier iteration before it is used again.
  st.resolve([&](const detail::PendingCheck& c) { return c.loss_id == loss_id; });
  if (st.fast_path) {
    return ScaledLoss(&st, loss.to(at::kFloat), loss_id, targets, options.delay_unscale());
  }
  for (size_t t : targets) st.prepare_backward(t, loss_id);
  const double scale = st.scalers[static_cast<size_t>(loss_id)].loss_scale();
  return ScaledLoss(&st, loss.to(at::kFloat) * scale, loss_id, targets, options.delay_unscale());
}

bool Amp::step() {
  std::vector<size_t> all(state_->entries.size());
  for (size_t i = 0; i < all.size(); ++i) all[i] = i;
  return state_->step(all);
}

bool Amp::step(size_t index) {
  TORCH_CHECK(index < state_->entries.size(), "Amp::step: optimizer index ", index,
              " out of range; initialize received ", state_->entries.size(), " optimizer(s)");
  return state_->step({index});
}

void Amp::zero_grad() {
  auto& st = *state_;
  st.rethrow_deferred();
  st.sync_all();
  for (auto& e : st.entries) st.clear_grads(e);
  for (auto& m : st.models) {
    for (auto& p : m->parameters()) p.mutable_grad() = at::Tensor();
  }
}

double Amp::loss_scale(int64_t loss_id) { return loss_scaler(loss_id).loss_scale(); }

const LossScaler& Amp::loss_scaler(int64_t loss_id) {
  auto& st = *state_;
  TORCH_CHECK(loss_id >= 0 && loss_id < static_cast<int64_t>(st.scalers.size()), "Amp: loss_id ",
              loss_id, " out of range; initialize made ", st.scalers.size(), " loss scaler(s)");
  st.resolve([&](const detail::PendingCheck& c) { return c.loss_id == loss_id; });
  return st.scalers[static_cast<size_t>(loss_id)];
}

int64_t Amp::skipped_steps(size_t index) const {
  TORCH_CHECK(index < state_->entries.size(), "Amp::skipped_steps: optimizer index ", index,
              " out of range");
  return state_->entries[index].skipped;
}

std::vector<at::Tensor> Amp::master_params(size_t index) const {
  TORCH_CHECK(index < state_->entries.size(), "Amp::master_params: optimizer index ", index,
              " out of range");
  state_->sync(state_->entries[index]);
  return apex::amp::master_params(*state_->entries[index].optimizer);
}

void Amp::sync_model() { state_->sync_all(); }

size_t Amp::num_optimizers() const { return state_->entries.size(); }

torch::optim::Optimizer& Amp::optimizer(size_t index) {
  TORCH_CHECK(index < state_->entries.size(), "Amp::optimizer: index ", index, " out of range");
  return *state_->entries[index].optimizer;
}

StateDict Amp::state_dict() {
  auto& st = *state_;
  st.rethrow_deferred();
  st.sync_all();
  st.resolve([](const detail::PendingCheck&) { return true; });
  StateDict d = make_state_dict();
  d.insert("opt_level", to_string(st.props.opt_level));
  for (size_t i = 0; i < st.scalers.size(); ++i) {
    d.insert("loss_scaler" + std::to_string(i), st.scalers[i].state_dict());
  }
  c10::impl::GenericList masters(c10::ListType::ofTensors());
  for (const auto& e : st.entries) {
    c10::List<at::Tensor> list;
    for (const auto& s : e.slots) {
      if (s.copy)
        list.push_back(s.master.detach().to(c10::kCPU, /*non_blocking=*/false,
                                            /*copy=*/true));
    }
    masters.push_back(list);
  }
  d.insert("master_params", masters);
  return d;
}

void Amp::load_state_dict(const StateDict& state) {
  auto& st = *state_;
  st.rethrow_deferred();
  st.sync_all();
  st.resolve([](const detail::PendingCheck&) { return true; });
  // Validate everything into copies; commit only when all of it is good.
  std::vector<LossScaler> scalers = st.scalers;
  std::vector<bool> seen(scalers.size(), false);
  std::vector<std::vector<at::Tensor>> masters;
  bool have_masters = false;
  for (const auto& entry : state) {
    TORCH_CHECK(entry.key().isString(), "Amp::load_state_dict: keys must be strings");
    const std::string key = entry.key().toStringRef();
    const c10::IValue& v = entry.value();
    if (key == "opt_level") {
      TORCH_CHECK(v.isString() && v.toStringRef() == to_string(st.props.opt_level),
                  "Amp::load_state_dict: the state was written at opt_level ",
                  v.isString() ? v.toStringRef() : std::string("?"), ", this handle is ",
                  to_string(st.props.opt_level));
    } else if (key.rfind("loss_scaler", 0) == 0) {
      const std::string num = key.substr(11);
      size_t i = 0;
      try {
        i = std::stoul(num);
      } catch (const std::exception&) {
        TORCH_CHECK(false, "Amp::load_state_dict: unexpected key '", key, "'");
      }
      TORCH_CHECK(i < scalers.size(), "Amp::load_state_dict: '", key, "' but this handle has ",
                  scalers.size(), " loss scaler(s) (num_losses)");
      TORCH_CHECK(v.isGenericDict(), "Amp::load_state_dict: '", key, "' must be a dict");
      StateDict sd = make_state_dict();
      for (const auto& e : v.toGenericDict()) sd.insert(e.key().toStringRef(), e.value());
      scalers[i].load_state_dict(sd);
      seen[i] = true;
    } else if (key == "master_params") {
      TORCH_CHECK(v.isList(), "Amp::load_state_dict: 'master_params' must be a list");
      const auto outer = v.toList();
      TORCH_CHECK(outer.size() == st.entries.size(), "Amp::load_state_dict: 'master_params' has ",
                  outer.size(), " optimizer list(s), this handle has ", st.entries.size());
      for (size_t i = 0; i < outer.size(); ++i) {
        const c10::IValue inner_v = outer.get(i);
        TORCH_CHECK(inner_v.isList(), "Amp::load_state_dict: master_params[", i,
                    "] must be a list of tensors");
        std::vector<at::Tensor> inner;
        for (const auto& t : inner_v.toListRef()) {
          TORCH_CHECK(t.isTensor(), "Amp::load_state_dict: master_params[", i, "] holds a ",
                      t.tagKind(), ", expected tensors");
          inner.push_back(t.toTensor());
        }
        std::vector<const detail::Slot*> copies;
        for (const auto& s : st.entries[i].slots) {
          if (s.copy) copies.push_back(&s);
        }
        TORCH_CHECK(inner.size() == copies.size(), "Amp::load_state_dict: master_params[", i,
                    "] has ", inner.size(), " tensors, optimizer ", i, " has ", copies.size(),
                    " master weights");
        for (size_t k = 0; k < inner.size(); ++k) {
          TORCH_CHECK(inner[k].sizes() == copies[k]->master.sizes() && inner[k].is_floating_point(),
                      "Amp::load_state_dict: master_params[", i, "][", k, "] has shape ",
                      inner[k].sizes(), " and dtype ", inner[k].scalar_type(),
                      ", expected a floating tensor of shape ", copies[k]->master.sizes());
        }
        masters.push_back(std::move(inner));
      }
      have_masters = true;
    } else {
      TORCH_CHECK(false, "Amp::load_state_dict: unexpected key '", key, "'");
    }
  }
  for (size_t i = 0; i < seen.size(); ++i) {
    TORCH_CHECK(seen[i], "Amp::load_state_dict: missing 'loss_scaler", i, "'");
  }
  bool need_masters = false;
  for (const auto& e : st.entries) {
    for (const auto& s : e.slots) need_masters = need_masters || s.copy;
  }
  TORCH_CHECK(have_masters || !need_masters,
              "Amp::load_state_dict: missing 'master_params' (this handle keeps fp32 master "
              "weights; resuming without them would lose precision)");

  st.scalers = std::move(scalers);
  if (have_masters) {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < masters.size(); ++i) {
      size_t k = 0;
      for (auto& s : st.entries[i].slots) {
        if (!s.copy) continue;
        s.master.copy_(masters[i][k++]);
      }
      st.copy_masters_to_model(st.entries[i]);
    }
  }
}

void Amp::save(const std::string& path) {
  const auto bytes = apex::detail::pickle_save(state_dict(), "amp");
  apex::write_file_atomic(path, std::string_view(bytes.data(), bytes.size()));
}

void Amp::load(const std::string& path) {
  const c10::IValue v = apex::detail::load_state_file(
      path, "amp", "Amp::load",
      "an Amp state (Amp::save, or Python's amp.state_dict() saved by torch.save)");
  TORCH_CHECK(v.isGenericDict(), "Amp::load: '", path, "' holds a ", v.tagKind(),
              ", expected an Amp state dict");
  StateDict d = make_state_dict();
  for (const auto& e : v.toGenericDict()) {
    TORCH_CHECK(e.key().isString(), "Amp::load: '", path, "' has a non-string key");
    d.insert(e.key().toStringRef(), e.value());
  }
  // A dict of another kind (no kind record: e.g. written from Python) says what it looks like.
  TORCH_CHECK(!d.contains("scale") || d.contains("loss_scaler0"), "Amp::load: '", path,
              "' holds a GradScaler state (keys scale, growth_factor, ...), expected an Amp state "
              "(keys loss_scaler0, ...)");
  TORCH_CHECK(!d.contains("param_groups"), "Amp::load: '", path,
              "' holds an optimizer state (keys state, param_groups), expected an Amp state "
              "(keys loss_scaler0, ...)");
  load_state_dict(d);
}

Amp initialize(std::vector<std::shared_ptr<torch::nn::Module>> models,
               std::vector<torch::optim::Optimizer*> optimizers, const Options& options) {
  return Amp(std::move(models), std::move(optimizers), options);
}

}  // namespace apex::amp
