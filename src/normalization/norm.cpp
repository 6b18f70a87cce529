#include "apex/normalization/functional.h"

#include <ATen/EmptyTensor.h>
#include <ATen/TensorOperators.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/ops/empty.h>
#include <c10/core/DeviceGuard.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <string>
#include <vector>

#include "bridge/bridge.h"
#include "bridge/refs.h"
#include "kernels/norm.h"
#include "ops/aten/norm.h"
#include "ops/norm_args.h"

namespace apex::normalization {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

struct Geometry {
  int64_t rows;
  int64_t cols;
  size_t shape_dims;
};

Geometry check_inputs(const char* who, const at::Tensor& x, at::IntArrayRef shape,
                      const at::Tensor& w, const at::Tensor& b, double eps) {
  const apex::ops::NormGeometry g = apex::ops::check_norm(
      who, bridge::meta_ref(x), shape, bridge::meta_ref(w), bridge::meta_ref(b), eps);
  return {g.rows, g.cols, shape.size()};
}

struct Flags {
  bool rms;
  bool mixed;
  bool memory_efficient;
};

const char* op_name(bool rms) { return rms ? "FusedRMSNorm" : "FusedLayerNorm"; }

// Statistics and output in float64 with ATen ops, for float64 tensors (gradcheck, references):
// the same formulas as the kernels. Returns {y, mean (LayerNorm), rstd}.
std::array<at::Tensor, 3> forward_f64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                      const Geometry& g, double eps, bool rms) {
  const at::Tensor x2 = x.view({g.rows, g.cols}).to(at::kDouble);
  const at::Tensor mean = rms ? at::Tensor() : x2.mean({1}, /*keepdim=*/true);
  const at::Tensor xc = rms ? x2 : x2 - mean;
  const at::Tensor rstd = (xc.square().mean({1}, /*keepdim=*/true) + eps).rsqrt();
  at::Tensor y = xc * rstd;
  if (w.defined()) y = y * w.reshape({g.cols}).to(at::kDouble);
  if (b.defined()) y = y + b.reshape({g.cols}).to(at::kDouble);
  return {y, rms ? at::Tensor() : mean.view({g.rows}), rstd.view({g.rows})};
}

// {dx, dw, db} in float64 from x_hat (already recomputed), dy and rstd.
std::array<at::Tensor, 3> backward_f64(const at::Tensor& xh, const at::Tensor& dy2,
                                       const at::Tensor& w, const at::Tensor& rstd, bool rms,
                                       bool want_b) {
  const at::Tensor gr = w.defined() ? dy2 * w : dy2;
  at::Tensor inner = gr - xh * (gr * xh).mean({1}, /*keepdim=*/true);
  if (!rms) inner = inner - gr.mean({1}, /*keepdim=*/true);
  return {rstd.view({-1, 1}) * inner, w.defined() ? (dy2 * xh).sum({0}) : at::Tensor(),
          want_b ? dy2.sum({0}) : at::Tensor()};
}

bool is_f64(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b) {
  const auto f64 = [](const at::Tensor& t) {
    return t.defined() && t.scalar_type() == at::kDouble;
  };
  return f64(x) || f64(w) || f64(b);
}

// A new contiguous tensor: on the CPU straight from ATen's CPU allocator, since at::empty's trip
// through the dispatcher costs ~0.1-0.2 us, and a norm of a few rows called from Python makes four
// of them (docs/perf-notes.md); elsewhere at::empty. What empty_cpu skips: at::empty's NaN fill
// under torch's deterministic mode (fill_uninitialized_memory) and its profiler event; so every
// element of what it returns must be written (the kernels write all, empty shapes are zeroed).
at::Tensor fresh(at::IntArrayRef sizes, const at::TensorOptions& options) {
  return options.device().is_cpu() ? at::detail::empty_cpu(sizes, options)
                                   : at::empty(sizes, options);
}

