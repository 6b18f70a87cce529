// DistributedFusedLAMB: FusedLAMB's two kernel stages on this rank's shard. Stage 1 (moments,
// and per-row sums of squares of the update and of the weights) runs for every group, the sums
// are added per parameter over its fragments and all-reduced over the ranks (one vector), then
// stage 2 applies each parameter's trust ratio to its fragments.
#include "apex/parallel/distributed_fused_lamb.h"

#include <ATen/ops/index_add.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/tensor.h>
#include <c10/util/Exception.h>

#include "kernels/multi_tensor.h"
#include "optim/state.h"
#include "parallel/sharded_optimizer.h"

namespace apex::parallel {
namespace {

constexpr const char* kWho = "DistributedFusedLAMB";

const DistributedFusedLAMBOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const DistributedFusedLAMBOptions&>(g.options());
}

void check(const DistributedFusedLAMBOptions& o) {
  optim::detail::check_adam_style(kWho, o);
  optim::detail::check_non_negative(kWho, "max_grad_norm", o.max_grad_norm());
}

}  // namespace

DistributedFusedLAMBOptions::DistributedFusedLAMBOptions(double lr) : lr_(lr) {}

DistributedFusedLAMB::DistributedFusedLAMB(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    DistributedFusedLAMBOptions defaults, ProcessGroup group)
    : DistributedFusedOptimizer(detail::checked_groups(groups, defaults, check),
                                std::make_unique<DistributedFusedLAMBOptions>(defaults),
                                ShardingSettings::of(defaults), std::move(group), kWho) {}

void DistributedFusedLAMB::check_hyperparameters() const {
  for (const auto& g : param_groups_) check(options_of(g));
}

void DistributedFusedLAMB::update(const at::Tensor& inv_scale) {
  auto& m = impl();
  const c10::Device device = m.grad_shard.device();
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  // The global norm of the unscaled gradients (what clipping compares with max_grad_norm).
  at::Tensor sq = m.grad_shard.to(at::kDouble).pow(2).sum().reshape({1});
  m.group.all_reduce_(sq);
  at::Tensor gnorm = sq.sqrt().to(at::kFloat);
  if (inv_scale.defined()) gnorm = gnorm * inv_scale.to(device);

  // Stage 1 of every group; per-parameter sums of squares (update, weights) over its fragments.
  const auto nparams = static_cast<int64_t>(m.params.size());
  at::Tensor sums = at::zeros({2, nparams}, f32);
  struct Launch {
    size_t group;
    kernels::LambArgs args;
    at::Tensor u, p, index;
    Impl::Rows* rows;
  };
  std::vector<std::map<at::ScalarType, Impl::Rows>> all_rows(param_groups_.size());
  std::vector<Launch> launches;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    const auto& o = options_of(param_groups_[gi]);
    const int64_t step = ++m.steps[gi];
    all_rows[gi] = m.shard_rows(gi);
    for (auto& [dt, r] : all_rows[gi]) {
      kernels::LambArgs args = optim::detail::lamb_args(o, step);
      args.global_grad_norm = gnorm.data_ptr<float>();
      args.amp.inv_scale = bridge::scalar_ptr(inv_scale, device, kWho, "inv_scale");
      Launch l{gi,
               args,
               at::zeros({r.lists.size()}, f32),
               at::zeros({r.lists.size()}, f32),
               at::tensor(r.params, at::TensorOptions().dtype(at::kLong)).to(device),
               &r};
      l.args.u_sumsq = l.u.data_ptr<float>();
      l.args.p_sumsq = l.p.data_ptr<float>();
      const auto view = r.lists.view();
      bridge::launch(device, kernels::cpu::lamb_stage1, kernels::cuda::lamb_stage1, view, l.args);
      sums[0].index_add_(0, l.index, l.u);
      sums[1].index_add_(0, l.index, l.p);
      launches.push_back(std::move(l));
    }
  }
  // A parameter's fragments on other ranks: one all-reduce of every parameter's two sums.
  m.group.all_reduce_(sums);
  // Stage 2 with each row's parameter totals.
  for (auto& l : launches) {
    l.u.copy_(sums[0].index_select(0, l.index));
    l.p.copy_(sums[1].index_select(0, l.index));
    const auto view = l.rows->lists.view();
    bridge::launch(device, kernels::cpu::lamb_stage2, kernels::cuda::lamb_stage2, view, l.args);
  }
}

StateDict DistributedFusedLAMB::group_state(size_t group) const {
  const auto& o = options_of(param_groups_[group]);
  StateDict g = make_state_dict();
  g.insert("lr", o.lr());
  g.insert("betas", c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
  g.insert("eps", o.eps());
  g.insert("weight_decay", o.weight_decay());
  g.insert("bias_correction", o.bias_correction());
  g.insert("adam_w_mode", o.adam_w_mode());
  g.insert("grad_averaging", o.grad_averaging());
  g.insert("max_grad_norm", o.max_grad_norm());
  g.insert("use_nvlamb", o.use_nvlamb());
  return g;
}

}  // namespace apex::parallel
