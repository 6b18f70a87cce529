// DistributedFusedAdam (ZeRO-2): real processes on Gloo over 127.0.0.1. Every equivalence test
// compares with one process training on the whole batch with FusedAdam (the same kernel): one
// rank is bit-identical; more ranks sum the gradients in another order (the reduce-scatter), so
// they agree within the fp32 (or bf16) row of the tolerance table.
#include <apex/amp/grad_scaler.h>
#include <apex/optim/fused_adam.h>
#include <apex/optim/fused_lamb.h>
#include <apex/parallel.h>
#include <apex/parallel/c10d.h>
#include <apex/serialize.h>
#include <torch/autograd.h>
#include <torch/nn.h>

#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <sstream>

#include "common/test_util.h"
#include "launcher.h"

namespace ap = apex::parallel;
using apex::test::all_close;
using apex::test::get;
using apex::test::launch;
using apex::test::LaunchOptions;
using apex::test::parse_args;
using apex::test::randn_seeded;
using apex::test::RegisterWorker;
using apex::test::tolerance_for;

namespace {

constexpr int64_t kBatch = 12;  // the global batch: divisible by 1, 2, 3 and 4 ranks

torch::nn::Sequential mlp(int64_t hidden = 16) {
  // 12*16+16, 16*16+16, 16*4+4: 548 elements, none a multiple of the shard unit.
  return torch::nn::Sequential(torch::nn::Linear(12, hidden), torch::nn::ReLU(),
                               torch::nn::Linear(hidden, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

void copy_params(torch::nn::Module& dst, const torch::nn::Module& src) {
  const torch::NoGradGuard no_grad;
  auto d = dst.parameters();
  auto s = src.parameters();
  for (size_t i = 0; i < d.size(); ++i) d[i].copy_(s[i]);
}

// Two groups: the first layer (its own lr and weight decay), the rest.
std::vector<torch::optim::OptimizerParamGroup> adam_groups(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> first(ps.begin(), ps.begin() + 2);
  std::vector<at::Tensor> rest(ps.begin() + 2, ps.end());
  return {torch::optim::OptimizerParamGroup(
              first, std::make_unique<apex::optim::FusedAdamOptions>(
                         apex::optim::FusedAdamOptions(0.01).weight_decay(0.1))),
          torch::optim::OptimizerParamGroup(rest, std::make_unique<apex::optim::FusedAdamOptions>(
                                                      apex::optim::FusedAdamOptions(0.02)))};
}

std::vector<torch::optim::OptimizerParamGroup> lamb_groups(const std::vector<at::Tensor>& ps) {
  std::vector<at::Tensor> first(ps.begin(), ps.begin() + 2);
  std::vector<at::Tensor> rest(ps.begin() + 2, ps.end());
  return {torch::optim::OptimizerParamGroup(
              first, std::make_unique<apex::optim::FusedLAMBOptions>(
                         apex::optim::FusedLAMBOptions(0.01).weight_decay(0.1))),
          torch::optim::OptimizerParamGroup(
              rest, std::make_unique<apex::optim::FusedLAMBOptions>(
                        apex::optim::FusedLAMBOptions(0.02).weight_decay(0.0)))};
}

std::vector<torch::optim::OptimizerParamGroup> dflamb_groups(torch::nn::Sequential& m) {
  auto ps = m->parameters();
  std::vector<at::Tensor> first(ps.begin(), ps.begin() + 2);
  std::vector<at::Tensor> rest(ps.begin() + 2, ps.end());
  return {torch::optim::OptimizerParamGroup(
              first, std::make_unique<ap::DistributedFusedLAMBOptions>(
                         ap::DistributedFusedLAMBOptions(0.01).weight_decay(0.1))),
          torch::optim::OptimizerParamGroup(
              rest, std::make_unique<ap::DistributedFusedLAMBOptions>(
                        ap::DistributedFusedLAMBOptions(0.02).weight_decay(0.0)))};
}

std::vector<torch::optim::OptimizerParamGroup> dfa_groups(torch::nn::Sequential& m) {
  auto ps = m->parameters();
  std::vector<at::Tensor> first(ps.begin(), ps.begin() + 2);
  std::vector<at::Tensor> rest(ps.begin() + 2, ps.end());
  return {torch::optim::OptimizerParamGroup(
              first, std::make_unique<ap::DistributedFusedAdamOptions>(
                         ap::DistributedFusedAdamOptions(0.01).weight_decay(0.1))),
          torch::optim::OptimizerParamGroup(rest, std::make_unique<ap::DistributedFusedAdamOptions>(
                                                      ap::DistributedFusedAdamOptions(0.02)))};
}

at::Tensor inputs(int step, int micro) {
  return randn_seeded({kBatch, 12}, 1000 + step * 10 + micro);
}
at::Tensor targets(int step, int micro) {
  return randn_seeded({kBatch, 4}, 1005 + step * 10 + micro);
}

// Compares every parameter with the reference; `exact` demands equal bits.
int compare(const std::vector<at::Tensor>& g, const std::vector<at::Tensor>& w, bool exact,
            at::ScalarType dtype, const std::string& what) {
  int bad = 0;
  for (size_t i = 0; i < g.size(); ++i) {
    if (exact) {
      if (!at::equal(g[i], w[i])) {
        std::cout << what << ": tensor " << i << " differs from the reference (max "
                  << (g[i].to(at::kDouble) - w[i].to(at::kDouble)).abs().max().item<double>()
                  << ")\n";
        ++bad;
      }
    } else if (const auto r = all_close(g[i], w[i], tolerance_for(dtype)); !r) {
      std::cout << what << ": tensor " << i << ": " << r.message() << "\n";
      ++bad;
    }
  }
  return bad;
}

// Every rank holds the same parameters after a step (the all-gather's point).
int same_on_every_rank(torch::nn::Module& m, const ap::ProcessGroup& pg) {
  int bad = 0;
  for (const auto& p : m.parameters()) {
    const auto all = pg.all_gather(p.detach());
    for (size_t r = 1; r < all.size(); ++r) {
      if (!at::equal(all[r], all[0])) {
        std::cout << "rank " << r << " holds other parameters than rank 0\n";
        ++bad;
      }
    }
  }
  return bad;
}

struct Run {
  at::ScalarType dtype = at::kFloat;
  int micro = 1;
  double bucket_mb = 0.0003;  // ~78 fp32 elements: fragments across buckets and shards
  ap::ReduceScatter rs = ap::ReduceScatter::kAuto;
  int inf_step = -1;
  int inf_rank = 1;
  double clip = 0;
  bool contiguous = false;
  double cap_mb = 0;         // message_cap_mb
  bool store_params = true;  // false: no fp32 masters kept for half parameters
};

ap::DistributedFusedAdamOptions dfa_options(const Run& run) {
  return ap::DistributedFusedAdamOptions()
      .bucket_cap_mb(run.bucket_mb)
      .reduce_scatter(run.rs)
      .contiguous_grad_buffer(run.contiguous)
      .message_cap_mb(run.cap_mb)
      .store_params(run.store_params);
}

// The model's output, times its "scale" parameter when it has one: registered first, used last,
// so its gradient arrives first while the layout starts with the last registered parameters
// (the sharded optimizer re-lays itself out after the first step).
at::Tensor apply(torch::nn::Sequential& m, const at::Tensor& x) {
  at::Tensor y = m->forward(x);
  if (const auto* scale = m->named_parameters(/*recurse=*/false).find("scale")) y = y * *scale;
  return y;
}

// One process doing what W ranks do, in their order: each rank's slice's gradients (in the
// model's dtype), accumulated over micro-batches in fp32, divided by W, summed in rank order
// (the all-to-all reduce-scatter's order), then FusedAdam on fp32 masters (the model's own
// parameters when it is fp32).
struct Reference {
  torch::nn::Sequential model;
  std::vector<at::Tensor> master;
  std::unique_ptr<apex::optim::FusedOptimizer> opt;

  explicit Reference(torch::nn::Sequential m, bool lamb = false) : model(std::move(m)) {
    for (const auto& p : model->parameters()) {
      master.push_back(p.scalar_type() == at::kFloat ? p
                                                     : p.detach().to(at::kFloat).requires_grad_());
    }
    if (lamb) {
      opt = std::make_unique<apex::optim::FusedLAMB>(lamb_groups(master));
    } else {
      opt = std::make_unique<apex::optim::FusedAdam>(adam_groups(master));
    }
  }

  void step(int world, int step, const Run& run) {
    const int64_t n = kBatch / world;
    const auto params = model->parameters();
    std::vector<at::Tensor> total(params.size());
    for (int r = 0; r < world; ++r) {
      std::vector<at::Tensor> acc;
      for (const auto& p : params) acc.push_back(at::zeros(p.sizes(), at::kFloat));
      for (int m = 0; m < run.micro; ++m) {
        const at::Tensor x = inputs(step, m).to(run.dtype).slice(0, r * n, (r + 1) * n);
        const at::Tensor t = targets(step, m).to(run.dtype).slice(0, r * n, (r + 1) * n);
        // An unused parameter's gradient is zero, as the sharded optimizer treats it.
        const auto gs = torch::autograd::grad({at::mse_loss(apply(model, x), t)}, params, {},
                                              std::nullopt, false, /*allow_unused=*/true);
        for (size_t i = 0; i < gs.size(); ++i) {
          if (gs[i].defined()) acc[i].add_(gs[i].to(at::kFloat));
        }
      }
      for (size_t i = 0; i < acc.size(); ++i) {
        if (world > 1) acc[i].div_(static_cast<double>(world));
        total[i] = r == 0 ? acc[i] : total[i].add_(acc[i]);
      }
    }
    for (size_t i = 0; i < master.size(); ++i) master[i].mutable_grad() = total[i];
    if (run.clip > 0) torch::nn::utils::clip_grad_norm_(master, run.clip);
    opt->step();
    const torch::NoGradGuard no_grad;
    for (size_t i = 0; i < master.size(); ++i) {
      if (master[i].is_same(params[i])) continue;
      params[i].copy_(master[i]);
      // Without store_params the sharded optimizer keeps no master: the next step starts from
      // the half parameter.
      if (!run.store_params) master[i].copy_(params[i]);
    }
  }
};

// One iteration of the sharded optimizer on this rank's slice. Returns false when the step was
// skipped (an inf).
bool iteration(int rank, int world, int step, const Run& run, torch::nn::Sequential& local,
               ap::DistributedFusedOptimizer& opt, apex::amp::GradScaler* scaler) {
  const int64_t n = kBatch / world;
  const bool inf = step == run.inf_step;
  opt.zero_grad();
  for (int m = 0; m < run.micro; ++m) {
    const at::Tensor xs = inputs(step, m).to(run.dtype).slice(0, rank * n, (rank + 1) * n);
    const at::Tensor ts = targets(step, m).to(run.dtype).slice(0, rank * n, (rank + 1) * n);
    at::Tensor loss = at::mse_loss(apply(local, xs), ts);
    if (inf && rank == run.inf_rank && m == 0) loss = loss * std::numeric_limits<float>::infinity();
    if (scaler != nullptr) loss = scaler->scale(loss);
    if (m + 1 < run.micro) {
      auto guard = opt.no_sync();
      loss.backward();
    } else {
      loss.backward();
    }
  }
  if (run.clip > 0) {
    if (scaler != nullptr) scaler->unscale_(opt);
    opt.clip_grad_norm(run.clip);
  }
  bool stepped = true;
  if (scaler != nullptr) {
    stepped = scaler->step(opt).has_value();
    scaler->update();
  } else {
    opt.step();
  }
  return stepped;
}

// The gathered state against the reference's: moments and fp32 masters (the parameters' values
// without store_params).
int compare_state(const ap::DistributedFusedOptimizer& opt, const Reference& ref, bool exact) {
  const auto cs = opt.consolidated_state_dict();
  const auto ref_sd = ref.opt->python_state_dict();
  const auto st = cs.at("state").toGenericDict();
  const auto ref_st = ref_sd.at("state").toGenericDict();
  int bad = 0;
  for (const auto& kv : st) {
    const int64_t i = kv.key().toInt();
    const auto d = kv.value().toGenericDict();
    const auto r = ref_st.at(i).toGenericDict();
    bad += compare(
        {d.at("exp_avg").toTensor(), d.at("exp_avg_sq").toTensor(), d.at("param").toTensor()},
        {r.at("exp_avg").toTensor(), r.at("exp_avg_sq").toTensor(), ref.master[i]}, exact,
        at::kFloat, "state of parameter " + std::to_string(i));
  }
  return bad;
}

ap::ProcessGroup join() {
  return ap::init_process_group(ap::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
}

// The model of this rank (another initialization than rank 0's, which the optimizer's broadcast
// must replace) and the reference (rank 0's).
std::pair<torch::nn::Sequential, torch::nn::Sequential> models(int rank, at::ScalarType dtype,
                                                               int64_t hidden = 16,
                                                               bool unused = false,
                                                               bool scaled = false) {
  // A parameter no forward uses ("unused"): no gradient ever reaches its bucket region, which
  // must be sent as zeros (the buffers are reused, so a missed zeroing sends stale values).
  torch::manual_seed(1);
  auto ref = mlp();
  if (unused) ref->register_parameter("unused", at::randn({40}));
  if (scaled) ref->register_parameter("scale", at::rand({4}) + 0.5);
  torch::manual_seed(100 + rank);
  auto local = mlp(hidden);
  if (unused) local->register_parameter("unused", at::randn({40}));
  if (scaled) local->register_parameter("scale", at::rand({4}) + 0.5);
  if (rank == 0) copy_params(*local, *ref);
  ref->to(dtype);
  local->to(dtype);
  return {ref, local};
}

int equivalence(int rank, int world, const std::string& arg) {
  const auto a = parse_args(arg);
  Run run;
  run.dtype = get(a, "dtype", "float") == "bf16" ? at::kBFloat16 : at::kFloat;
  run.micro = std::stoi(get(a, "micro", "1"));
  run.bucket_mb = std::stod(get(a, "bucket_mb", "0.0003"));
  run.rs = get(a, "rs", "auto") == "native" ? ap::ReduceScatter::kNative : ap::ReduceScatter::kAuto;
  run.inf_step = std::stoi(get(a, "inf_step", "-1"));
  run.clip = std::stod(get(a, "clip", "0"));
  run.contiguous = get(a, "contiguous", "0") == "1";
  run.cap_mb = std::stod(get(a, "cap_mb", "0"));
  run.store_params = get(a, "store_params", "1") == "1";
  const bool unused = get(a, "unused", "0") == "1";
  const bool scale_param = get(a, "scale", "0") == "1";
  const bool scaled = get(a, "scaler", "0") == "1" || run.inf_step >= 0;
  const int steps = std::stoi(get(a, "steps", "4"));
  auto pg = join();
  auto [ref_model, local] = models(rank, run.dtype, 16, unused, scale_param);
  const bool lamb = get(a, "opt", "adam") == "lamb";
  Reference ref(ref_model, lamb);
  std::unique_ptr<ap::DistributedFusedOptimizer> opt_holder;
  if (lamb) {
    auto o = ap::DistributedFusedLAMBOptions()
                 .bucket_cap_mb(run.bucket_mb)
                 .reduce_scatter(run.rs)
                 .contiguous_grad_buffer(run.contiguous)
                 .message_cap_mb(run.cap_mb)
                 .store_params(run.store_params);
    opt_holder = std::make_unique<ap::DistributedFusedLAMB>(dflamb_groups(local), o, pg);
  } else {
    opt_holder =
        std::make_unique<ap::DistributedFusedAdam>(dfa_groups(local), dfa_options(run), pg);
  }
  ap::DistributedFusedOptimizer& opt = *opt_holder;
  if (run.rs == ap::ReduceScatter::kNative &&
      opt.reduce_scatter_algorithm() != ap::ReduceScatter::kNative) {
    std::cout << "reduce_scatter(kNative) was not taken\n";
    return 1;
  }
  // Bit-identical where the sums run in the same order: the all-to-all reduce-scatter sums in
  // rank order as the reference does; Gloo's native one is a ring all-reduce (another order),
  // and the clipping norm is summed in another order than LibTorch's clip_grad_norm_.
  // LAMB's norms sum a parameter's fragments apart, then together: another order than FusedLAMB.
  const bool exact = run.rs != ap::ReduceScatter::kNative && run.clip == 0 && !lamb;
  std::unique_ptr<apex::amp::GradScaler> scaler;
  if (scaled) {
    scaler = std::make_unique<apex::amp::GradScaler>(
        apex::amp::GradScalerOptions().device(c10::kCPU).init_scale(1024.0));
  }
  int64_t taken = 0;
  auto position = [&](const std::vector<at::Tensor>& layout) {
    std::string out;
    const auto ps = local->parameters();
    for (const auto& t : layout) {
      for (size_t i = 0; i < ps.size(); ++i) {
        if (ps[i].is_same(t)) out += std::to_string(i) + " ";
      }
    }
    return out;
  };
  // `fixed=1`: init_params_bucket before the first step (the first layer: weight and bias) and
  // before step 2 (the last bias): each group leads the layout in buckets of its own, and with
  // one bucket for the rest the shard is one padded bucket per segment; the state moves with the
  // layout (still bit-identical to the replay).
  const bool fixed = get(a, "fixed", "0") == "1";
  std::vector<int64_t> groups;  // elements per init_params_bucket group (new ones only)
  const auto fix = [&](const std::vector<at::Tensor>& group, int64_t added,
                       const std::string& expect) {
    opt.init_params_bucket(group);
    groups.push_back(added);
    int64_t rest = 0;
    for (const auto& p : local->parameters()) rest += p.numel();
    int64_t want = 0;  // a padded bucket per group and one for the rest
    for (const int64_t e : groups) {
      want += (e + 32 * world - 1) / (32 * world) * 32;
      rest -= e;
    }
    want += (rest + 32 * world - 1) / (32 * world) * 32;
    int bad_here = 0;
    if (position(opt.layout()).rfind(expect, 0) != 0) {
      std::cout << "init_params_bucket: layout " << position(opt.layout())
                << ", expected it to start " << expect << "\n";
      ++bad_here;
    }
    if (run.bucket_mb >= 1 && opt.memory().shard_elements != want) {
      std::cout << "init_params_bucket: " << opt.memory().shard_elements
                << " shard elements, expected " << want << " (one bucket per segment)\n";
      ++bad_here;
    }
    return bad_here;
  };
  int bad = 0;
  int bad_fixed = 0;
  if (fixed) {
    const auto ps = local->parameters();
    bad_fixed += fix({ps[0], ps[1]}, ps[0].numel() + ps[1].numel(), "0 1 ");
  }
  const std::string before = position(opt.layout());
  for (int s = 0; s < steps; ++s) {
    if (fixed && s == 2) {
      const auto ps = local->parameters();
      // ps[0] is in a group already: ignored.
      bad_fixed +=
          fix({ps.back(), ps[0]}, ps.back().numel(), "0 1 " + std::to_string(ps.size() - 1) + " ");
    }
    const bool stepped = iteration(rank, world, s, run, local, opt, scaler.get());
    if (s == 0 && scale_param) {
      // The scale's gradient arrived first: it leads the layout after the first step.
      const std::string after = position(opt.layout());
      if (after == before || after.rfind("0 ", 0) != 0) {
        std::cout << "the layout did not follow the gradients' arrival: " << before << "-> "
                  << after << "\n";
        ++bad;
      }
    }
    if (s != run.inf_step) ref.step(world, s, run);
    taken += stepped ? 1 : 0;
    if (stepped == (s == run.inf_step)) {
      std::cout << "step " << s << ": stepped " << stepped << ", expected the opposite\n";
      ++bad;
    }
    bad += same_on_every_rank(*local, pg);
    bad += compare(local->parameters(), ref.model->parameters(), exact, run.dtype,
                   "step " + std::to_string(s));
    if (bad > 0) break;
  }
  if (fixed) {
    // Refused on every rank, nothing changed: a tensor that is not a parameter here, and ranks
    // giving different parameters.
    bad += bad_fixed;
    const std::string kept = position(opt.layout());
    const auto refused = [&](const std::vector<at::Tensor>& g, const std::string& text) {
      try {
        opt.init_params_bucket(g);
        std::cout << "init_params_bucket accepted what should fail with: " << text << "\n";
        ++bad;
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        if (msg.find(text) == std::string::npos) {
          std::cout << "unexpected message: " << msg << "\n";
          ++bad;
        }
      }
      if (position(opt.layout()) != kept) {
        std::cout << "a refused init_params_bucket changed the layout\n";
        ++bad;
      }
    };
    refused({at::ones({3})}, "tensor 0 (Float[3]) is not one of this optimizer's parameters");
    if (world > 1) {
      const auto ps = local->parameters();
      refused({rank == 0 ? ps[2] : ps[3]}, "rank 1 gave other parameters than rank 0");
    }
  }
  if (opt.step_count(0) != taken || opt.step_count(1) != taken) {
    std::cout << "step counts " << opt.step_count(0) << ", " << opt.step_count(1) << "; expected "
              << taken << "\n";
    ++bad;
  }
  if (scaler) {
    const auto scales = pg.all_gather(at::full({1}, scaler->get_scale(), at::kDouble));
    for (const auto& sc : scales) {
      if (!at::equal(sc, scales[0])) {
        std::cout << "the loss scales differ between ranks\n";
        ++bad;
      }
    }
    if (run.inf_step >= 0 && scaler->get_scale() != 512.0) {
      std::cout << "scale " << scaler->get_scale() << " after one skipped step, expected 512\n";
      ++bad;
    }
  }
  if (!run.store_params && run.dtype != at::kFloat) {
    const auto mem = opt.memory();
    if (mem.state_bytes != 8 * mem.shard_elements) {
      std::cout << "store_params(false): " << mem.state_bytes << " bytes of state for "
                << mem.shard_elements << " shard elements, expected 8 per element\n";
      ++bad;
    }
  }
  if (!lamb) bad += compare_state(opt, ref, exact);
  if (bad == 0 && rank == 0) std::cout << (exact ? "bit-identical\n" : "within tolerance\n");
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_eq("dfa_equivalence", equivalence);

// Checkpoints: `phase=save` trains `steps` steps and saves (sharded, the model on rank 0, and the
// consolidated state); `phase=load` loads (sharded or consolidated) at this world size, trains
// on to `steps`, and compares with one process that never stopped.
int checkpoint(int rank, int world, const std::string& arg) {
  const auto a = parse_args(arg);
  const std::string phase = get(a, "phase", "save");
  const std::string dir = get(a, "dir", "");
  const std::string how = get(a, "how", "sharded");
  const int steps = std::stoi(get(a, "steps", "3"));
  Run run;
  run.dtype = get(a, "dtype", "float") == "bf16" ? at::kBFloat16 : at::kFloat;
  auto pg = join();
  auto [ref_model, local] = models(rank, run.dtype);
  if (phase == "save") {
    ap::DistributedFusedAdam opt(dfa_groups(local), dfa_options(run), pg);
    for (int s = 0; s < steps; ++s) iteration(rank, world, s, run, local, opt, nullptr);
    opt.save_sharded(dir);
    const auto cs = opt.consolidated_state_dict();
    const auto ts = opt.torch_state_dict();
    if (rank == 0) {
      apex::save_module(*local, dir + "/model.pt");
      apex::save_pickle(cs, dir + "/consolidated.pt");
      apex::save_pickle(ts, dir + "/adamw.pt");
    }
    pg.barrier();
    return 0;
  }
  const int start = std::stoi(get(a, "start", "3"));
  apex::load_module(*local, dir + "/model.pt");
  ap::DistributedFusedAdam opt(dfa_groups(local), dfa_options(run), pg);
  if (phase == "corrupt") {
    // A damaged or foreign checkpoint is refused naming the file, and nothing changes.
    const auto before = opt.consolidated_state_dict();
    std::string msg;
    try {
      opt.load_sharded(dir);
    } catch (const c10::Error& e) {
      msg = e.what_without_backtrace();
    }
    const std::string expect = get(a, "expect", "");
    if (msg.find(expect) == std::string::npos) {
      std::cout << "the error does not name '" << expect << "': " << msg << "\n";
      return 1;
    }
    const auto after = opt.consolidated_state_dict();
    const auto b = before.at("state").toGenericDict();
    const auto f = after.at("state").toGenericDict();
    for (const auto& kv : b) {
      const auto d0 = kv.value().toGenericDict();
      const auto d1 = f.at(kv.key()).toGenericDict();
      for (const char* k : {"param", "exp_avg", "exp_avg_sq"}) {
        if (!at::equal(d0.at(k).toTensor(), d1.at(k).toTensor())) {
          std::cout << "a failed load changed " << k << "\n";
          return 1;
        }
      }
    }
    if (opt.step_count(0) != 0) {
      std::cout << "a failed load changed the step\n";
      return 1;
    }
    std::cout << "refused: " << msg << "\n";
    return 0;
  }
  if (how == "sharded") {
    opt.load_sharded(dir);
  } else {
    opt.load_consolidated_state_dict(apex::load_pickle(dir + "/consolidated.pt").toGenericDict());
  }
  if (opt.step_count(0) != start) {
    std::cout << "loaded step " << opt.step_count(0) << ", expected " << start << "\n";
    return 1;
  }
  // The reference: one process, never interrupted (the first steps at the saving world size).
  const int saved_world = std::stoi(get(a, "saved_world", "1"));
  Reference ref(ref_model);
  int bad = 0;
  for (int s = 0; s < steps; ++s) {
    if (s < start) {
      ref.step(saved_world, s, run);
      continue;
    }
    iteration(rank, world, s, run, local, opt, nullptr);
    ref.step(world, s, run);
    bad += compare(local->parameters(), ref.model->parameters(), true, run.dtype,
                   "resumed step " + std::to_string(s));
  }
  bad += compare_state(opt, ref, true);
  if (bad == 0 && rank == 0) std::cout << "bit-identical to the uninterrupted run\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_ckpt("dfa_checkpoint", checkpoint);

// The torch.optim.AdamW layout: FusedAdam in one process loads it and continues as the sharded
// run does.
int export_adamw(int rank, int world, const std::string& arg) {
  Run run;
  auto pg = join();
  auto [ref_model, local] = models(rank, run.dtype);
  ap::DistributedFusedAdam opt(dfa_groups(local), dfa_options(run), pg);
  for (int s = 0; s < 3; ++s) iteration(rank, world, s, run, local, opt, nullptr);
  const auto sd = opt.torch_state_dict();
  // The single process starts from the sharded run's weights and its exported state.
  copy_params(*ref_model, *local);
  Reference ref(ref_model);
  ref.opt->load_python_state_dict(sd);
  int bad = 0;
  for (int s = 3; s < 5; ++s) {
    iteration(rank, world, s, run, local, opt, nullptr);
    ref.step(world, s, run);
    bad += compare(local->parameters(), ref.model->parameters(), true, run.dtype,
                   "after export, step " + std::to_string(s));
  }
  if (bad == 0 && rank == 0) std::cout << "bit-identical\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_export("dfa_export", export_adamw);

// Bytes per rank: the state is 12 bytes (fp32 master, exp_avg, exp_avg_sq) and the gradient
// shard 4 per element of this rank's shard, which is 1/W of the parameters plus padding.
int memory(int rank, int world, const std::string& arg) {
  auto pg = join();
  torch::manual_seed(3);
  torch::nn::Sequential m(torch::nn::Linear(200, 300), torch::nn::ReLU(),
                          torch::nn::Linear(300, 50));
  m->to(at::kBFloat16);
  const double cap = std::stod(get(parse_args(arg), "bucket_mb", "0.1"));
  ap::DistributedFusedAdam opt(m->parameters(),
                               ap::DistributedFusedAdamOptions().bucket_cap_mb(cap), pg);
  const auto mem = opt.memory();
  int64_t psi = 0;
  for (const auto& p : m->parameters()) psi += p.numel();
  const int64_t buckets_max =
      static_cast<int64_t>(std::ceil(static_cast<double>(psi) * 4 / (cap * 1024 * 1024))) + 1;
  int bad = 0;
  if (mem.params != psi) ++bad;
  if (mem.state_bytes != 12 * mem.shard_elements) ++bad;
  if (mem.grad_shard_bytes != 4 * mem.shard_elements) ++bad;
  const int64_t ideal = (psi + world - 1) / world;
  if (mem.shard_elements < ideal || mem.shard_elements > ideal + buckets_max * 32) ++bad;
  // A backward fills the buckets; after the step none of them is alive.
  const at::Tensor x = randn_seeded({4, 200}, 9).to(at::kBFloat16);
  m->forward(x).to(at::kFloat).pow(2).mean().backward();
  for (const auto& p : m->parameters()) {
    if (p.grad().defined()) {
      std::cout << "p.grad is still defined after backward\n";
      ++bad;
    }
  }
  opt.step();
  if (opt.memory().grad_buffer_bytes != 0) {
    std::cout << "bucket buffers alive after the step: " << opt.memory().grad_buffer_bytes << "\n";
    ++bad;
  }
  std::cout << "world " << world << ": " << psi << " parameters, shard " << mem.shard_elements
            << " elements, state " << mem.state_bytes << " B, gradient shard "
            << mem.grad_shard_bytes
            << " B: " << static_cast<double>(2 * psi + mem.state_bytes + mem.grad_shard_bytes) / psi
            << " B/param with the bf16 model (formula 2 + 16/W with fp32 gradient sync: "
            << 2.0 + 16.0 / world << ")\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_mem("dfa_memory", memory);

// store_param_remainders: one bf16 model under two DistributedFusedAdams, one keeping fp32 masters
// and one 16-bit remainders, fed the same gradients: after every step the gathered masters and
// moments are equal bit for bit, each parameter is its master's high half rounded half up (so the
// two models differ, by one unit, only where a master's low half is exactly 0x8000), the state
// takes 10 bytes per shard element instead of 12; the consolidated state loads into a fresh
// optimizer with the same masters and model; fp16 parameters are refused naming the fix.
// `opt=lamb`: the same with DistributedFusedLAMB (its kernel rows read the same merged masters).
std::unique_ptr<ap::DistributedFusedOptimizer> remainder_optimizer(bool lamb,
                                                                   std::vector<at::Tensor> params,
                                                                   bool remainders,
                                                                   const ap::ProcessGroup& pg) {
  if (lamb) {
    const auto o = ap::DistributedFusedLAMBOptions(0.01)
                       .weight_decay(0.01)
                       .bucket_cap_mb(0.0003)
                       .store_param_remainders(remainders);
    return std::make_unique<ap::DistributedFusedLAMB>(std::move(params), o, pg);
  }
  const auto o = ap::DistributedFusedAdamOptions(0.01)
                     .weight_decay(0.01)
                     .bucket_cap_mb(0.0003)
                     .store_param_remainders(remainders);
  return std::make_unique<ap::DistributedFusedAdam>(std::move(params), o, pg);
}

int remainders(int rank, int world, const std::string& arg) {
  const bool lamb = get(parse_args(arg), "opt", "adam") == "lamb";
  auto pg = join();
  torch::manual_seed(5);
  auto a = mlp();
  auto b = mlp();
  copy_params(*b, *a);
  a->to(at::kBFloat16);
  b->to(at::kBFloat16);
  const auto with_holder = remainder_optimizer(lamb, a->parameters(), true, pg);
  const auto without_holder = remainder_optimizer(lamb, b->parameters(), false, pg);
  ap::DistributedFusedOptimizer& with = *with_holder;
  ap::DistributedFusedOptimizer& without = *without_holder;
  int bad = 0;
  const auto ma = with.memory();
  const auto mb = without.memory();
  if (ma.state_bytes != 10 * ma.shard_elements || mb.state_bytes != 12 * mb.shard_elements) {
    std::cout << "state bytes " << ma.state_bytes << " / " << mb.state_bytes << " for "
              << ma.shard_elements << " shard elements; expected 10 and 12 per element\n";
    ++bad;
  }
  const auto pa = a->parameters();
  const auto pb = b->parameters();
  // The parameter a master's bits give: the high half, plus one where the low half is >= 0x8000.
  const auto high_half_up = [](const at::Tensor& master) {
    const at::Tensor bits = master.contiguous().view(at::kInt).to(at::kLong);
    const at::Tensor low = bits.bitwise_and(0xFFFF);
    return std::make_pair(
        (bits.bitwise_right_shift(16) + low.ge(0x8000).to(at::kLong)).bitwise_and(0xFFFF), low);
  };
  const auto bits16 = [](const at::Tensor& p) {
    return p.detach().contiguous().view(at::kShort).to(at::kLong).bitwise_and(0xFFFF).reshape({-1});
  };
  int64_t ties = 0;
  for (int step = 0; step < 6; ++step) {
    for (int which = 0; which < 2; ++which) {
      const auto& ps = which == 0 ? pa : pb;
      ap::DistributedFusedOptimizer& opt = which == 0 ? with : without;
      at::Tensor loss = at::zeros({}, at::kFloat);
      for (size_t i = 0; i < ps.size(); ++i) {
        const at::Tensor g =
            randn_seeded(ps[i].sizes(), 300 + 10 * step + static_cast<int>(i) + 1000 * rank);
        loss = loss + (ps[i].to(at::kFloat) * g).sum();
      }
      loss.backward();
      opt.step();
      opt.zero_grad();
    }
    const auto sa = with.consolidated_state_dict().at("state").toGenericDict();
    const auto sb = without.consolidated_state_dict().at("state").toGenericDict();
    for (const auto& kv : sa) {
      const int64_t i = kv.key().toInt();
      const auto da = kv.value().toGenericDict();
      const auto db = sb.at(i).toGenericDict();
      bad += compare(
          {da.at("param").toTensor(), da.at("exp_avg").toTensor(), da.at("exp_avg_sq").toTensor()},
          {db.at("param").toTensor(), db.at("exp_avg").toTensor(), db.at("exp_avg_sq").toTensor()},
          true, at::kFloat, "step " + std::to_string(step) + ", state " + std::to_string(i));
      const auto [want, low] = high_half_up(da.at("param").toTensor().reshape({-1}));
      const at::Tensor got = bits16(pa[static_cast<size_t>(i)]);
      if (!at::equal(got, want)) {
        std::cout << "step " << step << ": parameter " << i
                  << " is not its master's high half rounded half up\n";
        ++bad;
      }
      const at::Tensor tie = low.eq(0x8000);
      ties += tie.sum().item<int64_t>();
      const at::Tensor other = bits16(pb[static_cast<size_t>(i)]);
      if (!at::equal(got.masked_select(tie.logical_not()),
                     other.masked_select(tie.logical_not()))) {
        std::cout << "step " << step << ": parameter " << i
                  << " differs from the fp32-master model away from ties\n";
        ++bad;
      }
    }
  }
  // The consolidated state into a fresh model and optimizer: the same masters and model.
  torch::manual_seed(77);
  auto c = mlp();
  c->to(at::kBFloat16);
  const auto fresh_holder = remainder_optimizer(lamb, c->parameters(), true, pg);
  ap::DistributedFusedOptimizer& fresh = *fresh_holder;
  fresh.load_consolidated_state_dict(with.consolidated_state_dict());
  const auto sf = fresh.consolidated_state_dict().at("state").toGenericDict();
  const auto sa = with.consolidated_state_dict().at("state").toGenericDict();
  for (const auto& kv : sf) {
    const int64_t i = kv.key().toInt();
    bad += compare({kv.value().toGenericDict().at("param").toTensor()},
                   {sa.at(i).toGenericDict().at("param").toTensor()}, true, at::kFloat,
                   "loaded master " + std::to_string(i));
  }
  bad += compare(c->parameters(), a->parameters(), true, at::kBFloat16, "loaded model");
  // fp32: nothing to keep remainders of, refused.
  try {
    remainder_optimizer(lamb, mlp()->parameters(), true, pg);
    std::cout << "fp32 parameters with store_param_remainders were accepted\n";
    ++bad;
  } catch (const c10::Error& e) {
    if (std::string(e.what_without_backtrace()).find("no parameter is BFloat16") ==
        std::string::npos) {
      std::cout << "unexpected message: " << e.what_without_backtrace() << "\n";
      ++bad;
    }
  }
  // fp16: refused before anything collective.
  auto h = mlp();
  h->to(at::kHalf);
  try {
    remainder_optimizer(lamb, h->parameters(), true, pg);
    std::cout << "fp16 parameters with store_param_remainders were accepted\n";
    ++bad;
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find("store_param_remainders") == std::string::npos ||
        msg.find("is Half") == std::string::npos) {
      std::cout << "unexpected message: " << msg << "\n";
      ++bad;
    }
  }
  std::cout << (lamb ? "LAMB" : "Adam") << ", rank " << rank << " of " << world << ": 6 steps, "
            << ties << " ties (low half 0x8000) seen\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_rem("dfa_remainders", remainders);

// Faults: ranks with different models, a rank that dies before its step.
int fault(int rank, int world, const std::string& arg) {
  const auto a = parse_args(arg);
  const std::string mode = get(a, "mode", "");
  if (mode == "ifname") {
    // A store on a non-loopback address: refused before anything connects.
    try {
      ap::init_process_group(ap::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      std::cout << msg << "\n";
      return msg.find("set GLOO_SOCKET_IFNAME") != std::string::npos ? 0 : 1;
    }
    std::cout << "the group formed\n";
    return 1;
  }
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().timeout(std::chrono::seconds(8)));
  auto [ref, local] = models(rank, at::kFloat, mode == "layout" && rank == 1 ? 17 : 16);
  if (mode == "layout") {
    try {
      ap::DistributedFusedAdam opt(local->parameters(), {}, pg);
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      std::cout << msg << "\n";
      return msg.find("rank 1 has a different layout") != std::string::npos ? 0 : 1;
    }
    std::cout << "different layouts were accepted\n";
    return 1;
  }
  Run run;
  run.cap_mb = std::stod(get(a, "cap_mb", "0"));  // the exchanges in pieces
  ap::DistributedFusedAdam opt(local->parameters(), dfa_options(run), pg);
  const at::Tensor x = inputs(0, 0).slice(0, 0, 6);
  at::mse_loss(local->forward(x), targets(0, 0).slice(0, 0, 6)).backward();
  if (rank == 1) _exit(3);  // dies with its reduce-scatters started
  try {
    opt.step();
  } catch (const c10::Error& e) {
    std::cout << e.what_without_backtrace() << "\n";
    return 0;
  }
  std::cout << "the step succeeded without rank 1\n";
  return 1;
}
const RegisterWorker r_fault("dfa_fault", fault);

// process_group_of: a c10d group someone else made (here, ours) wrapped again; what the Python
// package's sharded optimizers run on (torch.distributed's group).
int wrapped(int rank, int world, const std::string& /*arg*/) {
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().timeout(std::chrono::seconds(20)));
  const auto refused = [](const std::function<void()>& f, const std::string& what) {
    try {
      f();
    } catch (const c10::Error& e) {
      const std::string msg = e.what_without_backtrace();
      if (msg.find(what) != std::string::npos) return true;
      std::cout << "unexpected message: " << msg << "\n";
      return false;
    }
    std::cout << "accepted, expected: " << what << "\n";
    return false;
  };
  bool ok = refused([] { ap::process_group_of({}, c10::kCPU, std::chrono::seconds(1)); },
                    "the c10d group is null");
  ok = refused(
           [&] {
             ap::process_group_of(ap::c10d_group(pg), c10::Device(c10::kCUDA, 0),
                                  std::chrono::seconds(1));
           },
           "a gloo group takes CPU tensors, got device cuda:0") &&
       ok;
  ap::ProcessGroup w =
      ap::process_group_of(ap::c10d_group(pg), c10::kCPU, std::chrono::seconds(20));
  at::Tensor t = at::full({3}, static_cast<double>(rank + 1));
  w.all_reduce_(t);
  ok = ok && w.rank() == rank && w.size() == world && w.backend() == ap::Backend::kGloo &&
       at::equal(t, at::full({3}, world * (world + 1) / 2.0));
  // A sharded optimizer on the wrapped group trains as on the group itself.
  auto [ref, local] = models(rank, at::kFloat, 16);
  auto [ref2, local2] = models(rank, at::kFloat, 16);
  ap::DistributedFusedAdam a(local->parameters(), dfa_options(Run{}), pg);
  ap::DistributedFusedAdam b(local2->parameters(), dfa_options(Run{}), w);
  for (int step = 0; step < 2; ++step) {
    const at::Tensor x = inputs(step, rank);
    at::mse_loss(local->forward(x), targets(step, rank)).backward();
    a.step();
    at::mse_loss(local2->forward(x), targets(step, rank)).backward();
    b.step();
  }
  for (size_t i = 0; i < local->parameters().size(); ++i) {
    ok = ok && at::equal(local->parameters()[i], local2->parameters()[i]);
  }
  w.destroy();  // forgets the wrapped copy; the group itself goes on
  pg.barrier();
  std::cout << (ok ? "ok" : "failed") << "\n";
  return ok ? 0 : 1;
}
const RegisterWorker r_wrapped("dfa_wrapped", wrapped);

bool all_passed(const std::vector<apex::test::RankResult>& r) {
  for (const auto& x : r) {
    if (x.exit_code != 0) return false;
  }
  return true;
}

void run(const std::string& worker, int world, const std::string& arg) {
  LaunchOptions o;
  o.world = world;
  o.arg = arg;
  const auto r = launch(worker, o);
  EXPECT_TRUE(all_passed(r)) << worker << " " << arg << " on " << world << " ranks:\n"
                             << apex::test::describe(r);
}

std::string fresh_dir(const std::string& name) {
  const std::string dir =
      ::testing::TempDir() + "apex_dfa_" + name + "_" + std::to_string(getpid());
  std::system(("rm -rf '" + dir + "'").c_str());
  ::mkdir(dir.c_str(), 0755);
  return dir;
}

}  // namespace

TEST(DistributedFusedAdam, OneRankIsBitIdenticalToFusedAdam) { run("dfa_equivalence", 1, ""); }
TEST(DistributedFusedAdam, TwoRanksMatchWholeBatch) { run("dfa_equivalence", 2, ""); }
TEST(DistributedFusedAdam, ThreeRanksMatchWholeBatch) { run("dfa_equivalence", 3, ""); }
TEST(DistributedFusedAdam, FourRanksMatchWholeBatch) { run("dfa_equivalence", 4, ""); }
TEST(DistributedFusedAdam, NativeReduceScatterThreeRanks) {
  run("dfa_equivalence", 3, "rs=native");
}
TEST(DistributedFusedAdam, Bf16ModelWithMastersThreeRanks) {
  run("dfa_equivalence", 3, "dtype=bf16");
}
TEST(DistributedFusedAdam, NoSyncAccumulationOverThreeMicroBatches) {
  run("dfa_equivalence", 2, "micro=3");
  run("dfa_equivalence", 3, "micro=3,contiguous=1");
}
TEST(DistributedFusedAdam, OneBucket) { run("dfa_equivalence", 2, "bucket_mb=100"); }
// message_cap_mb: a bucket's reduce-scatter and parameter all-gather as collectives of at most
// 32 elements per peer (the smallest piece; 0.0002 MiB is 52 fp32), several per bucket and shard.
// The all-to-all pieces sum in rank order as before: bit-identical to the replay.
TEST(DistributedFusedAdam, MessageCapSendsBucketsInPieces) {
  run("dfa_equivalence", 2, "bucket_mb=100,cap_mb=0.0002");
  run("dfa_equivalence", 3, "cap_mb=0.0001,dtype=bf16,micro=3,contiguous=1");
  run("dfa_equivalence", 3, "bucket_mb=100,cap_mb=0.0002,rs=native");
  run("dfa_equivalence", 2, "bucket_mb=100,cap_mb=0.0002,opt=lamb,scale=1");
}
// The layout follows the first backward's gradient order (rank 0's) after the first step; the
// state moves with it: still bit-identical to the replay.
TEST(DistributedFusedAdam, LayoutFollowsTheFirstBackwardsGradientOrder) {
  run("dfa_equivalence", 3, "scale=1");
  run("dfa_equivalence", 2, "scale=1,dtype=bf16,micro=3");
  run("dfa_equivalence", 2, "scale=1,opt=lamb");
}
// init_params_bucket: groups in buckets of their own ahead of the rest, before the first step
// and between steps (the state moves); foreign tensors and ranks that disagree are refused.
TEST(DistributedFusedAdam, InitParamsBucketGivesGroupsTheirOwnBuckets) {
  run("dfa_equivalence", 2, "fixed=1,bucket_mb=100");
  run("dfa_equivalence", 3, "fixed=1,bucket_mb=100,dtype=bf16");
  run("dfa_equivalence", 3, "fixed=1,micro=3");
  run("dfa_equivalence", 2, "fixed=1,bucket_mb=100,opt=lamb");
}
// store_params(false): no fp32 master; each step updates the bf16 parameters from their own
// values (the replay copies its masters back from the rounded parameters): bit-identical, 8 bytes
// of state per shard element.
TEST(DistributedFusedAdam, WithoutStoreParamsHalfParametersAreTheirOwnMasters) {
  run("dfa_equivalence", 3, "dtype=bf16,store_params=0");
  run("dfa_equivalence", 2, "dtype=bf16,store_params=0,micro=3,bucket_mb=100,scale=1");
  run("dfa_equivalence", 2, "dtype=bf16,store_params=0,opt=lamb");
}
TEST(DistributedFusedAdam, UnusedParameterTravelsAsZeros) {
  run("dfa_equivalence", 3, "unused=1");
  run("dfa_equivalence", 2, "unused=1,micro=3");
}

// LAMB: per-parameter norms over fragments in other buckets and on other ranks.
TEST(DistributedFusedLAMB, MatchesFusedLAMBOnOneToFourRanks) {
  for (int w = 1; w <= 4; ++w) run("dfa_equivalence", w, "opt=lamb");
}
TEST(DistributedFusedLAMB, Bf16MastersNoSyncAndInfSkip) {
  run("dfa_equivalence", 3, "opt=lamb,dtype=bf16,micro=3");
  run("dfa_equivalence", 2, "opt=lamb,inf_step=1");
}
TEST(DistributedFusedAdam, GradScalerInfOnOneRankSkipsEveryRank) {
  run("dfa_equivalence", 2, "inf_step=1");
  run("dfa_equivalence", 3, "inf_step=2,dtype=bf16");
}
TEST(DistributedFusedAdam, ClipGradNormMatchesWholeBatch) {
  run("dfa_equivalence", 2, "clip=0.05");
  run("dfa_equivalence", 3, "clip=0.05,scaler=1");
}

TEST(DistributedFusedAdam, ShardedCheckpointsLoadAtAnyWorldSize) {
  for (const auto& [n, m] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 3}, {3, 2}}) {
    for (const char* dtype : {"float", "bf16"}) {
      const std::string dir = fresh_dir("reshard");
      run("dfa_checkpoint", n, std::string("phase=save,dtype=") + dtype + ",dir=" + dir);
      run("dfa_checkpoint", m,
          "phase=load,steps=5,start=3,saved_world=" + std::to_string(n) + ",dtype=" + dtype +
              ",dir=" + dir);
      std::system(("rm -rf '" + dir + "'").c_str());
    }
  }
}

TEST(DistributedFusedAdam, ConsolidatedStateLoadsAtAnotherWorldSize) {
  const std::string dir = fresh_dir("consolidated");
  run("dfa_checkpoint", 2, "phase=save,dtype=bf16,dir=" + dir);
  run("dfa_checkpoint", 3,
      "phase=load,how=consolidated,steps=5,start=3,saved_world=2,dtype=bf16,dir=" + dir);
  std::system(("rm -rf '" + dir + "'").c_str());
}

TEST(DistributedFusedAdam, TorchAdamWLayoutContinuesInFusedAdam) {
  run("dfa_export", 1, "");
  run("dfa_export", 2, "");
}

TEST(DistributedFusedAdam, DamagedShardsAreRefusedNamingTheFile) {
  const std::string dir = fresh_dir("corrupt");
  run("dfa_checkpoint", 2, "phase=save,dir=" + dir);
  // A flipped byte in rank 1's shard.
  {
    const std::string path = dir + "/shard-1-of-2.pt";
    std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
    f.seekg(0, std::ios::end);
    const auto size = static_cast<std::streamoff>(f.tellg());
    f.seekg(size / 2);
    char c = 0;
    f.read(&c, 1);
    c = static_cast<char>(c ^ 0x5a);
    f.seekp(size / 2);
    f.write(&c, 1);
  }
  run("dfa_checkpoint", 3, "phase=corrupt,expect=shard-1-of-2.pt,dir=" + dir);
  // A missing shard.
  std::remove((dir + "/shard-1-of-2.pt").c_str());
  run("dfa_checkpoint", 2, "phase=corrupt,expect=shard-1-of-2.pt,dir=" + dir);
  // A shard of another save.
  run("dfa_checkpoint", 2, "phase=save,dir=" + dir);
  const std::string other = fresh_dir("corrupt_other");
  run("dfa_checkpoint", 2, "phase=save,dir=" + other);
  std::rename((other + "/shard-0-of-2.pt").c_str(), (dir + "/shard-0-of-2.pt").c_str());
  run("dfa_checkpoint", 2, "phase=corrupt,expect=another save,dir=" + dir);
  std::system(("rm -rf '" + dir + "' '" + other + "'").c_str());
}

TEST(DistributedFusedAdam, StateBytesPerRankFollowTheFormula) {
  for (int w = 1; w <= 4; ++w) run("dfa_memory", w, "");
}

TEST(DistributedFusedAdam, ParamRemaindersKeepTheFp32MastersBitForBit) {
  for (int w : {1, 2, 3}) run("dfa_remainders", w, "");
}
TEST(DistributedFusedLAMB, ParamRemaindersKeepTheFp32MastersBitForBit) {
  for (int w : {1, 2, 3}) run("dfa_remainders", w, "opt=lamb");
}

TEST(DistributedFusedAdam, DifferentLayoutsAreRefusedNamingTheRank) {
  run("dfa_fault", 2, "mode=layout");
}

// Several machines: Gloo advertises the address this host's name resolves to; when that is
// loopback and MASTER_ADDR is not, every rank fails at once naming GLOO_SOCKET_IFNAME (rank 0
// used to wait for the whole timeout).
TEST(MultiNode, LoopbackHostnameWithoutInterfaceFailsFastOnEveryRank) {
  char name[256] = {};
  ASSERT_EQ(gethostname(name, sizeof(name) - 1), 0);
  addrinfo hints{};
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  ASSERT_EQ(getaddrinfo(name, nullptr, &hints, &found), 0) << name;
  bool loopback = true;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    loopback = loopback && a->ai_family == AF_INET &&
               (ntohl(reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr.s_addr) >> 24) == 127;
  }
  freeaddrinfo(found);
  if (!loopback) GTEST_SKIP() << "this host's name resolves to a routable address";
  LaunchOptions o;
  o.world = 2;
  o.arg = "mode=ifname";
  o.deadline_s = 30;
  o.env = {{"MASTER_ADDR", "10.77.0.9"}};
  const auto r = launch("dfa_fault", o);
  for (const auto& x : r) {
    EXPECT_EQ(x.exit_code, 0) << apex::test::describe(r);
    EXPECT_LT(x.seconds, 5) << apex::test::describe(r);
  }
}

TEST(DistributedFusedAdam, OnAWrappedC10dGroupAsOnItsOwn) { run("dfa_wrapped", 2, ""); }

TEST(DistributedFusedAdam, DeadRankFailsTheOthersWithinTheTimeout) {
  // As one collective per bucket, and in pieces (message_cap_mb).
  for (const char* arg : {"mode=dead", "mode=dead,cap_mb=0.0001"}) {
    LaunchOptions o;
    o.world = 2;
    o.arg = arg;
    o.deadline_s = 40;
    const auto r = launch("dfa_fault", o);
    EXPECT_EQ(r[0].exit_code, 0) << arg << apex::test::describe(r);
    EXPECT_LT(r[0].seconds, 30) << arg << apex::test::describe(r);
    EXPECT_NE(r[0].output.find("DistributedFusedAdam"), std::string::npos)
        << arg << apex::test::describe(r);
  }
}
