#pragma once

// Internal: the fused non-finite check + unscale over gradient lists, shared by LossScaler, Amp
// and GradScaler.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <vector>

namespace apex::amp::detail {

/// The flag of `device` in `flags` (one fp32 element per device), created as 0 if absent.
at::Tensor& flag_for(std::vector<at::Tensor>& flags, c10::Device device);

/// Groups `tensors` by (device, dtype) and runs `at::_amp_foreach_non_finite_check_and_unscale_`
/// on each group with `inv_scale` (one fp32 element, any device), setting the device's flag.
void check_and_unscale_(const std::vector<at::Tensor>& tensors, const at::Tensor& inv_scale,
                        std::vector<at::Tensor>& flags);

/// As check_and_unscale_, reading only: sets the device's flag when a tensor holds inf/NaN and
/// leaves the tensors as they are (for kernels that unscale by themselves).
void check_finite_(const std::vector<at::Tensor>& tensors, std::vector<at::Tensor>& flags);

/// The sum of `flags` on `device` (0 when empty): one tensor, no synchronization.
at::Tensor sum_flags(const std::vector<at::Tensor>& flags, c10::Device device);

}  // namespace apex::amp::detail
