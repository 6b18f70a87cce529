// ZeRO-2 Adam on c10d. The layout (buckets, shards, fragments) is computed once from the
// parameters; gradients arrive through post-accumulate-grad hooks into full-size bucket buffers,
// which are reduce-scattered into this rank's flat gradient shard; the fused Adam kernel updates
// the shard; the parameters are all-gathered back, bucket by bucket.
#include "apex/parallel/distributed_fused_adam.h"

#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <apex/optim/multi_tensor.h>
#include <apex/parallel/c10d.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/serialize/archive.h>
#include <torch/utils.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <map>
#include <random>
#include <sstream>

#include "bridge/bridge.h"
#include "kernels/multi_tensor.h"
#include "optim/python_state.h"
#include "parallel/errors.h"

namespace apex::parallel {
namespace {

constexpr const char* kWho = "DistributedFusedAdam";
// A shard starts on 128 bytes of fp32: bucket sizes are multiples of world * kAlign elements.
constexpr int64_t kAlign = 32;
constexpr int64_t kShardFormat = 1;

const DistributedFusedAdamOptions& options_of(const torch::optim::OptimizerParamGroup& g) {
  return static_cast<const DistributedFusedAdamOptions&>(g.options());
}

void check_hyper(const DistributedFusedAdamOptions& o) {
  auto non_negative = [](const char* name, double v) {
    TORCH_CHECK(std::isfinite(v) && v >= 0, kWho, ": ", name, " must be finite and >= 0, got ", v);
  };
  non_negative("lr", o.lr());
  non_negative("eps", o.eps());
  non_negative("weight_decay", o.weight_decay());
  const double b1 = std::get<0>(o.betas());
  const double b2 = std::get<1>(o.betas());
  TORCH_CHECK(b1 >= 0 && b1 < 1, kWho, ": betas[0] must be in [0, 1), got ", b1);
  TORCH_CHECK(b2 >= 0 && b2 < 1, kWho, ": betas[1] must be in [0, 1), got ", b2);
}

bool is_float_type(at::ScalarType t) {
  return t == at::kFloat || t == at::kHalf || t == at::kBFloat16;
}

int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

std::string describe(const at::Tensor& p) {
  std::ostringstream s;
  s << p.scalar_type() << p.sizes();
  return s.str();
}

}  // namespace

DistributedFusedAdamOptions::DistributedFusedAdamOptions(double lr) : lr_(lr) {}

// ---------------------------------------------------------------------------------------------
// The layout and the state of one rank.
// ---------------------------------------------------------------------------------------------

struct DistributedFusedAdam::Impl {
  // A piece of a parameter inside one bucket.
  struct Fragment {
    int64_t param = 0;
    int64_t param_offset = 0;
    int64_t bucket = 0;
    int64_t bucket_offset = 0;
    int64_t length = 0;
  };
  // A piece of a parameter inside one rank's shard of a bucket.
  struct ShardFragment {
    int64_t param = 0;
    int64_t param_offset = 0;
    int64_t bucket = 0;
    int64_t shard_offset = 0;  // within the bucket's shard
    int64_t local_offset = 0;  // within the rank's flat buffers
    int64_t length = 0;
  };
  enum class BucketState { kEmpty, kFilling, kInFlight, kReduced };
  struct Bucket {
    int64_t size = 0;   // elements, a multiple of world * kAlign
    int64_t shard = 0;  // size / world
    int64_t local_offset = 0;
    std::vector<Fragment> fragments;
    std::vector<int64_t> params;  // distinct parameters with a fragment here
    int64_t arrived = 0;
    BucketState state = BucketState::kEmpty;
    at::Tensor full;      // gradients of the whole bucket, while they live
    at::Tensor received;  // all-to-all output
    c10::intrusive_ptr<c10d::Work> work;
  };
  struct Param {
    at::Tensor tensor;
    size_t group = 0;
    int64_t numel = 0;
    std::vector<int64_t> buckets;  // distinct, in order
    std::vector<int64_t> fragments;
    bool arrived = false;
  };

