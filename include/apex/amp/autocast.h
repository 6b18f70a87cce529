#pragma once

#include <apex/amp/cpu_half.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <optional>

namespace apex::amp {

/// RAII autocast region, the C++ counterpart of Python's `torch.autocast`.
///
/// It follows `torch.autocast` step for step: on entry it saves the device's enabled flag and
/// autocast dtype and the cast-cache flag, sets them, and increments the nesting depth; on exit it
/// decrements the depth, clears LibTorch's cast cache when the outermost region ends (skipping this
/// leaks the cached half copies of the weights, pytorch/pytorch#46649), and restores what it saved.
/// Autocast state is thread-local: run `backward()` outside the guard, as in Python.
///
/// `dtype` defaults to the device's autocast default (bf16 on CPU, fp16 on CUDA) and must be
/// fp16 or bf16. A CUDA guard on a machine without CUDA warns and disables itself (as torch does).
///
///   { apex::amp::AutocastGuard guard(c10::kCPU, at::kBFloat16); auto y = model->forward(x); }
class AutocastGuard {
 public:
  explicit AutocastGuard(c10::DeviceType device = c10::kCUDA,
                         std::optional<c10::ScalarType> dtype = std::nullopt, bool enabled = true,
                         std::optional<bool> cache_enabled = std::nullopt);
  ~AutocastGuard();

  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard(AutocastGuard&&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

  /// Whether this region turned autocast on (false when disabled or not available).
  bool enabled() const { return enabled_; }
  /// The lower-precision dtype this region uses.
  c10::ScalarType dtype() const { return dtype_; }
  c10::DeviceType device() const { return device_; }

 private:
  c10::DeviceType device_;
  c10::ScalarType dtype_;
  bool enabled_;
  bool prev_enabled_;
  c10::ScalarType prev_dtype_;
  bool prev_cache_enabled_;
  // On the CPU, where LibTorch's half matmuls are slow, they run through fp32 in this region.
  std::optional<CpuHalfFallbackGuard> half_fallback_;
};

/// Whether autocast is currently enabled for `device` on this thread.
bool is_autocast_enabled(c10::DeviceType device);

}  // namespace apex::amp
