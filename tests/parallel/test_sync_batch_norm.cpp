// SyncBatchNorm on the CPU: ranks with uneven (and empty) batches against BatchNorm over the
// concatenated batch in float64; the kernels alone in one process.
#include <apex/parallel.h>
#include <torch/nn.h>

#include <iostream>
#include <map>
#include <sstream>

#include "common/test_util.h"
#include "launcher.h"

namespace ap = apex::parallel;
using apex::test::all_close;
using apex::test::launch;
using apex::test::LaunchOptions;
using apex::test::randn_seeded;
using apex::test::RegisterWorker;
using apex::test::tolerance_for;

namespace {

std::vector<int64_t> parse_sizes(const std::string& s) {
  std::vector<int64_t> out;
  std::istringstream in(s);
  for (std::string x; std::getline(in, x, ':');) out.push_back(std::stoll(x));
  return out;
}

struct Case {
  std::vector<int64_t> sizes;  // per-rank batch
  c10::ScalarType dtype = at::kFloat;
  std::string layout = "nchw";  // nchw | cl (channels-last) | 2d (N, C) | 3d (N, C, L)
  bool affine = true;
};

Case parse_case(const std::string& arg) {
  Case c;
  std::istringstream in(arg);
  for (std::string kv; std::getline(in, kv, ',');) {
    const auto eq = kv.find('=');
    const std::string k = kv.substr(0, eq), v = kv.substr(eq + 1);
    if (k == "sizes") c.sizes = parse_sizes(v);
    if (k == "dtype") c.dtype = v == "bf16" ? at::kBFloat16 : v == "fp16" ? at::kHalf : at::kFloat;
    if (k == "layout") c.layout = v;
    if (k == "affine") c.affine = v == "1";
  }
  return c;
}

constexpr int64_t kC = 5;

at::Tensor global_input(const Case& c, int64_t n, uint64_t seed) {
  at::Tensor x;
  if (c.layout == "2d") {
    x = randn_seeded({n, kC}, seed);
  } else if (c.layout == "3d") {
    x = randn_seeded({n, kC, 7}, seed);
  } else {
    x = randn_seeded({n, kC, 3, 4}, seed);
  }
  // Off-centre values: a mean far from zero checks the Welford merge.
  return (x * 2 + 3).to(c.dtype).to(at::kFloat);  // exactly representable in the dtype
}

at::Tensor as_layout(const at::Tensor& x, const Case& c) {
  return c.layout == "cl" ? x.contiguous(at::MemoryFormat::ChannelsLast) : x;
}

// Each rank normalizes its slice; the reference is BatchNorm (float64) on the whole batch, over
// three training steps (running statistics), then one in eval mode.
int syncbn(int rank, int world, const std::string& arg) {
  const Case c = parse_case(arg);
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().timeout(std::chrono::seconds(60)));
  int64_t total = 0, first = 0;
  for (int r = 0; r < world; ++r) {
    if (r < rank) first += c.sizes[r];
    total += c.sizes[r];
  }
  const int64_t mine = c.sizes[rank];
  auto opts = torch::nn::BatchNormOptions(kC).affine(c.affine).momentum(0.3);
  ap::SyncBatchNorm bn(opts, pg);
  torch::nn::BatchNorm1d ref(opts);  // BatchNorm{1,2}d compute alike; only the checks differ
  ref->to(at::kDouble);
  if (c.affine) {
    const torch::NoGradGuard no_grad;
    bn->weight.copy_(randn_seeded({kC}, 9) + 1);
    bn->bias.copy_(randn_seeded({kC}, 10));
    ref->weight.copy_(bn->weight);
    ref->bias.copy_(bn->bias);
  }
  const auto tol = tolerance_for(c.dtype);
  int bad = 0;
  const auto check = [&](const at::Tensor& got, const at::Tensor& want, const std::string& what) {
    const auto r = all_close(got, want, tol);
    if (!r) {
      std::cout << "rank " << rank << " " << what << ": " << r.message() << "\n";
      ++bad;
    }
  };
  for (int step = 0; step < 3; ++step) {
    const at::Tensor X = global_input(c, total, 100 + step);
    // dy reaches the half-precision output rounded to its dtype: make it exact there.
    const at::Tensor G = randn_seeded(X.sizes(), 200 + step).to(c.dtype).to(at::kFloat);
    // Reference on the whole batch, in float64.
    at::Tensor xr = X.to(at::kDouble).requires_grad_();
    at::Tensor yr = at::batch_norm(xr, ref->weight, ref->bias, ref->running_mean, ref->running_var,
                                   true, 0.3, 1e-5, false);
    (yr * G.to(at::kDouble)).sum().backward();
    // This rank's slice.
    at::Tensor x = as_layout(X.slice(0, first, first + mine).to(c.dtype), c).requires_grad_();
    at::Tensor y = bn->forward(x);
    if (y.scalar_type() != c.dtype) {
      std::cout << "output dtype " << y.scalar_type() << "\n";
      ++bad;
    }
    if (c.layout == "cl" && mine > 0 && !y.is_contiguous(at::MemoryFormat::ChannelsLast)) {
      std::cout << "channels-last input gave an output in another layout\n";
      ++bad;
    }
    (y.to(at::kFloat) * G.slice(0, first, first + mine)).sum().backward();
    check(y, yr.slice(0, first, first + mine), "output step " + std::to_string(step));
    check(x.grad(), xr.grad().slice(0, first, first + mine),
          "input gradient step " + std::to_string(step));
    if (c.affine) {
      at::Tensor gw = bn->weight.grad().clone(), gb = bn->bias.grad().clone();
      pg.all_reduce_(gw);
      pg.all_reduce_(gb);
      check(gw, ref->weight.grad(), "weight gradient (summed over ranks)");
      check(gb, ref->bias.grad(), "bias gradient (summed over ranks)");
      bn->weight.mutable_grad().reset();
      bn->bias.mutable_grad().reset();
      ref->weight.mutable_grad().reset();
      ref->bias.mutable_grad().reset();
    }
    check(bn->running_mean, ref->running_mean, "running_mean");
    check(bn->running_var, ref->running_var, "running_var");
  }
  // Evaluation: the running statistics, no communication (rank 0 alone here; a collective would
  // wait for the others until the timeout).
  bn->eval();
  if (rank == 0) {
    const at::Tensor X = global_input(c, total, 999);
    const at::Tensor x = as_layout(X.to(c.dtype), c);
    const at::Tensor want =
        at::batch_norm(X.to(at::kDouble), ref->weight, ref->bias, ref->running_mean,
                       ref->running_var, false, 0.3, 1e-5, false);
    check(bn->forward(x), want, "eval output");
  }
  if (bn->num_batches_tracked.item<int64_t>() != 3) {
    std::cout << "num_batches_tracked " << bn->num_batches_tracked.item<int64_t>() << "\n";
    ++bad;
  }
  std::cout << "rank " << rank << ": " << (bad == 0 ? "ok" : "MISMATCH") << "\n";
  return bad == 0 ? 0 : 1;
}
const RegisterWorker r_syncbn("syncbn", syncbn);