  DistributedFusedAdam* owner = nullptr;
  ProcessGroup group;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int64_t rank = 0;
  int64_t world = 1;
  DistributedFusedAdamOptions settings;
  at::ScalarType grad_dtype = at::kFloat;
  at::ScalarType param_dtype = at::kFloat;
  ReduceScatter algorithm = ReduceScatter::kAllToAll;

  std::vector<Param> params;
  std::vector<Fragment> fragments;
  std::vector<Bucket> buckets;
  std::vector<ShardFragment> local;  // this rank's
  int64_t shard_elements = 0;        // L: equal on every rank

  at::Tensor exp_avg, exp_avg_sq, master, grad_shard;  // [L]
  at::Tensor contiguous;                               // contiguous_grad_buffer
  std::vector<int64_t> steps;                          // per group

  size_t next_launch = 0;
  std::vector<int64_t> in_flight;  // bucket indices, oldest first
  bool sync_enabled = true;
  bool synced = false;    // every bucket reduced since the last step/zero_grad
  bool unscaled = false;  // unscale_grads ran since the last step

  std::string where() const {
    std::ostringstream s;
    s << kWho << ": rank " << rank << " of " << world;
    return s.str();
  }

  void build_layout(double bucket_cap_mb) {
    const int64_t unit = world * kAlign;
    const double cap_elems =
        bucket_cap_mb * 1024.0 * 1024.0 / static_cast<double>(c10::elementSize(grad_dtype));
    const int64_t cap = std::max<int64_t>(unit, round_up(static_cast<int64_t>(cap_elems), unit));
    int64_t total = 0;
    for (const auto& p : params) total += p.numel;
    // Cut the flat sequence of parameters (in layout order) into buckets of `cap`.
    int64_t start = 0;
    size_t pi = 0;
    int64_t poff = 0;
    while (start < total) {
      Bucket b;
      const int64_t used = std::min(cap, total - start);
      b.size = round_up(used, unit);
      b.shard = b.size / world;
      b.local_offset = shard_elements;
      shard_elements += b.shard;
      const auto bi = static_cast<int64_t>(buckets.size());
      int64_t filled = 0;
      while (filled < used) {
        auto& p = params[pi];
        const int64_t len = std::min(p.numel - poff, used - filled);
        Fragment f{static_cast<int64_t>(pi), poff, bi, filled, len};
        p.fragments.push_back(static_cast<int64_t>(fragments.size()));
        if (p.buckets.empty() || p.buckets.back() != bi) {
          p.buckets.push_back(bi);
          b.params.push_back(static_cast<int64_t>(pi));
        }
        fragments.push_back(f);
        b.fragments.push_back(f);
        filled += len;
        poff += len;
        if (poff == p.numel) {
          ++pi;
          poff = 0;
        }
      }
      buckets.push_back(std::move(b));
      start += used;
    }
    local = shard_fragments(rank);
  }

  // The fragments of rank r's shards, in local order.
  std::vector<ShardFragment> shard_fragments(int64_t r) const {
    std::vector<ShardFragment> out;
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      const auto& b = buckets[bi];
      const int64_t lo = r * b.shard;
      const int64_t hi = lo + b.shard;
      for (const auto& f : b.fragments) {
        const int64_t s = std::max(lo, f.bucket_offset);
        const int64_t e = std::min(hi, f.bucket_offset + f.length);
        if (s >= e) continue;
        ShardFragment sf;
        sf.param = f.param;
        sf.param_offset = f.param_offset + (s - f.bucket_offset);
        sf.bucket = static_cast<int64_t>(bi);
        sf.shard_offset = s - lo;
        sf.local_offset = b.local_offset + (s - lo);
        sf.length = e - s;
        out.push_back(sf);
      }
    }
    return out;
  }

  at::Tensor flat(int64_t param) const { return params[param].tensor.view({-1}); }

  bool any_half() const {
    return std::any_of(params.begin(), params.end(),
                       [](const Param& p) { return p.tensor.scalar_type() != at::kFloat; });
  }

  // ---- gradients ----

  at::Tensor& full_buffer(Bucket& b, int64_t bi) {
    if (!b.full.defined()) {
      if (settings.contiguous_grad_buffer()) {
        int64_t off = 0;
        for (int64_t i = 0; i < bi; ++i) off += buckets[i].size;
        b.full = contiguous.narrow(0, off, b.size);
        b.full.zero_();
      } else {
        b.full = at::zeros({b.size}, params.front().tensor.options().dtype(grad_dtype));
      }
    }
    return b.full;
  }

