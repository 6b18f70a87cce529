// The Python package's second op library, on LibTorch's stable ABI: the multi-tensor ops of
// apex.optimizers and amp_C, the norms' forward and backward and SyncBatchNorm's CPU pieces
// (namespace apex_cpp_stable, the same schemas as apex_cpp's) over the same CPU kernels, compiled
// with TORCH_TARGET_VERSION 2.10, so that one build loads into every torch from 2.10 on.
// python/apex/_ops.py uses it when _apex_cpp.so (regular ABI, every op) was built for another
// torch. It holds no ATen code: tensors are checked through the stable accessors, scalars live on
// the host (CPU tensors only), the kernels' thread pool is torch::stable::parallel_for
// (kernels/cpu/parallel.h).
//
// The messages are the regular op library's (src/bridge), so a test can compare both.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernel_args.h"
#include "kernels/batch_norm.h"
#include "kernels/multi_tensor.h"
#include "kernels/norm.h"
#include "schemas.h"

namespace apex::python::stable {
namespace {

using torch::headeronly::MemoryFormat;
using torch::headeronly::ScalarType;

// Throws std::runtime_error (a RuntimeError in Python) with the message alone, as TORCH_CHECK's
// reach Python; STD_TORCH_CHECK would put the C++ function, file and line in front of it.
template <class... Args>
[[noreturn]] void fail(const Args&... args) {
  std::ostringstream s;
  (s << ... << args);
  throw std::runtime_error(s.str());
}
#define APEX_CHECK(cond, ...)       \
  do {                              \
    if (!(cond)) fail(__VA_ARGS__); \
  } while (false)
using torch::stable::Tensor;
using TensorList = std::vector<Tensor>;

std::string dims(torch::headeronly::IntHeaderOnlyArrayRef d) {
  std::ostringstream s;
  s << "[";
  for (size_t i = 0; i < d.size(); ++i) s << (i ? ", " : "") << d[i];
  s << "]";
  return s.str();
}

std::string device_name(const Tensor& t) {
  if (t.is_cpu()) return "cpu";
  std::ostringstream s;
  s << (t.is_cuda() ? "cuda" : "device type ") << ":" << static_cast<int>(t.get_device_index());
  return s.str();
}

const char* dtype_name(ScalarType t) {
  switch (t) {
    case ScalarType::Float:
      return "Float";
    case ScalarType::Half:
      return "Half";
    case ScalarType::BFloat16:
      return "BFloat16";
    case ScalarType::Double:
      return "Double";
    case ScalarType::Long:
      return "Long";
    case ScalarType::Int:
      return "Int";
    case ScalarType::Bool:
      return "Bool";
    case ScalarType::Short:
      return "Short";
    case ScalarType::Char:
      return "Char";
    case ScalarType::Byte:
      return "Byte";
    case ScalarType::ComplexFloat:
      return "ComplexFloat";
    case ScalarType::ComplexDouble:
      return "ComplexDouble";
    default:
      return "a dtype other than float32, float16 or bfloat16";
  }
}

void check_cpu(const Tensor& t, const char* who) {
  APEX_CHECK(
      t.is_cpu(), who, ": apex-cpp's stable-ABI op library runs on CPU tensors, got a tensor on ",
      device_name(t), " (the regular op library, built for this torch, has the CUDA kernels)");
}

kernels::DType kernel_dtype(ScalarType t, const char* who) {
  switch (t) {
    case ScalarType::Float:
      return kernels::DType::kFloat32;
    case ScalarType::Half:
      return kernels::DType::kFloat16;
    case ScalarType::BFloat16:
      return kernels::DType::kBFloat16;
    default:
      fail(who, ": expected float32, float16 or bfloat16 tensors, got ", dtype_name(t));
  }
}

// Non-overlapping and dense: some order of the dimensions makes the strides those of a
// contiguous tensor (the kernels read numel elements from data_ptr).
bool dense(const Tensor& t) {
  if (t.numel() == 0) return true;
  const auto sizes = t.sizes();
  const auto strides = t.strides();
  std::vector<size_t> order;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] != 1) order.push_back(d);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return strides[a] < strides[b]; });
  int64_t expected = 1;
  for (size_t d : order) {
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

void check_list(const TensorList& list, const char* who, const char* arg) {
  APEX_CHECK(!list.empty(), who, ": ", arg, " must not be empty");
  const Tensor& first = list.front();
  for (size_t i = 0; i < list.size(); ++i) {
    const Tensor& t = list[i];
    APEX_CHECK(t.defined(), who, ": ", arg, "[", i, "] is undefined");
    check_cpu(t, who);
    APEX_CHECK(t.scalar_type() == first.scalar_type(), who, ": all tensors of ", arg,
               " must have one dtype, got ", dtype_name(first.scalar_type()), " at index 0 and ",
               dtype_name(t.scalar_type()), " at index ", i);
    APEX_CHECK(dense(t), who, ": ", arg, "[", i,
               "] must be contiguous (non-overlapping and dense)");
    kernel_dtype(t.scalar_type(), who);
  }
}

void check_matching(const TensorList& ref, const TensorList& other, const char* who,
                    const char* ref_name, const char* other_name) {
  APEX_CHECK(ref.size() == other.size(), who, ": ", ref_name, " and ", other_name,
             " must have the same length, got ", ref.size(), " and ", other.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    APEX_CHECK(ref[i].sizes().vec() == other[i].sizes().vec(), who, ": ", other_name, "[", i,
               "] has shape ", dims(other[i].sizes()), " but ", ref_name, "[", i, "] has shape ",
               dims(ref[i].sizes()));
    // Strides of size-1 dimensions are never used (bridge::same_memory_order).
    const auto sizes = ref[i].sizes().vec();
    const auto a = ref[i].strides().vec();
    const auto b = other[i].strides().vec();
    bool same = a.size() == b.size();
    for (size_t d = 0; same && d < a.size(); ++d) same = sizes[d] <= 1 || a[d] == b[d];
    APEX_CHECK(same, who, ": ", other_name, "[", i, "] has strides ", dims(other[i].strides()),
               " but ", ref_name, "[", i, "] has strides ", dims(ref[i].strides()));
  }
}

using Named = std::pair<const TensorList*, const char*>;

// The kernel's view of parallel lists: every required list checked and matching the first;
// optional lists (index >= required) may be empty, and are then absent.
class Lists {
 public:
  // state_from: the first list holding optimizer state or masters (fp32 only); none by default.
  Lists(const char* who, const std::vector<Named>& ls, size_t required,
        size_t state_from = kernels::kMaxLists) {
    const TensorList& ref = *ls.front().first;
    for (size_t i = 0; i < ls.size(); ++i) {
      const TensorList& l = *ls[i].first;
      if (i >= required && l.empty()) continue;
      check_list(l, who, ls[i].second);
      if (i > 0) check_matching(ref, l, who, ls.front().second, ls[i].second);
      APEX_CHECK(i < state_from || l.front().scalar_type() == ScalarType::Float, who, ": ",
                 ls[i].second, " must be float32 (optimizer state and masters are fp32), got ",
                 dtype_name(l.front().scalar_type()));
      view_.dtype[i] = kernel_dtype(l.front().scalar_type(), who);
      ptrs_[i].reserve(l.size());
      for (const Tensor& t : l) ptrs_[i].push_back(t.mutable_data_ptr());
      view_.ptrs[i] = ptrs_[i].data();
    }
    for (const Tensor& t : ref) numel_.push_back(t.numel());
    view_.num_tensors = static_cast<int64_t>(numel_.size());
    view_.numel = numel_.data();
  }
  Lists(const Lists&) = delete;
  Lists& operator=(const Lists&) = delete;

  const kernels::TensorLists& view() const { return view_; }
  int64_t size() const { return view_.num_tensors; }

 private:
  std::vector<int64_t> numel_;
  std::vector<void*> ptrs_[kernels::kMaxLists];
  kernels::TensorLists view_;
};

// f(T*) with T the C++ type of a CPU tensor's dtype (the real ones and bool).
template <class F>
decltype(auto) with_element_type(const Tensor& t, void* p, F&& f) {
  switch (t.scalar_type()) {
    case ScalarType::Float:
      return f(static_cast<float*>(p));
    case ScalarType::Double:
      return f(static_cast<double*>(p));
    case ScalarType::Half:
      return f(static_cast<torch::headeronly::Half*>(p));
    case ScalarType::BFloat16:
      return f(static_cast<torch::headeronly::BFloat16*>(p));
    case ScalarType::Long:
      return f(static_cast<int64_t*>(p));
    case ScalarType::Int:
      return f(static_cast<int32_t*>(p));
    case ScalarType::Short:
      return f(static_cast<int16_t*>(p));
    case ScalarType::Char:
      return f(static_cast<int8_t*>(p));
    case ScalarType::Byte:
      return f(static_cast<uint8_t*>(p));
    case ScalarType::Bool:
      return f(static_cast<bool*>(p));
    default:
      fail("apex-cpp: unsupported dtype for a scalar tensor: ", dtype_name(t.scalar_type()));
  }
}

// Adam-style lists: params, grads, both moments, optional fp32 masters (returned in place: Lists
// is neither copied nor moved).
Lists moment_lists(const char* who, const TensorList& p, const TensorList& g, const TensorList& m,
                   const TensorList& v, const TensorList& master) {
  return Lists(who,
               {{&p, "params"},
                {&g, "grads"},
                {&m, "exp_avgs"},
                {&v, "exp_avg_sqs"},
                {&master, "master_params"}},
               4, 2);
}

// The one element of a CPU tensor of any real dtype, as a double.
double read_scalar(const Tensor& t) {
  APEX_CHECK(t.numel() == 1, "apex-cpp: expected a one-element tensor, got ", t.numel(),
             " elements");
  return with_element_type(t, t.mutable_data_ptr(), [](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_arithmetic_v<T>) {
      return static_cast<double>(*p);
    } else {
      return static_cast<double>(static_cast<float>(*p));  // Half, BFloat16: through float
    }
  });
}