// The mixed variants return the parameters' dtype (apex's MixedFused* definition).
at::ScalarType output_dtype(const at::Tensor& x, const at::Tensor& weight, Flags f) {
  return f.mixed ? weight.scalar_type() : x.scalar_type();
}

// What the forward computes: y and the statistics the backward needs ({y, mean (LayerNorm),
// rstd}). x, w, b are contiguous; absent w/b undefined.
std::array<at::Tensor, 3> norm_forward(const at::Tensor& x, const at::Tensor& w,
                                       const at::Tensor& b, const Geometry& g, double eps, Flags f,
                                       at::ScalarType out_dtype) {
  const char* who = op_name(f.rms);
  if (is_f64(x, w, b)) {
    auto [y64, mean64, rstd64] = forward_f64(x, w, b, g, eps, f.rms);
    return {y64.to(out_dtype).view(x.sizes()), mean64, rstd64};
  }
  at::Tensor y = fresh(x.sizes(), x.options().dtype(out_dtype));
  const auto stat_opts = x.options().dtype(at::kFloat);
  at::Tensor mean = f.rms ? at::Tensor() : fresh({g.rows}, stat_opts);
  at::Tensor rstd = fresh({g.rows}, stat_opts);
  const kernels::NormForwardArgs a = apex::ops::norm_forward_args(
      who, {g.rows, g.cols}, eps, f.rms, bridge::data_ref(x), bridge::data_ref(w),
      bridge::data_ref(b), bridge::data_ref(y), bridge::data_ref(mean), bridge::data_ref(rstd));
  if (g.rows > 0 && g.cols > 0) {
    if (x.is_cuda()) {
      const c10::DeviceGuard guard(x.device());
      kernels::cuda::norm_forward(a, bridge::cuda_stream(x.device()));
    } else {
      kernels::cpu::norm_forward(a);
    }
  }
  return {y, mean, rstd};
}

// What a backward needs to know of its forward.
struct BackwardSpec {
  bool rms = false;
  bool memory_efficient = false;
  bool f64 = false;
  bool has_bias = false;
  double eps = 1e-5;  // memory-efficient: the weight is clamped to |w| >= eps to divide by it
  int64_t rows = 0;
  int64_t cols = 0;
  at::ScalarType x_dtype = at::kFloat;
  at::ScalarType w_dtype = at::kFloat;  // the weight's, or the bias's when there is no weight
  at::ScalarType b_dtype = at::kFloat;  // the bias's (differs from the weight's on float64 only)
  std::vector<int64_t> shape;           // normalized_shape: dw and db's
};

BackwardSpec backward_spec(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                           const Geometry& g, double eps, Flags f) {
  BackwardSpec s;
  s.rms = f.rms;
  s.memory_efficient = f.memory_efficient;
  s.f64 = is_f64(x, w, b);
  s.has_bias = b.defined();
  s.eps = eps;
  s.rows = g.rows;
  s.cols = g.cols;
  s.x_dtype = x.scalar_type();
  s.w_dtype = w.defined() ? w.scalar_type() : b.defined() ? b.scalar_type() : at::kFloat;
  s.b_dtype = b.defined() ? b.scalar_type() : s.w_dtype;
  s.shape.assign(x.sizes().end() - static_cast<int64_t>(g.shape_dims), x.sizes().end());
  return s;
}

// The autograd node of a norm: a Node of its own, as LibTorch's generated ones are, rather than
// a torch::autograd::Function, whose generic machinery (input and output VariableInfo records,
// the IValue map of saved data, the output wrapping checks) cost about 3 us more per forward and
// backward than at::layer_norm's node, which short rows notice.
struct NormBackward : public torch::autograd::Node {
  BackwardSpec spec;
  SavedVariable src;  // x, or y when memory-efficient (x_hat from the output)
  SavedVariable w;
  SavedVariable b;  // memory-efficient only
  SavedVariable mean;
  SavedVariable rstd;