  void on_grad(int64_t index, const at::Tensor& param) {
    at::Tensor& grad = param.mutable_grad();
    if (!grad.defined()) return;
    auto& p = params[index];
    TORCH_CHECK(!grad.is_sparse(), where(), ": parameter ", index, " got a sparse gradient");
    TORCH_CHECK(grad.sizes() == param.sizes(), where(), ": parameter ", index,
                "'s gradient has shape ", grad.sizes(), ", expected ", param.sizes());
    for (const int64_t fi : p.fragments) {
      const auto& f = fragments[fi];
      const auto& b = buckets[f.bucket];
      TORCH_CHECK(b.state == BucketState::kEmpty || b.state == BucketState::kFilling, where(),
                  ": a gradient of parameter ", index, " (", describe(param),
                  ") arrived after its bucket ", f.bucket,
                  " was synchronized: call step() or zero_grad() between backward passes, "
                  "or run the earlier micro-batches under no_sync()");
    }
    const torch::NoGradGuard no_grad;
    const at::Tensor g = grad.reshape({-1});
    for (const int64_t fi : p.fragments) {
      const auto& f = fragments[fi];
      auto& b = buckets[f.bucket];
      full_buffer(b, f.bucket)
          .narrow(0, f.bucket_offset, f.length)
          .add_(g.narrow(0, f.param_offset, f.length));
      b.state = BucketState::kFilling;
    }
    grad = at::Tensor();  // the bucket holds it now: p.grad's memory is released
    synced = false;
    if (!p.arrived) {
      p.arrived = true;
      for (const int64_t bi : p.buckets) ++buckets[bi].arrived;
    }
    if (sync_enabled && settings.overlap_grad_sync()) launch_ready();
  }

  void launch_ready() {
    while (next_launch < buckets.size() &&
           buckets[next_launch].arrived ==
               static_cast<int64_t>(buckets[next_launch].params.size())) {
      launch(next_launch++);
    }
  }

