// The machinery of the sharded optimizers: the layout (buckets, shards, fragments) is computed
// once from the parameters; gradients arrive through post-accumulate-grad hooks into full-size
// bucket buffers, which are reduce-scattered into this rank's flat gradient shard; the
// algorithm (DistributedFusedAdam, DistributedFusedLAMB) updates the shard; the parameters are
// all-gathered back, bucket by bucket. Checkpoints: sharded (any world size) and consolidated.
#include "apex/parallel/distributed_fused_optimizer.h"

#include <apex/serialize.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize/archive.h>

#include <chrono>
#include <cmath>
#include <random>

#include "optim/python_state.h"
#include "parallel/sharded_optimizer.h"

namespace apex::parallel {
namespace {

constexpr int64_t kShardFormat = 1;

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

using detail::describe;

}  // namespace

// Runs the hook of parameter `index`.
namespace {
struct GradHook : torch::autograd::PostAccumulateGradHook {
  GradHook(DistributedFusedOptimizer::Impl* impl, int64_t index) : impl(impl), index(index) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    impl->on_grad(index, tensor);
  }
  DistributedFusedOptimizer::Impl* impl;
  int64_t index;
};
}  // namespace

// ---------------------------------------------------------------------------------------------

DistributedFusedOptimizer::DistributedFusedOptimizer(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    std::unique_ptr<torch::optim::OptimizerOptions> defaults, const ShardingSettings& sharding,
    ProcessGroup group, const char* name)
    : torch::optim::Optimizer(groups, std::move(defaults)),
      impl_(std::make_unique<Impl>()),
      group_(std::move(group)) {
  const char* kWho = name;
  // LibTorch replaces the options of optimizer types it does not know by the defaults: put the
  // user's back.
  for (size_t i = 0; i < groups.size(); ++i) {
    if (groups[i].has_options()) param_groups_[i].set_options(groups[i].options().clone());
  }
  auto& m = *impl_;
  TORCH_CHECK(group_.valid(), kWho,
              ": the process group is not initialized (call apex::parallel::init_process_group "
              "first, or pass a group)");
  m.owner = this;
  m.name = name;
  m.group = group_;
  m.pg = c10d_group(group_);
  m.rank = group_.rank();
  m.world = group_.size();
  m.settings = sharding;
  const auto& s = sharding;
  TORCH_CHECK(std::isfinite(s.bucket_cap_mb) && s.bucket_cap_mb > 0, kWho,
              ": bucket_cap_mb must be > 0, got ", s.bucket_cap_mb);
  TORCH_CHECK(s.pipeline_size >= 1, kWho, ": pipeline_size must be >= 1, got ", s.pipeline_size);
  TORCH_CHECK(std::isfinite(s.message_cap_mb) && s.message_cap_mb >= 0, kWho,
              ": message_cap_mb must be >= 0 (0: no cap), got ", s.message_cap_mb);
  TORCH_CHECK(s.dtype == at::kFloat, kWho, ": dtype (of the optimizer state) must be Float, got ",
              s.dtype);
  m.grad_dtype = s.grad_sync_dtype.value_or(s.dtype);
  m.param_dtype = s.param_sync_dtype.value_or(s.dtype);
  TORCH_CHECK(is_float_type(m.grad_dtype), kWho,
              ": grad_sync_dtype must be Float, Half or BFloat16, got ", m.grad_dtype);
  TORCH_CHECK(is_float_type(m.param_dtype), kWho,
              ": param_sync_dtype must be Float, Half or BFloat16, got ", m.param_dtype);
  m.algorithm = s.reduce_scatter;
  if (m.algorithm == ReduceScatter::kAuto) {
    m.algorithm =
        group_.backend() == Backend::kGloo ? ReduceScatter::kAllToAll : ReduceScatter::kNative;
  }

  // Parameters in reverse registration order (the order backward produces their gradients).
  std::vector<std::pair<at::Tensor, size_t>> order;
  for (size_t gi = 0; gi < param_groups_.size(); ++gi) {
    for (const auto& p : param_groups_[gi].params()) {
      if (p.requires_grad()) order.emplace_back(p, gi);
    }
  }
  std::reverse(order.begin(), order.end());
  TORCH_CHECK(!order.empty(), kWho, ": no parameter requires a gradient");
  const c10::Device device = order.front().first.device();
  for (size_t i = 0; i < order.size(); ++i) {
    const auto& p = order[i].first;
    TORCH_CHECK(p.layout() == at::kStrided && p.is_contiguous(), kWho, ": parameter ", i, " (",
                describe(p), ") must be dense and contiguous");
    TORCH_CHECK(is_float_type(p.scalar_type()), kWho, ": parameter ", i, " is ", p.scalar_type(),
                "; expected Float, Half or BFloat16");
    TORCH_CHECK(p.device() == device, kWho, ": parameters on ", device, " and ", p.device(),
                "; all must be on one device");
    TORCH_CHECK(!s.store_param_remainders || p.scalar_type() != at::kHalf, kWho,
                ": store_param_remainders keeps bf16 parameters' low halves; parameter ", i,
                " is Half (use BFloat16 parameters, or store_param_remainders(false))");
    TORCH_CHECK(!s.store_param_remainders || p.device().is_cpu(), kWho,
                ": store_param_remainders runs on CPU parameters only for now; parameter ", i,
                " is on ", p.device());
    TORCH_CHECK(p.scalar_type() != at::kFloat || m.param_dtype == at::kFloat, kWho,
                ": param_sync_dtype ", m.param_dtype,
                " would round the fp32 parameters every step (they are their own master); use "
                "Float, or keep the model in half precision");
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK(!order[j].first.is_same(p), kWho, ": a parameter appears twice");
    }
    TORCH_CHECK(torch::autograd::impl::post_acc_grad_hooks(p) == nullptr, kWho, ": parameter ", i,
                " already has a post-accumulate-grad hook (another sharded optimizer?)");
    Impl::Param info;
    info.tensor = p;
    info.group = order[i].second;
    info.numel = p.numel();
    m.params.push_back(std::move(info));
  }
  TORCH_CHECK(
      !s.store_param_remainders ||
          std::any_of(m.params.begin(), m.params.end(),
                      [](const Impl::Param& p) { return p.tensor.scalar_type() == at::kBFloat16; }),
      kWho,
      ": store_param_remainders keeps bf16 parameters' low halves, and no parameter is "
      "BFloat16 (Float parameters are their own masters: use store_param_remainders(false))");

  // Every rank must lay out the same parameters: compared before any sized collective.
  std::ostringstream sig;
  sig << m.params.size() << " parameters;";
  for (const auto& p : m.params) sig << ' ' << describe(p.tensor);
  sig << "; bucket_cap_mb " << s.bucket_cap_mb << ", grad_sync_dtype " << m.grad_dtype
      << ", param_sync_dtype " << m.param_dtype << ", store_param_remainders "
      << s.store_param_remainders << ", store_params " << s.store_params << ", message_cap_mb "
      << s.message_cap_mb << ", reduce-scatter "
      << (m.algorithm == ReduceScatter::kNative ? "native" : "all-to-all");
  const auto sigs = group_.all_gather_string(sig.str());
  for (size_t r = 1; r < sigs.size(); ++r) {
    TORCH_CHECK(sigs[r] == sigs[0], kWho, ": rank ", m.rank, " of ", m.world, ": rank ", r,
                " has a different layout than rank 0 (rank 0: ", sigs[0], "; rank ", r, ": ",
                sigs[r], "); every rank must construct it with the same parameters and settings");
  }

  m.order.resize(m.params.size());
  for (size_t i = 0; i < m.order.size(); ++i) m.order[i] = static_cast<int64_t>(i);
  m.steps.assign(param_groups_.size(), 0);
  // Start from rank 0's parameters (as DDP does), then take the masters from them.
  {
    const torch::NoGradGuard no_grad;
    for (auto& p : m.params) group_.broadcast_(p.tensor, 0);
  }
  m.build_layout(s.bucket_cap_mb);
  if (m.master.defined()) {
    for (const auto& sf : m.local) {
      m.master.narrow(0, sf.local_offset, sf.length).copy_(m.piece(sf));
    }
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        m.params[i].tensor, std::make_unique<GradHook>(impl_.get(), static_cast<int64_t>(i)));
  }
}

