#pragma once

#include <apex/amp/autocast.h>
#include <apex/amp/loss_scaler.h>
#include <apex/amp/options.h>
#include <apex/amp/scale_loss.h>

#include <ATen/core/Tensor.h>
#include <ATen/core/ivalue.h>
#include <apex/state_dict.h>
#include <torch/nn/pimpl.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace apex::amp {

/// The handle `initialize` returns. It owns the loss scalers and the fp32 master weights, and
/// drives the mixed-precision training step. A LibTorch loop keeps its own zero_grad() and
/// step(); amp adds three lines:
///
///   auto amp = apex::amp::initialize(model, optimizer, apex::amp::OptLevel::O2);  // 1
///   for (...) {
///     optimizer.zero_grad();
///     auto loss = loss_fn(amp.forward(model, x), y);                              // 2
///     amp.scale_loss(loss).backward();                                            // 3
///     optimizer.step();      // changes nothing when the gradients overflowed
///   }
///
/// When a scale_loss scope's gradients overflow, amp lowers the scale and clears the gradients
/// (so the optimizer's step skips every parameter); with O2's fp32 masters, the model's half
/// weights follow the masters at the next forward, scale_loss or any other call on the handle.
/// `amp.step()` and `amp.zero_grad()` do the same as the optimizer's own calls, and amp.step()
/// reports whether the step was taken. The optimizers are referenced, not owned: they must
/// outlive the handle.
class Amp {
 public:
  Amp(std::vector<std::shared_ptr<torch::nn::Module>> models,
      std::vector<torch::optim::Optimizer*> optimizers, const Options& options);
  ~Amp();
  Amp(Amp&&) noexcept;
  Amp& operator=(Amp&&) noexcept;
  Amp(const Amp&) = delete;
  Amp& operator=(const Amp&) = delete;

  const Properties& properties() const;

  /// Runs `module->forward(args...)` under this level's policy: autocast for O1; floating tensor
  /// inputs cast to the model dtype for O2/O3; floating tensor outputs (also inside tuples and
  /// vectors) cast to `cast_model_outputs` (fp32).
  /// `module` may be a holder (`Net` of TORCH_MODULE), a std::shared_ptr, or the module itself.
  template <typename ModuleHolder, typename... Args>
  auto forward(ModuleHolder& module, Args&&... args) {
    sync_model();
    auto& m = module_of(module);
    std::optional<AutocastGuard> guard;
    if (autocast_enabled()) {
      guard.emplace(device_type_of(m), properties().half_dtype, true);
    }
    // The CPU half fallback (a no-op where LibTorch's half kernels are fast); at O1 on the CPU
    // the autocast region has opened it already.
    const bool opened = guard.has_value() && guard->enabled() && guard->device() == c10::kCPU;
    const CpuHalfFallbackGuard half_fallback(computes_in_half() && !opened);
    return cast_output(m.forward(cast_input(std::forward<Args>(args))...));
  }

  /// An autocast region with this level's settings for code outside `forward` (a loss function,
  /// say); it is a no-op region unless the level autocasts (O1).
  AutocastGuard autocast(c10::DeviceType device) const {
    return AutocastGuard(device, properties().half_dtype, autocast_enabled());
  }

  /// Starts a scaled-loss scope for `loss` (a one-element floating tensor) with scaler `loss_id`.
  ScaledLoss scale_loss(const at::Tensor& loss, int64_t loss_id = 0,
                        const ScaleLossOptions& options = {});

  /// Steps every optimizer whose gradients did not overflow, then copies fp32 masters into the
  /// half model parameters. Returns true when every optimizer stepped. At most one host
  /// synchronization (reading the overflow flags).
  bool step();
  /// Same, for the optimizer at `index` only.
  bool step(size_t index);
  /// Clears model and master gradients (sets them undefined, as `zero_grad(true)` does).
  void zero_grad();
  /// Copies the fp32 masters into the model's half parameters where the optimizer changed them
  /// (its own step()) since the last copy. forward, scale_loss, zero_grad, state_dict and
  /// master_params do it themselves; call it before using the bare model (evaluation, export)
  /// right after your own optimizer.step().
  void sync_model();

  /// Current scale of loss scaler `loss_id`.
  double loss_scale(int64_t loss_id = 0);
  /// Loss scaler `loss_id` (after resolving pending overflow checks).
  const LossScaler& loss_scaler(int64_t loss_id = 0);
  /// Steps skipped because of overflow, for optimizer `index`.
  int64_t skipped_steps(size_t index = 0) const;
  /// The parameters optimizer `index` updates (fp32 masters where master weights are on).
  std::vector<at::Tensor> master_params(size_t index = 0) const;
  size_t num_optimizers() const;
  torch::optim::Optimizer& optimizer(size_t index);

