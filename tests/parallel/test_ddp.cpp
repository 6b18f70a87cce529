// DistributedDataParallel, process groups and their faults: real processes (copies of this
// binary) on Gloo over 127.0.0.1. Every equivalence test compares against one process training
// on the whole batch.
#include <apex/amp/initialize.h>
#include <apex/parallel.h>
#include <torch/nn.h>
#include <torch/optim/sgd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdlib>
#include <iostream>
#include <map>
#include <sstream>
#include <thread>

#include "common/test_util.h"
#include "launcher.h"

namespace ap = apex::parallel;

namespace apex::parallel::detail {
// src/parallel/backends.h (not a public header): whether Gloo's transport thread calls our handler.
bool gloo_transport_guarded();
}  // namespace apex::parallel::detail
using apex::test::all_close;
using apex::test::get;
using apex::test::launch;
using apex::test::LaunchOptions;
using apex::test::parse_args;
using apex::test::randn_seeded;
using apex::test::RegisterWorker;
using apex::test::tolerance_for;

namespace {

// The models: an MLP, a CNN with BatchNorm (SyncBatchNorm under DDP) and a small transformer.
// Each returns logits for `x`.
struct Model {
  std::shared_ptr<torch::nn::Module> module;
  std::function<at::Tensor(const at::Tensor&)> forward;
};

torch::nn::Sequential mlp() {
  return torch::nn::Sequential(torch::nn::Linear(12, 16), torch::nn::ReLU(),
                               torch::nn::Linear(16, 16), torch::nn::Tanh(),
                               torch::nn::Linear(16, 4));
}

torch::nn::Sequential cnn() {
  return torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 4, 3).padding(1)),
                               torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::Flatten(),
                               torch::nn::Linear(4 * 6 * 6, 4));
}

at::Tensor inputs_for(const std::string& model, int64_t n, uint64_t seed) {
  if (model == "cnn") return randn_seeded({n, 2, 6, 6}, seed);
  if (model == "transformer") {
    auto gen = at::detail::createCPUGenerator(seed);
    return at::randint(0, 16, {n, 8}, gen);
  }
  return randn_seeded({n, 12}, seed);
}

// Tokens [B, 8] of a 16-word vocabulary -> 4 logits: an embedding with learned positions, two of
// LibTorch's encoder layers (2 heads, no dropout), the mean over positions, a linear head.
struct TinyTransformer : torch::nn::Module {
  TinyTransformer() {
    embed = register_module("embed", torch::nn::Embedding(16, 16));
    pos = register_parameter("pos", torch::randn({8, 16}) * 0.02);
    encoder = register_module(
        "encoder",
        torch::nn::TransformerEncoder(torch::nn::TransformerEncoderOptions(
            torch::nn::TransformerEncoderLayerOptions(16, 2).dim_feedforward(32).dropout(0.0), 2)));
    head = register_module("head", torch::nn::Linear(16, 4));
  }
  at::Tensor forward(const at::Tensor& tokens) {
    const at::Tensor h = embed(tokens) + pos;  // [B, L, D]; LibTorch's layers take [L, B, D]
    return head(encoder(h.transpose(0, 1)).transpose(0, 1).mean(1));
  }
  torch::nn::Embedding embed{nullptr};
  at::Tensor pos;
  torch::nn::TransformerEncoder encoder{nullptr};
  torch::nn::Linear head{nullptr};
};

std::shared_ptr<TinyTransformer> transformer(uint64_t seed) {
  torch::manual_seed(seed);
  return std::make_shared<TinyTransformer>();
}

void copy_params(torch::nn::Module& dst, const torch::nn::Module& src) {
  const torch::NoGradGuard no_grad;
  auto d = dst.parameters();
  auto s = src.parameters();
  for (size_t i = 0; i < d.size(); ++i) d[i].copy_(s[i]);
}

int compare_params(const torch::nn::Module& got, const torch::nn::Module& want,
                   apex::test::Tolerance tol, const std::string& what) {
  int bad = 0;
  const auto g = got.named_parameters();
  const auto w = want.named_parameters();
  for (size_t i = 0; i < g.size(); ++i) {
    if (!g[i].value().defined() || !w[i].value().defined()) continue;
    const auto r = all_close(g[i].value(), w[i].value(), tol);
    if (!r) {
      std::cout << what << ": parameter " << g[i].key() << ": " << r.message() << "\n";
      ++bad;
    }
  }
  return bad;
}

ap::ProcessGroup join(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  return ap::init_process_group(ap::ProcessGroupOptions().timeout(timeout));
}