// Sets a one-element CPU tensor of any real dtype to v.
void write_scalar(const Tensor& t, double v) {
  with_element_type(t, t.mutable_data_ptr(), [v](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_same_v<T, bool>) {
      *p = v != 0.0;
    } else if constexpr (std::is_arithmetic_v<T>) {
      *p = static_cast<T>(v);
    } else {
      *p = static_cast<T>(static_cast<float>(v));  // Half, BFloat16: from float
    }
  });
}

void check_flag(const Tensor& flag, const char* who) {
  APEX_CHECK(flag.defined() && flag.numel() == 1, who,
             ": noop_flag must be a one-element tensor, got ", dims(flag.sizes()));
  check_cpu(flag, who);
}

// apex's flag convention: the flag becomes max(flag, value).
void raise_flag(const Tensor& noop, float value) {
  if (value > read_scalar(noop)) write_scalar(noop, value);
}

// A one-element float32 CPU tensor's element, for the kernels' kernel-memory scalars.
const float* scalar_ptr(const std::optional<Tensor>& t, const char* who, const char* name) {
  if (!t.has_value() || !t->defined()) return nullptr;
  APEX_CHECK(t->numel() == 1 && t->scalar_type() == ScalarType::Float, who, ": ", name,
             " must be a one-element float32 tensor, got ", dtype_name(t->scalar_type()), " with ",
             t->numel(), " elements");
  check_cpu(*t, who);
  return t->const_data_ptr<float>();
}