DistributedFusedOptimizer::~DistributedFusedOptimizer() {
  if (!impl_) return;
  for (auto& p : impl_->params) {
    auto& hook = torch::autograd::impl::post_acc_grad_hooks(p.tensor);
    if (hook != nullptr && dynamic_cast<GradHook*>(hook.get()) != nullptr) hook.reset();
  }
  // Collectives still in flight (a step that never came) must end before their buffers go.
  for (const int64_t bi : impl_->in_flight) {
    try {
      for (const auto& w : impl_->buckets[bi].works) w->wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the error was or will be reported elsewhere
    }
  }
}

torch::Tensor DistributedFusedOptimizer::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    const torch::AutoGradMode grad(true);
    loss = closure();
  }
  scaled_step(at::Tensor());
  return loss;
}

at::Tensor DistributedFusedOptimizer::scaled_step(const at::Tensor& inv_scale) {
  auto& m = *impl_;
  check_hyperparameters();
  if (inv_scale.defined()) {
    TORCH_CHECK(inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat, impl_->name,
                ": inv_scale must be a one-element Float tensor, got ", describe(inv_scale));
  }
  m.sync_all();
  at::Tensor found;
  bool skip = false;
  if (inv_scale.defined() || m.unscaled) {
    found = m.found_inf_agreed();
    skip = found.item<float>() != 0.0f;
  } else {
    found = at::zeros({1}, m.grad_shard.options().dtype(at::kFloat));
  }
  if (!skip) {
    {
      const torch::NoGradGuard no_grad;
      m.merge_masters();
      try {
        update(inv_scale.defined() ? inv_scale.to(m.grad_shard.device()) : at::Tensor());
      } catch (...) {
        if (m.transient_masters) m.master = at::Tensor();  // the merged copy goes
        throw;
      }
      m.split_masters();
      m.all_gather_params();
    }
  }
  m.reset_grads();
  m.follow_arrival_order();
  return found;
}