// Trains a DDP copy on this rank's shard and the reference on the whole batch, then compares.
int ddp_equivalence(int rank, int world, const std::string& arg) {
  const auto args = parse_args(arg);
  const std::string model = get(args, "model", "mlp");
  const std::string mode = get(args, "mode", "plain");
  const std::string buckets = get(args, "buckets", "many");
  const int steps = std::stoi(get(args, "steps", "4"));
  const int64_t b = 3;  // per-rank batch
  auto pg = join();

  // The reference trains on every sample; the DDP copy starts from other weights on every rank
  // but 0 (seed 100 + rank): DDP's broadcast must make them rank 0's, which are the reference's.
  std::shared_ptr<torch::nn::Module> ref_m, local_m;
  std::function<at::Tensor(const at::Tensor&)> ref_fwd;
  torch::nn::Linear branch{nullptr}, never{nullptr};
  if (model == "transformer") {
    auto r = transformer(1);
    auto l = transformer(100 + rank);
    if (rank == 0) copy_params(*l, *r);
    ref_m = r;
    local_m = l;
    ref_fwd = [r](const at::Tensor& x) { return r->forward(x); };
  } else {
    torch::manual_seed(1);
    auto r = model == "cnn" ? cnn() : mlp();
    torch::manual_seed(100 + rank);
    auto l = model == "cnn" ? cnn() : mlp();
    if (rank == 0) copy_params(*l, *r);
    if (model == "cnn") l = ap::convert_sync_batchnorm(l, pg);
    ref_m = r.ptr();
    local_m = l.ptr();
    ref_fwd = [p = r.ptr()](const at::Tensor& x) { return p->forward(x); };
  }
  // find_unused: a branch used only on rank 1's samples, and a layer no rank uses.
  torch::nn::Sequential local_extra, ref_extra;
  if (mode == "unused") {
    torch::manual_seed(7);
    ref_extra = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
    torch::manual_seed(7);
    local_extra = torch::nn::Sequential(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  }
  struct Wrapped : torch::nn::Module {
    std::shared_ptr<torch::nn::Module> body;
    std::function<at::Tensor(const at::Tensor&)> fwd;
    torch::nn::Sequential extra{nullptr};
    int use_branch = 0;
    Wrapped(std::shared_ptr<torch::nn::Module> m, std::function<at::Tensor(const at::Tensor&)> f,
            torch::nn::Sequential e)
        : body(register_module("body", std::move(m))), fwd(std::move(f)) {
      if (e) extra = register_module("extra", e);
    }
    at::Tensor forward(const at::Tensor& x) {
      at::Tensor y = fwd(x);
      if (use_branch != 0) y = y + extra[0]->as<torch::nn::Linear>()->forward(y);
      return y;
    }
  };
  auto seq_fwd = [](const std::shared_ptr<torch::nn::Module>& m) {
    if (auto s = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(m)) {
      return std::function<at::Tensor(const at::Tensor&)>(
          [s](const at::Tensor& x) { return s->forward(x); });
    }
    auto c = std::dynamic_pointer_cast<TinyTransformer>(m);
    return std::function<at::Tensor(const at::Tensor&)>(
        [c](const at::Tensor& x) { return c->forward(x); });
  };
  auto local = std::make_shared<Wrapped>(local_m, seq_fwd(local_m), local_extra);
  auto ref = std::make_shared<Wrapped>(ref_m, ref_fwd, ref_extra);

  if (mode == "frozen") {
    // The first layer frozen, still initialised per rank: construction makes it rank 0's (as
    // Python's DDP does), or every step differs from the reference.
    auto lp = local->parameters();
    auto rp = ref->parameters();
    for (size_t i = 0; i < 2; ++i) {
      lp[i].set_requires_grad(false);
      rp[i].set_requires_grad(false);
    }
  }
  ap::DistributedDataParallelOptions o;
  if (buckets == "many") o.bucket_cap_mb(0.0005).first_bucket_mb(0.0002);
  if (buckets == "one") o.bucket_cap_mb(1000).first_bucket_mb(1000);
  if (mode == "unused") o.find_unused_parameters(true);
  if (mode == "static") o.static_graph(true);
  if (mode == "view") o.gradient_as_bucket_view(true);
  if (mode == "delay") o.delay_allreduce(true);
  if (mode == "fp16") o.comm_hook(ap::CommHook::kFp16Compress);
  if (mode == "bf16") o.comm_hook(ap::CommHook::kBf16Compress);
  if (mode == "fp32") o.comm_hook(ap::CommHook::kAllReduceFp32);
  if (mode == "predivide") o.gradient_predivide_factor(2.0);
  if (mode == "sum") o.gradient_average(false);
  ap::DistributedDataParallel<std::shared_ptr<Wrapped>> ddp(local, o, pg);

  torch::optim::SGD ref_opt(ref->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  const int micro = mode == "no_sync" ? 2 : 1;
  const double loss_mul = mode == "sum" ? world : 1.0;
  for (int step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    if (mode == "view") {
      // LibTorch's Optimizer::zero_grad detaches in place, which a view into a bucket refuses;
      // Module::zero_grad does not (and keeps the view with set_to_none = false).
      ddp->zero_grad(/*set_to_none=*/false);
    } else {
      opt.zero_grad();
    }
    for (int m = 0; m < micro; ++m) {
      const uint64_t seed = 1000 + step * 10 + m;
      const at::Tensor x = inputs_for(model, world * b, seed);
      // Reference: the whole batch (the branch on rank 1's slice only).
      at::Tensor y_ref;
      if (mode == "unused") {
        std::vector<at::Tensor> parts;
        for (int r = 0; r < world; ++r) {
          ref->use_branch = r == 1 ? 1 : 0;
          parts.push_back(ref->forward(x.slice(0, r * b, (r + 1) * b)));
        }
        y_ref = at::cat(parts);
      } else {
        y_ref = ref->forward(x);
      }
      const at::Tensor target = randn_seeded(y_ref.sizes(), seed + 5);
      (at::mse_loss(y_ref, target) * loss_mul).backward();
      // DDP: this rank's shard.
      local->use_branch = mode == "unused" && rank == 1 ? 1 : 0;
      const at::Tensor xs = x.slice(0, rank * b, (rank + 1) * b);
      const at::Tensor ts = target.slice(0, rank * b, (rank + 1) * b);
      if (m + 1 < micro) {
        ap::NoSyncGuard no_sync(ddp);
        at::mse_loss(ddp->forward(xs), ts).backward();
      } else {
        at::mse_loss(ddp->forward(xs), ts).backward();
      }
    }
    if (mode == "unused" && step == 0) {
      // The layer nobody used keeps no gradient; the branch has the average of rank 1's.
      const auto& never_w = local_extra[1]->as<torch::nn::Linear>()->weight;
      if (never_w.grad().defined()) {
        std::cout << "a parameter unused on every rank got a gradient\n";
        return 1;
      }
    }
    ref_opt.step();
    opt.step();
  }
  const auto tol = mode == "bf16"   ? tolerance_for(at::kBFloat16)
                   : mode == "fp16" ? tolerance_for(at::kHalf)
                                    : apex::test::Tolerance{2e-5, 2e-6};
  int bad = compare_params(*local, *ref, tol, "rank " + std::to_string(rank));
  if (model == "cnn") {
    const auto lb = local->buffers();
    const auto rb = ref->buffers();
    for (size_t i = 0; i < lb.size(); ++i) {
      if (lb[i].is_floating_point() && !all_close(lb[i], rb[i], tol)) {
        std::cout << "buffer " << i << " differs from the whole-batch BatchNorm's\n";
        ++bad;
      }
    }
  }
  if (buckets == "many" && ddp->engine().bucket_indices().size() < 2) {
    std::cout << "expected several buckets, got " << ddp->engine().bucket_indices().size() << "\n";
    ++bad;
  }
  if (buckets == "one" && ddp->engine().bucket_indices().size() != 1) {
    std::cout << "expected one bucket, got " << ddp->engine().bucket_indices().size() << "\n";
    ++bad;
  }
  std::cout << "rank " << rank << ": " << (bad == 0 ? "ok" : "MISMATCH") << "\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_eq("ddp_equivalence", ddp_equivalence);

// amp + DDP: an inf on one rank's input makes every rank skip that step, with equal scales, and
// the O2 masters stay equal on every rank.
int amp_skip(int rank, int world, const std::string& arg) {
  auto pg = join();
  // "O2" or "O2,fp32" (apex's allreduce_always_fp32 over the fp16 gradients).
  const std::string level_name = arg.substr(0, arg.find(','));
  const bool fp32_wire = arg.find(",fp32") != std::string::npos;
  const auto level = apex::amp::parse_opt_level(level_name.empty() ? "O2" : level_name);
  // The same initial weights on every rank: initialize copies the O2 masters from the weights it
  // sees, before DDP's broadcast (docs/distributed.md).
  torch::manual_seed(3);
  auto net = mlp();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.05));
  auto amp =
      apex::amp::initialize(net, opt, apex::amp::Options(level).half_dtype(at::kHalf).verbosity(0));
  ap::DistributedDataParallel<torch::nn::Sequential> ddp(
      net,
      ap::DistributedDataParallelOptions().comm_hook(fp32_wire ? ap::CommHook::kAllReduceFp32
                                                               : ap::CommHook::kAllReduce),
      pg);
  const int steps = 5, bad_step = 2;
  for (int step = 0; step < steps; ++step) {
    amp.zero_grad();
    at::Tensor x = randn_seeded({4, 12}, 50 + step * 2 + rank);
    if (step == bad_step && rank == world - 1) x[0][0] = std::numeric_limits<float>::infinity();
    const at::Tensor t = randn_seeded({4, 4}, 51 + step * 2 + rank);
    const at::Tensor loss = at::mse_loss(amp.forward(ddp, x).to(at::kFloat), t);
    amp.scale_loss(loss).backward();
    amp.step();
  }
  int bad = 0;
  // The inf step at least (fp16 may overflow at the first scale too): the same on every rank.
  if (amp.skipped_steps() < 1) {
    std::cout << "rank " << rank << " skipped no step\n";
    ++bad;
  }
  at::Tensor mine =
      at::tensor({amp.loss_scale(), static_cast<double>(amp.skipped_steps())}, at::kDouble);
  for (const auto& s : pg.all_gather(mine)) {
    if (!s.equal(mine)) {
      std::cout << "loss scale / skipped steps differ across ranks: " << s << " vs " << mine
                << "\n";
      ++bad;
    }
  }
  for (const auto& p : amp.master_params()) {
    const auto all = pg.all_gather(p.detach());
    for (const auto& q : all) {
      if (!q.equal(p.detach())) {
        std::cout << "master parameters differ across ranks\n";
        ++bad;
        break;
      }
    }
  }
  std::cout << "rank " << rank << ": " << (bad == 0 ? "ok" : "MISMATCH") << "\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_amp("amp_skip", amp_skip);

// Faults: each worker expects an error (with text) within the timeout, and prints it.
int expect_error(const std::function<void()>& f, const std::string& needle) {
  try {
    f();
  } catch (const std::exception& e) {
    // c10::Error from our checks; Gloo's own exceptions from a collective that backward ran.
    const auto* c = dynamic_cast<const c10::Error*>(&e);
    const std::string m = c != nullptr ? c->what_without_backtrace() : e.what();
    std::cout << "ERROR: " << m.substr(0, 600) << "\n";
    // `needle`: alternatives separated by '|'.
    std::istringstream alternatives(needle);
    for (std::string alt; std::getline(alternatives, alt, '|');) {
      if (m.find(alt) != std::string::npos) return 0;
    }
    std::cout << "expected the message to contain one of: " << needle << "\n";
    return 2;
  }
  std::cout << "no error raised\n";
  return 1;
}

int fault(int rank, int world, const std::string& arg) {
  const auto quick = ap::ProcessGroupOptions().timeout(std::chrono::seconds(4));
  if (arg == "no_store") {
    // Rank 1 of 2 with nobody serving the store.
    return expect_error([&] { ap::init_process_group(quick); }, "could not reach the store");
  }
  if (arg == "never_fills") {
    // Rank 0 of 2 alone.
    return expect_error([&] { ap::init_process_group(quick); }, "could not gather every rank");
  }
  if (arg == "silent_store") {
    // Rank 1 of 2; the port's listener accepts and never answers (not a c10d store).
    const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(std::atoi(std::getenv("MASTER_PORT"))));
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0 || ::listen(fd, 8) != 0) {
      std::cout << "cannot listen on MASTER_PORT\n";
      return 5;
    }
    std::thread([fd] {
      while (::accept(fd, nullptr, nullptr) >= 0) {
      }
    }).detach();
    return expect_error([&] { ap::init_process_group(quick); }, "could not reach the store");
  }
  if (arg == "duplicate_rank") {
    return expect_error([&] { ap::init_process_group(quick); },
                        "joined the group twice|could not connect to the other ranks");
  }
  if (arg == "mismatched_broadcast") {
    // A collective whose receiver posts one receive: the data of another size arrives for the
    // receive Gloo already took from its queue. The receiving rank's call fails at once with the
    // cause (not after the group's timeout, 30 s here); the root's next call fails at once.
    auto pg = ap::init_process_group(ap::ProcessGroupOptions().timeout(std::chrono::seconds(30)));
    at::Tensor t = at::ones({rank == 0 ? 4096 : 16});
    if (rank == 1) {
      return expect_error([&] { pg.broadcast_(t, 0); }, "Gloo's transport thread failed: ");
    }
    try {
      pg.broadcast_(t, 0);  // the root's send may complete before the receiver finds the size
    } catch (const std::exception&) {  // NOLINT(bugprone-empty-catch): the next call must fail
    }
    return expect_error([&] { pg.all_reduce_(t); }, "Connection|closed");
  }
  auto pg = ap::init_process_group(quick);
  if (arg == "mismatched_collective") {
    // Different sizes on the two ranks: Gloo's transport thread throws. The error reaches this
    // call (the rank whose thread threw: our words and Gloo's; its peer: the closed connection,
    // or its timeout where the close came before its send was matched), and the next call on
    // the group fails as well, at once.
    if (!ap::detail::gloo_transport_guarded()) {
      std::cout << "Gloo's transport thread is not guarded in this binary\n";
      return 3;
    }
    at::Tensor t = at::ones({rank == 0 ? 16 : 4096});
    const char* needle =
        "Gloo's transport thread failed: |Connection closed by peer|Connection reset by "
        "peer|Timed out waiting 4000ms";
    if (const int rc = expect_error([&] { pg.all_reduce_(t); }, needle); rc != 0) return rc;
    const auto t0 = std::chrono::steady_clock::now();
    at::Tensor u = at::ones({8});
    if (const int rc = expect_error([&] { pg.all_reduce_(u); }, needle); rc != 0) return rc;
    if (std::chrono::steady_clock::now() - t0 > std::chrono::seconds(1)) {
      std::cout << "the next collective took more than a second to fail\n";
      return 4;
    }
    return 0;
  }
  if (arg == "thread_exception") {
    // What the guard around Gloo's pair events does not cover (its listener failing to accept,
    // its deferred callbacks, a binary without the guard): an exception of Gloo's on a thread of
    // its own. The handler init_process_group installed ends the process with one line, status 1.
    std::thread([] {
      throw std::runtime_error(
          "[enforce fail at gloo/transport/tcp/listener.cc] accept: Too many "
          "open files");
    }).join();
    std::cout << "the thread's exception did not end the process\n";
    return 0;
  }
  if (arg == "diff_dtypes") {
    // Another opt level's model on rank 1: bf16 weights where rank 0 has fp32.
    torch::manual_seed(1);
    auto net = mlp();
    if (rank == 1) net->to(at::kBFloat16);
    return expect_error(
        [&] {
          ap::DistributedDataParallel<torch::nn::Sequential> ddp(
              net, ap::DistributedDataParallelOptions(), pg);
        },
        "the ranks hold different models (rank 1): parameter '0.weight': BFloat16 [16, 12] on "
        "rank 1, but parameter '0.weight': Float [16, 12] on rank 0");
  }
  if (arg == "diff_models") {
    torch::manual_seed(1);
    auto net = rank == 0 ? mlp()
                         : torch::nn::Sequential(torch::nn::Linear(12, 17), torch::nn::ReLU(),
                                                 torch::nn::Linear(17, 4));
    return expect_error(
        [&] {
          ap::DistributedDataParallel<torch::nn::Sequential> ddp(
              net, ap::DistributedDataParallelOptions(), pg);
        },
        "the ranks hold different models");
  }
  if (arg == "diff_buffers") {
    // The same parameters, a buffer of another size on rank 1: refused before anything is
    // broadcast, so rank 1's parameters stay its own.
    torch::manual_seed(static_cast<uint64_t>(rank) + 1);
    auto net = mlp();
    net->register_buffer("extra", torch::zeros({rank == 0 ? 3 : 5}));
    std::vector<at::Tensor> before;
    for (const auto& p : net->parameters()) before.push_back(p.detach().clone());
    const int rc = expect_error(
        [&] {
          ap::DistributedDataParallel<torch::nn::Sequential> ddp(
              net, ap::DistributedDataParallelOptions(), pg);
        },
        "the ranks hold different models");
    const auto after = net->parameters();
    for (size_t i = 0; i < before.size(); ++i) {
      if (!torch::equal(before[i], after[i])) {
        std::fprintf(stderr, "rank %d: parameter %zu changed by a refused construction\n", rank, i);
        return 1;
      }
    }
    return rc;
  }
  torch::manual_seed(1);
  auto net = mlp();
  ap::DistributedDataParallel<torch::nn::Sequential> ddp(net, ap::DistributedDataParallelOptions(),
                                                         pg);
  torch::optim::SGD opt(ddp->parameters(), torch::optim::SGDOptions(0.05));
  return expect_error(
      [&] {
        for (int step = 0; step < 50; ++step) {
          if (arg == "dead_rank" && rank == 1 && step == 2) std::_Exit(3);
          opt.zero_grad();
          const at::Tensor out = ddp->forward(randn_seeded({4, 12}, step));
          // skip_backward: rank 1 runs a forward but no backward in step 2.
          if (arg == "skip_backward" && rank == 1 && step == 2) continue;
          out.square().mean().backward();
          opt.step();
        }
        pg.barrier();
      },
      // Gloo's words for a peer gone or silent, or the Reducer's for a skipped backward.
      arg == "dead_rank" ? "Connection"
                         : "Timed out|Connection|Expected to have finished reduction");
}
const RegisterWorker r_fault("fault", fault);

