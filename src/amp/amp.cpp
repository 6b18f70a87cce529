// The Amp handle (apex/amp/initialize.h): initialize's checks and casts, forward's policy,
// scale_loss and ScaledLoss, step. Its state: amp_state.{h,cpp}; its state dict:
// amp_checkpoint.cpp.
#include <apex/amp/initialize.h>
#include <apex/amp/utils.h>
#include <apex/optim/fused_optimizer.h>
#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <algorithm>
#include <exception>
#include <mutex>
#include <unordered_map>
#include <unordered_set>

#include "amp/amp_state.h"
#include "amp/half_model_check.h"
#include "common/environment.h"
#include "common/no_sync.h"

namespace apex::amp {

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
    TORCH_WARN(
        "apex::amp: ", to_string(p.opt_level), " computes matmuls in ", t,
        ", which LibTorch multiplies ", cpu_half_matmul_slow_reason(t),
        ", and APEX_CPU_HALF_FALLBACK=0 turns off apex's CPU half fallback for them, so training "
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
  // The fallback's kernels go into the dispatcher now, at setup, rather than on the first forward,
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

Amp initialize(std::vector<std::shared_ptr<torch::nn::Module>> models,
               std::vector<torch::optim::Optimizer*> optimizers, const Options& options) {
  return Amp(std::move(models), std::move(optimizers), options);
}

}  // namespace apex::amp