  void launch(size_t bi) {
    auto& b = buckets[bi];
    while (static_cast<int64_t>(in_flight.size()) >=
           std::max<int64_t>(1, settings.pipeline_size())) {
      finish(in_flight.front());
    }
    at::Tensor& full = full_buffer(b, static_cast<int64_t>(bi));
    if (settings.average_grad_sync() && world > 1) full.div_(static_cast<double>(world));
    try {
      if (algorithm == ReduceScatter::kNative) {
        at::Tensor out = grad_shard.narrow(0, b.local_offset, b.shard);
        b.work = pg->reduce_scatter_single(out, full);
      } else {
        b.received = at::empty_like(full);
        std::vector<int64_t> even;
        b.work = pg->all_to_all_single(b.received, full, even, even);
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, where(), ": the reduce-scatter of bucket ", bi,
                  " failed: ", detail::message_of(e));
    }
    b.state = BucketState::kInFlight;
    in_flight.push_back(static_cast<int64_t>(bi));
  }

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t bi) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, where(), ": the ", what, " of bucket ", bi, " failed (timeout ",
                  group.timeout().count(), " ms): ", detail::message_of(e));
    }
  }

  void finish(int64_t bi) {
    auto& b = buckets[bi];
    in_flight.erase(std::find(in_flight.begin(), in_flight.end(), bi));
    auto work = std::move(b.work);
    wait(work, "reduce-scatter", bi);
    if (algorithm == ReduceScatter::kAllToAll) {
      at::Tensor out = grad_shard.narrow(0, b.local_offset, b.shard);
      if (world == 1) {
        out.copy_(b.received);
      } else {
        // Rank j's contribution is chunk j: summed in rank order, in fp32.
        at::Tensor acc = b.received.narrow(0, 0, b.shard).to(at::kFloat, false, true);
        for (int64_t j = 1; j < world; ++j) acc.add_(b.received.narrow(0, j * b.shard, b.shard));
        out.copy_(acc);
      }
      b.received = at::Tensor();
    }
    if (!settings.contiguous_grad_buffer()) b.full = at::Tensor();
    b.state = BucketState::kReduced;
  }

  // Every bucket reduced (the ones whose gradients never all arrived too: missing gradients are
  // zeros), in bucket order on every rank.
  void sync_all() {
    if (synced) return;
    while (next_launch < buckets.size()) launch(next_launch++);
    while (!in_flight.empty()) finish(in_flight.front());
    synced = true;
  }

  void reset_grads() {
    for (auto& b : buckets) {
      TORCH_CHECK(b.state != BucketState::kInFlight || !b.work, where(),
                  ": internal: a reduce-scatter is still in flight");
      b.full = at::Tensor();
      b.received = at::Tensor();
      b.arrived = 0;
      b.state = BucketState::kEmpty;
    }
    for (auto& p : params) p.arrived = false;
    next_launch = 0;
    synced = false;
    unscaled = false;
  }

  at::Tensor found_inf_agreed() {
    at::Tensor found = at::zeros({1}, grad_shard.options().dtype(at::kFloat));
    if (grad_shard.numel() > 0) optim::multi_tensor_check_finite({grad_shard}, found);
    group.all_reduce_max_(found);
    return found;
  }

  // ---- the update ----

  void adam(const at::Tensor& inv_scale) {
    const bool need_master = master.defined();
    for (size_t gi = 0; gi < owner->param_groups().size(); ++gi) {
      const auto& o = options_of(owner->param_groups()[gi]);
      // Rows of one (parameter dtype): one kernel call each.
      std::map<at::ScalarType, bridge::ListBuilder> rows;
      for (const auto& sf : local) {
        const auto& p = params[sf.param];
        if (p.group != gi) continue;
        const at::ScalarType dt = p.tensor.scalar_type();
        auto it = rows.try_emplace(dt, 5).first;
        const bool half = dt != at::kFloat;
        it->second.add(
            {flat(sf.param).narrow(0, sf.param_offset, sf.length),
             grad_shard.narrow(0, sf.local_offset, sf.length),
             exp_avg.narrow(0, sf.local_offset, sf.length),
             exp_avg_sq.narrow(0, sf.local_offset, sf.length),
             half && need_master ? master.narrow(0, sf.local_offset, sf.length) : at::Tensor()});
      }
      ++steps[gi];
      if (rows.empty()) continue;
      kernels::AdamArgs args;
      args.lr = static_cast<float>(o.lr());
      args.beta1 = static_cast<float>(std::get<0>(o.betas()));
      args.beta2 = static_cast<float>(std::get<1>(o.betas()));
      args.eps = static_cast<float>(o.eps());
      args.weight_decay = static_cast<float>(o.weight_decay());
      args.adam_w_mode = o.adam_w_mode();
      args.bias_correction = o.bias_correction();
      args.step = steps[gi];
      const c10::Device device = grad_shard.device();
      args.amp.inv_scale = bridge::scalar_ptr(inv_scale, device, kWho, "inv_scale");
      for (auto& [dt, lists] : rows) {
        const auto view = lists.view();
        bridge::launch(device, kernels::cpu::adam, kernels::cuda::adam, view, args);
      }
    }
  }

  // Every rank's shard of the parameters to every rank, bucket by bucket (pipelined).
  void all_gather_params() {
    if (buckets.empty()) return;
    const auto opts = params.front().tensor.options().dtype(param_dtype);
    std::vector<std::pair<at::Tensor, at::Tensor>> bufs(buckets.size());  // send, receive
    std::vector<c10::intrusive_ptr<c10d::Work>> works(buckets.size());
    size_t done = 0;
    auto unpack = [&](size_t bi) {
      wait(works[bi], "parameter all-gather", static_cast<int64_t>(bi));
      works[bi].reset();
      const at::Tensor& recv = bufs[bi].second;
      for (const auto& f : buckets[bi].fragments) {
        flat(f.param)
            .narrow(0, f.param_offset, f.length)
            .copy_(recv.narrow(0, f.bucket_offset, f.length));
      }
      bufs[bi] = {};
    };
    size_t li = 0;
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      const auto& b = buckets[bi];
      at::Tensor send = at::zeros({b.shard}, opts);
      for (; li < local.size() && local[li].bucket == static_cast<int64_t>(bi); ++li) {
        const auto& sf = local[li];
        send.narrow(0, sf.shard_offset, sf.length)
            .copy_(flat(sf.param).narrow(0, sf.param_offset, sf.length));
      }
      at::Tensor recv = at::empty({b.size}, opts);
      bufs[bi] = {send, recv};
      while (bi - done >= static_cast<size_t>(std::max<int64_t>(1, settings.pipeline_size()))) {
        unpack(done++);
      }
      try {
        works[bi] = pg->all_gather_single(bufs[bi].second, bufs[bi].first);
      } catch (const std::exception& e) {
        TORCH_CHECK(false, where(), ": the parameter all-gather of bucket ", bi,
                    " failed: ", detail::message_of(e));
      }
    }
    while (done < buckets.size()) unpack(done++);
  }

  // ---- whole state, for checkpoints ----

  // Per parameter (layout index): fp32 weights, exp_avg, exp_avg_sq, gathered from every rank.
  struct Full {
    std::vector<at::Tensor> param, exp_avg, exp_avg_sq;
  };

  at::Tensor local_param_values() const {
    at::Tensor out = at::zeros({shard_elements}, grad_shard.options().dtype(at::kFloat));
    for (const auto& sf : local) {
      const bool half = params[sf.param].tensor.scalar_type() != at::kFloat;
      out.narrow(0, sf.local_offset, sf.length)
          .copy_(half ? master.narrow(0, sf.local_offset, sf.length)
                      : flat(sf.param).narrow(0, sf.param_offset, sf.length));
    }
    return out;
  }

  Full gather_full() const {
    const at::Tensor mine = at::cat({local_param_values(), exp_avg, exp_avg_sq}).cpu();
    const auto all = group.all_gather(mine.to(grad_shard.device()));
    Full full;
    for (const auto& p : params) {
      const auto o = at::TensorOptions().dtype(at::kFloat);
      full.param.push_back(at::zeros({p.numel}, o));
      full.exp_avg.push_back(at::zeros({p.numel}, o));
      full.exp_avg_sq.push_back(at::zeros({p.numel}, o));
    }
    for (int64_t r = 0; r < world; ++r) {
      const at::Tensor t = all[r].cpu();
      for (const auto& sf : shard_fragments(r)) {
        auto put = [&](std::vector<at::Tensor>& dst, int64_t base) {
          dst[sf.param]
              .narrow(0, sf.param_offset, sf.length)
              .copy_(t.narrow(0, base + sf.local_offset, sf.length));
        };
        put(full.param, 0);
        put(full.exp_avg, shard_elements);
        put(full.exp_avg_sq, 2 * shard_elements);
      }
    }
    return full;
  }

  // Installs whole per-parameter state (validated by the caller): this rank's fragments of it.
  void install(const Full& full, const std::vector<int64_t>& new_steps) {
    const torch::NoGradGuard no_grad;
    for (const auto& sf : local) {
      auto take = [&](const std::vector<at::Tensor>& src, at::Tensor& dst) {
        dst.narrow(0, sf.local_offset, sf.length)
            .copy_(src[sf.param].reshape({-1}).narrow(0, sf.param_offset, sf.length));
      };
      take(full.exp_avg, exp_avg);
      take(full.exp_avg_sq, exp_avg_sq);
      if (master.defined() && params[sf.param].tensor.scalar_type() != at::kFloat &&
          full.param[sf.param].defined()) {
        take(full.param, master);
      }
    }
    steps = new_steps;
  }

  // The ranks agree before anything changes: every rank's error (or "") to every rank.
  void agree(const std::string& error, const char* what) const {
    const auto all = group.all_gather_string(error);
    TORCH_CHECK(error.empty(), error);
    for (size_t r = 0; r < all.size(); ++r) {
      TORCH_CHECK(all[r].empty(), where(), ": ", what, " failed on rank ", r,
                  ", so no rank changed anything: ", all[r]);
    }
  }
};

