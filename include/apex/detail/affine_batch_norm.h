// What apex::amp needs to know of a batch-norm module that is not one of LibTorch's (apex's
// SyncBatchNorm): whether it is affine, so that O2 keeps its parameters in fp32. A module class
// says so by deriving from this; amp asks through it, so that amp does not depend on the module's
// library.
#pragma once

namespace apex::detail {

class AffineBatchNorm {
 public:
  virtual ~AffineBatchNorm() = default;
  /// Whether the module has a learnable weight and bias (kept in fp32 under O2's
  /// keep_batchnorm_fp32).
  virtual bool is_affine_batch_norm() const = 0;

 protected:
  AffineBatchNorm() = default;
  AffineBatchNorm(const AffineBatchNorm&) = default;
  AffineBatchNorm& operator=(const AffineBatchNorm&) = default;
};

}  // namespace apex::detail