::testing::AssertionResult all_ranks_passed(const std::vector<apex::test::RankResult>& r) {
  for (const auto& x : r) {
    if (x.exit_code != 0) return ::testing::AssertionFailure() << apex::test::describe(r);
  }
  return ::testing::AssertionSuccess();
}

// The fault worker `arg` in `ranks` (all of the world's when empty) of a world of `world`.
std::vector<apex::test::RankResult> launch_fault(const std::string& arg, std::vector<int> ranks,
                                                 int world = 2) {
  LaunchOptions o;
  o.world = world;
  o.arg = arg;
  o.ranks = std::move(ranks);
  o.deadline_s = 60;
  return launch("fault", o);
}

void equivalence(int world, const std::string& arg) {
  LaunchOptions o;
  o.world = world;
  o.arg = arg;
  const auto r = launch("ddp_equivalence", o);
  EXPECT_TRUE(all_ranks_passed(r)) << arg;
}

}  // namespace

TEST(Ddp, MlpEqualsWholeBatchTwoRanksManyBuckets) { equivalence(2, "model=mlp,buckets=many"); }
TEST(Ddp, MlpEqualsWholeBatchThreeRanksOneBucket) { equivalence(3, "model=mlp,buckets=one"); }
TEST(Ddp, CnnWithSyncBatchNormEqualsWholeBatch) { equivalence(2, "model=cnn,buckets=many"); }
TEST(Ddp, CnnThreeRanks) { equivalence(3, "model=cnn,buckets=one"); }
TEST(Ddp, TransformerEqualsWholeBatch) { equivalence(2, "model=transformer,buckets=many"); }
TEST(Ddp, NoSyncAccumulation) { equivalence(2, "model=mlp,mode=no_sync"); }
TEST(Ddp, FindUnusedParameters) { equivalence(2, "model=mlp,mode=unused,buckets=default"); }
TEST(Ddp, StaticGraph) { equivalence(2, "model=mlp,mode=static,buckets=default"); }
TEST(Ddp, GradientAsBucketView) { equivalence(2, "model=mlp,mode=view"); }
TEST(Ddp, DelayAllreduce) { equivalence(2, "model=mlp,mode=delay,buckets=default"); }
TEST(Ddp, Fp16CompressHook) { equivalence(2, "model=mlp,mode=fp16"); }
TEST(Ddp, Bf16CompressHook) { equivalence(2, "model=mlp,mode=bf16"); }
TEST(Ddp, AllreduceAlwaysFp32Hook) { equivalence(2, "model=mlp,mode=fp32"); }
TEST(Ddp, GradientPredivideFactor) { equivalence(3, "model=mlp,mode=predivide"); }
TEST(Ddp, GradientSumWithoutAverage) { equivalence(2, "model=mlp,mode=sum"); }
TEST(Ddp, FrozenParametersAreRankZeros) { equivalence(2, "model=mlp,mode=frozen"); }

