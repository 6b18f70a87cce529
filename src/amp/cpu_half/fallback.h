// The CPU half fallback's room (its public face: apex/amp/cpu_half.h). What the op files share:
// the scope (a depth per thread), whether the policy serves a dtype, the one test that decides
// whether a call is taken, and each op file's registration. Files:
//
//   cpu_support.cpp  the CPU's features (cpuid, the OS's XSAVE state, oneDNN's ISA limit) and how
//                    LibTorch multiplies half matrices on it (apex/amp/utils.h)
//   policy.cpp       the decision, read once: what the fallback serves on this CPU under
//                    APEX_CPU_HALF_FALLBACK / _ATTENTION / _GEMM, or as a test forced it
//   scope.cpp        the guard, and the registry: the op files' kernels put into the dispatcher,
//                    only those the policy enables
//   products.cpp     mm, bmm, addmm, baddbmm, addbmm, addmv (their out= and in-place forms
//                    generated), and `x += bias`
//   convolution.cpp  convolution forward and backward (1-D ones by conv1d.cpp)
//   attention.cpp    the CPU flash attention, forward and backward
//   activations.cpp  GELU and SiLU, forward and backward
//   recurrent.cpp    LSTM, GRU and the plain RNNs (AutogradCPU)
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace torch {
class Library;
}

namespace apex::amp::cpu_half {

/// How many live guards opened the scope in this thread (scope.cpp).
extern constinit thread_local int scope_depth;
/// Tests' counters: op calls the fallback computed in this thread, and of them those apex's own
/// product (or attention kernels) took.
extern constinit thread_local uint64_t taken_calls;
extern constinit thread_local uint64_t own_product_calls;

/// The policy in force (policy.cpp): whether the fallback computes `dtype` (Half or BFloat16)
/// products, convolutions, activations and recurrent layers; whether attention's own kernels serve
/// `dtype`; whether apex's own half product is in the kernel table (and not turned off).
bool serves(at::ScalarType dtype);
bool serves_attention(at::ScalarType dtype);
bool own_product();

inline bool is_half(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

/// Inside a scope, the one half dtype of the defined tensors, all on the CPU; nullopt otherwise.
inline std::optional<at::ScalarType> scoped_half_dtype(c10::ArrayRef<const at::Tensor*> ts) {
  if (scope_depth == 0) return std::nullopt;
  std::optional<at::ScalarType> dtype;
  for (const at::Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!is_half(*t) || !t->device().is_cpu()) return std::nullopt;
    if (dtype && *dtype != t->scalar_type()) return std::nullopt;
    dtype = t->scalar_type();
  }
  return dtype;
}

/// The calls the fallback takes: in a scope, every tensor defined of them on the CPU, of one half
/// dtype the policy serves. Counted.
inline bool take(c10::ArrayRef<const at::Tensor*> ts) {
  const std::optional<at::ScalarType> dtype = scoped_half_dtype(ts);
  if (!dtype.has_value() || !serves(*dtype)) return false;
  ++taken_calls;
  return true;
}

/// The tensor widened exactly to fp32 (undefined stays undefined).
inline at::Tensor wide(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; }

/// Each op file's kernels, for the registry (scope.cpp). `cpu` holds CPU-key kernels of aten's
/// ops, `autograd` AutogradCPU ones.
void register_products(torch::Library& cpu);
void register_convolution(torch::Library& cpu);
void register_activations(torch::Library& cpu);
void register_recurrent(torch::Library& cpu, torch::Library& autograd);
void register_attention(torch::Library& cpu);

}  // namespace apex::amp::cpu_half