at::Tensor DistributedFusedOptimizer::unscale_grads(const at::Tensor& inv_scale) {
  auto& m = *impl_;
  TORCH_CHECK(inv_scale.defined() && inv_scale.numel() == 1, impl_->name,
              ": unscale_grads needs a one-element inv_scale");
  m.sync_all();
  m.grad_shard.mul_(inv_scale.to(m.grad_shard.device()));
  m.unscaled = true;
  return m.found_inf_agreed();
}

void DistributedFusedOptimizer::zero_grad() {
  auto& m = *impl_;
  while (!m.in_flight.empty()) m.finish(m.in_flight.front());
  m.reset_grads();
  for (auto& p : m.params) p.tensor.mutable_grad() = at::Tensor();
}

double DistributedFusedOptimizer::grad_norm() {
  auto& m = *impl_;
  m.sync_all();
  at::Tensor sq = m.grad_shard.to(at::kFloat).pow(2).sum().to(at::kDouble).reshape({1});
  m.group.all_reduce_(sq);
  return std::sqrt(sq.item<double>());
}

double DistributedFusedOptimizer::clip_grad_norm(double max_norm) {
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0, impl_->name,
              ": clip_grad_norm: max_norm must be finite and > 0, got ", max_norm);
  const double norm = grad_norm();
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) impl_->grad_shard.mul_(coef);
  return norm;
}

DistributedFusedOptimizer::NoSync::NoSync(DistributedFusedOptimizer& opt)
    : opt_(opt), was_(opt.impl_->sync_enabled) {
  opt_.impl_->sync_enabled = false;
}

