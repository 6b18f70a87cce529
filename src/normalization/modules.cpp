#include <ATen/ops/ones.h>
#include <ATen/ops/zeros.h>
#include <apex/normalization/fused_layer_norm.h>
#include <c10/util/Exception.h>

namespace apex::normalization {
namespace {
void check_options(const FusedNormOptions& o, const char* who) {
  TORCH_CHECK(!o.normalized_shape().empty(), who, ": normalized_shape must not be empty");
  for (int64_t d : o.normalized_shape()) {
    TORCH_CHECK(d > 0, who, ": normalized_shape must be positive, got ", o.normalized_shape());
  }
  TORCH_CHECK(o.eps() > 0, who, ": eps must be > 0, got ", o.eps());
}
}  // namespace

namespace detail {

template <class Self>
LayerNormModule<Self>::LayerNormModule(FusedNormOptions options_, const char* who)
    : options(std::move(options_)) {
  check_options(options, who);
  reset();
}

template <class Self>
void LayerNormModule<Self>::reset() {
  if (options.elementwise_affine()) {
    weight = this->register_parameter("weight", at::ones(options.normalized_shape()));
    bias = this->register_parameter("bias", at::zeros(options.normalized_shape()));
  } else {
    weight = this->register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = this->register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
}

template <class Self>
RMSNormModule<Self>::RMSNormModule(FusedNormOptions options_, const char* who)
    : options(std::move(options_)) {
  check_options(options, who);
  reset();
}

template <class Self>
void RMSNormModule<Self>::reset() {
  weight = options.elementwise_affine()
               ? this->register_parameter("weight", at::ones(options.normalized_shape()))
               : this->register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
}

template class LayerNormModule<FusedLayerNormImpl>;
template class LayerNormModule<MixedFusedLayerNormImpl>;
template class RMSNormModule<FusedRMSNormImpl>;
template class RMSNormModule<MixedFusedRMSNormImpl>;

}  // namespace detail

FusedLayerNormImpl::FusedLayerNormImpl(FusedNormOptions options_)
    : LayerNormModule(std::move(options_), "FusedLayerNorm") {}

at::Tensor FusedLayerNormImpl::forward(const at::Tensor& input) {
  return fused_layer_norm(input, options.normalized_shape(), weight, bias, options.eps(),
                          options.memory_efficient());
}

FusedRMSNormImpl::FusedRMSNormImpl(FusedNormOptions options_)
    : RMSNormModule(std::move(options_), "FusedRMSNorm") {}

at::Tensor FusedRMSNormImpl::forward(const at::Tensor& input) {
  return fused_rms_norm(input, options.normalized_shape(), weight, options.eps(),
                        options.memory_efficient());
}

MixedFusedLayerNormImpl::MixedFusedLayerNormImpl(FusedNormOptions options_)
    : LayerNormModule(std::move(options_), "MixedFusedLayerNorm") {
  TORCH_CHECK(
      options.elementwise_affine(),
      "MixedFusedLayerNorm: elementwise_affine must be true (the mixed variants are affine)");
}

at::Tensor MixedFusedLayerNormImpl::forward(const at::Tensor& input) {
  return mixed_fused_layer_norm(input, options.normalized_shape(), weight, bias, options.eps(),
                                options.memory_efficient());
}

MixedFusedRMSNormImpl::MixedFusedRMSNormImpl(FusedNormOptions options_)
    : RMSNormModule(std::move(options_), "MixedFusedRMSNorm") {
  TORCH_CHECK(options.elementwise_affine(),
              "MixedFusedRMSNorm: elementwise_affine must be true (the mixed variants are affine)");
}

at::Tensor MixedFusedRMSNormImpl::forward(const at::Tensor& input) {
  return mixed_fused_rms_norm(input, options.normalized_shape(), weight, options.eps(),
                              options.memory_efficient());
}

}  // namespace apex::normalization