TEST(DdpAmp, InfOnOneRankSkipsEveryRankO2) {
  LaunchOptions o;
  o.arg = "O2";
  EXPECT_TRUE(all_ranks_passed(launch("amp_skip", o)));
}
TEST(DdpAmp, AllreduceAlwaysFp32OverHalfGradients) {
  LaunchOptions o;
  o.arg = "O2,fp32";
  EXPECT_TRUE(all_ranks_passed(launch("amp_skip", o)));
}
TEST(DdpAmp, InfOnOneRankSkipsEveryRankO1) {
  LaunchOptions o;
  o.arg = "O1";
  EXPECT_TRUE(all_ranks_passed(launch("amp_skip", o)));
}

// Faults end in a clear error within the timeout (4 s), never a hang: the deadline is 60 s.
TEST(DdpFaults, DeadRankFailsTheOthers) {
  LaunchOptions o;
  o.arg = "dead_rank";
  o.deadline_s = 60;
  const auto r = launch("fault", o);
  ASSERT_EQ(r.size(), 2u);
  EXPECT_EQ(r[0].exit_code, 0) << apex::test::describe(r);
  EXPECT_EQ(r[1].exit_code, 3) << apex::test::describe(r);
  EXPECT_LT(r[0].seconds, 30) << apex::test::describe(r);
}
TEST(DdpFaults, DifferentModelsAreRefused) {
  LaunchOptions o;
  o.arg = "diff_models";
  const auto r = launch("fault", o);
  EXPECT_TRUE(all_ranks_passed(r));
  EXPECT_NE(r[0].output.find("rank 1"), std::string::npos) << apex::test::describe(r);
}
TEST(DdpFaults, DifferentBuffersAreRefusedBeforeAnyBroadcast) {
  LaunchOptions o;
  o.arg = "diff_buffers";
  const auto r = launch("fault", o);
  EXPECT_TRUE(all_ranks_passed(r));
  // Rank 0 passed the shape check itself; it names the rank that did not.
  EXPECT_NE(r[0].output.find("different models (rank 1)"), std::string::npos)
      << apex::test::describe(r);
}
TEST(DdpFaults, SkippedBackwardFailsBothRanks) {
  LaunchOptions o;
  o.arg = "skip_backward";
  o.deadline_s = 60;
  EXPECT_TRUE(all_ranks_passed(launch("fault", o)));
}
TEST(DdpFaults, UnreachableStore) {
  const auto r = launch_fault("no_store", {1});
  EXPECT_TRUE(all_ranks_passed(r));
  // Within the timeout (4 s) and a few seconds (before: twice the timeout, c10d retries once),
  // and quiet: one error line, not c10d's retry log with its backtraces.
  EXPECT_LT(r[0].seconds, 4 + 5) << apex::test::describe(r);
  EXPECT_EQ(r[0].output.find("frame #"), std::string::npos) << apex::test::describe(r);
}
TEST(DdpFaults, WorldThatNeverFills) {
  const auto r = launch_fault("never_fills", {0});
  EXPECT_TRUE(all_ranks_passed(r));
  EXPECT_LT(r[0].seconds, 4 + 5) << apex::test::describe(r);
}