// Runs the hook of parameter `index`.
namespace {
struct GradHook : torch::autograd::PostAccumulateGradHook {
  GradHook(DistributedFusedAdam::Impl* impl, int64_t index) : impl(impl), index(index) {}
  void operator()(const torch::autograd::Variable& tensor) override {
    impl->on_grad(index, tensor);
  }
  DistributedFusedAdam::Impl* impl;
  int64_t index;
};
}  // namespace

// ---------------------------------------------------------------------------------------------

DistributedFusedAdam::DistributedFusedAdam(
    const std::vector<torch::optim::OptimizerParamGroup>& groups,
    DistributedFusedAdamOptions defaults, ProcessGroup group)
    : torch::optim::Optimizer(groups, std::make_unique<DistributedFusedAdamOptions>(defaults)),
      impl_(std::make_unique<Impl>()),
      group_(std::move(group)) {
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
  m.group = group_;
  m.pg = c10d_group(group_);
  m.rank = group_.rank();
  m.world = group_.size();
  m.settings = defaults;
  const auto& s = defaults;
  check_hyper(s);
  for (const auto& g : param_groups_) check_hyper(options_of(g));
  TORCH_CHECK(std::isfinite(s.bucket_cap_mb()) && s.bucket_cap_mb() > 0, kWho,
              ": bucket_cap_mb must be > 0, got ", s.bucket_cap_mb());
  TORCH_CHECK(s.pipeline_size() >= 1, kWho, ": pipeline_size must be >= 1, got ",
              s.pipeline_size());
  TORCH_CHECK(s.dtype() == at::kFloat, kWho, ": dtype (of the optimizer state) must be Float, got ",
              s.dtype());
  m.grad_dtype = s.grad_sync_dtype().value_or(s.dtype());
  m.param_dtype = s.param_sync_dtype().value_or(s.dtype());
  TORCH_CHECK(is_float_type(m.grad_dtype), kWho,
              ": grad_sync_dtype must be Float, Half or BFloat16, got ", m.grad_dtype);
  TORCH_CHECK(is_float_type(m.param_dtype), kWho,
              ": param_sync_dtype must be Float, Half or BFloat16, got ", m.param_dtype);
  m.algorithm = s.reduce_scatter();
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
    TORCH_CHECK(p.scalar_type() != at::kFloat || m.param_dtype == at::kFloat, kWho,
                ": param_sync_dtype ", m.param_dtype,
                " would round the fp32 parameters every step (they are their own master); use "
                "Float, or keep the model in half precision");
    for (size_t j = 0; j < i; ++j) {
      TORCH_CHECK(!order[j].first.is_same(p), kWho, ": a parameter appears twice");
    }
    TORCH_CHECK(torch::autograd::impl::post_acc_grad_hooks(p) == nullptr, kWho, ": parameter ", i,
                " already has a post-accumulate-grad hook (another DistributedFusedAdam?)");
    Impl::Param info;
    info.tensor = p;
    info.group = order[i].second;
    info.numel = p.numel();
    m.params.push_back(std::move(info));
  }

  // Every rank must lay out the same parameters: compared before any sized collective.
  std::ostringstream sig;
  sig << m.params.size() << " parameters;";
  for (const auto& p : m.params) sig << ' ' << describe(p.tensor);
  sig << "; bucket_cap_mb " << s.bucket_cap_mb() << ", grad_sync_dtype " << m.grad_dtype
      << ", param_sync_dtype " << m.param_dtype;
  const auto sigs = group_.all_gather_string(sig.str());
  for (size_t r = 1; r < sigs.size(); ++r) {
    TORCH_CHECK(sigs[r] == sigs[0], kWho, ": rank ", m.rank, " of ", m.world, ": rank ", r,
                " has a different layout than rank 0 (rank 0: ", sigs[0], "; rank ", r, ": ",
                sigs[r], "); every rank must construct it with the same parameters and settings");
  }

  m.build_layout(s.bucket_cap_mb());
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  m.exp_avg = at::zeros({m.shard_elements}, f32);
  m.exp_avg_sq = at::zeros({m.shard_elements}, f32);
  m.grad_shard = at::zeros({m.shard_elements}, f32.dtype(m.grad_dtype));
  if (s.contiguous_grad_buffer()) {
    int64_t total = 0;
    for (const auto& b : m.buckets) total += b.size;
    m.contiguous = at::zeros({total}, f32.dtype(m.grad_dtype));
  }
  m.steps.assign(param_groups_.size(), 0);

  // Start from rank 0's parameters (as DDP does), then take the masters from them.
  {
    const torch::NoGradGuard no_grad;
    for (auto& p : m.params) group_.broadcast_(p.tensor, 0);
    if (m.any_half()) {
      m.master = at::zeros({m.shard_elements}, f32);
      for (const auto& sf : m.local) {
        m.master.narrow(0, sf.local_offset, sf.length)
            .copy_(m.flat(sf.param).narrow(0, sf.param_offset, sf.length));
      }
    }
  }
  for (size_t i = 0; i < m.params.size(); ++i) {
    torch::autograd::impl::set_post_acc_grad_hooks(
        m.params[i].tensor, std::make_unique<GradHook>(impl_.get(), static_cast<int64_t>(i)));
  }
}

