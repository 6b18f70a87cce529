#include <apex/parallel/c10d.h>
#include <apex/parallel/distributed.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/engine.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/default_comm_hooks.hpp>
#include <torch/csrc/distributed/c10d/logger.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>

#include <cmath>
#include <limits>
#include <sstream>
#include <string>
#include <unordered_set>

#include "common/no_sync.h"
#include "parallel/errors.h"

namespace apex::parallel::detail {
namespace {

constexpr const char* kWho = "apex::parallel::DistributedDataParallel";
// Rank 0's parameters and buffers reach the others in pieces of this many bytes (torch's).
constexpr size_t kBroadcastBucketBytes = 250u << 20;

// "Float [12, 4]": what a parameter or buffer must agree on across ranks.
std::string describe(const at::Tensor& t) {
  std::string d = std::string(c10::toString(t.scalar_type())) + " [";
  for (size_t i = 0; i < t.sizes().size(); ++i) {
    d += (i > 0 ? ", " : "") + std::to_string(t.sizes()[i]);
  }
  return d + "]";
}

// The first line where rank `r`'s description differs from rank 0's, both sides named.
std::string first_difference(const std::string& zero, const std::string& other, int64_t r) {
  std::istringstream a(zero), b(other);
  std::string la, lb;
  for (size_t i = 0;; ++i) {
    const bool ha = static_cast<bool>(std::getline(a, la));
    const bool hb = static_cast<bool>(std::getline(b, lb));
    if (!ha && !hb) return "they differ";
    if (ha && hb && la == lb) continue;
    if (!ha) return "rank " + std::to_string(r) + " has more tensors, from " + lb;
    if (!hb) return "rank " + std::to_string(r) + " has fewer tensors; rank 0 has " + la;
    return lb + " on rank " + std::to_string(r) + ", but " + la + " on rank 0 (tensor " +
           std::to_string(i) + ")";
  }
}

// Rank 0's values of `tensors` on every rank (detached: the Reducer's hooks must not see it).
void broadcast_from_rank0(const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                          const std::vector<at::Tensor>& tensors, const char* what, int64_t rank) {
  const torch::NoGradGuard no_grad;
  std::vector<at::Tensor> detached;
  detached.reserve(tensors.size());
  for (const auto& t : tensors) detached.push_back(t.detach());
  try {
    c10d::broadcast_coalesced(pg, detached, kBroadcastBucketBytes, 0);
  } catch (const std::exception& e) {
    TORCH_CHECK(false, kWho, ": broadcasting rank 0's ", what, " failed on rank ", rank, ": ",
                message_of(e));
  }
}

// The Reducer's constructor changes between torch minors; this is the one place that calls it.
std::shared_ptr<c10d::Reducer> make_reducer(std::vector<at::Tensor> params,
                                            std::vector<std::vector<size_t>> buckets,
                                            const c10::intrusive_ptr<c10d::ProcessGroup>& pg,
                                            std::vector<bool> sparse, int64_t cap, bool find_unused,
                                            bool grad_as_view,
                                            std::unordered_map<size_t, std::string> names,
                                            int64_t first_cap) {
// 2.11 (the lent GPU machine's torch) and 2.13 declare the same constructor; 2.12 lies between.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 11)
  return std::make_shared<c10d::Reducer>(std::move(params), std::move(buckets), pg,
                                         std::move(sparse), cap, find_unused, grad_as_view,
                                         std::move(names), first_cap,
                                         /*skip_all_reduce_unused_params=*/false,
                                         /*use_python_reducer=*/false,
                                         /*bucket_bytes_cap_list=*/std::vector<int64_t>{});
#else
  // Older minors order and name the arguments differently; no call for them has been compiled
  // yet, so they get a clear error rather than a guess.
  TORCH_CHECK(false, kWho, ": built against torch ", TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
              ", whose c10d::Reducer constructor apex-cpp does not call yet (torch 2.11 or later "
              "is needed for DistributedDataParallel)");
#endif
}

// One hook for every non-default way a bucket travels: an optional wire dtype, a factor before
// the all-reduce and one after it (apex's gradient_predivide_factor and gradient_average).
class BucketHook : public c10d::CppCommHookInterface<c10::intrusive_ptr<c10d::ProcessGroup>> {
 public:
  BucketHook(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, CommHook kind, double pre,
             double post)
      : CppCommHookInterface(pg), kind_(kind), pre_(pre), post_(post) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    at::Tensor wire = buffer;
    const auto half = buffer.scalar_type() == at::kHalf || buffer.scalar_type() == at::kBFloat16;
    if (kind_ == CommHook::kFp16Compress && buffer.scalar_type() != at::kHalf) {
      wire = buffer.to(at::kHalf);
    } else if (kind_ == CommHook::kBf16Compress && buffer.scalar_type() != at::kBFloat16) {
      wire = buffer.to(at::kBFloat16);
    } else if (kind_ == CommHook::kAllReduceFp32 && half) {
      wire = buffer.to(at::kFloat);
    }
    if (pre_ != 1.0) wire.mul_(pre_);
    std::vector<at::Tensor> tensors{wire};
    auto fut = state_->allreduce(tensors)->getFuture();
    const double post = post_;
    return fut->then(
        [buffer, wire, post](c10::ivalue::Future& done) {
          done.value();  // rethrows a failed all-reduce
          if (post != 1.0) wire.mul_(post);
          if (!wire.is_same(buffer)) buffer.copy_(wire);
          return c10::IValue(buffer);
        },
        c10::TensorType::get());
  }

