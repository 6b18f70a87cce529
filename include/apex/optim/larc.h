#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>
#include <torch/optim/optimizer.h>

namespace apex::optim {

/// Options of LARC, with apex.parallel.LARC's defaults.
struct LARCOptions {
  TORCH_ARG(double, trust_coefficient) = 0.02;
  /// true: the local rate is min(local / lr, 1) (clipping); false: it scales lr (scaling).
  TORCH_ARG(bool, clip) = true;
  TORCH_ARG(double, eps) = 1e-8;
};

/// Layer-wise adaptive rate control around any optimizer, as apex.parallel.LARC. For each
/// parameter with a gradient and non-zero norms:
///   local = trust_coefficient * |p| / (|g| + weight_decay * |p| + eps)
///   clip mode: local = min(local / lr, 1)
///   g = (g + weight_decay * p) * local
/// then the wrapped optimizer steps with its weight decay set to 0 (restored afterwards, also
/// when the step throws). Norms come from one multi-tensor pass per group.
///
/// Weight decay is read from the group options of FusedAdam, FusedSGD, FusedLAMB,
/// FusedNovoGrad, FusedAdagrad and LibTorch's SGD, Adam, AdamW, Adagrad and RMSprop; other
/// optimizer types are treated as having none.
class LARC {
 public:
  explicit LARC(torch::optim::Optimizer& optimizer, LARCOptions options = {});

  /// Rescales the gradients, then calls the wrapped optimizer's step().
  at::Tensor step(torch::optim::Optimizer::LossClosure closure = nullptr);
  void zero_grad(bool set_to_none = true) { optimizer_.zero_grad(set_to_none); }
  torch::optim::Optimizer& optimizer() { return optimizer_; }

 private:
  torch::optim::Optimizer& optimizer_;
  LARCOptions options_;
};

}  // namespace apex::optim