// ---- primitives ------------------------------------------------------------------------------

void multi_tensor_scale(Tensor noop, TensorList src, TensorList dst, double scale) {
  constexpr const char* who = "multi_tensor_scale";
  check_flag(noop, who);
  if (src.empty() && dst.empty()) return;
  const Lists lists(who, {{&src, "src"}, {&dst, "dst"}}, 2);
  float flag = 0.0f;
  kernels::ScaleArgs args;
  args.scale = static_cast<float>(scale);
  args.found_inf = &flag;
  kernels::cpu::scale(lists.view(), args);
  raise_flag(noop, flag);
}

void multi_tensor_axpby(Tensor noop, TensorList x, TensorList y, TensorList out, double a, double b,
                        int64_t arg_to_check) {
  constexpr const char* who = "multi_tensor_axpby";
  check_flag(noop, who);
  APEX_CHECK(arg_to_check >= -1 && arg_to_check <= 1, who,
             ": arg_to_check must be -1 (both), 0 (x) or 1 (y), got ", arg_to_check);
  if (x.empty() && y.empty() && out.empty()) return;
  const Lists lists(who, {{&x, "x"}, {&y, "y"}, {&out, "out"}}, 3);
  float flag = 0.0f;
  kernels::AxpbyArgs args;
  args.a = static_cast<float>(a);
  args.b = static_cast<float>(b);
  args.arg_to_check = static_cast<int>(arg_to_check);
  args.found_inf = &flag;
  kernels::cpu::axpby(lists.view(), args);
  raise_flag(noop, flag);
}

std::tuple<Tensor, Tensor> norms(const char* who, const Tensor& noop, const TensorList& x,
                                 const std::optional<Tensor>& inv_scale, bool per_tensor) {
  check_flag(noop, who);
  if (x.empty()) {
    return {torch::stable::new_zeros(noop, {1}, ScalarType::Float),
            torch::stable::new_zeros(noop, {0}, ScalarType::Float)};
  }
  const Lists lists(who, {{&x, "x"}}, 1);
  Tensor total = torch::stable::new_empty(x.front(), {1}, ScalarType::Float);
  Tensor per = torch::stable::new_empty(
      x.front(), {per_tensor ? static_cast<int64_t>(x.size()) : 0}, ScalarType::Float);
  kernels::NormArgs args;
  args.type = kernels::NormType::kL2;
  args.inv_scale = scalar_ptr(inv_scale, who, "inv_scale");
  args.total = total.mutable_data_ptr<float>();
  args.per_tensor = per_tensor ? per.mutable_data_ptr<float>() : nullptr;
  kernels::cpu::norm(lists.view(), args);
  // apex's l2norm sets the flag on a non-finite value, which shows in the total.
  if (!std::isfinite(*total.const_data_ptr<float>())) raise_flag(noop, 1.0f);
  return {total, per};
}

std::tuple<Tensor, Tensor> multi_tensor_l2norm(Tensor noop, TensorList x, bool per_tensor) {
  return norms("multi_tensor_l2norm", noop, x, std::nullopt, per_tensor);
}

std::tuple<Tensor, Tensor> multi_tensor_unscale_l2norm(Tensor noop, TensorList x, Tensor inv_scale,
                                                       bool per_tensor) {
  APEX_CHECK(inv_scale.defined(), "multi_tensor_unscale_l2norm: inv_scale must be defined");
  return norms("multi_tensor_unscale_l2norm", noop, x, inv_scale, per_tensor);
}

// ---- optimizers ------------------------------------------------------------------------------