DistributedFusedOptimizer::NoSync::~NoSync() {
  opt_.impl_->sync_enabled = was_;
  // The accumulated gradients stay in their buckets; the next backward counts arrivals afresh.
  for (auto& b : opt_.impl_->buckets) {
    if (b.state == Impl::BucketState::kFilling || b.state == Impl::BucketState::kEmpty)
      b.arrived = 0;
  }
  for (auto& p : opt_.impl_->params) p.arrived = false;
}

ShardedMemory DistributedFusedOptimizer::memory() const {
  const auto& m = *impl_;
  ShardedMemory out;
  for (const auto& p : m.params) out.params += p.numel;
  out.shard_elements = m.shard_elements;
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  out.state_bytes = bytes(m.exp_avg) + bytes(m.exp_avg_sq) + bytes(m.master) + bytes(m.remainders);
  out.grad_shard_bytes = bytes(m.grad_shard);
  out.grad_buffer_bytes = bytes(m.contiguous);
  for (const auto& t : m.spare) out.cached_buffer_bytes += bytes(t);
  for (const auto& b : m.buckets) {
    // With contiguous_grad_buffer a bucket's `full` is a view of it, counted above.
    out.grad_buffer_bytes +=
        (m.contiguous.defined() ? 0 : bytes(b.full)) + bytes(b.sent) + bytes(b.received);
  }
  return out;
}

int64_t DistributedFusedOptimizer::step_count(size_t group) const {
  TORCH_CHECK(group < impl_->steps.size(), impl_->name, ": no group ", group);
  return impl_->steps[group];
}

std::vector<at::Tensor> DistributedFusedOptimizer::layout() const {
  std::vector<at::Tensor> out;
  for (const int64_t i : impl_->order) out.push_back(impl_->params[i].tensor);
  return out;
}

void DistributedFusedOptimizer::init_params_bucket(const std::vector<at::Tensor>& params) {
  auto& m = *impl_;
  std::vector<char> taken(m.params.size(), 0);
  for (const auto& g : m.fixed) {
    for (const int64_t i : g) taken[i] = 1;
  }
  std::vector<int64_t> group;
  std::string error;
  for (size_t k = 0; k < params.size(); ++k) {
    const auto it = std::find_if(m.params.begin(), m.params.end(),
                                 [&](const Impl::Param& p) { return p.tensor.is_same(params[k]); });
    if (it == m.params.end()) {
      error = m.where() + ": init_params_bucket: tensor " + std::to_string(k) + " (" +
              describe(params[k]) + ") is not one of this optimizer's parameters";
      break;
    }
    const auto i = static_cast<int64_t>(it - m.params.begin());
    if (taken[i] == 0) group.push_back(i);  // already in a group (or twice here): ignored
    taken[i] = 1;
  }
  if (error.empty() && std::any_of(m.buckets.begin(), m.buckets.end(), [](const auto& b) {
        return b.state != Impl::BucketState::kEmpty;
      })) {
    error = m.where() +
            ": init_params_bucket with gradients pending: call it before backward, or after "
            "step() or zero_grad()";
  }
  m.agree(error, "init_params_bucket");
  std::string mine;
  for (const int64_t i : group) mine += std::to_string(i) + " ";
  const auto all = m.group.all_gather_string(mine);
  for (size_t r = 1; r < all.size(); ++r) {
    TORCH_CHECK(all[r] == all[0], m.where(), ": init_params_bucket: rank ", r,
                " gave other parameters than rank 0 (layout indices '", all[r], "' against '",
                all[0], "'); every rank must give the same");
  }
  if (group.empty()) return;
  m.fixed.push_back(group);
  std::vector<int64_t> next;
  for (const auto& g : m.fixed) next.insert(next.end(), g.begin(), g.end());
  for (const int64_t i : m.order) {
    if (taken[i] == 0) next.push_back(i);
  }
  m.relayout(std::move(next));
}

