#pragma once

#include <torch/optim/optimizer.h>

#include <memory>
#include <vector>

#include "train/trainer.h"

namespace apex::train {

/// The optimizer --optimizer names (fused-adam, fused-lamb, fused-sgd, fused-novograd,
/// fused-adagrad, adam, sgd) over `params`, with --lr and --weight-decay.
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        const std::vector<at::Tensor>& params);

}  // namespace apex::train