 private:
  CommHook kind_;
  double pre_;
  double post_;
};

// What the output node's backward needs, held weakly: a graph may outlive its DDP module (the
// backward then does nothing DDP-specific), as Python's sink holds a weakref.
struct SinkState : torch::CustomClassHolder {
  std::weak_ptr<c10d::Reducer> reducer;
  std::weak_ptr<bool> delay_pending;  // a static graph's first delayed all-reduce not queued yet
};

// DDP's identity node on the outputs (Python's _DDPSink): a clone, so that the Reducer sees a
// backward even for outputs the loss does not use, and, in a static graph's first iteration, the
// place to queue the delayed all-reduce at the end of backward.
struct DdpSink : public torch::autograd::Function<DdpSink> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const c10::intrusive_ptr<SinkState>& state,
                                                at::TensorList inputs) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    torch::autograd::variable_list out;
    out.reserve(inputs.size());
    for (const auto& t : inputs) out.push_back(t.defined() ? t.clone() : t);
    return out;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto capsule = ctx->saved_data["state"].toCapsule();
    const auto* state = static_cast<const SinkState*>(capsule.get());
    const auto pending = state->delay_pending.lock();
    if (pending && *pending) {
      *pending = false;
      torch::autograd::Engine::get_default_engine().queue_callback([weak = state->reducer] {
        if (auto r = weak.lock()) r->delay_all_reduce();
      });
    }
    torch::autograd::variable_list out{at::Tensor()};
    out.insert(out.end(), grads.begin(), grads.end());
    return out;
  }
};

}  // namespace

struct DdpEngine::State {
  std::vector<at::Tensor> params;
  std::vector<c10::ScalarType> param_dtypes;
  std::vector<at::Tensor> buffers;
  std::shared_ptr<c10d::Reducer> reducer;
  std::shared_ptr<c10d::Logger> logger;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  bool require_forward_param_sync = true;
  std::shared_ptr<bool> static_delay_pending = std::make_shared<bool>(false);
  bool training_output_pending = false;
};

