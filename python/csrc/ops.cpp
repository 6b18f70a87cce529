// The Python package's front door: torch custom ops (namespace apex_cpp) over the same kernels
// and tensor glue the C++ library uses, reached through src/ops only: the multi-tensor ops' bodies
// (ops/multi_tensor_ops.h, shared with the stable-ABI library) over ops::AtenGlue
// (ops/aten/glue.h), the norms' and SyncBatchNorm's entry points (ops/aten/norm.h,
// ops/aten/batch_norm.h). The Python side (python/apex) adds the fake implementations, autograd
// and apex's classes.
#include <ATen/TensorOperators.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/clamp_min.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/full.h>
#include <ATen/ops/full_like.h>
#include <ATen/ops/isfinite.h>
#include <ATen/ops/logical_not.h>
#include <ATen/ops/maximum.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>
#include <apex/amp/cpu_half.h>
#include <apex/amp/cpu_half_testing.h>
#include <apex/amp/options.h>
#include <apex/optim/multi_tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/library.h>

#include <array>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "common/environment.h"
#include "ops/aten/batch_norm.h"
#include "ops/aten/glue.h"
#include "ops/aten/norm.h"
#include "ops/multi_tensor_ops.h"
#include "ops/scalars.h"
#include "schemas.h"

namespace apex::python {
namespace {

using at::Tensor;
using TensorList = std::vector<Tensor>;

// Tests: the tensor form on CPU tensors too (_update_scale_hysteresis_tensor_form).
std::atomic<bool> tensor_form_forced{false};
void force_update_scale_tensor_form(bool on) { tensor_form_forced.store(on); }

// apex's update_scale_hysteresis: on CPU tensors the host form (ops/scalars.h), which the
// stable-ABI library runs too; elsewhere the same rule in tensor ops, where the tensors are,
// unsynced (test_stable_abi compares the forms).
void update_scale_hysteresis(const Tensor& scale, const Tensor& growth_tracker,
                             const Tensor& hysteresis_tracker, const Tensor& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             int64_t hysteresis) {
  const ops::TensorRef s = bridge::ref(scale), g = bridge::ref(growth_tracker),
                       h = bridge::ref(hysteresis_tracker), f = bridge::ref(found_inf);
  if (s.is_cpu() && g.is_cpu() && h.is_cpu() && f.is_cpu() && !tensor_form_forced) {
    ops::update_scale_hysteresis(s, g, h, f, growth_factor, backoff_factor, growth_interval,
                                 hysteresis);
    return;
  }
  ops::check_update_scale_hysteresis(s, g, h, f, growth_interval, hysteresis);
  const Tensor inf = found_inf.to(scale.device()).reshape({}).ne(0);
  const Tensor hyst = hysteresis_tracker.reshape({});
  const Tensor growth = growth_tracker.reshape({});
  // Overflow: one hysteresis step used; back off when none are left.
  const Tensor hyst_after = at::where(inf, hyst - 1, hyst);
  const Tensor back_off = inf.logical_and(hyst_after.le(0));
  // Clean: count towards growth; grow when the interval is reached (and the result is finite).
  const Tensor growth_after = at::where(inf, at::zeros_like(growth), growth + 1);
  const Tensor grow = growth_after.ge(growth_interval);
  const Tensor grown = scale * growth_factor;
  Tensor new_scale = at::where(back_off, scale * backoff_factor,
                               at::where(grow.logical_and(at::isfinite(grown)), grown, scale));
  scale.copy_(new_scale);
  growth_tracker.copy_(
      at::where(grow, at::zeros_like(growth), growth_after).reshape(growth_tracker.sizes()));
  // The budget refills after a clean step (apex); it stays at zero tolerance until then.
  hysteresis_tracker.copy_(
      at::where(inf, at::clamp_min(hyst_after, 0), at::full_like(hyst, hysteresis))
          .reshape(hysteresis_tracker.sizes()));
}

// ---- norms -------------------------------------------------------------------------------------

const char* norm_who(bool rms) { return rms ? "FusedRMSNorm" : "FusedLayerNorm"; }

// fused_norm_fwd's outputs from {y, mean, rstd}: custom ops return defined tensors, so
// RMSNorm's absent mean becomes an empty one.
std::tuple<Tensor, Tensor, Tensor> norm_outputs(std::array<Tensor, 3> r) {
  if (!r[1].defined()) r[1] = at::empty({0}, r[2].options());
  return {r[0], r[1], r[2]};
}

std::tuple<Tensor, Tensor, Tensor> fused_norm_fwd(const Tensor& input,
                                                  at::IntArrayRef normalized_shape,
                                                  const std::optional<Tensor>& weight,
                                                  const std::optional<Tensor>& bias, double eps,
                                                  bool rms, bool mixed, bool memory_efficient) {
  return norm_outputs(
      normalization::ops::forward(norm_who(rms), input, normalized_shape, weight.value_or(Tensor()),
                                  bias.value_or(Tensor()), eps, rms, mixed, memory_efficient));
}

std::tuple<Tensor, Tensor, Tensor> fused_norm_bwd(
    const Tensor& grad_out, const Tensor& saved, const Tensor& mean, const Tensor& rstd,
    const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
    at::IntArrayRef normalized_shape, double eps, bool rms, bool mixed, bool memory_efficient,
    at::ScalarType input_dtype, std::array<bool, 3> output_mask) {
  auto r = normalization::ops::backward(norm_who(rms), grad_out, saved, mean, rstd,
                                        weight.value_or(Tensor()), bias.value_or(Tensor()),
                                        normalized_shape, eps, rms, mixed, memory_efficient,
                                        input_dtype, output_mask);
  // Gradients not asked for come back empty (Python turns them into None).
  for (Tensor& t : r) {
    if (!t.defined()) t = at::empty({0}, saved.options());
  }
  return {r[0], r[1], r[2]};
}

// The autograd of fused_norm_fwd, in C++ (a Python registration cost ~40 us per call): the
// forward and backward ops are called through the dispatcher, so under torch.compile they reach
// their fake implementations.
// kStats: y and the statistics (marked non-differentiable), as fused_norm_fwd returns them; else
// y alone (fused_norm), which compiled autograd can trace (it refuses non-differentiable outputs).
template <bool kStats>
class NormFunction : public torch::autograd::Function<NormFunction<kStats>> {
 public:
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const Tensor& input, std::vector<int64_t> shape,
                                                const std::optional<Tensor>& weight,
                                                const std::optional<Tensor>& bias, double eps,
                                                bool rms, bool mixed, bool memory_efficient) {
    static const auto fwd = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("apex_cpp::fused_norm_fwd", "")
                                .typed<decltype(fused_norm_fwd)>();
    Tensor y, mean, rstd;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      std::tie(y, mean, rstd) =
          fwd.call(input, shape, weight, bias, eps, rms, mixed, memory_efficient);
    }
    if constexpr (kStats) ctx->mark_non_differentiable({mean, rstd});
    // memory_efficient keeps the output and recomputes x_hat = (y - bias) / weight (apex's).
    ctx->save_for_backward({memory_efficient ? y : input, mean, rstd, weight.value_or(Tensor()),
                            bias.value_or(Tensor())});
    ctx->saved_data["shape"] = c10::IValue(shape);
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["flags"] = c10::IValue(
        std::vector<bool>{rms, mixed, memory_efficient, weight.has_value(), bias.has_value()});
    ctx->saved_data["input_dtype"] = static_cast<int64_t>(input.scalar_type());
    if constexpr (kStats) return {y, mean, rstd};
    return {y};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    static const auto bwd = c10::Dispatcher::singleton()
                                .findSchemaOrThrow("apex_cpp::fused_norm_bwd", "")
                                .typed<decltype(fused_norm_bwd)>();
    const auto saved = ctx->get_saved_variables();
    const auto flags = ctx->saved_data["flags"].toBoolList();
    const bool has_w = flags.get(3);
    const bool has_b = flags.get(4);
    // needs_input_grad counts the tensor inputs present: input, then weight and bias if given.
    const std::array<bool, 3> want = {ctx->needs_input_grad(0), has_w && ctx->needs_input_grad(1),
                                      has_b && ctx->needs_input_grad(has_w ? 2 : 1)};
    Tensor none;
    if (!grads[0].defined()) return {none, none, none, none, none, none, none, none};
    const auto shape = ctx->saved_data["shape"].toIntVector();
    // Without create_graph nothing records the backward op: skip the Autograd and
    // ADInplaceOrView keys, whose fallbacks for a custom op box all thirteen arguments.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below;
    if (!at::GradMode::is_enabled()) below.emplace();
    auto [dx, dw, db] =
        bwd.call(grads[0], saved[0], saved[1], saved[2],
                 has_w ? std::optional<Tensor>(saved[3]) : std::nullopt,
                 has_b ? std::optional<Tensor>(saved[4]) : std::nullopt, shape,
                 ctx->saved_data["eps"].toDouble(), flags.get(0), flags.get(1), flags.get(2),
                 static_cast<at::ScalarType>(ctx->saved_data["input_dtype"].toInt()), want);
    return {want[0] ? dx : none,
            none,
            want[1] ? dw : none,
            want[2] ? db : none,
            none,
            none,
            none,
            none};
  }
};

