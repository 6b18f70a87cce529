#pragma once

// Internal, ATen-free: the bodies of the Python package's multi-tensor ops (apex.optimizers,
// amp_C), written once for both op libraries. Each body is a template over the library's tensor
// glue L (python/csrc/ops.cpp for at::Tensor, python/csrc/stable_ops.cpp for
// torch::stable::Tensor), which supplies, all static:
//
//   Tensor, In, ListIn, OptIn         the tensor type and how the op's signature takes it
//   ref(t), refs(list)                ops::TensorRef views
//   float_zeros(like, n)              n fp32 zeros on like's device (float_empty: uninitialised)
//   float_full(like, v)               one fp32 element v on like's device
//   as_float(t, like)                 t's elements as a contiguous fp32 tensor on like's device
//   floats(t)                         float* of an fp32 tensor
//   raise_flag(noop, flag)            apex's flag convention: noop = max(noop, fp32 flag)
//   raise_flag_if_nonfinite(noop, x)  noop = 1 where the one-element x is not finite
//   launch<Kernel>(on, lists, args)   Kernel::cpu, or Kernel::cuda on on's device's stream
//
// Conventions of apex's amp_C that they keep: a one-element noop flag of any integer or float
// dtype; scale, axpby and the norms set it to 1 on a non-finite value; sgd skips the step when it
// is set; adam, adagrad, lamb and novograd ignore it (found_inf skips them).

#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "kernels/multi_tensor.h"
#include "ops/kernel_args.h"
#include "ops/lists.h"