DdpEngine::DdpEngine(torch::nn::Module& module, ProcessGroup group,
                     DistributedDataParallelOptions options)
    : state_(std::make_unique<State>()), group_(std::move(group)), options_(options) {
  TORCH_CHECK(group_.valid(), kWho,
              ": no process group (call apex::parallel::init_process_group first, or pass one)");
  auto& s = *state_;
  s.pg = c10d_group(group_);
  const auto& o = options_;
  TORCH_CHECK(std::isfinite(o.bucket_cap_mb()) && o.bucket_cap_mb() > 0, kWho,
              ": bucket_cap_mb must be > 0, got ", o.bucket_cap_mb());
  TORCH_CHECK(std::isfinite(o.first_bucket_mb()) && o.first_bucket_mb() > 0, kWho,
              ": first_bucket_mb must be > 0, got ", o.first_bucket_mb());
  TORCH_CHECK(std::isfinite(o.gradient_predivide_factor()) && o.gradient_predivide_factor() > 0,
              kWho, ": gradient_predivide_factor must be > 0, got ", o.gradient_predivide_factor());
  TORCH_CHECK(!(o.static_graph() && o.delay_allreduce()), kWho,
              ": static_graph and delay_allreduce cannot be combined");

  // Parameters that need gradients, each once (shared parameters appear under several names);
  // frozen ones too, for the construction check and broadcast only (Python's DDP syncs every
  // parameter: a frozen layer initialised differently per rank would differ for the whole run).
  std::unordered_set<const c10::TensorImpl*> seen;
  std::unordered_map<size_t, std::string> names;
  std::vector<at::Tensor> frozen;
  for (const auto& np : module.named_parameters()) {
    const at::Tensor& p = np.value();
    if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
    if (!p.requires_grad()) {
      TORCH_CHECK(p.device().type() == group_.device().type(), kWho, ": parameter '", np.key(),
                  "' is on ", p.device(), " but the process group reduces ", group_.device(),
                  " tensors");
      frozen.push_back(p);
      continue;
    }
    TORCH_CHECK(p.device().type() == group_.device().type(), kWho, ": parameter '", np.key(),
                "' is on ", p.device(), " but the process group reduces ", group_.device(),
                " tensors");
    TORCH_CHECK(p.layout() == at::kStrided, kWho, ": parameter '", np.key(),
                "' is sparse; sparse gradients are not supported");
    names[s.params.size()] = np.key();
    s.params.push_back(p);
    s.param_dtypes.push_back(p.scalar_type());
  }
  TORCH_CHECK(!s.params.empty(), kWho,
              ": the module has no parameter that requires a gradient: nothing to synchronize");
  for (const auto& b : module.buffers()) s.buffers.push_back(b);

  if (o.init_sync() && group_.size() > 1) {
    // Every rank's names, dtypes and shapes, compared on every rank before anything is
    // broadcast, buffers too: a rank whose tensors differ in count, shape or dtype (another
    // model, or another opt level's half weights) would feed the flattened broadcast below
    // pieces of other sizes (which Gloo answers by terminating the process), or, sizes swapped
    // between two buffers, fill them with the wrong values silently.
    std::string mine;
    for (const auto& np : module.named_parameters()) {
      mine += "parameter '" + np.key() + "': " + describe(np.value()) + "\n";
    }
    for (const auto& nb : module.named_buffers()) {
      mine += "buffer '" + nb.key() + "': " + describe(nb.value()) + "\n";
    }
    std::vector<std::string> all;
    try {
      all = group_.all_gather_string(mine);
    } catch (const std::exception& e) {
      TORCH_CHECK(false, kWho, ": could not compare the model across the ranks (rank ",
                  group_.rank(), "): ", message_of(e));
    }
    for (size_t r = 1; r < all.size(); ++r) {
      if (all[r] == all[0]) continue;
      TORCH_CHECK(false, kWho, ": the ranks hold different models (rank ", r,
                  "): ", first_difference(all[0], all[r], static_cast<int64_t>(r)));
    }

    std::vector<at::Tensor> state = s.params;
    state.insert(state.end(), frozen.begin(), frozen.end());
    state.insert(state.end(), s.buffers.begin(), s.buffers.end());
    broadcast_from_rank0(s.pg, state, "parameters", group_.rank());
  }

  const auto mib = [](double m) { return static_cast<int64_t>(std::min(m * 1048576.0, 9.0e18)); };
  const int64_t big = std::numeric_limits<int64_t>::max();
  const int64_t cap = o.delay_allreduce() ? big : mib(o.bucket_cap_mb());
  const int64_t first = o.delay_allreduce() ? big : mib(o.first_bucket_mb());
  // Definition order need not be execution order: one bucket until the first backward has shown
  // the order, then the Reducer rebuilds (except with find_unused_parameters, where the order may
  // change and the [first, cap] layout in definition order stays).
  std::vector<size_t> limits;
  if (o.static_graph() || !o.find_unused_parameters()) {
    limits = {std::numeric_limits<size_t>::max()};
  } else {
    limits = {static_cast<size_t>(first), static_cast<size_t>(cap)};
  }
  std::vector<bool> sparse(s.params.size(), false);
  auto buckets = std::get<0>(c10d::compute_bucket_assignment_by_size(s.params, limits, sparse));
  std::reverse(buckets.begin(), buckets.end());
  s.reducer =
      make_reducer(s.params, std::move(buckets), s.pg, sparse, cap, o.find_unused_parameters(),
                   o.gradient_as_bucket_view(), std::move(names), first);
  // The Reducer dereferences its logger without a check when the unused set changes: always one.
  s.logger = std::make_shared<c10d::Logger>(s.reducer);
  s.reducer->set_logger(s.logger);
  s.logger->set_construction_data_and_log("apex::parallel::DistributedDataParallel", {}, -1,
                                          o.broadcast_buffers(), false, o.static_graph());
  if (o.static_graph()) {
    s.reducer->set_static_graph();
    s.logger->set_static_graph();
    *s.static_delay_pending = true;
  }
  const double world = static_cast<double>(group_.size());
  const double f = o.gradient_predivide_factor();
  if (o.comm_hook() != CommHook::kAllReduce || f != 1.0 || !o.gradient_average()) {
    // apex: x 1/f before, x f/world after when averaging (a plain sum / f otherwise). The 16-bit
    // wires divide by world before the sum, as torch's compress hooks do, so that a sum over many
    // ranks stays in range.
    const bool compress =
        o.comm_hook() == CommHook::kFp16Compress || o.comm_hook() == CommHook::kBf16Compress;
    double pre = 1.0 / f;
    double post = o.gradient_average() ? f / world : 1.0;
    if (compress && f == 1.0 && o.gradient_average()) {
      pre = 1.0 / world;
      post = 1.0;
    }
    s.reducer->register_comm_hook(std::make_unique<BucketHook>(s.pg, o.comm_hook(), pre, post));
  }
}