void multi_tensor_adam(Tensor noop, TensorList g, TensorList p, TensorList m, TensorList v,
                       TensorList master, double lr, double beta1, double beta2, double eps,
                       int64_t step, bool adam_w_mode, bool bias_correction, double weight_decay,
                       std::optional<Tensor> inv_scale, std::optional<Tensor> found_inf,
                       std::optional<Tensor> lr_tensor, std::optional<Tensor> step_tensor,
                       bool unscale_grads) {
  constexpr const char* who = "multi_tensor_adam";
  check_flag(noop, who);
  if (p.empty()) return;
  const Lists lists = moment_lists(who, p, g, m, v, master);
  APEX_CHECK(step >= 1 || step_tensor.has_value(), who, ": step must be >= 1, got ", step);
  kernels::AdamArgs args =
      adam_args(lr, beta1, beta2, eps, step, adam_w_mode, bias_correction, weight_decay);
  args.lr_ptr = scalar_ptr(lr_tensor, who, "lr");
  args.step_ptr = scalar_ptr(step_tensor, who, "step");
  args.amp.inv_scale = scalar_ptr(inv_scale, who, "inv_scale");
  args.amp.found_inf = scalar_ptr(found_inf, who, "found_inf");
  args.amp.unscale_grads = unscale_grads;
  kernels::cpu::adam(lists.view(), args);
}

void multi_tensor_sgd(Tensor noop, TensorList g, TensorList p, TensorList momentum_buf,
                      TensorList master, double lr, double momentum, double dampening,
                      double weight_decay, bool nesterov, bool first_run, bool wd_after_momentum,
                      double scale, bool unscale_grads) {
  constexpr const char* who = "multi_tensor_sgd";
  check_flag(noop, who);
  if (p.empty()) return;
  const Lists lists(who,
                    {{&p, "params"},
                     {&g, "grads"},
                     {&momentum_buf, "momentum_buffers"},
                     {&master, "master_params"}},
                    2, 2);
  APEX_CHECK(momentum == 0 || !momentum_buf.empty(), who, ": momentum ", momentum,
             " needs the momentum buffers");
  // The step is skipped when the noop flag is already set (apex's early exit).
  const float flag = static_cast<float>(read_scalar(noop));
  const float inv = static_cast<float>(scale);
  kernels::SgdArgs args =
      sgd_args(lr, momentum, dampening, weight_decay, nesterov, first_run, wd_after_momentum);
  args.amp.inv_scale = &inv;
  args.amp.found_inf = &flag;
  args.amp.unscale_grads = unscale_grads;
  kernels::cpu::sgd(lists.view(), args);
}

void multi_tensor_adagrad(Tensor noop, TensorList g, TensorList p, TensorList h, TensorList master,
                          double lr, double eps, bool adagrad_w_mode, double weight_decay,
                          std::optional<Tensor> inv_scale, std::optional<Tensor> found_inf,
                          bool unscale_grads) {
  constexpr const char* who = "multi_tensor_adagrad";
  check_flag(noop, who);
  if (p.empty()) return;
  const Lists lists(
      who, {{&p, "params"}, {&g, "grads"}, {&h, "state_sums"}, {&master, "master_params"}}, 3, 2);
  kernels::AdagradArgs args = adagrad_args(lr, eps, adagrad_w_mode, weight_decay);
  args.amp.inv_scale = scalar_ptr(inv_scale, who, "inv_scale");
  args.amp.found_inf = scalar_ptr(found_inf, who, "found_inf");
  args.amp.unscale_grads = unscale_grads;
  kernels::cpu::adagrad(lists.view(), args);
}

void multi_tensor_lamb(Tensor noop, TensorList g, TensorList p, TensorList m, TensorList v,
                       TensorList master, double lr, double beta1, double beta2, double eps,
                       int64_t step, bool bias_correction, double weight_decay, bool grad_averaging,
                       bool adam_w_mode, Tensor global_grad_norm, double max_grad_norm,
                       bool use_nvlamb, std::optional<Tensor> inv_scale,
                       std::optional<Tensor> found_inf, bool unscale_grads) {
  constexpr const char* who = "multi_tensor_lamb";
  check_flag(noop, who);
  if (p.empty()) return;
  const Lists lists = moment_lists(who, p, g, m, v, master);
  APEX_CHECK(step >= 1, who, ": step must be >= 1, got ", step);
  check_cpu(global_grad_norm, who);
  APEX_CHECK(global_grad_norm.numel() == 1, who,
             ": global_grad_norm must be a one-element tensor, got ", global_grad_norm.numel(),
             " elements");
  std::vector<float> u_sumsq(static_cast<size_t>(lists.size()), 0.0f);
  std::vector<float> p_sumsq(static_cast<size_t>(lists.size()), 0.0f);
  const float gnorm = static_cast<float>(read_scalar(global_grad_norm));
  kernels::LambArgs args = lamb_args(lr, beta1, beta2, eps, step, bias_correction, weight_decay,
                                     grad_averaging, adam_w_mode, max_grad_norm, use_nvlamb);
  args.global_grad_norm = &gnorm;
  args.u_sumsq = u_sumsq.data();
  args.p_sumsq = p_sumsq.data();
  args.amp.inv_scale = scalar_ptr(inv_scale, who, "inv_scale");
  args.amp.found_inf = scalar_ptr(found_inf, who, "found_inf");
  args.amp.unscale_grads = unscale_grads;
  kernels::cpu::lamb_stage1(lists.view(), args);
  kernels::cpu::lamb_stage2(lists.view(), args);
}