ReduceScatter DistributedFusedOptimizer::reduce_scatter_algorithm() const {
  return impl_->algorithm;
}

// ---------------------------------------------------------------------------------------------
// Checkpoints
// ---------------------------------------------------------------------------------------------

namespace {

std::string shard_path(const std::string& dir, int64_t rank, int64_t world) {
  return dir + "/shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".pt";
}

c10::impl::GenericList int_list(const std::vector<int64_t>& v) {
  c10::impl::GenericList l(c10::AnyType::get());
  for (const int64_t x : v) l.push_back(x);
  return l;
}

c10::IValue entry(const StateDict& d, const char* key, const std::string& what) {
  TORCH_CHECK(d.contains(key), what, ": no '", key, "' entry");
  return d.at(key);
}

int64_t int_entry(const StateDict& d, const char* key, const std::string& what) {
  const auto v = entry(d, key, what);
  TORCH_CHECK(v.isInt(), what, ": '", key, "' must be an int, got ", v.tagKind());
  return v.toInt();
}

std::vector<int64_t> int_list_entry(const StateDict& d, const char* key, const std::string& what) {
  const auto v = entry(d, key, what);
  TORCH_CHECK(v.isList(), what, ": '", key, "' must be a list, got ", v.tagKind());
  std::vector<int64_t> out;
  for (const auto& x : v.toList()) {
    const c10::IValue item = x;
    TORCH_CHECK(item.isInt(), what, ": '", key, "' must hold ints, got ", item.tagKind());
    out.push_back(item.toInt());
  }
  return out;
}

StateDict dict_of(const c10::IValue& v, const std::string& what) {
  TORCH_CHECK(v.isGenericDict(), what, ": expected a dict, got ", v.tagKind());
  return v.toGenericDict();
}

}  // namespace

void DistributedFusedOptimizer::save_sharded(const std::string& dir) const {
  const auto& m = *impl_;
  // One id per save, rank 0's: the manifest names it and every shard carries it, so shards of
  // an older save (another world size, a save that died halfway) are never mixed in.
  const std::string mine =
      std::to_string(std::random_device{}()) + "-" +
      std::to_string(std::chrono::steady_clock::now().time_since_epoch().count());
  const std::string id = m.group.all_gather_string(mine).front();
  std::vector<int64_t> numels;
  for (const auto& p : m.params) numels.push_back(p.numel);
  std::string error;
  try {
    StateDict d = make_state_dict();
    d.insert("apex_kind", "distributed_fused_adam_shard");
    d.insert("format", kShardFormat);
    d.insert("id", id);
    d.insert("rank", m.rank);
    d.insert("world", m.world);
    d.insert("numels", int_list(numels));
    std::vector<int64_t> rows;
    std::vector<at::Tensor> idx;
    for (const auto& sf : m.local) {
      rows.insert(rows.end(), {sf.param, sf.param_offset, sf.length});
      idx.push_back(at::arange(sf.local_offset, sf.local_offset + sf.length,
                               at::TensorOptions().dtype(at::kLong)));
    }
    d.insert("fragments", int_list(rows));
    const at::Tensor take = idx.empty() ? at::empty({0}, at::kLong) : at::cat(idx);
    d.insert("param", m.local_param_values().cpu().index_select(0, take));
    d.insert("exp_avg", m.exp_avg.cpu().index_select(0, take));
    d.insert("exp_avg_sq", m.exp_avg_sq.cpu().index_select(0, take));
    save_pickle(d, shard_path(dir, m.rank, m.world));
  } catch (const std::exception& e) {
    error = detail::message_of(e);
  }
  m.agree(error, "save_sharded");
  // Every shard is on disk: the manifest makes the folder a checkpoint.
  if (m.rank == 0) {
    try {
      StateDict d = make_state_dict();
      d.insert("apex_kind", "distributed_fused_adam_manifest");
      d.insert("format", kShardFormat);
      d.insert("id", id);
      d.insert("world", m.world);
      d.insert("numels", int_list(numels));
      d.insert("steps", int_list(m.steps));
      d.insert("optimizer", m.name);
      save_pickle(d, dir + "/manifest.pt");
    } catch (const std::exception& e) {
      error = detail::message_of(e);
    }
  }
  m.agree(error, "save_sharded (manifest)");
}

