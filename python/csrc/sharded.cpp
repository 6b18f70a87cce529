// apex.contrib.optimizers' DistributedFusedAdam / DistributedFusedLAMB: the C++ sharded optimizers
// (apex::parallel::DistributedFused*) as a torch custom class (torch.classes.apex_cpp.
// ShardedOptimizer), over the c10d group torch.distributed made (passed as
// ProcessGroup.boxed()). The Python classes (python/apex/contrib/optimizers) keep apex's
// signatures, param_groups and the GradScaler contract; everything else is the C++ machinery:
// the layout, the hooks that move gradients into buckets, the collectives, the kernels and the
// checkpoints.
#include <ATen/ops/zeros.h>
#include <apex/parallel/c10d.h>
#include <apex/parallel/distributed_fused_adam.h>
#include <apex/parallel/distributed_fused_lamb.h>
#include <apex/state_dict.h>
#include <c10/util/Exception.h>
#include <torch/custom_class.h>

#include <chrono>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

namespace apex::python {
namespace {

using parallel::DistributedFusedOptimizer;
using Numbers = c10::Dict<std::string, double>;
using Names = c10::Dict<std::string, std::string>;

double number(const Numbers& d, const char* key, const char* who) {
  const auto it = d.find(key);
  TORCH_CHECK(it != d.end(), who, ": the option '", key, "' is missing");
  return it->value();
}

std::optional<at::ScalarType> dtype_of(const Names& d, const char* key, const char* who) {
  const auto it = d.find(key);
  if (it == d.end() || it->value().empty()) return std::nullopt;
  const std::string& v = it->value();
  if (v == "float32") return at::kFloat;
  if (v == "float16") return at::kHalf;
  if (v == "bfloat16") return at::kBFloat16;
  TORCH_CHECK(false, who, ": ", key,
              " must be torch.float32, torch.float16 or torch.bfloat16, got ", v);
}

parallel::ReduceScatter reduce_scatter_of(const Names& d, const char* who) {
  const auto it = d.find("reduce_scatter");
  const std::string v = it == d.end() ? "auto" : it->value();
  if (v == "auto") return parallel::ReduceScatter::kAuto;
  if (v == "native") return parallel::ReduceScatter::kNative;
  if (v == "all-to-all") return parallel::ReduceScatter::kAllToAll;
  TORCH_CHECK(false, who, ": reduce_scatter must be 'auto', 'native' or 'all-to-all', got '", v,
              "'");
}

// The sharding options (the whole optimizer's) into `o`.
template <class Options>
void set_sharding(Options& o, const Numbers& n, const Names& s, const char* who) {
  o.bucket_cap_mb(number(n, "bucket_cap_mb", who));
  o.pipeline_size(static_cast<int64_t>(number(n, "pipeline_size", who)));
  o.overlap_grad_sync(number(n, "overlap_grad_sync", who) != 0);
  o.average_grad_sync(number(n, "average_grad_sync", who) != 0);
  o.contiguous_grad_buffer(number(n, "contiguous_grad_buffer", who) != 0);
  o.store_params(number(n, "store_params", who) != 0);
  o.store_param_remainders(number(n, "store_param_remainders", who) != 0);
  o.message_cap_mb(number(n, "message_cap_mb", who));
  o.dtype(dtype_of(s, "dtype", who).value_or(at::kFloat));
  o.grad_sync_dtype(dtype_of(s, "grad_sync_dtype", who));
  o.param_sync_dtype(dtype_of(s, "param_sync_dtype", who));
  o.reduce_scatter(reduce_scatter_of(s, who));
}

// A group's hyperparameters (what a scheduler may change between steps) into `o`: those both
// algorithms have, then LAMB's own.
template <class Options>
void set_adam_style(Options& o, const Numbers& h, const char* who) {
  o.lr(number(h, "lr", who));
  o.betas(std::make_tuple(number(h, "beta1", who), number(h, "beta2", who)));
  o.eps(number(h, "eps", who));
  o.weight_decay(number(h, "weight_decay", who));
  o.bias_correction(number(h, "bias_correction", who) != 0);
  o.adam_w_mode(number(h, "adam_w_mode", who) != 0);
}

void set_hyper(parallel::DistributedFusedAdamOptions& o, const Numbers& h, const char* who) {
  set_adam_style(o, h, who);
}

void set_hyper(parallel::DistributedFusedLAMBOptions& o, const Numbers& h, const char* who) {
  set_adam_style(o, h, who);
  o.grad_averaging(number(h, "grad_averaging", who) != 0);
  o.max_grad_norm(number(h, "max_grad_norm", who));
  o.use_nvlamb(number(h, "use_nvlamb", who) != 0);
}

template <class Optimizer, class Options>
std::unique_ptr<DistributedFusedOptimizer> make(const std::vector<std::vector<at::Tensor>>& params,
                                                const std::vector<Numbers>& hyper,
                                                const Numbers& numbers, const Names& names,
                                                parallel::ProcessGroup group, const char* who) {
  TORCH_CHECK(params.size() == hyper.size(), who, ": ", params.size(), " parameter groups but ",
              hyper.size(), " option sets");
  Options defaults;
  set_sharding(defaults, numbers, names, who);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  for (size_t g = 0; g < params.size(); ++g) {
    auto o = std::make_unique<Options>(defaults);
    set_hyper(*o, hyper[g], who);
    groups.emplace_back(params[g], std::move(o));
  }
  return std::make_unique<Optimizer>(groups, defaults, std::move(group));
}

class ShardedOptimizer : public torch::CustomClassHolder {
 public:
  ShardedOptimizer(const std::string& kind, const std::vector<std::vector<at::Tensor>>& params,
                   const std::vector<Numbers>& hyper, const Numbers& numbers, const Names& names,
                   const c10::intrusive_ptr<c10d::ProcessGroup>& group, double timeout_s)
      : kind_(kind) {
    const char* who = kind == "lamb" ? "DistributedFusedLAMB" : "DistributedFusedAdam";
    TORCH_CHECK(kind == "adam" || kind == "lamb", "ShardedOptimizer: kind must be 'adam' or ",
                "'lamb', got '", kind, "'");
    TORCH_CHECK(!params.empty() && !params.front().empty(), who, ": no parameters");
    const c10::Device device = params.front().front().device();
    const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout_s * 1000.0));
    parallel::ProcessGroup pg = parallel::process_group_of(group, device, timeout);
    opt_ = kind == "adam"
               ? make<parallel::DistributedFusedAdam, parallel::DistributedFusedAdamOptions>(
                     params, hyper, numbers, names, pg, who)
               : make<parallel::DistributedFusedLAMB, parallel::DistributedFusedLAMBOptions>(
                     params, hyper, numbers, names, pg, who);
  }