void run(int world, const std::string& arg) {
  LaunchOptions o;
  o.world = world;
  o.arg = arg;
  const auto r = launch("syncbn", o);
  for (const auto& x : r) {
    EXPECT_EQ(x.exit_code, 0) << arg << "\n" << apex::test::describe(r);
    if (x.exit_code != 0) break;
  }
}

}  // namespace

TEST(SyncBatchNorm, UnevenBatchesTwoRanks) { run(2, "sizes=3:6"); }
TEST(SyncBatchNorm, EmptyBatchOnOneRank) { run(3, "sizes=5:0:2"); }
TEST(SyncBatchNorm, ChannelsLast) { run(2, "sizes=4:3,layout=cl"); }
TEST(SyncBatchNorm, TwoDimensionalInput) { run(2, "sizes=7:2,layout=2d"); }
TEST(SyncBatchNorm, ThreeDimensionalInputNoAffine) { run(2, "sizes=2:3,layout=3d,affine=0"); }
TEST(SyncBatchNorm, Bf16) { run(2, "sizes=4:5,dtype=bf16"); }
TEST(SyncBatchNorm, Fp16ChannelsLast) { run(2, "sizes=3:4,dtype=fp16,layout=cl"); }

// One process: the kernels against BatchNorm, over long and short channel runs.
TEST(SyncBatchNormLocal, GroupOfOneEqualsBatchNorm) {
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  for (const auto& sizes : std::vector<std::vector<int64_t>>{
           {9, 3, 17, 19},
           {300, 6},
           {2, 4, 1000},
           {65, 2, 1, 1},
           // Large enough that every walk splits across threads (the check below).
           {4096, 64},
           {2, 64, 4096}}) {
    torch::nn::BatchNormOptions o(sizes[1]);
    ap::SyncBatchNorm bn(o, pg);
    torch::nn::BatchNorm1d ref(o);
    ref->to(at::kDouble);  // the reference: ATen's BatchNorm in float64
    at::Tensor x = (at::randn(sizes) * 3 + 10).requires_grad_();
    at::Tensor xr = x.detach().to(at::kDouble).requires_grad_();
    at::Tensor g = at::randn(sizes);
    at::Tensor y = bn->forward(x);
    at::Tensor yr = at::batch_norm(xr, ref->weight, ref->bias, ref->running_mean, ref->running_var,
                                   true, 0.1, 1e-5, false);
    (y * g).sum().backward();
    (yr * g.to(at::kDouble)).sum().backward();
    const auto tol = tolerance_for(at::kFloat);
    EXPECT_TRUE(all_close(y, yr, tol)) << sizes;
    EXPECT_TRUE(all_close(x.grad(), xr.grad(), tol)) << sizes;
    EXPECT_TRUE(all_close(bn->weight.grad(), ref->weight.grad(), tol)) << sizes;
    EXPECT_TRUE(all_close(bn->bias.grad(), ref->bias.grad(), tol)) << sizes;
    EXPECT_TRUE(all_close(bn->running_mean, ref->running_mean, tol)) << sizes;
    EXPECT_TRUE(all_close(bn->running_var, ref->running_var, tol)) << sizes;
    // Bit-identical whatever the thread count.
    const int threads = at::get_num_threads();
    at::set_num_threads(1);
    at::Tensor y1 = bn->forward(x.detach());
    at::set_num_threads(std::max(2, threads));
    at::Tensor y2 = bn->forward(x.detach());
    at::set_num_threads(threads);
    EXPECT_TRUE(y1.equal(y2)) << sizes;
  }
  // Evaluation uses the running statistics.
  ap::SyncBatchNorm bn(torch::nn::BatchNormOptions(3), pg);
  bn->eval();
  at::Tensor x = at::randn({4, 3});
  EXPECT_TRUE(all_close(bn->forward(x), x / std::sqrt(1 + 1e-5), {1e-6, 1e-6}));
  EXPECT_TRUE(apex::test::throws_with(
      [&] {
        bn->forward(at::randn({4, 5}));
      },
      "expected 3 channels (dim 1), got input of size [4, 5]"));
  bn->train();
  EXPECT_TRUE(apex::test::throws_with(
      [&] {
        bn->forward(at::randn({1, 3}));
      },
      "expected more than 1 value per channel"));
  ap::destroy_process_group();
}

