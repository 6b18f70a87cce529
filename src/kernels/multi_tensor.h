// Kernel interface of the multi-tensor engine. Nothing here knows about at::Tensor: the host layer
// (src/optim) checks tensors, builds these plain structs and calls the CPU or the CUDA backend,
// which share the declarations below (namespaces kernels::cpu and kernels::cuda).
//
// Pointers marked "kernel memory" live where the kernel runs: host memory for the CPU backend,
// device memory for the CUDA backend. Every math operation is done in fp32 registers whatever the
// storage dtype; moments and other optimizer state are always fp32.
#pragma once

#include <cmath>
#include <cstdint>

namespace apex::kernels {

/// Storage dtype of one tensor list.
enum class DType : int8_t { kFloat32 = 0, kFloat16 = 1, kBFloat16 = 2 };

/// Bytes per element of `t`.
inline constexpr int64_t dtype_size(DType t) { return t == DType::kFloat32 ? 4 : 2; }

inline constexpr int kMaxLists = 6;

/// Parallel tensor lists: tensor i of list l starts at ptrs[l][i]; all lists of one call share the
/// element counts numel[i] (tensors are contiguous). A list whose ptrs[l] is null is absent
/// (optional lists such as master weights). Element counts are 64-bit: tensors of 2^31 elements
/// and more are indexed correctly.
struct TensorLists {
  int64_t num_tensors = 0;
  const int64_t* numel = nullptr;     // host memory, [num_tensors]
  void* const* ptrs[kMaxLists] = {};  // host arrays of kernel-memory pointers
  DType dtype[kMaxLists] = {};
};

/// Loss-scaling inputs shared by every optimizer kernel.
struct AmpArgs {
  const float* inv_scale =
      nullptr;  ///< kernel memory; grads are multiplied by *inv_scale. null = 1
  const float* found_inf =
      nullptr;  ///< kernel memory; when non-null and != 0 the kernel changes nothing
  /// torch's GradScaler contract: the gradients are left unscaled after the step. The kernel
  /// writes g_in * inv_scale back into the gradient list in the same pass (and, on a skipped
  /// step, only that). Needs inv_scale.
  bool unscale_grads = false;
};

// ---------------------------------------------------------------------------------------------
// Primitives
// ---------------------------------------------------------------------------------------------

/// lists: 0 = in, 1 = out. out = in * scale; *found_inf = 1 when any input is not finite.
struct ScaleArgs {
  float scale = 1.0f;
  float* found_inf = nullptr;  ///< kernel memory, required
};

/// lists: 0 = x, 1 = y, 2 = out. out = a*x + b*y. arg_to_check: -1 both, 0 x, 1 y.
struct AxpbyArgs {
  float a = 1.0f;
  float b = 1.0f;
  int arg_to_check = -1;
  float* found_inf = nullptr;  ///< kernel memory, required
};

enum class NormType : int8_t { kL2 = 0, kInf = 1 };

/// lists: 0 = x. Norm of x * (*inv_scale) over all tensors (total) and per tensor; x is not
/// written. Outputs are fp32 in kernel memory; per_tensor may be null.
struct NormArgs {
  NormType type = NormType::kL2;
  const float* inv_scale = nullptr;  ///< kernel memory; null = 1
  float* total = nullptr;            ///< kernel memory, [1], required
  float* per_tensor = nullptr;       ///< kernel memory, [num_tensors] or null
};

// ---------------------------------------------------------------------------------------------
// Optimizers. "p" is the parameter the math reads; when the master list is present the math
// reads and writes the fp32 master and also writes the rounded result into the model list p.
// ---------------------------------------------------------------------------------------------

/// lists: 0 = p, 1 = g, 2 = exp_avg, 3 = exp_avg_sq, 4 = master (optional).
///   g  = g_in * inv_scale;  L2 mode: g += wd*p;  AdamW mode: p *= 1 - lr*wd
///   m  = b1*m + (1-b1)*g;   v = b2*v + (1-b2)*g*g
///   p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)        (torch.optim.Adam's order)
/// bc1 = 1 - b1^step, bc2 = 1 - b2^step when bias_correction, else 1.
struct AdamArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  bool adam_w_mode = true;
  bool bias_correction = true;
  int64_t step = 1;  ///< used when step_ptr is null
  /// Capturable mode: when non-null, lr and step are read from kernel memory (CUDA graphs).
  const float* lr_ptr = nullptr;
  const float* step_ptr = nullptr;
  AmpArgs amp;
};

/// lists: 0 = p, 1 = g, 2 = momentum buffer (optional, required when momentum != 0),
/// 3 = master (optional).
///   g = g_in*inv_scale; if (!wd_after_momentum) g += wd*p
///   momentum: buf = first_run ? g : momentum*buf + (1-dampening)*g;
///             g = nesterov ? g + momentum*buf : buf
///   if (wd_after_momentum) g += wd*p;  p -= lr*g
struct SgdArgs {
  float lr = 0.0f;
  float momentum = 0.0f;
  float dampening = 0.0f;
  float weight_decay = 0.0f;
  bool nesterov = false;
  bool wd_after_momentum = false;
  bool first_run = false;
  AmpArgs amp;
};

/// lists: 0 = p, 1 = g, 2 = state_sum, 3 = master (optional).
///   g = g_in*inv_scale;  L2 mode: g += wd*p;  w mode: p -= lr*wd*p
///   h += g*g;  p -= lr * g / (sqrt(h) + eps)
struct AdagradArgs {
  float lr = 1e-2f;  ///< already divided by 1 + (step-1)*lr_decay
  float eps = 1e-10f;
  float weight_decay = 0.0f;
  bool adagrad_w_mode = false;
  AmpArgs amp;
};