DistributedFusedAdam::~DistributedFusedAdam() {
  if (!impl_) return;
  for (auto& p : impl_->params) {
    auto& hook = torch::autograd::impl::post_acc_grad_hooks(p.tensor);
    if (hook != nullptr && dynamic_cast<GradHook*>(hook.get()) != nullptr) hook.reset();
  }
  // Collectives still in flight (a step that never came) must end before their buffers go.
  for (const int64_t bi : impl_->in_flight) {
    try {
      if (impl_->buckets[bi].work) impl_->buckets[bi].work->wait();
    } catch (...) {  // NOLINT(bugprone-empty-catch): the error was or will be reported elsewhere
    }
  }
}

torch::Tensor DistributedFusedAdam::step(LossClosure closure) {
  torch::Tensor loss;
  if (closure) {
    const torch::AutoGradMode grad(true);
    loss = closure();
  }
  scaled_step(at::Tensor());
  return loss;
}

at::Tensor DistributedFusedAdam::scaled_step(const at::Tensor& inv_scale) {
  auto& m = *impl_;
  for (const auto& g : param_groups_) check_hyper(options_of(g));
  if (inv_scale.defined()) {
    TORCH_CHECK(inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat, kWho,
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
      m.adam(inv_scale.defined() ? inv_scale.to(m.grad_shard.device()) : at::Tensor());
      m.all_gather_params();
    }
  }
  m.reset_grads();
  return found;
}