TEST(DdpFaults, SilentStoreEndsWithinTheTimeout) {
  // Before: a listener that accepts and never answers kept the rank waiting without end.
  const auto r = launch_fault("silent_store", {1});
  EXPECT_TRUE(all_ranks_passed(r));
  EXPECT_LT(r[0].seconds, 4 + 5) << apex::test::describe(r);
}
TEST(DdpFaults, DuplicateRankIsNamed) {
  const auto r = launch_fault("duplicate_rank", {0, 1, 1}, 3);
  EXPECT_TRUE(all_ranks_passed(r));
  bool named = false;
  for (const auto& x : r) {
    named = named || x.output.find("two processes were given RANK=1") != std::string::npos;
    EXPECT_LT(x.seconds, 4 + 5) << apex::test::describe(r);
  }
  EXPECT_TRUE(named) << apex::test::describe(r);
}
TEST(DdpFaults, DifferentDtypesAreRefusedNotAborted) {
  // Before: the shapes matched, the broadcast's byte counts did not: Gloo terminated a rank.
  LaunchOptions o;
  o.arg = "diff_dtypes";
  const auto r = launch("fault", o);
  EXPECT_TRUE(all_ranks_passed(r));
}
TEST(DdpFaults, MismatchedCollectiveIsAnErrorAtTheCallNotAnAbort) {
  // Gloo's transport thread finds a peer's data of another size and throws where Gloo has no
  // handler (before: std::terminate, SIGABRT). Both ranks' calls fail with an error they can catch,
  // so do their next calls, and each process ends as it chooses (here: the test passes).
  LaunchOptions o;
  o.arg = "mismatched_collective";
  o.deadline_s = 60;
  const auto r = launch("fault", o);
  EXPECT_TRUE(all_ranks_passed(r));
  bool named = false;
  for (const auto& x : r) {
    EXPECT_EQ(x.output.find("terminate called"), std::string::npos) << apex::test::describe(r);
    named = named || x.output.find("Received data size doesn't match") != std::string::npos;
    EXPECT_LT(x.seconds, 4 + 5) << apex::test::describe(r);
  }
  EXPECT_TRUE(named) << apex::test::describe(r);
}