  // The hyperparameters of every group, as the Python param_groups hold them now (a scheduler or
  // the user may have changed them since the last step); checked before anything changes.
  void set_hyperparameters(const std::vector<Numbers>& hyper) {
    auto& groups = opt_->param_groups();
    TORCH_CHECK(hyper.size() == groups.size(), name(), ": ", hyper.size(), " option sets for ",
                groups.size(), " parameter groups");
    for (size_t g = 0; g < groups.size(); ++g) {
      if (kind_ == "adam") {
        set_hyper(static_cast<parallel::DistributedFusedAdamOptions&>(groups[g].options()),
                  hyper[g], name());
      } else {
        set_hyper(static_cast<parallel::DistributedFusedLAMBOptions&>(groups[g].options()),
                  hyper[g], name());
      }
    }
  }

  // One step; with inv_scale, the kernel unscales and an inf/NaN anywhere skips it on every
  // rank. Returns the found-inf flag (zeros without inv_scale).
  at::Tensor step(const std::optional<at::Tensor>& inv_scale) {
    if (inv_scale.has_value()) return opt_->scaled_step(*inv_scale);
    opt_->step();
    return at::zeros({1}, at::TensorOptions().dtype(at::kFloat));
  }
  at::Tensor unscale_grads(const at::Tensor& inv_scale) { return opt_->unscale_grads(inv_scale); }
  void zero_grad() { opt_->zero_grad(); }
  double grad_norm() { return opt_->grad_norm(); }
  double clip_grad_norm(double max_norm) { return opt_->clip_grad_norm(max_norm); }
  void set_no_sync(bool on) {
    if (on && !no_sync_) no_sync_ = std::make_unique<DistributedFusedOptimizer::NoSync>(*opt_);
    if (!on) no_sync_.reset();
  }
  c10::IValue state_dict() const { return opt_->consolidated_state_dict(); }
  // Format 2 in typed pieces (a Python dict of mixed values does not convert to one IValue):
  // per parameter index its tensors, per group its numbers (lr, step) and parameter indices.
  void load_state_dict(const c10::Dict<int64_t, c10::Dict<std::string, at::Tensor>>& state,
                       const std::vector<Numbers>& groups,
                       const std::vector<std::vector<int64_t>>& params) {
    TORCH_CHECK(groups.size() == params.size(), name(), ": load_state_dict: ", groups.size(),
                " groups but ", params.size(), " parameter lists");
    c10::impl::GenericDict per_param(c10::IntType::get(), c10::AnyType::get());
    for (const auto& e : state) {
      StateDict d = make_state_dict();
      for (const auto& t : e.value()) d.insert(t.key(), t.value());
      per_param.insert(e.key(), d);
    }
    c10::impl::GenericList group_list(c10::AnyType::get());
    for (size_t g = 0; g < groups.size(); ++g) {
      StateDict d = make_state_dict();
      for (const auto& e : groups[g]) d.insert(e.key(), e.value());
      d.insert("params", c10::List<int64_t>(params[g]));
      group_list.push_back(d);
    }
    StateDict whole = make_state_dict();
    whole.insert("state", per_param);
    whole.insert("param_groups", group_list);
    opt_->load_consolidated_state_dict(whole);
  }
  void init_params_bucket(const std::vector<at::Tensor>& params) {
    opt_->init_params_bucket(params);
  }
  void save_sharded(const std::string& dir) const { opt_->save_sharded(dir); }
  void load_sharded(const std::string& dir) { opt_->load_sharded(dir); }
  int64_t step_count(int64_t group) const {
    TORCH_CHECK(group >= 0, name(), ": group must be >= 0, got ", group);
    return opt_->step_count(static_cast<size_t>(group));
  }
  c10::Dict<std::string, int64_t> memory() const {
    const parallel::ShardedMemory m = opt_->memory();
    c10::Dict<std::string, int64_t> d;
    d.insert("params", m.params);
    d.insert("shard_elements", m.shard_elements);
    d.insert("state_bytes", m.state_bytes);
    d.insert("grad_shard_bytes", m.grad_shard_bytes);
    d.insert("grad_buffer_bytes", m.grad_buffer_bytes);
    d.insert("cached_buffer_bytes", m.cached_buffer_bytes);
    return d;
  }

