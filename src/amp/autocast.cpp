#include <apex/amp/autocast.h>

#include <ATen/autocast_mode.h>
#include <c10/util/Exception.h>
#include <torch/cuda.h>

namespace apex::amp {

AutocastGuard::AutocastGuard(c10::DeviceType device, std::optional<c10::ScalarType> dtype,
                             bool enabled, std::optional<bool> cache_enabled)
    : device_(device), enabled_(enabled) {
  TORCH_CHECK(at::autocast::is_autocast_available(device),
              "AutocastGuard: autocast is not available for device type ", device,
              "; expected cpu or cuda");
  dtype_ = dtype.value_or(at::autocast::get_autocast_dtype(device));
  TORCH_CHECK(dtype_ == c10::kHalf || dtype_ == c10::kBFloat16,
              "AutocastGuard: dtype must be Half or BFloat16, got ", dtype_);
  if (enabled_ && device == c10::kCUDA && !torch::cuda::is_available()) {
    // torch.autocast warns and disables itself here; do the same rather than fail.
    TORCH_WARN("AutocastGuard: CUDA is not available; the CUDA autocast region is disabled");
    enabled_ = false;
  }
  // Python's __enter__ order: save, set enabled, set dtype, nest, set cache flag.
  prev_cache_enabled_ = at::autocast::is_autocast_cache_enabled();
  prev_enabled_ = at::autocast::is_autocast_enabled(device_);
  prev_dtype_ = at::autocast::get_autocast_dtype(device_);
  at::autocast::set_autocast_enabled(device_, enabled_);
  at::autocast::set_autocast_dtype(device_, dtype_);
  at::autocast::increment_nesting();
  at::autocast::set_autocast_cache_enabled(cache_enabled.value_or(prev_cache_enabled_));
  if (enabled_ && device_ == c10::kCPU) half_fallback_.emplace(true);
}

AutocastGuard::~AutocastGuard() {
  // Python's __exit__: the outermost region drops the cached half copies of the weights.
  if (at::autocast::decrement_nesting() == 0) {
    at::autocast::clear_cache();
  }
  at::autocast::set_autocast_enabled(device_, prev_enabled_);
  at::autocast::set_autocast_dtype(device_, prev_dtype_);
  at::autocast::set_autocast_cache_enabled(prev_cache_enabled_);
}

bool is_autocast_enabled(c10::DeviceType device) {
  return at::autocast::is_autocast_enabled(device);
}

}  // namespace apex::amp