// Whether a call is plain eager work on CPU or CUDA tensors: no tensor subclass or mode of
// Python's (fake tensors, torch_dispatch modes), no functionalization or functorch transform,
// which must see the forward and backward ops through the dispatcher.
// APEX_NORM_EAGER_AUTOGRAD=0: every call takes the traceable route (compiled autograd over eager
// code needs it; ~6 us slower per forward + backward). Python's norms ask this too
// (apex_cpp::_norm_eager_autograd), so the switch is read in one place.
bool norm_eager_autograd() {
  static const bool enabled = !apex::detail::env_is("APEX_NORM_EAGER_AUTOGRAD", "0");
  return enabled;
}

bool eager_call(const Tensor& input, const std::optional<Tensor>& weight,
                const std::optional<Tensor>& bias) {
  constexpr c10::DispatchKeySet kTraced(
      {c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
       c10::DispatchKey::Functionalize, c10::DispatchKey::FuncTorchGradWrapper,
       c10::DispatchKey::FuncTorchBatched, c10::DispatchKey::FuncTorchDynamicLayerFrontMode,
       c10::DispatchKey::FuncTorchDynamicLayerBackMode});
  if (!norm_eager_autograd()) return false;
  if (c10::impl::tls_local_dispatch_key_set().included_.has_any(kTraced)) return false;
  // Strided memory the kernels can read as it is: no lazy negation or conjugation, no
  // ZeroTensor, no sparse or MKLDNN layout (the dispatcher's fallbacks convert those first).
  constexpr c10::DispatchKeySet kNotRaw(
      {c10::DispatchKey::Negative, c10::DispatchKey::Conjugate, c10::DispatchKey::ZeroTensor});
  const auto plain = [&](const Tensor& t) {
    return !t.key_set().has_any(kTraced | kNotRaw) && t.layout() == c10::kStrided &&
           (t.is_cpu() || t.is_cuda());
  };
  return plain(input) && (!weight.has_value() || plain(*weight)) &&
         (!bias.has_value() || plain(*bias));
}