/// LAMB runs in two passes so that the user's gradients are never overwritten:
///   stage 1, lists 0 = p, 1 = g, 2 = m, 3 = v, 4 = master (optional):
///     clip = (max_grad_norm > 0 && gnorm > max_grad_norm) ? gnorm / max_grad_norm : 1
///     g = g_in*inv_scale / clip;  L2 mode: g += wd*p
///     m = b1*m + beta3*g;  v = b2*v + (1-b2)*g*g   (beta3 = 1-b1 with grad_averaging, else 1)
///     u = (m/bc1) / (sqrt(v/bc2) + eps)  [+ wd*p in AdamW mode]
///     per_tensor_u_sumsq[i] += sum(u*u); per_tensor_p_sumsq[i] += sum(p*p)
///   stage 2, same lists (g may be absent): recompute u from m, v and p, then
///     ratio = (use_nvlamb || wd != 0) && |p| != 0 && |u| != 0 ? lr*|p|/|u| : lr;  p -= ratio*u
/// gnorm is the global norm of the unscaled gradients (kernel memory). The caller zeroes the
/// per-tensor sums before stage 1.
struct LambArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float beta3 = 0.1f;
  float eps = 1e-6f;
  float weight_decay = 0.01f;
  float bias_correction1 = 1.0f;  ///< 1 - b1^step, or 1
  float bias_correction2 = 1.0f;  ///< 1 - b2^step, or 1
  bool adam_w_mode = true;
  bool use_nvlamb = false;
  float max_grad_norm = 1.0f;
  const float* global_grad_norm = nullptr;  ///< kernel memory, [1]
  float* u_sumsq = nullptr;                 ///< kernel memory, [num_tensors]
  float* p_sumsq = nullptr;                 ///< kernel memory, [num_tensors]
  AmpArgs amp;
};

/// lists: 0 = p, 1 = g, 2 = m, 3 = master (optional). v[i] is tensor i's blended gradient norm
/// (already computed by the caller, of the unscaled gradients).
///   g = g_in*inv_scale; d = v[i]/bc2 + eps  (bc2 = sqrt(1 - b2^step) or 1)
///   reg_inside_moment: g = g/d + wd*p;  m = b1*m + beta3*g;  p -= lr * m/bc1
///   otherwise:         m = b1*m + beta3*g;  p -= lr * ((m/bc1)/d + wd*p)
struct NovoGradArgs {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta3 = 0.1f;
  float eps = 1e-8f;
  float weight_decay = 0.0f;
  float bias_correction1 = 1.0f;
  float bias_correction2 = 1.0f;
  bool reg_inside_moment = false;
  const float* v = nullptr;  ///< kernel memory, [num_tensors]
  AmpArgs amp;
};

/// The scalars LAMB and NovoGrad derive from their hyperparameters, computed in double and rounded
/// once by the caller; one definition for both front doors (src/optim and the Python ops).
/// 1 - beta^step: the bias correction of a moment after `step` steps, or 1 when it is off.
inline double bias_correction(double beta, int64_t step, bool on) {
  return on ? 1.0 - std::pow(beta, static_cast<double>(step)) : 1.0;
}
/// beta3, the gradient's weight in the first moment: 1 - beta1 with grad averaging, else 1.
inline float grad_weight(double beta1, bool grad_averaging) {
  return grad_averaging ? static_cast<float>(1.0 - beta1) : 1.0f;
}

/// Every multi-tensor kernel with its arguments: X(name, Args). Each backend has one function per
/// entry, declared from this list (cpu: name(lists, args); cuda: name(lists, args, stream)), and
/// the build without CUDA kernels defines its stubs from it (cuda/unavailable.cpp). A new kernel
/// is one line here, its Args struct above, and one function per backend.
#define APEX_MULTI_TENSOR_KERNELS(X) \
  X(scale, ScaleArgs)                \
  X(axpby, AxpbyArgs)                \
  X(norm, NormArgs)                  \
  X(adam, AdamArgs)                  \
  X(sgd, SgdArgs)                    \
  X(adagrad, AdagradArgs)            \
  X(lamb_stage1, LambArgs)           \
  X(lamb_stage2, LambArgs)           \
  X(novograd, NovoGradArgs)

namespace cpu {
#define APEX_DECLARE_CPU_KERNEL(name, Args) void name(const TensorLists& lists, const Args& args);
APEX_MULTI_TENSOR_KERNELS(APEX_DECLARE_CPU_KERNEL)
#undef APEX_DECLARE_CPU_KERNEL
/// Sets *found_inf = 1 when any element of list 0 is not finite (the CPU optimizers' pre-pass).
void check_finite(const TensorLists& lists, float* found_inf);
/// Name of the SIMD code path in use (an entry of cmake/ApexCpuIsa.cmake: "avx512bf16",
/// "avx512", "avx2" or "baseline"); APEX_CPU_ISA overrides.
const char* isa_name();
}  // namespace cpu

namespace cuda {
// Same semantics as the CPU backend, enqueued on `stream` (a cudaStream_t) of the current device.
// Every kernel-memory pointer must be on that device.
#define APEX_DECLARE_CUDA_KERNEL(name, Args) \
  void name(const TensorLists& lists, const Args& args, void* stream);
APEX_MULTI_TENSOR_KERNELS(APEX_DECLARE_CUDA_KERNEL)
#undef APEX_DECLARE_CUDA_KERNEL
void check_finite(const TensorLists& lists, float* found_inf, void* stream);
}  // namespace cuda

}  // namespace apex::kernels
