// apex-train's --optimizer: the optimizer a name stands for, with the run's lr and weight decay.
#include "train/optimizer_factory.h"

#include <apex/optim.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

namespace apex::train {

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        const std::vector<at::Tensor>& params) {
  namespace ao = apex::optim;
  const std::string& n = o.optimizer;
  if (n == "fused-adam") {
    return std::make_unique<ao::FusedAdam>(params,
                                           ao::FusedAdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "fused-lamb") {
    return std::make_unique<ao::FusedLAMB>(params,
                                           ao::FusedLAMBOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "fused-sgd") {
    return std::make_unique<ao::FusedSGD>(
        params, ao::FusedSGDOptions(o.lr).momentum(0.9).weight_decay(o.weight_decay));
  }
  if (n == "fused-novograd") {
    return std::make_unique<ao::FusedNovoGrad>(
        params, ao::FusedNovoGradOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "fused-adagrad") {
    return std::make_unique<ao::FusedAdagrad>(
        params, ao::FusedAdagradOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "adam") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  }
  TORCH_CHECK(n == "sgd", "apex-train: unknown optimizer '", n, "'");
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(0.9).weight_decay(o.weight_decay));
}

}  // namespace apex::train
