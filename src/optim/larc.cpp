#include "apex/optim/larc.h"

#include <ATen/ops/clamp_max.h>
#include <ATen/ops/where.h>
#include <apex/optim/fused_adagrad.h>
#include <apex/optim/fused_adam.h>
#include <apex/optim/fused_lamb.h>
#include <apex/optim/fused_novograd.h>
#include <apex/optim/fused_sgd.h>
#include <apex/optim/multi_tensor.h>
#include <c10/util/Exception.h>
#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

#include "bridge/bridge.h"

#include <optional>

namespace apex::optim {
namespace {

// Reads the weight decay of `o` and, when `set` is given, writes it. nullopt for unknown types.
template <class... Options>
std::optional<double> weight_decay_of(torch::optim::OptimizerOptions& o,
                                      std::optional<double> set) {
  std::optional<double> out;
  (
      [&] {
        if (out) return;
        if (auto* typed = dynamic_cast<Options*>(&o)) {
          out = typed->weight_decay();
          if (set) typed->weight_decay(*set);
        }
      }(),
      ...);
  return out;
}

std::optional<double> weight_decay(torch::optim::OptimizerOptions& o,
                                   std::optional<double> set = std::nullopt) {
  return weight_decay_of<FusedAdamOptions, FusedSGDOptions, FusedLAMBOptions, FusedNovoGradOptions,
                         FusedAdagradOptions, torch::optim::SGDOptions, torch::optim::AdamOptions,
                         torch::optim::AdamWOptions, torch::optim::AdagradOptions,
                         torch::optim::RMSpropOptions>(o, set);
}

}  // namespace

LARC::LARC(torch::optim::Optimizer& optimizer, LARCOptions options)
    : optimizer_(optimizer), options_(options) {
  TORCH_CHECK(options.trust_coefficient() > 0, "LARC: trust_coefficient must be > 0, got ",
              options.trust_coefficient());
  TORCH_CHECK(options.eps() >= 0, "LARC: eps must be >= 0, got ", options.eps());
}

at::Tensor LARC::step(torch::optim::Optimizer::LossClosure closure) {
  auto& groups = optimizer_.param_groups();
  std::vector<double> saved(groups.size(), 0.0);
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    saved[gi] = weight_decay(groups[gi].options()).value_or(0.0);
  }
  // The wrapped optimizer's decay is restored whatever happens below.
  struct Restore {
    std::vector<torch::optim::OptimizerParamGroup>& groups;
    const std::vector<double>& saved;
    ~Restore() {
      for (size_t gi = 0; gi < groups.size(); ++gi) weight_decay(groups[gi].options(), saved[gi]);
    }
  } restore{groups, saved};
  {
    const at::NoGradGuard no_grad;
    for (size_t gi = 0; gi < groups.size(); ++gi) {
      const double wd = saved[gi];
      const double lr = groups[gi].options().get_lr();
      // One multi-tensor call per (device, dtype) of the group's parameters.
      std::vector<at::Tensor> with_grad;
      for (const auto& p : groups[gi].params()) {
        if (!p.grad().defined()) continue;
        TORCH_CHECK(!p.grad().is_sparse(), "LARC: sparse gradients are not supported");
        with_grad.push_back(p);
      }
      for (const auto& ps : bridge::by_device_and_dtype(with_grad)) {
        std::vector<at::Tensor> data;
        std::vector<at::Tensor> grads;
        for (const auto& p : ps) {
          data.push_back(p.detach());
          grads.push_back(p.grad());
        }
        const at::Tensor pn = std::get<1>(multi_tensor_l2norm(data, true));
        const at::Tensor gn = std::get<1>(multi_tensor_l2norm(grads, true));
        at::Tensor local = options_.trust_coefficient() * pn / (gn + pn * wd + options_.eps());
        if (options_.clip()) local = at::clamp_max(local / lr, 1.0);
        // Parameters with a zero norm (or zero gradient) keep their gradient as it is.
        const at::Tensor apply = pn.ne(0).logical_and(gn.ne(0));
        local = at::where(apply, local, at::ones_like(local));
        const at::Tensor decay = apply.to(at::kFloat) * wd;
        for (size_t i = 0; i < grads.size(); ++i) {
          const auto idx = static_cast<int64_t>(i);
          at::Tensor& g = grads[i];
          if (wd != 0) g.add_(data[i] * decay[idx].to(g.scalar_type()));
          g.mul_(local[idx].to(g.scalar_type()));
        }
      }
      weight_decay(groups[gi].options(), 0.0);
    }
  }
  return optimizer_.step(std::move(closure));
}

}  // namespace apex::optim
