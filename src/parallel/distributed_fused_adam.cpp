// DistributedFusedAdam: the fused Adam kernel on this rank's shard (one launch per group and
// parameter dtype, one row per fragment).
#include "apex/parallel/distributed_fused_adam.h"

#include <c10/util/Exception.h>

#include "kernels/multi_tensor.h"
#include "optim/state.h"
#include "parallel/sharded_optimizer.h"

namespace apex::parallel {
namespace {

constexpr const char* kWho = "DistributedFusedAdam";

const DistributedFusedAdamOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const DistributedFusedAdamOptions&>(g.options());
}

void check(const DistributedFusedAdamOptions& o) { optim::detail::check_adam_style(kWho, o); }

}  // namespace

DistributedFusedAdamOptions::DistributedFusedAdamOptions(double lr) : lr_(lr) {}

DistributedFusedAdam::DistributedFusedAdam(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    DistributedFusedAdamOptions defaults, ProcessGroup group)
    : DistributedFusedOptimizer(detail::checked_groups(groups, defaults, check),
                                std::make_unique<DistributedFusedAdamOptions>(defaults),
                                ShardingSettings::of(defaults), std::move(group), kWho) {}

void DistributedFusedAdam::check_hyperparameters() const {
  for (const auto& g : param_groups_) check(options_of(g));
}

void DistributedFusedAdam::update(const at::Tensor& inv_scale) {
  auto& m = impl();
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& o = options_of(param_groups_[gi]);
    ++m.steps[gi];
    auto rows = m.shard_rows(gi);
    if (rows.empty()) continue;
    kernels::AdamArgs args = optim::detail::adam_args(o);
    args.step = m.steps[gi];
    const c10::Device device = m.grad_shard.device();
    args.amp.inv_scale = bridge::scalar_ptr(inv_scale, device, kWho, "inv_scale");
    for (auto& [dt, r] : rows) {
      const auto view = r.lists.view();
      bridge::launch(device, kernels::cpu::adam, kernels::cuda::adam, view, args);
    }
  }
}

StateDict DistributedFusedAdam::group_state(size_t group) const {
  const auto& o = options_of(param_groups_[group]);
  StateDict g = make_state_dict();
  g.insert("lr", o.lr());
  g.insert("betas", c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("bias_correction", o.bias_correction());
  g.insert("adam_w_mode", o.adam_w_mode());
  return g;
}

StateDict DistributedFusedAdam::torch_state_dict() const {
  return torch_layout(
      [&](size_t gi) { return optim::detail::torch_adam_group(options_of(param_groups_[gi])); });
}

}  // namespace apex::parallel