  std::string name() const override {
    return spec.rms ? "FusedRMSNormBackward" : "FusedLayerNormBackward";
  }
  // Both lock the node's mutex, as LibTorch's own nodes do: two threads may run backward through
  // one graph, one of them releasing what the other unpacks.
  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);
    for (SavedVariable* v : {&src, &w, &b, &mean, &rstd}) v->reset_data();
  }
  variable_list apply(variable_list&& grads) override;
  // Compiled autograd (Python's torch._dynamo.compiled_autograd) traces nodes through these; this
  // one calls its kernels directly and cannot be traced. Say what to do instead of torch's
  // generic "not implemented".
  void compiled_args(torch::autograd::CompiledNodeArgs& /*args*/) const override {
    TORCH_CHECK_NOT_IMPLEMENTED(
        false, name(),
        ": compiled autograd cannot trace apex-cpp's eager norm node; set "
        "APEX_NORM_EAGER_AUTOGRAD=0 before apex is imported, so that the modules' eager calls "
        "record a traceable one (or compile the forward too)");
  }
};

// A new node owned as the LibTorch in use owns them: c10::intrusive_ptr from 2.12 on,
// std::shared_ptr with torch::autograd::deleteNode (found by argument-dependent lookup, so that
// it is only looked up where it exists) before.
template <class T, class N = torch::autograd::Node, class... Args>
auto make_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, N>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::shared_ptr<T>(new T(std::forward<Args>(args)...), [](N* n) { deleteNode(n); });
  }
}

// What the backward computes: {dx, dw, db}, each only where wanted (dx of src's shape in
// x_dtype; dw, db of the normalized shape in the parameters' dtypes). src is x, or y when
// memory-efficient.
std::array<at::Tensor, 3> norm_backward(const BackwardSpec& s, const at::Tensor& dy_in,
                                        const at::Tensor& src_t, const at::Tensor& w_t,
                                        const at::Tensor& b_t, const at::Tensor& mean_t,
                                        const at::Tensor& rstd_t, bool want_dx, bool want_w,
                                        bool want_b) {
  const bool rms = s.rms;
  const bool memory_efficient = s.memory_efficient;
  const double eps = s.eps;
  const int64_t rows = s.rows;
  const int64_t cols = s.cols;
  const at::ScalarType x_dtype = s.x_dtype;
  const at::ScalarType w_dtype = s.w_dtype;
  const at::ScalarType b_dtype = s.b_dtype;
  const at::Tensor dy = dy_in.contiguous();
  want_w = want_w && w_t.defined();
  want_b = want_b && s.has_bias;
  at::Tensor dx;
  at::Tensor dw;
  at::Tensor db;
  if (s.f64) {
    const auto d = [&](const at::Tensor& t) { return t.reshape({-1, cols}).to(at::kDouble); };
    at::Tensor xh;
    if (memory_efficient) {
      xh = d(src_t);
      if (b_t.defined()) xh = xh - d(b_t);
      if (w_t.defined()) {
        // apex's clamp by magnitude (|w| < eps divides by eps of w's sign, +eps for zeros).
        const at::Tensor wd = d(w_t);
        const at::Tensor mag = at::full_like(wd, eps);
        xh = xh / at::where(wd.abs() < eps, at::where(wd < 0, -mag, mag), wd);
      }
    } else {
      xh = (rms ? d(src_t) : d(src_t) - mean_t.view({-1, 1})) * rstd_t.view({-1, 1});
    }
    auto r =
        backward_f64(xh, d(dy), w_t.defined() ? d(w_t) : at::Tensor(), rstd_t, rms, s.has_bias);
    dx = r[0].to(x_dtype).view(src_t.sizes());
    dw = want_w ? r[1] : at::Tensor();
    db = want_b ? r[2] : at::Tensor();
  } else {
    // A CPU backward whose input needs no gradient (a frozen input, or autograd::grad of the
    // parameters alone) computes dw/db only: one read of each row instead of two passes and a
    // write. The CUDA kernels always write dx.
    if (want_dx || src_t.is_cuda()) {
      dx = fresh(src_t.sizes(), src_t.options().dtype(x_dtype));
    }
    // The CPU backend writes dw/db in the parameters' dtype; the CUDA one in fp32 (cast below).
    const auto dwb = src_t.options().dtype(src_t.is_cuda() ? at::kFloat : w_dtype);
    dw = want_w ? fresh({cols}, dwb) : at::Tensor();
    db = want_b ? fresh({cols}, dwb) : at::Tensor();
    kernels::NormBackwardArgs a = apex::ops::norm_backward_args(
        op_name(rms), {rows, cols}, eps, rms, memory_efficient, x_dtype, bridge::data_ref(dy),
        bridge::data_ref(src_t), bridge::data_ref(w_t), bridge::data_ref(b_t),
        bridge::data_ref(mean_t), bridge::data_ref(rstd_t), bridge::data_ref(dx),
        bridge::data_ref(dw), bridge::data_ref(db));
    if (rows > 0 && cols > 0) {
      if (src_t.is_cuda()) {
        const c10::DeviceGuard guard(src_t.device());
        // The dw/db partial rows come from torch's caching allocator (on the current stream),
        // which already holds the device's memory; freed after the work is enqueued, as usual.
        at::Tensor workspace;
        a.workspace = [&](std::size_t bytes) {
          workspace = at::empty({static_cast<int64_t>(bytes)}, src_t.options().dtype(at::kByte));
          return workspace.data_ptr();
        };
        kernels::cuda::norm_backward(a, bridge::cuda_stream(src_t.device()));
      } else {
        kernels::cpu::norm_backward(a);
      }
    } else {
      if (dx.defined()) dx.zero_();
      if (dw.defined()) dw.zero_();
      if (db.defined()) db.zero_();
    }
  }
  // [cols] in its parameter's dtype and shape (no-ops where they already are).
  const auto as_param = [&](const at::Tensor& t, at::ScalarType dtype) {
    if (!t.defined()) return t;
    const at::Tensor v = t.dim() == static_cast<int64_t>(s.shape.size()) ? t : t.view(s.shape);
    return v.scalar_type() == dtype ? v : v.to(dtype);
  };
  return {want_dx ? dx : at::Tensor(), as_param(dw, w_dtype), as_param(db, b_dtype)};
}