void multi_tensor_novograd(Tensor noop, TensorList g, TensorList p, TensorList m, TensorList master,
                           Tensor v, double lr, double beta1, double beta2, double eps,
                           int64_t step, bool bias_correction, double weight_decay,
                           bool grad_averaging, bool reg_inside_moment,
                           std::optional<Tensor> inv_scale, std::optional<Tensor> found_inf,
                           bool unscale_grads) {
  constexpr const char* who = "multi_tensor_novograd";
  check_flag(noop, who);
  if (p.empty()) return;
  const Lists lists(
      who, {{&p, "params"}, {&g, "grads"}, {&m, "exp_avgs"}, {&master, "master_params"}}, 3, 2);
  APEX_CHECK(step >= 1, who, ": step must be >= 1, got ", step);
  APEX_CHECK(v.numel() == static_cast<int64_t>(p.size()), who, ": grad_norms has ", v.numel(),
             " elements, expected one per tensor (", p.size(), ")");
  check_cpu(v, who);
  // The blended norms as fp32, from any dtype and layout (one element per tensor).
  Tensor flat = torch::stable::flatten(v);
  std::vector<float> vf(p.size());
  for (size_t i = 0; i < vf.size(); ++i) {
    vf[i] =
        static_cast<float>(read_scalar(torch::stable::narrow(flat, 0, static_cast<int64_t>(i), 1)));
  }
  kernels::NovoGradArgs args = novograd_args(lr, beta1, beta2, eps, step, bias_correction,
                                             weight_decay, grad_averaging, reg_inside_moment);
  args.v = vf.data();
  args.amp.inv_scale = scalar_ptr(inv_scale, who, "inv_scale");
  args.amp.found_inf = scalar_ptr(found_inf, who, "found_inf");
  args.amp.unscale_grads = unscale_grads;
  kernels::cpu::novograd(lists.view(), args);
}

// ---- norms -------------------------------------------------------------------------------------
// fused_norm_fwd / fused_norm_bwd for fp32, bf16 and fp16 CPU tensors: the regular library's
// glue (src/normalization/norm.cpp) without its float64 path, which apex._stable_norms computes
// with torch's ops. Autograd and autocast are Python's here (apex._stable_norms): the stable ABI
// registers kernels for backend keys, not autograd nodes.

const char* norm_who(bool rms) { return rms ? "FusedRMSNorm" : "FusedLayerNorm"; }

struct Geometry {
  int64_t rows;
  int64_t cols;
};

