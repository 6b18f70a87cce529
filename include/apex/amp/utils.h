#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>

#include <vector>

namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace apex::amp {

/// Whether `module` itself (not its children) is a BatchNorm1d/2d/3d with affine parameters.
bool is_affine_batchnorm(const torch::nn::Module& module);

/// Casts every floating parameter and buffer of `module` and its descendants to `dtype`, except
/// those of affine BatchNorm layers, which stay fp32 (apex's `convert_network`; batch statistics
/// in half precision lose accuracy). Tensors keep their identity (`set_data`), so optimizers that
/// hold them see the new dtype.
void convert_network(torch::nn::Module& module, c10::ScalarType dtype);

/// The parameters `optimizer` updates, in group order: after `initialize` with master weights
/// these are the fp32 masters (apex's `amp.master_params`).
std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer);

}  // namespace apex::amp