void DistributedFusedOptimizer::load_sharded(const std::string& dir) {
  auto& m = *impl_;
  Impl::Full full;
  std::vector<int64_t> steps;
  std::string error;
  try {
    const std::string mpath = dir + "/manifest.pt";
    const std::string mwhat = m.where() + ": '" + mpath + "'";
    const StateDict man = dict_of(load_pickle(mpath), mwhat);
    TORCH_CHECK(man.contains("apex_kind") && man.at("apex_kind").isString() &&
                    man.at("apex_kind").toStringRef() == "distributed_fused_adam_manifest",
                mwhat, ": not a sharded optimizer's manifest");
    TORCH_CHECK(int_entry(man, "format", mwhat) == kShardFormat, mwhat, ": format ",
                int_entry(man, "format", mwhat), ", expected ", kShardFormat);
    const auto kind = entry(man, "optimizer", mwhat);
    TORCH_CHECK(kind.isString() && kind.toStringRef() == m.name, mwhat, ": written by ",
                kind.isString() ? kind.toStringRef() : std::string("?"), ", this is ", m.name);
    const auto idv = entry(man, "id", mwhat);
    TORCH_CHECK(idv.isString(), mwhat, ": 'id' must be a string");
    const std::string id = idv.toStringRef();
    const int64_t world = int_entry(man, "world", mwhat);
    TORCH_CHECK(world >= 1 && world <= 65536, mwhat, ": world ", world, " is out of range");
    const auto numels = int_list_entry(man, "numels", mwhat);
    TORCH_CHECK(numels.size() == m.params.size(), mwhat, ": it holds ", numels.size(),
                " parameters, the optimizer has ", m.params.size());
    for (size_t i = 0; i < numels.size(); ++i) {
      TORCH_CHECK(numels[i] == m.params[i].numel, mwhat, ": parameter ", i, " has ", numels[i],
                  " elements there, ", m.params[i].numel, " here (", describe(m.params[i].tensor),
                  "): a checkpoint of another model");
    }
    steps = int_list_entry(man, "steps", mwhat);
    TORCH_CHECK(steps.size() == m.steps.size(), mwhat, ": it holds ", steps.size(),
                " parameter groups, the optimizer has ", m.steps.size());
    for (const int64_t s : steps) TORCH_CHECK(s >= 0, mwhat, ": negative step ", s);

    std::vector<at::Tensor> covered;
    for (const auto& p : m.params) {
      full.param.push_back(at::zeros({p.numel}, at::kFloat));
      full.exp_avg.push_back(at::zeros({p.numel}, at::kFloat));
      full.exp_avg_sq.push_back(at::zeros({p.numel}, at::kFloat));
      covered.push_back(at::zeros({p.numel}, at::kBool));
    }
    for (int64_t r = 0; r < world; ++r) {
      const std::string path = shard_path(dir, r, world);
      const std::string what = m.where() + ": '" + path + "'";
      const StateDict d = dict_of(load_pickle(path), what);
      TORCH_CHECK(d.contains("apex_kind") && d.at("apex_kind").isString() &&
                      d.at("apex_kind").toStringRef() == "distributed_fused_adam_shard",
                  what, ": not a sharded optimizer's shard");
      const auto sid = entry(d, "id", what);
      TORCH_CHECK(sid.isString() && sid.toStringRef() == id, what,
                  ": it belongs to another save than the manifest (a save that did not finish, "
                  "or a file copied from elsewhere)");
      TORCH_CHECK(int_entry(d, "rank", what) == r && int_entry(d, "world", what) == world, what,
                  ": it says rank ", int_entry(d, "rank", what), " of ",
                  int_entry(d, "world", what), ", expected rank ", r, " of ", world);
      const auto rows = int_list_entry(d, "fragments", what);
      TORCH_CHECK(rows.size() % 3 == 0, what, ": malformed fragment list");
      int64_t total = 0;
      for (size_t k = 0; k < rows.size(); k += 3) {
        const int64_t pi = rows[k], off = rows[k + 1], len = rows[k + 2];
        TORCH_CHECK(pi >= 0 && pi < static_cast<int64_t>(m.params.size()) && off >= 0 && len > 0 &&
                        off + len <= m.params[pi].numel,
                    what, ": fragment (parameter ", pi, ", offset ", off, ", length ", len,
                    ") is outside the parameters");
        total += len;
      }
      std::vector<at::Tensor> data;
      for (const char* key : {"param", "exp_avg", "exp_avg_sq"}) {
        const auto v = entry(d, key, what);
        TORCH_CHECK(v.isTensor(), what, ": '", key, "' must be a tensor");
        const at::Tensor t = v.toTensor();
        TORCH_CHECK(t.dim() == 1 && t.numel() == total && t.scalar_type() == at::kFloat, what,
                    ": '", key, "' is ", describe(t), ", expected Float[", total, "]");
        data.push_back(t);
      }
      int64_t at_ = 0;
      for (size_t k = 0; k < rows.size(); k += 3) {
        const int64_t pi = rows[k], off = rows[k + 1], len = rows[k + 2];
        auto c = covered[pi].narrow(0, off, len);
        TORCH_CHECK(!c.any().item<bool>(), what, ": parameter ", pi,
                    " elements overlap another shard's");
        c.fill_(true);
        full.param[pi].narrow(0, off, len).copy_(data[0].narrow(0, at_, len));
        full.exp_avg[pi].narrow(0, off, len).copy_(data[1].narrow(0, at_, len));
        full.exp_avg_sq[pi].narrow(0, off, len).copy_(data[2].narrow(0, at_, len));
        at_ += len;
      }
    }
    for (size_t i = 0; i < covered.size(); ++i) {
      TORCH_CHECK(covered[i].all().item<bool>(), m.where(), ": '", dir,
                  "': the shards do not cover parameter ", i, " (a shard file is missing)");
    }
  } catch (const std::exception& e) {
    error = detail::message_of(e);
  }
  m.agree(error, "load_sharded");
  m.install(full, steps);
}