at::Tensor DistributedFusedAdam::unscale_grads(const at::Tensor& inv_scale) {
  auto& m = *impl_;
  TORCH_CHECK(inv_scale.defined() && inv_scale.numel() == 1, kWho,
              ": unscale_grads needs a one-element inv_scale");
  m.sync_all();
  m.grad_shard.mul_(inv_scale.to(m.grad_shard.device()));
  m.unscaled = true;
  return m.found_inf_agreed();
}

void DistributedFusedAdam::zero_grad() {
  auto& m = *impl_;
  while (!m.in_flight.empty()) m.finish(m.in_flight.front());
  m.reset_grads();
  if (m.settings.contiguous_grad_buffer()) m.contiguous.zero_();
  for (auto& p : m.params) p.tensor.mutable_grad() = at::Tensor();
}

double DistributedFusedAdam::grad_norm() {
  auto& m = *impl_;
  m.sync_all();
  at::Tensor sq = m.grad_shard.to(at::kFloat).pow(2).sum().to(at::kDouble).reshape({1});
  m.group.all_reduce_(sq);
  return std::sqrt(sq.item<double>());
}

double DistributedFusedAdam::clip_grad_norm(double max_norm) {
  TORCH_CHECK(std::isfinite(max_norm) && max_norm > 0, kWho,
              ": clip_grad_norm: max_norm must be finite and > 0, got ", max_norm);
  const double norm = grad_norm();
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) impl_->grad_shard.mul_(coef);
  return norm;
}

DistributedFusedAdam::NoSync::NoSync(DistributedFusedAdam& opt)
    : opt_(opt), was_(opt.impl_->sync_enabled) {
  opt_.impl_->sync_enabled = false;
}

DistributedFusedAdam::NoSync::~NoSync() {
  opt_.impl_->sync_enabled = was_;
  // The accumulated gradients stay in their buckets; the next backward counts arrivals afresh.
  for (auto& b : opt_.impl_->buckets) {
    if (b.state == Impl::BucketState::kFilling || b.state == Impl::BucketState::kEmpty)
      b.arrived = 0;
  }
  for (auto& p : opt_.impl_->params) p.arrived = false;
}

