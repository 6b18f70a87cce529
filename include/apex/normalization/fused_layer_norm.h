#pragma once

#include <apex/normalization/functional.h>
#include <torch/arg.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <vector>

namespace apex::normalization {

/// Options of FusedLayerNorm and FusedRMSNorm (apex's names and defaults).
struct FusedNormOptions {
  /* implicit */ FusedNormOptions(std::vector<int64_t> normalized_shape)  // NOLINT
      : normalized_shape_(std::move(normalized_shape)) {}
  TORCH_ARG(std::vector<int64_t>, normalized_shape);
  TORCH_ARG(double, eps) = 1e-5;
  /// Learnable weight (ones) and, for LayerNorm, bias (zeros) of shape normalized_shape.
  TORCH_ARG(bool, elementwise_affine) = true;
  /// Save the output instead of the input for the backward (see functional.h).
  TORCH_ARG(bool, memory_efficient) = false;
};

namespace detail {
/// What the LayerNorm modules share: options, and weight (ones) and bias (zeros) when affine.
/// `Self` is the module class, so that clone() copies the class it is called on.
template <class Self>
class LayerNormModule : public torch::nn::Cloneable<Self> {
 public:
  LayerNormModule(FusedNormOptions options, const char* who);
  void reset() override;

  FusedNormOptions options;
  at::Tensor weight;
  at::Tensor bias;
};

/// What the RMSNorm modules share: options, and weight (ones) when affine.
template <class Self>
class RMSNormModule : public torch::nn::Cloneable<Self> {
 public:
  RMSNormModule(FusedNormOptions options, const char* who);
  void reset() override;

  FusedNormOptions options;
  at::Tensor weight;
};
}  // namespace detail

/// LayerNorm over the trailing normalized_shape dimensions, on the fused kernels
/// (apex.normalization.FusedLayerNorm). `FusedLayerNorm ln(FusedNormOptions({768}));`
class FusedLayerNormImpl : public detail::LayerNormModule<FusedLayerNormImpl> {
 public:
  explicit FusedLayerNormImpl(FusedNormOptions options);
  at::Tensor forward(const at::Tensor& input);
};
TORCH_MODULE(FusedLayerNorm);

/// RMSNorm over the trailing normalized_shape dimensions (apex.normalization.FusedRMSNorm).
class FusedRMSNormImpl : public detail::RMSNormModule<FusedRMSNormImpl> {
 public:
  explicit FusedRMSNormImpl(FusedNormOptions options);
  at::Tensor forward(const at::Tensor& input);
};
TORCH_MODULE(FusedRMSNorm);

/// apex's MixedFusedLayerNorm: always affine, parameters in fp32 (or whatever dtype they are
/// given), input usually fp16/bf16, output in the parameters' dtype.
class MixedFusedLayerNormImpl : public detail::LayerNormModule<MixedFusedLayerNormImpl> {
 public:
  explicit MixedFusedLayerNormImpl(FusedNormOptions options);
  at::Tensor forward(const at::Tensor& input);
};
TORCH_MODULE(MixedFusedLayerNorm);

/// apex's MixedFusedRMSNorm: as MixedFusedLayerNorm, for RMSNorm.
class MixedFusedRMSNormImpl : public detail::RMSNormModule<MixedFusedRMSNormImpl> {
 public:
  explicit MixedFusedRMSNormImpl(FusedNormOptions options);
  at::Tensor forward(const at::Tensor& input);
};
TORCH_MODULE(MixedFusedRMSNorm);

}  // namespace apex::normalization