StateDict DistributedFusedOptimizer::consolidated_state_dict() const {
  const auto& m = *impl_;
  const Impl::Full full = m.gather_full();
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < m.params.size(); ++i) index[m.params[i].tensor.unsafeGetTensorImpl()] = i;
  StateDict out = optim::detail::write_python_layout(
      *this,
      [&](const at::Tensor& p) -> std::optional<StateDict> {
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end()) return std::nullopt;
        const size_t i = it->second;
        StateDict d = make_state_dict();
        d.insert("param", full.param[i].view(p.sizes()));
        d.insert("exp_avg", full.exp_avg[i].view(p.sizes()));
        d.insert("exp_avg_sq", full.exp_avg_sq[i].view(p.sizes()));
        return d;
      },
      [&](size_t gi) {
        StateDict g = group_state(gi);
        g.insert("step", m.steps[gi]);
        return g;
      });
  out.insert("format", static_cast<int64_t>(2));
  return out;
}

StateDict DistributedFusedOptimizer::torch_layout(
    const std::function<StateDict(size_t)>& group) const {
  const auto& m = *impl_;
  const Impl::Full full = m.gather_full();
  std::map<const c10::TensorImpl*, size_t> index;
  for (size_t i = 0; i < m.params.size(); ++i) index[m.params[i].tensor.unsafeGetTensorImpl()] = i;
  return optim::detail::write_python_layout(
      *this,
      [&](const at::Tensor& p) -> std::optional<StateDict> {
        auto it = index.find(p.unsafeGetTensorImpl());
        if (it == index.end()) return std::nullopt;
        const size_t i = it->second;
        StateDict d = make_state_dict();
        d.insert("step",
                 optim::detail::step_tensor_value(static_cast<double>(m.steps[m.params[i].group])));
        d.insert("exp_avg", full.exp_avg[i].view(p.sizes()));
        d.insert("exp_avg_sq", full.exp_avg_sq[i].view(p.sizes()));
        return d;
      },
      group);
}