namespace apex::ops {

/// A kernel of both backends, for L::launch: cpu() always, cuda() only where L has CUDA kernels
/// (a member template: the stable-ABI library never instantiates it, so never links it).
#define APEX_OPS_KERNEL(Name, fn)     \
  struct Name {                       \
    template <class... A>             \
    static void cpu(const A&... a) {  \
      kernels::cpu::fn(a...);         \
    }                                 \
    template <class... A>             \
    static void cuda(const A&... a) { \
      kernels::cuda::fn(a...);        \
    }                                 \
  }
APEX_OPS_KERNEL(ScaleKernel, scale);
APEX_OPS_KERNEL(AxpbyKernel, axpby);
APEX_OPS_KERNEL(NormKernel, norm);
APEX_OPS_KERNEL(AdamKernel, adam);
APEX_OPS_KERNEL(SgdKernel, sgd);
APEX_OPS_KERNEL(AdagradKernel, adagrad);
APEX_OPS_KERNEL(LambStage1Kernel, lamb_stage1);
APEX_OPS_KERNEL(LambStage2Kernel, lamb_stage2);
APEX_OPS_KERNEL(NovoGradKernel, novograd);
#undef APEX_OPS_KERNEL

template <class L>
void check_flag(const typename L::Tensor& flag, const char* who) {
  const TensorRef f = L::ref(flag);
  APEX_OPS_CHECK(f.defined && f.numel == 1, who, ": noop_flag must be a one-element tensor, got ",
                 Shape{f.sizes});
  require_backend(f, who);
}

template <class L>
const float* optional_scalar(const typename L::OptIn& t, const TensorRef& on, const char* who,
                             const char* name) {
  return t.has_value() ? scalar_ptr(L::ref(*t), on, who, name) : nullptr;
}

// GradScaler's scalars of the optimizer ops (inv_scale, found_inf: kernel memory on the
// parameters' device): the kernel unscales and skips.
template <class L>
kernels::AmpArgs amp_args(const typename L::OptIn& inv_scale, const typename L::OptIn& found_inf,
                          bool unscale_grads, const TensorRef& on, const char* who) {
  kernels::AmpArgs a;
  a.inv_scale = optional_scalar<L>(inv_scale, on, who, "inv_scale");
  a.found_inf = optional_scalar<L>(found_inf, on, who, "found_inf");
  a.unscale_grads = unscale_grads;
  return a;
}

// Adam-style lists: params, grads, both moments, optional fp32 masters.
inline ListBuilder moment_lists(const char* who, const TensorRefs& p, const TensorRefs& g,
                                const TensorRefs& m, const TensorRefs& v,
                                const TensorRefs& master) {
  return build_lists(who,
                     {{&p, "params"},
                      {&g, "grads"},
                      {&m, "exp_avgs"},
                      {&v, "exp_avg_sqs"},
                      {&master, "master_params"}},
                     4, 2);
}

// ---- primitives ------------------------------------------------------------------------------

template <class L>
void multi_tensor_scale(typename L::In noop, typename L::ListIn src, typename L::ListIn dst,
                        double scale) {
  constexpr const char* who = "multi_tensor_scale";
  check_flag<L>(noop, who);
  if (src.empty() && dst.empty()) return;
  const TensorRefs s = L::refs(src), d = L::refs(dst);
  const ListBuilder lists = build_lists(who, {{&s, "src"}, {&d, "dst"}}, 2);
  const auto flag = L::float_zeros(src.front(), 1);
  kernels::ScaleArgs args;
  args.scale = static_cast<float>(scale);
  args.found_inf = L::floats(flag);
  L::template launch<ScaleKernel>(s.front(), lists.view(), args);
  L::raise_flag(noop, flag);
}

template <class L>
void multi_tensor_axpby(typename L::In noop, typename L::ListIn x, typename L::ListIn y,
                        typename L::ListIn out, double a, double b, int64_t arg_to_check) {
  constexpr const char* who = "multi_tensor_axpby";
  check_flag<L>(noop, who);
  APEX_OPS_CHECK(arg_to_check >= -1 && arg_to_check <= 1, who,
                 ": arg_to_check must be -1 (both), 0 (x) or 1 (y), got ", arg_to_check);
  if (x.empty() && y.empty() && out.empty()) return;
  const TensorRefs rx = L::refs(x), ry = L::refs(y), ro = L::refs(out);
  const ListBuilder lists = build_lists(who, {{&rx, "x"}, {&ry, "y"}, {&ro, "out"}}, 3);
  const auto flag = L::float_zeros(x.front(), 1);
  kernels::AxpbyArgs args;
  args.a = static_cast<float>(a);
  args.b = static_cast<float>(b);
  args.arg_to_check = static_cast<int>(arg_to_check);
  args.found_inf = L::floats(flag);
  L::template launch<AxpbyKernel>(rx.front(), lists.view(), args);
  L::raise_flag(noop, flag);
}

template <class L>
std::tuple<typename L::Tensor, typename L::Tensor> norms(const char* who,
                                                         const typename L::Tensor& noop,
                                                         const std::vector<typename L::Tensor>& x,
                                                         const typename L::Tensor* inv_scale,
                                                         bool per_tensor) {
  check_flag<L>(noop, who);
  if (x.empty()) return {L::float_zeros(noop, 1), L::float_zeros(noop, 0)};
  const TensorRefs rx = L::refs(x);
  const ListBuilder lists = build_lists(who, {{&rx, "x"}}, 1);
  auto total = L::float_empty(x.front(), 1);
  auto per = L::float_empty(x.front(), per_tensor ? static_cast<int64_t>(x.size()) : 0);
  kernels::NormArgs args;
  args.type = kernels::NormType::kL2;
  args.inv_scale =
      inv_scale != nullptr ? scalar_ptr(L::ref(*inv_scale), rx.front(), who, "inv_scale") : nullptr;
  args.total = L::floats(total);
  args.per_tensor = per_tensor ? L::floats(per) : nullptr;
  L::template launch<NormKernel>(rx.front(), lists.view(), args);
  // apex's l2norm sets the flag on a non-finite value, which shows in the total.
  L::raise_flag_if_nonfinite(noop, total);
  return {total, per};
}

template <class L>
std::tuple<typename L::Tensor, typename L::Tensor> multi_tensor_l2norm(typename L::In noop,
                                                                       typename L::ListIn x,
                                                                       bool per_tensor) {
  return norms<L>("multi_tensor_l2norm", noop, x, nullptr, per_tensor);
}

template <class L>
std::tuple<typename L::Tensor, typename L::Tensor> multi_tensor_unscale_l2norm(
    typename L::In noop, typename L::ListIn x, typename L::In inv_scale, bool per_tensor) {
  APEX_OPS_CHECK(L::ref(inv_scale).defined,
                 "multi_tensor_unscale_l2norm: inv_scale must be defined");
  return norms<L>("multi_tensor_unscale_l2norm", noop, x, &inv_scale, per_tensor);
}

// ---- optimizers ------------------------------------------------------------------------------

template <class L>
void multi_tensor_adam(typename L::In noop, typename L::ListIn g, typename L::ListIn p,
                       typename L::ListIn m, typename L::ListIn v, typename L::ListIn master,
                       double lr, double beta1, double beta2, double eps, int64_t step,
                       bool adam_w_mode, bool bias_correction, double weight_decay,
                       typename L::OptIn inv_scale, typename L::OptIn found_inf,
                       typename L::OptIn lr_tensor, typename L::OptIn step_tensor,
                       bool unscale_grads) {
  constexpr const char* who = "multi_tensor_adam";
  check_flag<L>(noop, who);
  if (p.empty()) return;
  const TensorRefs rp = L::refs(p), rg = L::refs(g), rm = L::refs(m), rv = L::refs(v),
                   rmaster = L::refs(master);
  const ListBuilder lists = moment_lists(who, rp, rg, rm, rv, rmaster);
  APEX_OPS_CHECK(step >= 1 || step_tensor.has_value(), who, ": step must be >= 1, got ", step);
  const TensorRef& on = rp.front();
  kernels::AdamArgs args =
      adam_args(lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay);
  args.lr_ptr = optional_scalar<L>(lr_tensor, on, who, "lr");
  args.step_ptr = optional_scalar<L>(step_tensor, on, who, "step");
  args.amp = amp_args<L>(inv_scale, found_inf, unscale_grads, on, who);
  L::template launch<AdamKernel>(on, lists.view(), args);
}

template <class L>
void multi_tensor_sgd(typename L::In noop, typename L::ListIn g, typename L::ListIn p,
                      typename L::ListIn momentum_buf, typename L::ListIn master, double lr,
                      double momentum, double dampening, double weight_decay, bool nesterov,
                      bool first_run, bool wd_after_momentum, double scale, bool unscale_grads) {
  constexpr const char* who = "multi_tensor_sgd";
  check_flag<L>(noop, who);
  if (p.empty()) return;
  const TensorRefs rp = L::refs(p), rg = L::refs(g), rb = L::refs(momentum_buf),
                   rmaster = L::refs(master);
  const ListBuilder lists = build_lists(
      who,
      {{&rp, "params"}, {&rg, "grads"}, {&rb, "momentum_buffers"}, {&rmaster, "master_params"}}, 2,
      2);
  APEX_OPS_CHECK(momentum == 0 || !momentum_buf.empty(), who, ": momentum ", momentum,
                 " needs the momentum buffers");
  // The step is skipped when the noop flag is already set (apex's early exit).
  const auto flag = L::as_float(noop, p.front());
  const auto inv = L::float_full(p.front(), scale);
  kernels::SgdArgs args =
      sgd_args(lr, momentum, dampening, weight_decay, nesterov, first_run, wd_after_momentum);
  args.amp.inv_scale = L::floats(inv);
  args.amp.found_inf = L::floats(flag);
  args.amp.unscale_grads = unscale_grads;
  L::template launch<SgdKernel>(rp.front(), lists.view(), args);
}

template <class L>
void multi_tensor_adagrad(typename L::In noop, typename L::ListIn g, typename L::ListIn p,
                          typename L::ListIn h, typename L::ListIn master, double lr, double eps,
                          bool adagrad_w_mode, double weight_decay, typename L::OptIn inv_scale,
                          typename L::OptIn found_inf, bool unscale_grads) {
  constexpr const char* who = "multi_tensor_adagrad";
  check_flag<L>(noop, who);
  if (p.empty()) return;
  const TensorRefs rp = L::refs(p), rg = L::refs(g), rh = L::refs(h), rmaster = L::refs(master);
  const ListBuilder lists = build_lists(
      who, {{&rp, "params"}, {&rg, "grads"}, {&rh, "state_sums"}, {&rmaster, "master_params"}}, 3,
      2);
  const TensorRef& on = rp.front();
  kernels::AdagradArgs args = adagrad_args(lr, eps, adagrad_w_mode, weight_decay);
  args.amp = amp_args<L>(inv_scale, found_inf, unscale_grads, on, who);
  L::template launch<AdagradKernel>(on, lists.view(), args);
}

template <class L>
void multi_tensor_lamb(typename L::In noop, typename L::ListIn g, typename L::ListIn p,
                       typename L::ListIn m, typename L::ListIn v, typename L::ListIn master,
                       double lr, double beta1, double beta2, double eps, int64_t step,
                       bool bias_correction, double weight_decay, bool grad_averaging,
                       bool adam_w_mode, typename L::In global_grad_norm, double max_grad_norm,
                       bool use_nvlamb, typename L::OptIn inv_scale, typename L::OptIn found_inf,
                       bool unscale_grads) {
  constexpr const char* who = "multi_tensor_lamb";
  check_flag<L>(noop, who);
  if (p.empty()) return;
  const TensorRefs rp = L::refs(p), rg = L::refs(g), rm = L::refs(m), rv = L::refs(v),
                   rmaster = L::refs(master);
  const ListBuilder lists = moment_lists(who, rp, rg, rm, rv, rmaster);
  APEX_OPS_CHECK(step >= 1, who, ": step must be >= 1, got ", step);
  const TensorRef gn = L::ref(global_grad_norm);
  require_backend(gn, who);
  APEX_OPS_CHECK(gn.numel == 1, who, ": global_grad_norm must be a one-element tensor, got ",
                 gn.numel, " elements");
  const TensorRef& on = rp.front();
  const auto u_sumsq = L::float_zeros(p.front(), lists.size());
  const auto p_sumsq = L::float_zeros(p.front(), lists.size());
  const auto gnorm = L::as_float(global_grad_norm, p.front());
  kernels::LambArgs args = lamb_args(lr, beta1, beta2, eps, step, bias_correction, weight_decay,
                                     grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb);
  args.global_grad_norm = L::floats(gnorm);
  args.u_sumsq = L::floats(u_sumsq);
  args.p_sumsq = L::floats(p_sumsq);
  args.amp = amp_args<L>(inv_scale, found_inf, unscale_grads, on, who);
  L::template launch<LambStage1Kernel>(on, lists.view(), args);
  L::template launch<LambStage2Kernel>(on, lists.view(), args);
}

template <class L>
void multi_tensor_novograd(typename L::In noop, typename L::ListIn g, typename L::ListIn p,
                           typename L::ListIn m, typename L::ListIn master, typename L::In v,
                           double lr, double beta1, double beta2, double eps, int64_t step,
                           bool bias_correction, double weight_decay, bool grad_averaging,
                           bool reg_inside_moment, typename L::OptIn inv_scale,
                           typename L::OptIn found_inf, bool unscale_grads) {
  constexpr const char* who = "multi_tensor_novograd";
  check_flag<L>(noop, who);
  if (p.empty()) return;
  const TensorRefs rp = L::refs(p), rg = L::refs(g), rm = L::refs(m), rmaster = L::refs(master);
  const ListBuilder lists = build_lists(
      who, {{&rp, "params"}, {&rg, "grads"}, {&rm, "exp_avgs"}, {&rmaster, "master_params"}}, 3, 2);
  APEX_OPS_CHECK(step >= 1, who, ": step must be >= 1, got ", step);
  const TensorRef rvn = L::ref(v);
  APEX_OPS_CHECK(rvn.numel == static_cast<int64_t>(p.size()), who, ": grad_norms has ", rvn.numel,
                 " elements, expected one per tensor (", p.size(), ")");
  require_backend(rvn, who);
  const TensorRef& on = rp.front();
  // The blended norms as fp32, from any dtype and layout (one element per tensor).
  const auto vf = L::as_float(v, p.front());
  kernels::NovoGradArgs args = novograd_args(lr, beta1, beta2, eps, step, bias_correction,
                                             weight_decay, grad_averaging, reg_inside_moment);
  args.v = L::floats(vf);
  args.amp = amp_args<L>(inv_scale, found_inf, unscale_grads, on, who);
  L::template launch<NovoGradKernel>(on, lists.view(), args);
}

}  // namespace apex::ops