// The eager route: the C++ library's autograd (its own node, the kernels called directly: about
// 6 us less per forward + backward from Python than a torch::autograd::Function around the
// dispatcher, docs/benchmarks.md). {y, mean, rstd}.
std::array<Tensor, 3> eager_norm(const Tensor& input, at::IntArrayRef normalized_shape,
                                 const std::optional<Tensor>& weight,
                                 const std::optional<Tensor>& bias, double eps, bool rms,
                                 bool mixed, bool memory_efficient) {
  return normalization::ops::forward_autograd(norm_who(rms), input, normalized_shape,
                                              weight.value_or(Tensor()), bias.value_or(Tensor()),
                                              eps, rms, mixed, memory_efficient);
}

// Eager calls take eager_norm; traced ones the Function, whose forward and backward ops reach
// their fake implementations.
std::tuple<Tensor, Tensor, Tensor> fused_norm_fwd_autograd(
    const Tensor& input, at::IntArrayRef normalized_shape, const std::optional<Tensor>& weight,
    const std::optional<Tensor>& bias, double eps, bool rms, bool mixed, bool memory_efficient) {
  if (eager_call(input, weight, bias)) {
    return norm_outputs(
        eager_norm(input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient));
  }
  auto r = NormFunction<true>::apply(input, normalized_shape.vec(), weight, bias, eps, rms, mixed,
                                     memory_efficient);
  return {r[0], r[1], r[2]};
}