DdpEngine::~DdpEngine() {
  if (!state_) return;
  try {
    state_->logger.reset();
    state_->reducer.reset();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor never throws
  }
}

void DdpEngine::pre_forward() {
  auto& s = *state_;
  for (size_t i = 0; i < s.params.size(); ++i) {
    TORCH_CHECK(s.params[i].scalar_type() == s.param_dtypes[i], kWho, ": parameter ", i,
                " changed dtype from ", s.param_dtypes[i], " to ", s.params[i].scalar_type(),
                " after the module was wrapped; call apex::amp::initialize (or cast the model) "
                "before wrapping it");
  }
  const bool grad = at::GradMode::is_enabled();
  if (grad && require_backward_grad_sync) {
    s.logger->set_runtime_stats_and_log();
    try {
      s.reducer->prepare_for_forward();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, kWho, " (rank ", group_.rank(), "): ", message_of(e));
    }
  }
  if (grad) s.reducer->rebuild_buckets();
  if (s.require_forward_param_sync && options_.broadcast_buffers() && !s.buffers.empty() &&
      group_.size() > 1) {
    broadcast_from_rank0(s.pg, s.buffers, "buffers", group_.rank());
  }
}

bool DdpEngine::wants_sink() const {
  const auto& o = options_;
  return state_->training_output_pending && ((o.find_unused_parameters() && !o.static_graph()) ||
                                             (o.static_graph() && *state_->static_delay_pending));
}

std::vector<at::Tensor> DdpEngine::post_forward(std::vector<at::Tensor> outputs) {
  auto& s = *state_;
  const auto& o = options_;
  const bool sync = at::GradMode::is_enabled() && require_backward_grad_sync;
  s.require_forward_param_sync = sync;
  s.training_output_pending = sync;
  if (sync) {
    if (o.find_unused_parameters() && !o.static_graph()) {
      std::vector<at::Tensor> defined;
      for (const auto& t : outputs) {
        if (t.defined()) defined.push_back(t);
      }
      s.reducer->prepare_for_backward(defined);
    } else {
      s.reducer->prepare_for_backward({});
    }
  }
  if (!wants_sink()) return outputs;
  std::vector<size_t> with_grad;
  torch::autograd::variable_list through;
  for (size_t i = 0; i < outputs.size(); ++i) {
    if (outputs[i].defined() && outputs[i].requires_grad()) {
      with_grad.push_back(i);
      through.push_back(outputs[i]);
    }
  }
  if (through.empty()) return outputs;
  auto sink = c10::make_intrusive<SinkState>();
  sink->reducer = s.reducer;
  sink->delay_pending = s.static_delay_pending;
  auto passed = DdpSink::apply(sink, at::TensorList(through));
  for (size_t k = 0; k < with_grad.size(); ++k) outputs[with_grad[k]] = passed[k];
  return outputs;
}

DdpEngine::Timings DdpEngine::timings() const {
  const at::DDPLoggingData d = state_->logger->get_ddp_logging_data();
  const auto get = [&](const char* key) -> int64_t {
    const auto it = d.ints_map.find(key);
    return it == d.ints_map.end() ? 0 : it->second;
  };
  Timings t;
  t.forward_compute_ns = get("avg_forward_compute_time");
  t.backward_compute_ns = get("avg_backward_compute_time");
  t.backward_comm_ns = get("avg_backward_comm_time");
  t.backward_compute_comm_overlap_ns = get("avg_backward_compute_comm_overlap_time");
  return t;
}

std::vector<std::vector<size_t>> DdpEngine::bucket_indices() const {
  std::vector<std::vector<size_t>> out;
  for (const auto& b : state_->reducer->get_grad_buckets(/*return_zero_tensors=*/false)) {
    std::vector<size_t> idx;
    const auto ps = b.getParameters();
    for (const auto& p : ps) {
      for (size_t i = 0; i < state_->params.size(); ++i) {
        if (state_->params[i].is_same(p)) idx.push_back(i);
      }
    }
    out.push_back(std::move(idx));
  }
  return out;
}

}  // namespace apex::parallel::detail

namespace apex::parallel {

NoSyncGuard::NoSyncGuard(detail::DdpEngine& engine)
    : engine_(engine), previous_(engine.require_backward_grad_sync) {
  engine_.require_backward_grad_sync = false;
  ++apex::detail::open_no_sync_scopes();
}

NoSyncGuard::~NoSyncGuard() {
  engine_.require_backward_grad_sync = previous_;
  --apex::detail::open_no_sync_scopes();
}

}  // namespace apex::parallel
