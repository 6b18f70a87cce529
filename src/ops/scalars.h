#pragma once

// Internal, ATen-free: one-element CPU tensors of any real dtype read and written on the host
// (the stable-ABI library's flags and scalars, the loss-scale update on CPU tensors).

#include "ops/tensor_ref.h"

namespace apex::ops {

/// The one element of a CPU tensor of any real dtype (or bool), as a double.
double read_scalar(const TensorRef& t);

/// Sets a one-element CPU tensor of any real dtype (or bool) to v, rounded to its dtype.
void write_scalar(const TensorRef& t, double v);

/// apex's update_scale_hysteresis (torch's _amp_update_scale_ that backs off only after
/// `hysteresis` consecutive overflows) on one-element CPU tensors: scale of a floating dtype,
/// computed in its precision (float for fp32 and half scales, as ATen's tensor form computes);
/// trackers of any integer dtype.
void update_scale_hysteresis(const TensorRef& scale, const TensorRef& growth_tracker,
                             const TensorRef& hysteresis_tracker, const TensorRef& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             int64_t hysteresis);

/// update_scale_hysteresis's argument checks (the device form's too).
void check_update_scale_hysteresis(const TensorRef& scale, const TensorRef& growth_tracker,
                                   const TensorRef& hysteresis_tracker, const TensorRef& found_inf,
                                   int64_t growth_interval, int64_t hysteresis);

}  // namespace apex::ops