// fused_norm: the modules' and functional forms' op, y alone (fused_norm_fwd also returns the
// statistics, for apex's autograd Functions). Below autograd (inference mode) the kernels; its
// autograd the same two routes as fused_norm_fwd's.
Tensor fused_norm(const Tensor& input, at::IntArrayRef normalized_shape,
                  const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                  double eps, bool rms, bool mixed, bool memory_efficient) {
  return normalization::ops::forward(norm_who(rms), input, normalized_shape,
                                     weight.value_or(Tensor()), bias.value_or(Tensor()), eps, rms,
                                     mixed, memory_efficient)[0];
}

Tensor fused_norm_autograd(const Tensor& input, at::IntArrayRef normalized_shape,
                           const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                           double eps, bool rms, bool mixed, bool memory_efficient) {
  if (eager_call(input, weight, bias)) {
    return eager_norm(input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient)[0];
  }
  return NormFunction<false>::apply(input, normalized_shape.vec(), weight, bias, eps, rms, mixed,
                                    memory_efficient)[0];
}

// apex's rule for its fused norms under autocast: the floating-point tensors are cast to the
// autocast dtype of their device, and the norm runs without autocast (where the functional forms
// used to check it in Python on every call).
template <c10::DispatchKey kAutocast, c10::DeviceType kDevice>
Tensor fused_norm_autocast(const Tensor& input, at::IntArrayRef normalized_shape,
                           const std::optional<Tensor>& weight, const std::optional<Tensor>& bias,
                           double eps, bool rms, bool mixed, bool memory_efficient) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("apex_cpp::fused_norm", "")
                             .typed<decltype(fused_norm)>();
  const c10::impl::ExcludeDispatchKeyGuard no_autocast(kAutocast);
  const at::ScalarType dtype = at::autocast::get_autocast_dtype(kDevice);
  const auto cast = [dtype](const Tensor& t) {
    // float64 stays (autocast's own rule for eligible tensors).
    return t.is_floating_point() && t.scalar_type() != dtype && t.scalar_type() != at::kDouble
               ? t.to(dtype)
               : t;
  };
  const auto cast_opt = [&](const std::optional<Tensor>& t) -> std::optional<Tensor> {
    if (!t.has_value()) return std::nullopt;
    return cast(*t);
  };
  return op.call(cast(input), normalized_shape, cast_opt(weight), cast_opt(bias), eps, rms, mixed,
                 memory_efficient);
}

// ---- batch norm (SyncBatchNorm's per-rank pieces, CPU) ------------------------------------------

// The CPU kernels' wrappers the C++ SyncBatchNorm uses (ops/aten/batch_norm.h); the
// collectives run in Python (apex.parallel.SyncBatchNorm).
Tensor batch_norm_stats(const Tensor& input) {
  return parallel::detail::batch_norm_stats(input, "batch_norm_stats");
}

Tensor batch_norm_elemt(const Tensor& input, const Tensor& mean, const Tensor& scale,
                        const Tensor& shift) {
  return parallel::detail::batch_norm_elemt("batch_norm_elemt", input, nullptr, mean, scale,
                                            nullptr, shift);
}

