#pragma once

// Internal: the definitions of FusedOptimizer::save_archive / load_archive, for the optimizers'
// translation units (they need LibTorch's optimizer serialization headers, which the public
// header does not include).

#include <apex/optim/fused_optimizer.h>
#include <torch/optim/serialize.h>
#include <torch/serialize/archive.h>

namespace apex::optim {

template <class State, class Options>
void FusedOptimizer::save_archive(torch::serialize::OutputArchive& archive) const {
  torch::optim::serialize<State, Options>(archive, *this);
  write_integrity(archive);
}

template <class State, class Options>
void FusedOptimizer::load_archive(torch::serialize::InputArchive& archive,
                                  const std::function<void()>& after) {
  load_transaction(
      archive, [&] { torch::optim::serialize<State, Options>(archive, *this); }, after);
}

}  // namespace apex::optim
