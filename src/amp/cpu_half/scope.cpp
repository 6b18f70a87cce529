// The CPU half fallback's scope (a depth per thread, opened by CpuHalfFallbackGuard) and its
// registry: the op files' kernels put into LibTorch's dispatcher once, only those the policy
// enables. Once in, a kernel checks the thread's depth itself and hands every call outside a scope
// (or one it does not take) to the kernel LibTorch had.
#include <apex/amp/cpu_half.h>
#include <apex/amp/cpu_half_testing.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "amp/cpu_half/fallback.h"
#include "amp/quiet_registration.h"

#include <mutex>

namespace apex::amp {
namespace cpu_half {

constinit thread_local int scope_depth = 0;
constinit thread_local uint64_t taken_calls = 0;
constinit thread_local uint64_t own_product_calls = 0;

namespace {

// A library of kernels for aten's ops. It lives as long as the process.
torch::Library* library(c10::DispatchKey key) {
  return new torch::Library(torch::Library::IMPL, "aten", key, __FILE__, __LINE__);
}

// `add` run once per `once`, with the dispatcher's "Overriding a previously registered kernel"
// warning dropped (quiet_registration.h).
template <class Add>
void register_once(std::once_flag& once, const Add& add) {
  std::call_once(once, [&] {
    detail::QuietRegistration quiet;
    const c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    add();
  });
}

// Products, convolution, activations and recurrent layers: where the policy serves a dtype.
void register_computed_ops() {
  static std::once_flag once;
  register_once(once, [] {
    static torch::Library* cpu = library(c10::DispatchKey::CPU);
    static torch::Library* autograd = library(c10::DispatchKey::AutogradCPU);
    register_products(*cpu);
    register_convolution(*cpu);
    register_activations(*cpu);
    register_recurrent(*cpu, *autograd);
  });
}

// Attention's kernels, on their own: where only they are in use (LibTorch's half matmuls fast),
// nothing else is registered.
void register_attention_ops() {
  static std::once_flag once;
  register_once(once, [] {
    static torch::Library* cpu = library(c10::DispatchKey::CPU);
    register_attention(*cpu);
  });
}

// What the policy enables, in the dispatcher.
void register_what_is_served() {
  if (cpu_half_fallback_available()) register_computed_ops();
  if (cpu_half_scope_available()) register_attention_ops();
}

}  // namespace
}  // namespace cpu_half

bool cpu_half_fallback_active() { return cpu_half::scope_depth > 0; }

void prepare_cpu_half_fallback() { cpu_half::register_what_is_served(); }

CpuHalfFallbackGuard::CpuHalfFallbackGuard(bool enabled)
    : opened_(enabled && cpu_half_scope_available()) {
  if (!opened_) return;
  cpu_half::register_what_is_served();
  ++cpu_half::scope_depth;
}

CpuHalfFallbackGuard::~CpuHalfFallbackGuard() {
  if (opened_) --cpu_half::scope_depth;
}

namespace detail {
uint64_t cpu_half_route_calls() { return cpu_half::taken_calls; }
uint64_t cpu_half_gemm_calls() { return cpu_half::own_product_calls; }
}  // namespace detail

}  // namespace apex::amp