Tensor batch_norm_backward_elemt(const Tensor& grad_out, const Tensor& input, const Tensor& mean,
                                 const Tensor& a, const Tensor& b, const Tensor& k) {
  return parallel::detail::batch_norm_elemt("batch_norm_backward_elemt", input, &grad_out, mean, a,
                                            &b, k);
}

Tensor batch_norm_backward_reduce(const Tensor& grad_out, const Tensor& input,
                                  const Tensor& mean64) {
  return parallel::detail::batch_norm_backward_reduce("batch_norm_backward_reduce", grad_out, input,
                                                      mean64);
}

std::string cpu_isa() { return apex::optim::cpu_kernel_isa(); }

// ---- CPU half precision through fp32 (apex/amp/cpu_half.h), for apex.amp and its scope ---------

// The guards a Python scope holds in this thread, innermost last (enter and exit come in pairs
// from one thread: apex.amp.cpu_half_fallback).
thread_local std::vector<std::unique_ptr<apex::amp::CpuHalfFallbackGuard>> half_scopes;

// Starts a scope; false (and nothing held) where the fallback is not available.
bool cpu_half_fallback_enter() {
  // The guard's own question (the fallback, or attention's own kernels where LibTorch's half
  // matmuls are fast), so that Python's scope serves what C++'s does.
  if (!apex::amp::cpu_half_scope_available()) return false;
  half_scopes.push_back(std::make_unique<apex::amp::CpuHalfFallbackGuard>(true));
  return true;
}

void cpu_half_fallback_exit() {
  TORCH_CHECK(!half_scopes.empty(),
              "apex_cpp::cpu_half_fallback_exit: no scope of this thread is open");
  half_scopes.pop_back();
}

bool cpu_half_fallback_active() { return apex::amp::cpu_half_fallback_active(); }
// For one dtype (Half or BFloat16), or for either.
bool cpu_half_fallback_available(std::optional<c10::ScalarType> dtype) {
  return dtype ? apex::amp::cpu_half_fallback_available(*dtype)
               : apex::amp::cpu_half_fallback_available();
}

// Tests: -1 decides from the CPU and the environment again, 0/1 force nothing/everything,
// 2: as a CPU whose half matmuls are fast (attention's own kernels only).
void cpu_half_fallback_force(int64_t forced) {
  TORCH_CHECK(forced >= -1 && forced <= 2,
              "apex_cpp::_cpu_half_fallback_force: expected -1, 0, 1 or 2, got ", forced);
  if (forced == 2) {
    apex::amp::detail::force_cpu_half_attention_only();
    return;
  }
  apex::amp::detail::force_cpu_half_fallback_available(
      forced < 0 ? std::nullopt : std::optional<bool>(forced == 1));
}

// Tests: the op calls in this thread that the fallback computed.
int64_t cpu_half_route_calls() {
  return static_cast<int64_t>(apex::amp::detail::cpu_half_route_calls());
}

// Tests: the C++ opt-level table (amp::Properties::resolve with no override) as describe()
// prints it, for a test that compares Python's (apex/amp/frontend.py) with it.
std::string amp_level_defaults(const std::string& level, c10::ScalarType half_dtype) {
  return apex::amp::Properties::resolve(
             apex::amp::Options(apex::amp::parse_opt_level(level)).half_dtype(half_dtype))
      .describe();
}

// For python -m apex.bench: seconds per call of the C++ multi_tensor_scale, called n times from
// C++ (what a Python call adds is measured against it in the same process).
double bench_scale_calls(const Tensor& noop, const TensorList& x, const TensorList& y, int64_t n) {
  TORCH_CHECK(n >= 1 && n <= (int64_t{1} << 30), "bench_scale_calls: n must be in [1, 2^30]");
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) ops::multi_tensor_scale<apex::ops::AtenGlue>(noop, x, y, 1.0);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() /
         static_cast<double>(n);
}

}  // namespace