variable_list NormBackward::apply(variable_list&& grads) {
  // create_graph: the gradients are computed as usual, and those that need a gradient of their own
  // get an Error node, so that a double backward through them fails with a clear message when it
  // runs (as LibTorch's ops without a double-backward formula do) rather than being refused here
  // or silently giving zero second derivatives.
  const bool create_graph = at::GradMode::is_enabled();
  const at::AutoGradMode no_graph(false);
  const std::lock_guard<std::mutex> lock(mutex_);
  // No gradient reached the output (it did not contribute to what is differentiated): none
  // flows on, as for LibTorch's own nodes.
  if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
  const at::Tensor src_t = src.unpack(spec.memory_efficient ? getptr() : decltype(getptr()){});
  const auto r = norm_backward(spec, grads[0], src_t, w.unpack(), b.unpack(), mean.unpack(),
                               rstd.unpack(), task_should_compute_output(0),
                               task_should_compute_output(1), task_should_compute_output(2));
  variable_list out{r[0], r[1], r[2]};
  if (create_graph) {
    // dx, dw and db depend on dy and, through what was saved, on the forward's input, weight and
    // bias: this node's own next edges (the saved tensors are contiguous copies without history,
    // or, memory-efficient, the output of this very node).
    auto edges = torch::autograd::collect_next_edges(grads[0]);
    edges.insert(edges.end(), next_edges().begin(), next_edges().end());
    const bool any = std::any_of(edges.begin(), edges.end(),
                                 [](const torch::autograd::Edge& e) { return e.is_valid(); });
    if (any) {
      const auto error = make_node<torch::autograd::Error>(
          std::string(op_name(spec.rms)) + ": double backward is not supported", std::move(edges));
      for (at::Tensor& t : out) {
        if (!t.defined()) continue;
        if (t.is_view()) t = t.clone();  // history is set on tensors of their own, not views
        torch::autograd::set_history(t, error);
      }
    }
  }
  return out;
}