TEST(DdpFaults, MismatchedBroadcastFailsTheReceiverAtOnce) {
  // Before: the receiver's one receive was not woken and waited out the 30 s timeout.
  const auto r = launch_fault("mismatched_broadcast", {0, 1});
  EXPECT_TRUE(all_ranks_passed(r));
  for (const auto& x : r) {
    EXPECT_EQ(x.output.find("terminate called"), std::string::npos) << apex::test::describe(r);
    EXPECT_LT(x.seconds, 10) << apex::test::describe(r);
  }
}

TEST(DdpFaults, GlooExceptionOnAThreadOfItsOwnEndsInOneLine) {
  const auto r = launch_fault("thread_exception", {0, 1});
  for (const auto& x : r) {
    EXPECT_EQ(x.exit_code, 1) << apex::test::describe(r);  // not a signal (SIGABRT), not 0
    EXPECT_NE(x.output.find("a collective failed on a communication thread: [enforce fail at "
                            "gloo/transport/tcp/listener.cc] accept: Too many open files"),
              std::string::npos)
        << apex::test::describe(r);
    EXPECT_EQ(x.output.find("terminate called"), std::string::npos) << apex::test::describe(r);
  }
}

// In-process checks of the group of one and of bad options.
TEST(ProcessGroup, GroupOfOneAndBadOptions) {
  EXPECT_TRUE(apex::test::throws_with(
      [] { ap::init_process_group(ap::ProcessGroupOptions().rank(2).world_size(2)); },
      "rank must be in [0, world_size = 2), got 2"));
  // NCCL: absent from a CPU build of LibTorch, and only for CUDA tensors where it is present.
  EXPECT_TRUE(apex::test::throws_with(
      [] {
        ap::init_process_group(ap::ProcessGroupOptions().world_size(1).backend(ap::Backend::kNccl));
      },
      ap::backend_available(ap::Backend::kNccl) ? "the NCCL backend reduces CUDA tensors, got "
                                                  "device cpu"
                                                : "NCCL backend is not available"));
  EXPECT_TRUE(apex::test::throws_with(
      [] {
        ap::init_process_group(
            ap::ProcessGroupOptions().world_size(1).backend(ap::Backend::kGloo).device(c10::kCUDA));
      },
      "the Gloo backend reduces CPU tensors, got device cuda"));
  // -1 is "unset" (the environment); other negative values are refused, not replaced.
  EXPECT_TRUE(apex::test::throws_with(
      [] { ap::init_process_group(ap::ProcessGroupOptions().rank(-3).world_size(1)); },
      "rank must be >= 0 (or -1: $RANK), got -3"));
  EXPECT_TRUE(apex::test::throws_with(
      [] { ap::init_process_group(ap::ProcessGroupOptions().world_size(-2)); },
      "world_size must be in [1, 1048576] (or -1: $WORLD_SIZE), got -2"));
  EXPECT_TRUE(apex::test::throws_with(
      [] { ap::init_process_group(ap::ProcessGroupOptions().world_size(1).master_port(-7)); },
      "master_port must be in [1, 65535] (or -1: $MASTER_PORT), got -7"));
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  EXPECT_EQ(pg.size(), 1);
  at::Tensor t = at::arange(5, at::kFloat);
  pg.all_reduce_(t);
  EXPECT_TRUE(t.equal(at::arange(5, at::kFloat)));
  EXPECT_TRUE(ap::default_process_group().valid());
  ap::destroy_process_group();
  EXPECT_FALSE(ap::default_process_group().valid());
  EXPECT_TRUE(apex::test::throws_with([&] { ap::default_process_group().barrier(); },
                                      "the group is not initialized"));
  torch::nn::Linear frozen(2, 2);
  for (auto& p : frozen->parameters()) p.set_requires_grad(false);
  auto pg1 = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  EXPECT_TRUE(apex::test::throws_with(
      [&] {
        ap::DistributedDataParallel<torch::nn::Linear> d(frozen,
                                                         ap::DistributedDataParallelOptions(), pg1);
      },
      "no parameter that requires a gradient"));
  EXPECT_TRUE(apex::test::throws_with(
      [&] {
        ap::DistributedDataParallel<torch::nn::Linear> d(
            torch::nn::Linear(2, 2), ap::DistributedDataParallelOptions().bucket_cap_mb(-1), pg1);
      },
      "bucket_cap_mb must be > 0, got -1"));
}