ShardedMemory DistributedFusedAdam::memory() const {
  const auto& m = *impl_;
  ShardedMemory out;
  for (const auto& p : m.params) out.params += p.numel;
  out.shard_elements = m.shard_elements;
  auto bytes = [](const at::Tensor& t) {
    return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
  };
  out.state_bytes = bytes(m.exp_avg) + bytes(m.exp_avg_sq) + bytes(m.master);
  out.grad_shard_bytes = bytes(m.grad_shard);
  out.grad_buffer_bytes = bytes(m.contiguous);
  if (!m.contiguous.defined()) {
    for (const auto& b : m.buckets) out.grad_buffer_bytes += bytes(b.full) + bytes(b.received);
  }
  return out;
}

int64_t DistributedFusedAdam::step_count(size_t group) const {
  TORCH_CHECK(group < impl_->steps.size(), kWho, ": no group ", group);
  return impl_->steps[group];
}

ReduceScatter DistributedFusedAdam::reduce_scatter_algorithm() const { return impl_->algorithm; }

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

void DistributedFusedAdam::save_sharded(const std::string& dir) const {
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
      save_pickle(d, dir + "/manifest.pt");
    } catch (const std::exception& e) {
      error = detail::message_of(e);
    }
  }
  m.agree(error, "save_sharded (manifest)");
}

void DistributedFusedAdam::load_sharded(const std::string& dir) {
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
                mwhat, ": not a DistributedFusedAdam manifest");
    TORCH_CHECK(int_entry(man, "format", mwhat) == kShardFormat, mwhat, ": format ",
                int_entry(man, "format", mwhat), ", expected ", kShardFormat);
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
                  what, ": not a DistributedFusedAdam shard");
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

StateDict DistributedFusedAdam::consolidated_state_dict() const {
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
        const auto& o = options_of(param_groups_[gi]);
        StateDict g = make_state_dict();
        g.insert("lr", o.lr());
        g.insert("betas",
                 c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
        g.insert("eps", o.eps());
        g.insert("weight_decay", o.weight_decay());
        g.insert("bias_correction", o.bias_correction());
        g.insert("adam_w_mode", o.adam_w_mode());
        g.insert("step", m.steps[gi]);
        return g;
      });
  out.insert("format", static_cast<int64_t>(2));
  return out;
}

StateDict DistributedFusedAdam::torch_state_dict() const {
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
      [&](size_t gi) {
        const auto& o = options_of(param_groups_[gi]);
        StateDict g = make_state_dict();
        g.insert("lr", o.lr());
        g.insert("betas",
                 c10::ivalue::Tuple::create(std::get<0>(o.betas()), std::get<1>(o.betas())));
        g.insert("eps", o.eps());
        g.insert("weight_decay", o.weight_decay());
        g.insert("amsgrad", false);
        g.insert("maximize", false);
        g.insert("foreach", c10::IValue());
        g.insert("capturable", false);
        g.insert("differentiable", false);
        g.insert("fused", c10::IValue());
        g.insert("decoupled_weight_decay", o.adam_w_mode());
        return g;
      });
}

void DistributedFusedAdam::load_consolidated_state_dict(const StateDict& state) {
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
                        " hold different steps (", gs, " and ", s,
                        "); DistributedFusedAdam keeps one per group");
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
  for (size_t gi = 0; gi < lrs.size(); ++gi) {
    static_cast<DistributedFusedAdamOptions&>(param_groups_[gi].options()).lr(lrs[gi]);
  }
}

void DistributedFusedAdam::save(torch::serialize::OutputArchive& /*archive*/) const {
  TORCH_CHECK(false, kWho,
              ": torch::save of a sharded optimizer would hold one rank's shard only; use "
              "save_sharded(dir) (loads at any world size) or consolidated_state_dict()");
}

void DistributedFusedAdam::load(torch::serialize::InputArchive& /*archive*/) {
  TORCH_CHECK(false, kWho, ": use load_sharded(dir) or load_consolidated_state_dict()");
}

}  // namespace apex::parallel