// Records the norm in the autograd graph: y's history is a NormBackward node with what the
// backward needs saved.
std::array<at::Tensor, 3> forward_with_graph(const at::Tensor& input, const at::Tensor& weight,
                                             const at::Tensor& bias, const Geometry& g, double eps,
                                             Flags f) {
  auto node = make_node<NormBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(input, weight, bias));
  at::Tensor x;
  at::Tensor w;
  at::Tensor b;
  std::array<at::Tensor, 3> out;
  {
    const at::AutoDispatchBelowADInplaceOrView below_autograd;
    x = input.contiguous();
    w = weight.defined() ? weight.contiguous() : at::Tensor();
    b = bias.defined() ? bias.contiguous() : at::Tensor();
    out = norm_forward(x, w, b, g, eps, f, output_dtype(input, weight, f));
  }
  const at::Tensor& y = out[0];
  torch::autograd::set_history(y, node);
  node->spec = backward_spec(x, w, b, g, eps, f);
  // memory_efficient keeps the output (which the next layer usually keeps anyway) instead of
  // the input, and recomputes x_hat = (y - bias) / weight in the backward.
  if (f.memory_efficient) {
    node->src = SavedVariable(y, /*is_output=*/true);
    node->b = SavedVariable(b, false);
  } else {
    node->src = SavedVariable(x, false);
    node->mean = SavedVariable(out[1], false);
  }
  node->w = SavedVariable(w, false);
  node->rstd = SavedVariable(out[2], false);
  return out;
}

// {y, mean, rstd}; y with a NormBackward node when a gradient is wanted.
std::array<at::Tensor, 3> run_with_stats(const char* who, const at::Tensor& input,
                                         at::IntArrayRef shape, const at::Tensor& weight,
                                         const at::Tensor& bias, double eps, Flags f) {
  const Geometry g = check_inputs(who, input, shape, weight, bias, eps);
  TORCH_CHECK(!f.mixed || weight.defined(), who, ": the mixed-dtype variants need a weight");
  TORCH_CHECK(input.device().is_cpu() || input.device().is_cuda(), who,
              ": expected a CPU or CUDA tensor, got one on ", input.device());
  const bool grad = at::GradMode::is_enabled() &&
                    (input.requires_grad() || (weight.defined() && weight.requires_grad()) ||
                     (bias.defined() && bias.requires_grad()));
  // Forward-mode AD has no formula here: a dual input is rejected rather than its tangent lost.
  const auto tangent = [](const at::Tensor& t) {
    return t.defined() && t._fw_grad(/*level=*/0).defined();
  };
  TORCH_CHECK(!tangent(input) && !tangent(weight) && !tangent(bias), who,
              ": forward-mode AD (dual tensors) is not supported");
  if (!grad) {
    // Nothing to record (inference, or no_grad): the kernels without the autograd node, its
    // saved tensors and metadata, which cost more than the kernel itself on small inputs.
    const at::Tensor w = weight.defined() ? weight.contiguous() : at::Tensor();
    const at::Tensor b = bias.defined() ? bias.contiguous() : at::Tensor();
    return norm_forward(input.contiguous(), w, b, g, eps, f, output_dtype(input, weight, f));
  }
  return forward_with_graph(input, weight, bias, g, eps, f);
}

at::Tensor run(const char* who, const at::Tensor& input, at::IntArrayRef shape,
               const at::Tensor& weight, const at::Tensor& bias, double eps, Flags f) {
  return run_with_stats(who, input, shape, weight, bias, eps, f)[0];
}

}  // namespace