 private:
  const char* name() const {
    return kind_ == "lamb" ? "DistributedFusedLAMB" : "DistributedFusedAdam";
  }

  std::string kind_;
  std::unique_ptr<DistributedFusedOptimizer> opt_;
  std::unique_ptr<DistributedFusedOptimizer::NoSync> no_sync_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(apex_cpp, m) {
  m.class_<ShardedOptimizer>("ShardedOptimizer")
      .def(torch::init<std::string, std::vector<std::vector<at::Tensor>>, std::vector<Numbers>,
                       Numbers, Names, c10::intrusive_ptr<c10d::ProcessGroup>, double>())
      .def("set_hyperparameters", &ShardedOptimizer::set_hyperparameters)
      .def("step", &ShardedOptimizer::step)
      .def("unscale_grads", &ShardedOptimizer::unscale_grads)
      .def("zero_grad", &ShardedOptimizer::zero_grad)
      .def("grad_norm", &ShardedOptimizer::grad_norm)
      .def("clip_grad_norm", &ShardedOptimizer::clip_grad_norm)
      .def("set_no_sync", &ShardedOptimizer::set_no_sync)
      .def("state_dict", &ShardedOptimizer::state_dict)
      .def("load_state_dict", &ShardedOptimizer::load_state_dict)
      .def("init_params_bucket", &ShardedOptimizer::init_params_bucket)
      .def("save_sharded", &ShardedOptimizer::save_sharded)
      .def("load_sharded", &ShardedOptimizer::load_sharded)
      .def("step_count", &ShardedOptimizer::step_count)
      .def("memory", &ShardedOptimizer::memory);
}

}  // namespace apex::python