// amp with DDP in one process (a dynamic scale: the path that stashes gradients; bf16 at O1
// defaults to a static 1, where nothing is stashed): gradients accumulated over two scale_loss
// scopes per step train as amp without DDP; inside a NoSyncGuard a scope must keep its gradients
// scaled (delay_unscale), else it is refused before anything changes.
TEST(DdpAmp, AccumulationNoSyncAndBucketViews) {
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  const auto opts = apex::amp::Options(apex::amp::OptLevel::O1)
                        .half_dtype(at::kBFloat16)
                        .loss_scale(apex::amp::LossScale::dynamic())
                        .verbosity(0);
  torch::manual_seed(1);
  auto a = mlp();
  torch::manual_seed(1);
  auto b = mlp();
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ob(b->parameters(), torch::optim::SGDOptions(0.1));
  auto amp_a = apex::amp::initialize(a, oa, opts);
  auto amp_b = apex::amp::initialize(b, ob, opts);
  ap::DistributedDataParallel<torch::nn::Sequential> ddp(b, ap::DistributedDataParallelOptions(),
                                                         pg);
  for (int s = 0; s < 3; ++s) {
    amp_a.zero_grad();
    amp_b.zero_grad();
    for (int k = 0; k < 2; ++k) {
      const at::Tensor x = randn_seeded({5, 12}, 10 * s + k);
      amp_a.scale_loss(amp_a.forward(a, x).to(at::kFloat).square().mean()).backward();
      amp_b.scale_loss(amp_b.forward(ddp, x).to(at::kFloat).square().mean()).backward();
    }
    amp_a.step();
    amp_b.step();
  }
  EXPECT_EQ(compare_params(*b, *a, {0, 0}, "amp accumulation under DDP"), 0);

  amp_b.zero_grad();
  const auto before = b->parameters()[0].detach().clone();
  {
    ap::NoSyncGuard no_sync(ddp);
    const at::Tensor x = randn_seeded({5, 12}, 99);
    EXPECT_TRUE(apex::test::throws_with(
        [&] { amp_b.scale_loss(amp_b.forward(ddp, x).to(at::kFloat).mean()).backward(); },
        "inside apex::parallel::NoSyncGuard"));
    amp_b
        .scale_loss(amp_b.forward(ddp, x).to(at::kFloat).mean(), 0,
                    apex::amp::ScaleLossOptions().delay_unscale(true))
        .backward();
  }
  amp_b.scale_loss(amp_b.forward(ddp, randn_seeded({5, 12}, 98)).to(at::kFloat).mean()).backward();
  EXPECT_TRUE(b->parameters()[0].detach().equal(before));
  amp_b.step();

  // Gradients that are views into DDP's buckets (gradient_as_bucket_view): two scopes per step
  // accumulate as without DDP, after amp.zero_grad() (gradients undefined) and after the DDP's
  // zero_grad(false) (zeroed bucket views kept); the stash must not alias the bucket the Reducer
  // writes the next backward's gradient into.
  torch::manual_seed(2);
  auto c = mlp();
  torch::manual_seed(2);
  auto d = mlp();
  torch::optim::SGD oc(c->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD od(d->parameters(), torch::optim::SGDOptions(0.1));
  auto amp_c = apex::amp::initialize(c, oc, opts);
  auto amp_d = apex::amp::initialize(d, od, opts);
  ap::DistributedDataParallel<torch::nn::Sequential> view_ddp(
      c, ap::DistributedDataParallelOptions().gradient_as_bucket_view(true), pg);
  int views_seen = 0;
  for (int s = 0; s < 5; ++s) {
    if (s < 3) {
      amp_c.zero_grad();
    } else {
      view_ddp->zero_grad(false);
    }
    amp_d.zero_grad();
    for (int k = 0; k < 2; ++k) {
      const at::Tensor x = randn_seeded({5, 12}, 40 + 10 * s + k);
      amp_c.scale_loss(amp_c.forward(view_ddp, x).to(at::kFloat).square().mean()).backward();
      amp_d.scale_loss(amp_d.forward(d, x).to(at::kFloat).square().mean()).backward();
      views_seen += c->parameters()[0].grad().is_view() ? 1 : 0;
    }
    amp_c.step();
    amp_d.step();
  }
  EXPECT_GT(views_seen, 0);  // the case under test was reached
  EXPECT_EQ(compare_params(*c, *d, {0, 0}, "amp accumulation over bucket views"), 0);
}

// A DDP of one process trains exactly as the bare module.
TEST(ProcessGroup, DdpOfOneEqualsNoDdp) {
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  torch::manual_seed(1);
  auto a = mlp();
  torch::manual_seed(1);
  auto b = mlp();
  ap::DistributedDataParallel<torch::nn::Sequential> ddp(b, ap::DistributedDataParallelOptions(),
                                                         pg);
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ob(ddp->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 3; ++s) {
    const at::Tensor x = randn_seeded({5, 12}, s);
    oa.zero_grad();
    ob.zero_grad();
    a->forward(x).square().mean().backward();
    ddp->forward(x).square().mean().backward();
    oa.step();
    ob.step();
  }
  EXPECT_EQ(compare_params(*b, *a, {0, 0}, "ddp of one"), 0);
  EXPECT_EQ(ddp->named_parameters().begin()->key().rfind("module.", 0), 0u);
  ap::destroy_process_group();
}