namespace ops {

std::array<at::Tensor, 3> forward(const char* who, const at::Tensor& input,
                                  at::IntArrayRef normalized_shape, const at::Tensor& weight,
                                  const at::Tensor& bias, double eps, bool rms, bool mixed,
                                  bool memory_efficient) {
  const Geometry g = check_inputs(who, input, normalized_shape, weight, bias, eps);
  TORCH_CHECK(!mixed || weight.defined(), who, ": the mixed-dtype variants need a weight");
  const Flags f{rms, mixed, memory_efficient};
  const at::Tensor w = weight.defined() ? weight.contiguous() : at::Tensor();
  const at::Tensor b = bias.defined() ? bias.contiguous() : at::Tensor();
  return norm_forward(input.contiguous(), w, b, g, eps, f, output_dtype(input, weight, f));
}

std::array<at::Tensor, 3> forward_autograd(const char* who, const at::Tensor& input,
                                           at::IntArrayRef normalized_shape,
                                           const at::Tensor& weight, const at::Tensor& bias,
                                           double eps, bool rms, bool mixed,
                                           bool memory_efficient) {
  return run_with_stats(who, input, normalized_shape, weight, bias, eps,
                        {rms, mixed, memory_efficient});
}

std::array<at::Tensor, 3> backward(const char* who, const at::Tensor& grad_out,
                                   const at::Tensor& saved, const at::Tensor& mean,
                                   const at::Tensor& rstd, const at::Tensor& weight,
                                   const at::Tensor& bias, at::IntArrayRef normalized_shape,
                                   double eps, bool rms, bool mixed, bool memory_efficient,
                                   at::ScalarType input_dtype, std::array<bool, 3> want) {
  const Geometry g = check_inputs(who, saved, normalized_shape, weight, bias, eps);
  apex::ops::check_norm_backward(who, {g.rows, g.cols}, bridge::meta_ref(grad_out),
                                 bridge::meta_ref(saved), bridge::meta_ref(mean),
                                 bridge::meta_ref(rstd), rms, memory_efficient, input_dtype);
  // The kernels read the weight as the bias's dtype (float64 takes ATen's path).
  if (!is_f64(saved, weight, bias)) {
    apex::ops::check_param_dtypes(who, bridge::meta_ref(weight), bridge::meta_ref(bias));
  }
  const at::Tensor w = weight.defined() ? weight.contiguous() : at::Tensor();
  const at::Tensor b = bias.defined() ? bias.contiguous() : at::Tensor();
  const at::Tensor src = saved.contiguous();
  BackwardSpec s = backward_spec(src, w, b, g, eps, {rms, mixed, memory_efficient});
  s.x_dtype = input_dtype;
  s.f64 = s.f64 || input_dtype == at::kDouble;
  return norm_backward(s, grad_out, src, w, memory_efficient ? b : at::Tensor(), mean.contiguous(),
                       rstd.contiguous(), want[0], want[1], want[2]);
}

}  // namespace ops

at::Tensor fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                            const at::Tensor& weight, const at::Tensor& bias, double eps,
                            bool memory_efficient) {
  return run("fused_layer_norm", input, normalized_shape, weight, bias, eps,
             {false, false, memory_efficient});
}

at::Tensor fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                          const at::Tensor& weight, double eps, bool memory_efficient) {
  return run("fused_rms_norm", input, normalized_shape, weight, at::Tensor(), eps,
             {true, false, memory_efficient});
}

at::Tensor mixed_fused_layer_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                  const at::Tensor& weight, const at::Tensor& bias, double eps,
                                  bool memory_efficient) {
  return run("mixed_fused_layer_norm", input, normalized_shape, weight, bias, eps,
             {false, true, memory_efficient});
}

at::Tensor mixed_fused_rms_norm(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                const at::Tensor& weight, double eps, bool memory_efficient) {
  return run("mixed_fused_rms_norm", input, normalized_shape, weight, at::Tensor(), eps,
             {true, true, memory_efficient});
}

}  // namespace apex::normalization