TEST(SyncBatchNormLocal, ConvertKeepsStateAndRefusesTypedMembers) {
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  torch::nn::Sequential net(torch::nn::Conv2d(2, 4, 3), torch::nn::BatchNorm2d(4),
                            torch::nn::ReLU());
  auto bn = net[1]->as<torch::nn::BatchNorm2d>();
  {
    const torch::NoGradGuard no_grad;
    bn->running_mean.fill_(0.5);
    bn->weight.fill_(2.0);
  }
  net->eval();
  auto converted = ap::convert_sync_batchnorm(net, pg);
  auto* sync = converted[1]->as<ap::SyncBatchNormImpl>();
  ASSERT_NE(sync, nullptr);
  EXPECT_TRUE(converted[0].get() == net[0].get());  // other elements are shared
  EXPECT_TRUE(sync->weight.is_same(bn->weight));
  EXPECT_TRUE(sync->running_mean.is_same(bn->running_mean));
  EXPECT_FALSE(sync->is_training());
  EXPECT_EQ(converted->named_parameters().size(), net->named_parameters().size());
  // A state_dict of one loads into the other (same names).
  std::vector<std::string> a, b;
  for (const auto& p : net->named_buffers()) a.push_back(p.key());
  for (const auto& p : converted->named_buffers()) b.push_back(p.key());
  EXPECT_EQ(a, b);

  struct Custom : torch::nn::Module {
    torch::nn::BatchNorm1d bn{nullptr};
    Custom() { bn = register_module("bn", torch::nn::BatchNorm1d(3)); }
    at::Tensor forward(const at::Tensor& x) { return bn->forward(x); }
  };
  EXPECT_TRUE(
      apex::test::throws_with([&] { ap::convert_sync_batchnorm(std::make_shared<Custom>(), pg); },
                              "which LibTorch cannot swap from outside"));
  torch::nn::Sequential holder(torch::nn::Linear(3, 3), std::make_shared<Custom>());
  EXPECT_TRUE(apex::test::throws_with([&] { ap::convert_sync_batchnorm(holder, pg); },
                                      "element '1' of the Sequential holds a BatchNorm"));
  ap::destroy_process_group();
}