TORCH_LIBRARY(apex_cpp, m) {
#define APEX_PY_DEF(name, schema) m.def(schema);
  APEX_PY_MULTI_TENSOR_OPS(APEX_PY_DEF)
#undef APEX_PY_DEF
  m.def(APEX_PY_UPDATE_SCALE_HYSTERESIS_SCHEMA);
  m.def(APEX_PY_NORM_FWD_SCHEMA);
  m.def(
      "fused_norm(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, float eps, "
      "bool rms, bool mixed, bool memory_efficient) -> Tensor");
  m.def(APEX_PY_NORM_BWD_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_STATS_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_ELEMT_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_BACKWARD_REDUCE_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_BACKWARD_ELEMT_SCHEMA);
  m.def("cpu_isa() -> str", &cpu_isa);
  m.def("cpu_half_fallback_enter() -> bool", &cpu_half_fallback_enter);
  m.def("cpu_half_fallback_exit() -> ()", &cpu_half_fallback_exit);
  m.def("cpu_half_fallback_active() -> bool", &cpu_half_fallback_active);
  m.def("cpu_half_fallback_available(ScalarType? dtype=None) -> bool",
        &cpu_half_fallback_available);
  m.def("cpu_half_fallback_prepare() -> ()", &apex::amp::prepare_cpu_half_fallback);
  m.def("_cpu_half_fallback_force(int forced) -> ()", &cpu_half_fallback_force);
  m.def("_cpu_half_route_calls() -> int", &cpu_half_route_calls);
  m.def("_norm_eager_autograd() -> bool", &norm_eager_autograd);
  m.def("_amp_level_defaults(str level, ScalarType half_dtype) -> str", &amp_level_defaults);
  m.def("_update_scale_hysteresis_tensor_form(bool on) -> ()", &force_update_scale_tensor_form);
  m.def("bench_scale_calls(Tensor(a!) noop_flag, Tensor[] x, Tensor(b!)[] y, int n) -> float",
        &bench_scale_calls);
}

// The kernels take CPU and CUDA tensors alike (the bridge picks the backend).
#define APEX_PY_IMPL(name, schema) m.impl(#name, &apex::ops::name<apex::ops::AtenGlue>);
#define APEX_PYTHON_IMPLS(m)                                   \
  APEX_PY_MULTI_TENSOR_OPS(APEX_PY_IMPL)                       \
  m.impl("update_scale_hysteresis", &update_scale_hysteresis); \
  m.impl("fused_norm", &fused_norm);                           \
  m.impl("fused_norm_fwd", &fused_norm_fwd);                   \
  m.impl("fused_norm_bwd", &fused_norm_bwd);

TORCH_LIBRARY_IMPL(apex_cpp, CPU, m) {
  APEX_PYTHON_IMPLS(m)
  m.impl("batch_norm_stats", &batch_norm_stats);
  m.impl("batch_norm_elemt", &batch_norm_elemt);
  m.impl("batch_norm_backward_reduce", &batch_norm_backward_reduce);
  m.impl("batch_norm_backward_elemt", &batch_norm_backward_elemt);
}

TORCH_LIBRARY_IMPL(apex_cpp, CUDA, m){APEX_PYTHON_IMPLS(m)}

TORCH_LIBRARY_IMPL(apex_cpp, Autograd, m) {
  m.impl("fused_norm_fwd", &fused_norm_fwd_autograd);
  m.impl("fused_norm", &fused_norm_autograd);
}

TORCH_LIBRARY_IMPL(apex_cpp, AutocastCPU, m) {
  m.impl("fused_norm", &fused_norm_autocast<c10::DispatchKey::AutocastCPU, c10::DeviceType::CPU>);
}

TORCH_LIBRARY_IMPL(apex_cpp, AutocastCUDA, m) {
  m.impl("fused_norm", &fused_norm_autocast<c10::DispatchKey::AutocastCUDA, c10::DeviceType::CUDA>);
}

}  // namespace apex::python