  /// `{"opt_level", "loss_scaler<i>": {...}, "master_params": [[tensor, ...] per optimizer]}`;
  /// readable by Python's `torch.load(f, weights_only=True)`. The master weights are included
  /// (apex left them out, and resumed O2 runs spiked).
  StateDict state_dict();
  /// Restores `state_dict()` output: scaler states, master weights (and the model parameters cast
  /// from them). Everything is validated before anything changes.
  void load_state_dict(const StateDict& state);
  /// Writes `state_dict()` to `path` atomically (temporary file, then rename).
  void save(const std::string& path);
  void load(const std::string& path);

 private:
  bool autocast_enabled() const;
  /// O1-O3: some ops run in the half dtype (autocast, or a model cast to it).
  bool computes_in_half() const;
  static c10::DeviceType device_type_of(const torch::nn::Module& module);
  template <typename M>
  static auto& module_of(M& module) {
    if constexpr (std::is_base_of_v<torch::nn::Module, M>) {
      return module;
    } else {
      return *module;
    }
  }
  at::Tensor cast_tensor(const at::Tensor& t, c10::ScalarType dtype) const;

  template <typename T>
  decltype(auto) cast_input(T&& value) const {
    using D = std::decay_t<T>;
    if constexpr (std::is_same_v<D, at::Tensor>) {
      return input_cast_type() ? cast_tensor(value, *input_cast_type()) : at::Tensor(value);
    } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
      std::vector<at::Tensor> out;
      out.reserve(value.size());
      for (const auto& t : value) out.push_back(cast_input(t));
      return out;
    } else {
      return std::forward<T>(value);
    }
  }

  template <typename T>
  auto cast_output(T&& value) const {
    using D = std::decay_t<T>;
    if constexpr (std::is_same_v<D, at::Tensor>) {
      return cast_tensor(value, properties().cast_model_outputs);
    } else if constexpr (std::is_same_v<D, std::vector<at::Tensor>>) {
      std::vector<at::Tensor> out;
      out.reserve(value.size());
      for (const auto& t : value) out.push_back(cast_output(t));
      return out;
    } else if constexpr (is_tuple<D>::value) {
      return std::apply([this](auto&&... e) { return std::make_tuple(cast_output(e)...); },
                        std::forward<T>(value));
    } else {
      return D(std::forward<T>(value));
    }
  }

  template <typename T>
  struct is_tuple : std::false_type {};
  template <typename... Ts>
  struct is_tuple<std::tuple<Ts...>> : std::true_type {};

  const std::optional<c10::ScalarType>& input_cast_type() const;

  std::unique_ptr<detail::AmpState> state_;
};

/// apex's `amp.initialize`: validates the models (fp32 parameters and buffers), casts them as the
/// opt level says, installs fp32 master weights into the optimizers (O2), and builds
/// `num_losses` loss scalers. Each optimizer may be initialized once.
Amp initialize(std::vector<std::shared_ptr<torch::nn::Module>> models,
               std::vector<torch::optim::Optimizer*> optimizers, const Options& options = {});

/// One model and one optimizer: `initialize(model, optimizer, OptLevel::O2)`.
template <typename ModuleType>
Amp initialize(torch::nn::ModuleHolder<ModuleType>& model, torch::optim::Optimizer& optimizer,
               const Options& options = {}) {
  return initialize({model.ptr()}, {&optimizer}, options);
}

/// The same for a model held by `std::shared_ptr` (pytorch/examples' C++ style:
/// `auto model = std::make_shared<Net>();`).
template <typename ModuleType>
requires std::is_base_of_v<torch::nn::Module, ModuleType> Amp
initialize(const std::shared_ptr<ModuleType>& model, torch::optim::Optimizer& optimizer,
           const Options& options = {}) {
  return initialize({std::static_pointer_cast<torch::nn::Module>(model)}, {&optimizer}, options);
}

/// The same for a module object the caller owns (pytorch/examples' `Net model;`): the handle
/// refers to it, so it must outlive the handle, as the optimizer must.
template <typename ModuleType>
requires std::is_base_of_v<torch::nn::Module, ModuleType> Amp
initialize(ModuleType& model, torch::optim::Optimizer& optimizer, const Options& options = {}) {
  return initialize(
      {std::shared_ptr<torch::nn::Module>(std::shared_ptr<torch::nn::Module>(), &model)},
      {&optimizer}, options);
}

/// A model without an optimizer (inference at the level's precision).
template <typename ModuleType>
Amp initialize(torch::nn::ModuleHolder<ModuleType>& model, const Options& options = {}) {
  return initialize({model.ptr()}, {}, options);
}

template <typename ModuleType>
requires std::is_base_of_v<torch::nn::Module, ModuleType> Amp
initialize(const std::shared_ptr<ModuleType>& model, const Options& options = {}) {
  return initialize({std::static_pointer_cast<torch::nn::Module>(model)}, {}, options);
}

}  // namespace apex::amp
