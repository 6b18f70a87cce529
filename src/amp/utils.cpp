// amp's model utilities (apex/amp/utils.h): casting a network but its affine batch norms, the
// optimizer's parameters. The CPU's half-precision features: cpu_half/cpu_support.cpp.
#include <apex/amp/utils.h>
#include <apex/detail/affine_batch_norm.h>

#include <torch/csrc/autograd/grad_mode.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/optim/optimizer.h>

#include <vector>

namespace apex::amp {
namespace {

template <typename Impl>
bool affine_bn_as(const torch::nn::Module& m) {
  const auto* bn = dynamic_cast<const Impl*>(&m);
  return bn != nullptr && bn->options.affine();
}

void cast_own_tensors(torch::nn::Module& m, c10::ScalarType dtype) {
  torch::NoGradGuard no_grad;
  for (auto& p : m.named_parameters(/*recurse=*/false)) {
    auto& t = p.value();
    if (t.is_floating_point() && t.scalar_type() != dtype) t.set_data(t.to(dtype));
  }
  for (auto& b : m.named_buffers(/*recurse=*/false)) {
    auto& t = b.value();
    if (t.is_floating_point() && t.scalar_type() != dtype) t.set_data(t.to(dtype));
  }
}

}  // namespace

bool is_affine_batchnorm(const torch::nn::Module& module) {
  const auto* other = dynamic_cast<const apex::detail::AffineBatchNorm*>(&module);
  return (other != nullptr && other->is_affine_batch_norm()) ||
         affine_bn_as<torch::nn::BatchNorm1dImpl>(module) ||
         affine_bn_as<torch::nn::BatchNorm2dImpl>(module) ||
         affine_bn_as<torch::nn::BatchNorm3dImpl>(module);
}

void convert_network(torch::nn::Module& module, c10::ScalarType dtype) {
  TORCH_CHECK(dtype == c10::kFloat || dtype == c10::kHalf || dtype == c10::kBFloat16 ||
                  dtype == c10::kDouble,
              "convert_network: dtype must be a floating type, got ", dtype);
  if (!is_affine_batchnorm(module)) cast_own_tensors(module, dtype);
  for (auto& child : module.children()) convert_network(*child, dtype);
}

std::vector<at::Tensor> master_params(const torch::optim::Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& group : optimizer.param_groups()) {
    for (const auto& p : group.params()) out.push_back(p);
  }
  return out;
}

}  // namespace apex::amp