void DistributedFusedOptimizer::load_consolidated_state_dict(const StateDict& state) {
  auto& m = *impl_;
  const std::string who = m.where() + ": load_consolidated_state_dict";
  Impl::Full full;
  std::vector<int64_t> steps(m.steps.size(), -1);
  std::vector<double> lrs(m.steps.size());
  std::string error;
  try {
    std::map<const c10::TensorImpl*, size_t> index;
    for (size_t i = 0; i < m.params.size(); ++i) {
      index[m.params[i].tensor.unsafeGetTensorImpl()] = i;
      const at::Tensor& p = m.params[i].tensor;
      full.param.push_back(p.detach().to(at::kFloat).reshape({-1}).cpu());
      full.exp_avg.push_back(at::zeros({p.numel()}, at::kFloat));
      full.exp_avg_sq.push_back(at::zeros({p.numel()}, at::kFloat));
    }
    optim::detail::read_python_layout(
        *this, state, who.c_str(),
        [&](size_t gi, const StateDict& g) {
          lrs[gi] = optim::detail::number_at(g, "lr", who.c_str());
          if (g.contains("step")) {
            steps[gi] = static_cast<int64_t>(optim::detail::number_at(g, "step", who.c_str()));
          }
        },
        [&](const at::Tensor& p, const StateDict& d) {
          auto it = index.find(p.unsafeGetTensorImpl());
          if (it == index.end()) return;
          const size_t i = it->second;
          const at::Tensor like = p.detach().cpu();
          full.exp_avg[i] = optim::detail::tensor_at(d, "exp_avg", like, who.c_str()).reshape({-1});
          full.exp_avg_sq[i] =
              optim::detail::tensor_at(d, "exp_avg_sq", like, who.c_str()).reshape({-1});
          if (d.contains("param")) {
            full.param[i] = optim::detail::tensor_at(d, "param", like, who.c_str()).reshape({-1});
          }
          if (d.contains("step")) {
            const auto s = static_cast<int64_t>(optim::detail::number_at(d, "step", who.c_str()));
            auto& gs = steps[m.params[i].group];
            TORCH_CHECK(gs < 0 || gs == s, who, ": parameters of group ", m.params[i].group,
                        " hold different steps (", gs, " and ", s, "); ", m.name,
                        " keeps one per group");
            gs = s;
          }
        });
    for (auto& s : steps) {
      TORCH_CHECK(s != -1, who, ": no step for a parameter group");
      TORCH_CHECK(s >= 0, who, ": negative step ", s);
    }
    for (const double lr : lrs) {
      TORCH_CHECK(std::isfinite(lr) && lr >= 0, who, ": lr must be finite and >= 0, got ", lr);
    }
  } catch (const std::exception& e) {
    error = detail::message_of(e);
  }
  m.agree(error, "load_consolidated_state_dict");
  m.install(full, steps);
  for (size_t gi = 0; gi < lrs.size(); ++gi) param_groups_[gi].options().set_lr(lrs[gi]);
}

void DistributedFusedOptimizer::save(torch::serialize::OutputArchive& /*archive*/) const {
  TORCH_CHECK(false, impl_->name,
              ": torch::save of a sharded optimizer would hold one rank's shard only; use "
              "save_sharded(dir) (loads at any world size) or consolidated_state_dict()");
}

void DistributedFusedOptimizer::load(torch::serialize::InputArchive& /*archive*/) {
  TORCH_CHECK(false, impl_->name, ": use load_sharded(dir) or load_consolidated_state_dict()");
}

}  // namespace apex::parallel