Geometry check_norm_inputs(const char* who, const Tensor& x, const std::vector<int64_t>& shape,
                           const std::optional<Tensor>& w, const std::optional<Tensor>& b,
                           double eps) {
  APEX_CHECK(x.defined(), who, ": input is undefined");
  const ScalarType xt = x.scalar_type();
  APEX_CHECK(xt == ScalarType::Float || xt == ScalarType::Double || xt == ScalarType::Half ||
                 xt == ScalarType::BFloat16,
             who, ": input must be a floating-point tensor, got ", dtype_name(xt));
  APEX_CHECK(eps > 0, who, ": eps must be > 0, got ", eps);
  APEX_CHECK(!shape.empty(), who, ": normalized_shape must not be empty");
  const auto nd = static_cast<int64_t>(shape.size());
  const std::vector<int64_t> sizes = x.sizes().vec();
  APEX_CHECK(x.dim() >= nd && std::equal(shape.begin(), shape.end(), sizes.end() - nd), who,
             ": normalized_shape ", dims(shape), " does not match the trailing dimensions of an ",
             "input of shape ", dims(x.sizes()));
  for (const auto* t : {&w, &b}) {
    if (!t->has_value()) continue;
    const char* name = t == &w ? "weight" : "bias";
    APEX_CHECK((*t)->sizes().vec() == shape, who, ": ", name, " must have shape ", dims(shape),
               ", got ", dims((*t)->sizes()));
    check_cpu(**t, who);
  }
  check_cpu(x, who);
  int64_t cols = 1;
  for (int64_t d : shape) cols *= d;
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

// t, or a contiguous copy (each stable op call costs ~1 us through the dispatcher: skipped where
// the tensor already is).
Tensor as_contiguous(const Tensor& t) {
  return t.is_contiguous() ? t : torch::stable::contiguous(t);
}
std::optional<Tensor> as_contiguous(const std::optional<Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return as_contiguous(*t);
}

std::tuple<Tensor, Tensor, Tensor> fused_norm_fwd(Tensor input, std::vector<int64_t> shape,
                                                  std::optional<Tensor> weight,
                                                  std::optional<Tensor> bias, double eps, bool rms,
                                                  bool mixed, bool memory_efficient) {
  const char* who = norm_who(rms);
  const Geometry g = check_norm_inputs(who, input, shape, weight, bias, eps);
  APEX_CHECK(!mixed || weight.has_value(), who, ": the mixed-dtype variants need a weight");
  const Tensor x = as_contiguous(input);
  const std::optional<Tensor> w = as_contiguous(weight);
  const std::optional<Tensor> b = as_contiguous(bias);
  APEX_CHECK(!w || !b || w->scalar_type() == b->scalar_type(), who,
             ": weight and bias must have the same dtype, got ", dtype_name(w->scalar_type()),
             " and ", dtype_name(b->scalar_type()));
  // The mixed variants return the parameters' dtype (apex's MixedFused* definition).
  const ScalarType out_dtype = mixed && w ? w->scalar_type() : x.scalar_type();
  kernels::NormForwardArgs a;
  a.rows = g.rows;
  a.cols = g.cols;
  a.rms = rms;
  a.eps = static_cast<float>(eps);
  a.x_dtype = kernel_dtype(x.scalar_type(), who);
  a.y_dtype = kernel_dtype(out_dtype, who);
  if (w) a.w_dtype = kernel_dtype(w->scalar_type(), who);
  if (b) a.w_dtype = kernel_dtype(b->scalar_type(), who);
  Tensor y = torch::stable::new_empty(x, x.sizes(), out_dtype);
  Tensor mean = torch::stable::new_empty(x, {rms ? 0 : g.rows}, ScalarType::Float);
  Tensor rstd = torch::stable::new_empty(x, {g.rows}, ScalarType::Float);
  a.x = x.const_data_ptr();
  a.w = w ? w->const_data_ptr() : nullptr;
  a.b = b ? b->const_data_ptr() : nullptr;
  a.y = y.mutable_data_ptr();
  a.mean = rms ? nullptr : mean.mutable_data_ptr<float>();
  a.rstd = rstd.mutable_data_ptr<float>();
  if (g.rows > 0 && g.cols > 0) kernels::cpu::norm_forward(a);
  return {y, mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> fused_norm_bwd(
    Tensor grad_out, Tensor saved, Tensor mean, Tensor rstd, std::optional<Tensor> weight,
    std::optional<Tensor> bias, std::vector<int64_t> shape, double eps, bool rms, bool mixed,
    bool memory_efficient, ScalarType input_dtype, std::vector<bool> output_mask) {
  const char* who = norm_who(rms);
  const Geometry g = check_norm_inputs(who, saved, shape, weight, bias, eps);
  APEX_CHECK(output_mask.size() == 3, who, ": output_mask must have 3 entries");
  APEX_CHECK(grad_out.sizes().vec() == saved.sizes().vec(), who, ": the gradient has shape ",
             dims(grad_out.sizes()), ", expected the output's ", dims(saved.sizes()));
  APEX_CHECK(rstd.numel() == g.rows && (rms || memory_efficient || mean.numel() == g.rows), who,
             ": the saved statistics have ", rstd.numel(), " rows, expected ", g.rows);
  check_cpu(grad_out, who);
  // The kernels read the saved input as input_dtype, and the weight as the bias's dtype.
  APEX_CHECK(memory_efficient || saved.scalar_type() == input_dtype, who, ": the saved input is ",
             dtype_name(saved.scalar_type()), " but input_dtype is ", dtype_name(input_dtype));
  APEX_CHECK(!weight || !bias || weight->scalar_type() == bias->scalar_type(), who,
             ": weight and bias must have the same dtype, got ", dtype_name(weight->scalar_type()),
             " and ", dtype_name(bias->scalar_type()));
  const Tensor dy = as_contiguous(grad_out);
  const Tensor src = as_contiguous(saved);
  const std::optional<Tensor> w = as_contiguous(weight);
  const std::optional<Tensor> b = as_contiguous(bias);
  const Tensor mean_c = as_contiguous(mean);
  const Tensor rstd_c = as_contiguous(rstd);
  const bool want_dx = output_mask[0];
  const bool want_w = output_mask[1] && w.has_value();
  const bool want_b = output_mask[2] && b.has_value();
  // dw and db in the parameters' dtype (the weight's, or the bias's when there is no weight).
  const ScalarType w_dtype = w ? w->scalar_type() : b ? b->scalar_type() : ScalarType::Float;
  const int64_t cols = g.cols;
  Tensor empty = torch::stable::new_empty(src, {0});
  Tensor dx = want_dx ? torch::stable::new_empty(src, src.sizes(), input_dtype) : empty;
  Tensor dw = want_w ? torch::stable::new_empty(src, {cols}, w_dtype) : empty;
  Tensor db = want_b ? torch::stable::new_empty(src, {cols}, w_dtype) : empty;
  kernels::NormBackwardArgs a;
  a.rows = g.rows;
  a.cols = cols;
  a.rms = rms;
  a.eps = static_cast<float>(eps);
  a.x_dtype = kernel_dtype(input_dtype, who);
  a.dy_dtype = kernel_dtype(dy.scalar_type(), who);
  APEX_CHECK(!memory_efficient || src.scalar_type() == dy.scalar_type(), who,
             ": the gradient's dtype ", dtype_name(dy.scalar_type()), " differs from the output's ",
             dtype_name(src.scalar_type()));
  if (w) a.w_dtype = kernel_dtype(w->scalar_type(), who);
  if (b && memory_efficient) a.w_dtype = kernel_dtype(b->scalar_type(), who);
  a.dy = dy.const_data_ptr();
  a.x = memory_efficient ? nullptr : src.const_data_ptr();
  a.y = memory_efficient ? src.const_data_ptr() : nullptr;
  a.w = w ? w->const_data_ptr() : nullptr;
  a.b = b && memory_efficient ? b->const_data_ptr() : nullptr;
  a.mean = rms || memory_efficient ? nullptr : mean_c.const_data_ptr<float>();
  a.rstd = rstd_c.const_data_ptr<float>();
  a.dx = want_dx ? dx.mutable_data_ptr() : nullptr;
  a.dw = want_w ? dw.mutable_data_ptr() : nullptr;
  a.db = want_b ? db.mutable_data_ptr() : nullptr;
  if (want_w || want_b) a.dwb_dtype = kernel_dtype(w_dtype, who);
  if (g.rows > 0 && cols > 0) {
    kernels::cpu::norm_backward(a);
  } else {
    for (Tensor* t : {&dx, &dw, &db}) {
      if (t->numel() > 0) torch::stable::zero_(*t);
    }
  }
  const auto as_param = [&](Tensor& t) {
    return t.numel() > 0 || (t.dim() == 1 && cols == 0) ? torch::stable::reshape(t, shape) : t;
  };
  return {dx, want_w ? as_param(dw) : dw, want_b ? as_param(db) : db};
}

// ---- batch norm (SyncBatchNorm's per-rank pieces, CPU) ------------------------------------------
// src/parallel/batch_norm_ops.cpp's CPU route on the stable accessors (its ATen route serves CUDA
// input, which this library does not take): the input viewed as [outer, channels, inner], NC*
// or channels-last, as the regular library's.

struct BatchNormLayout {
  kernels::BatchNormShape shape;
  MemoryFormat format = MemoryFormat::Contiguous;
};

// Whether x's strides are those of a dense tensor whose dimensions, innermost first, are `order`.
bool strides_in_order(const Tensor& x, const std::vector<int64_t>& order) {
  int64_t expected = 1;
  for (int64_t d : order) {
    if (x.size(d) != 1 && x.stride(d) != expected) return false;
    expected *= x.size(d);
  }
  return true;
}

BatchNormLayout batch_norm_layout(const Tensor& x, const char* who) {
  APEX_CHECK(x.dim() >= 2, who, ": expected an input of at least 2 dimensions (N, C, ...), got ",
             dims(x.sizes()));
  check_cpu(x, who);
  BatchNormLayout l;
  // Channels-last as ATen's is_contiguous(ChannelsLast[3d]) reads it: C innermost, then the
  // spatial dimensions from the last, then N; a tensor contiguous both ways counts as NC*.
  bool cl = false;
  if ((x.dim() == 4 || x.dim() == 5) && !x.is_contiguous()) {
    std::vector<int64_t> order{1};
    for (int64_t d = x.dim() - 1; d >= 2; --d) order.push_back(d);
    order.push_back(0);
    cl = strides_in_order(x, order);
  }
  l.format = !cl            ? MemoryFormat::Contiguous
             : x.dim() == 4 ? MemoryFormat::ChannelsLast
                            : MemoryFormat::ChannelsLast3d;
  l.shape = kernels::batch_norm_shape(x.size(0), x.size(1), x.numel(), cl);
  return l;
}

Tensor in_layout(const Tensor& t, MemoryFormat format) {
  return format == MemoryFormat::Contiguous ? as_contiguous(t)
                                            : torch::stable::contiguous(t, format);
}

// A per-channel tensor's c values as a contiguous tensor of `dtype`.
Tensor channel_values(const Tensor& t, int64_t c, const char* who, const char* name,
                      ScalarType dtype = ScalarType::Float) {
  APEX_CHECK(t.numel() == c, who, ": ", name, " has ", t.numel(), " elements, expected ", c);
  check_cpu(t, who);
  return as_contiguous(t.scalar_type() == dtype ? t : torch::stable::to(t, dtype));
}

Tensor batch_norm_stats(Tensor input) {
  constexpr const char* who = "batch_norm_stats";
  const BatchNormLayout l = batch_norm_layout(input, who);
  const Tensor x = in_layout(input, l.format);
  const int64_t c = l.shape.channels;
  Tensor out = torch::stable::new_zeros(x, {2 * c + 1}, ScalarType::Double);
  kernels::BatchNormStatsArgs a;
  a.shape = l.shape;
  a.dtype = kernel_dtype(x.scalar_type(), who);
  a.x = x.const_data_ptr();
  double* o = out.mutable_data_ptr<double>();
  a.mean = o;
  a.m2 = o + c;
  kernels::cpu::batch_norm_stats(a);
  o[2 * c] = static_cast<double>(l.shape.outer * l.shape.inner);
  return out;
}

Tensor elemt(const char* who, const Tensor& u, const Tensor* v, const Tensor& mean, const Tensor& a,
             const Tensor* b, const Tensor& k) {
  const BatchNormLayout l = batch_norm_layout(u, who);
  const int64_t c = l.shape.channels;
  APEX_CHECK(v == nullptr || v->sizes().vec() == u.sizes().vec(), who, ": the gradient has shape ",
             dims(v == nullptr ? u.sizes() : v->sizes()), ", expected ", dims(u.sizes()));
  const Tensor x = in_layout(u, l.format);
  Tensor dy;
  if (v != nullptr) {
    check_cpu(*v, who);
    dy = in_layout(*v, l.format);
  }
  const Tensor mf = channel_values(mean, c, who, "mean");
  const Tensor af = channel_values(a, c, who, "a");
  const Tensor kf = channel_values(k, c, who, "k");
  const Tensor bf = b != nullptr ? channel_values(*b, c, who, "b") : Tensor();
  Tensor out = torch::stable::empty(x.sizes(), x.scalar_type(), std::nullopt,
                                    torch::stable::Device(torch::headeronly::DeviceType::CPU),
                                    std::nullopt, l.format);
  kernels::BatchNormElemtArgs e;
  e.shape = l.shape;
  e.u_dtype = e.out_dtype = kernel_dtype(x.scalar_type(), who);
  e.u = x.const_data_ptr();
  if (v != nullptr) {
    e.v_dtype = kernel_dtype(dy.scalar_type(), who);
    e.v = dy.const_data_ptr();
    e.b = bf.const_data_ptr<float>();
  }
  e.out = out.mutable_data_ptr();
  e.a = af.const_data_ptr<float>();
  e.m = mf.const_data_ptr<float>();
  e.k = kf.const_data_ptr<float>();
  if (x.numel() > 0) kernels::cpu::batch_norm_elemt(e);
  return out;
}

Tensor batch_norm_elemt(Tensor input, Tensor mean, Tensor scale, Tensor shift) {
  return elemt("batch_norm_elemt", input, nullptr, mean, scale, nullptr, shift);
}

Tensor batch_norm_backward_elemt(Tensor grad_out, Tensor input, Tensor mean, Tensor a, Tensor b,
                                 Tensor k) {
  return elemt("batch_norm_backward_elemt", input, &grad_out, mean, a, &b, k);
}

Tensor batch_norm_backward_reduce(Tensor grad_out, Tensor input, Tensor mean64) {
  constexpr const char* who = "batch_norm_backward_reduce";
  const BatchNormLayout l = batch_norm_layout(input, who);
  const int64_t c = l.shape.channels;
  APEX_CHECK(grad_out.sizes().vec() == input.sizes().vec(), who, ": the gradient has shape ",
             dims(grad_out.sizes()), ", expected ", dims(input.sizes()));
  APEX_CHECK(mean64.numel() == c, who, ": mean has ", mean64.numel(), " elements, expected ", c);
  check_cpu(grad_out, who);
  const Tensor x = in_layout(input, l.format);
  const Tensor dy = in_layout(grad_out, l.format);
  const Tensor m = channel_values(mean64, c, who, "mean", ScalarType::Double);
  Tensor sums = torch::stable::new_zeros(x, {2 * c}, ScalarType::Double);
  kernels::BatchNormBackwardReduceArgs r;
  r.shape = l.shape;
  r.x_dtype = kernel_dtype(x.scalar_type(), who);
  r.dy_dtype = kernel_dtype(dy.scalar_type(), who);
  r.x = x.const_data_ptr();
  r.dy = dy.const_data_ptr();
  r.mean = m.const_data_ptr<double>();
  double* o = sums.mutable_data_ptr<double>();
  r.sum_dy = o;
  r.sum_dy_xmu = o + c;
  kernels::cpu::batch_norm_backward_reduce(r);
  return sums;
}

std::string cpu_isa() { return kernels::cpu::isa_name(); }

}  // namespace
}  // namespace apex::python::stable

// The schemas are apex_cpp's (schemas.h), so that the Python layer calls either library the
// same way.
STABLE_TORCH_LIBRARY(apex_cpp_stable, m) {
#define APEX_PY_DEF(name, schema) m.def(schema);
  APEX_PY_MULTI_TENSOR_OPS(APEX_PY_DEF)
#undef APEX_PY_DEF
  m.def(APEX_PY_NORM_FWD_SCHEMA);
  m.def(APEX_PY_NORM_BWD_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_STATS_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_ELEMT_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_BACKWARD_REDUCE_SCHEMA);
  m.def(APEX_PY_BATCH_NORM_BACKWARD_ELEMT_SCHEMA);
  m.def("cpu_isa() -> str");
}

namespace {
// Every op's kernel, for the CPU key and for the CUDA key: CUDA tensors reach the same functions,
// whose checks say that this library has CPU kernels only (rather than the dispatcher's "could
// not run ... with arguments from the 'CUDA' backend").
void register_kernels(torch::stable::detail::StableLibrary& m) {
  using namespace apex::python::stable;
#define APEX_PY_IMPL(name, schema) m.impl(#name, TORCH_BOX(&name));
  APEX_PY_MULTI_TENSOR_OPS(APEX_PY_IMPL)
#undef APEX_PY_IMPL
  m.impl("fused_norm_fwd", TORCH_BOX(&fused_norm_fwd));
  m.impl("fused_norm_bwd", TORCH_BOX(&fused_norm_bwd));
  m.impl("batch_norm_stats", TORCH_BOX(&batch_norm_stats));
  m.impl("batch_norm_elemt", TORCH_BOX(&batch_norm_elemt));
  m.impl("batch_norm_backward_reduce", TORCH_BOX(&batch_norm_backward_reduce));
  m.impl("batch_norm_backward_elemt", TORCH_BOX(&batch_norm_backward_elemt));
}
}  // namespace

STABLE_TORCH_LIBRARY_IMPL(apex_cpp_stable, CPU, m) { register_kernels(m); }
STABLE_TORCH_LIBRARY_IMPL(apex_cpp_stable, CUDA, m) { register_kernels(m); }

// No tensor arguments: a kernel for every dispatch key.
STABLE_TORCH_LIBRARY_IMPL(apex_cpp_stable, CompositeExplicitAutograd, m) {
  m.impl("cpu_isa", TORCH_BOX(&apex::python::stable::cpu_isa));
}
