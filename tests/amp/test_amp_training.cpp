#include "amp_test_util.h"

#include <apex/amp/cpu_half.h>
#include <apex/amp/utils.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

using apex::amp::Amp;
using apex::amp::LossScale;
using apex::amp::Options;
using apex::amp::OptLevel;
using apex::amp::ScaleLossOptions;
using namespace apex::test;

namespace {

/// Trains `plain` with `opt` the LibTorch way and `model` through `amp`, on the same batches;
/// returns how many amp steps were taken.
int train_side_by_side(Mlp& plain, torch::optim::Optimizer& opt, Mlp& model, Amp& amp, int steps) {
  int taken = 0;
  for (int s = 0; s < steps; ++s) {
    auto batch = blob_batch(s);
    opt.zero_grad();
    cross_entropy(plain->forward(batch.x), batch.y).backward();
    opt.step();
    amp.zero_grad();
    amp.scale_loss(cross_entropy(amp.forward(model, batch.x), batch.y)).backward();
    taken += amp.step() ? 1 : 0;
  }
  return taken;
}

struct Outcome {
  double first_loss = 0;
  double last_loss = 0;
  double accuracy = 0;
  int64_t skipped = 0;
};

Outcome train_mlp(std::optional<Options> options, double eps = 1e-8, int steps = 150) {
  torch::manual_seed(7);
  Mlp model(16, 64, 4);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3).eps(eps));
  Outcome out;
  std::optional<Amp> amp;
  if (options) amp.emplace(apex::amp::initialize(model, opt, *options));
  for (int s = 0; s < steps; ++s) {
    auto b = blob_batch(s);
    at::Tensor loss;
    if (amp) {
      amp->zero_grad();
      loss = cross_entropy(amp->forward(model, b.x), b.y);
      amp->scale_loss(loss).backward();
      amp->step();
    } else {
      opt.zero_grad();
      loss = cross_entropy(model->forward(b.x), b.y);
      loss.backward();
      opt.step();
    }
    if (s == 0) out.first_loss = loss.item<double>();
    out.last_loss = loss.item<double>();
  }
  auto test = make_blobs(1000, 16, 4, 1000 + 100000);
  torch::NoGradGuard ng;
  out.accuracy = accuracy(amp ? amp->forward(model, test.x) : model->forward(test.x), test.y);
  out.skipped = amp ? amp->skipped_steps() : 0;
  return out;
}

Outcome train_cnn(const Options& options, int steps = 80) {
  torch::manual_seed(11);
  Cnn model(3);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto amp = apex::amp::initialize(model, opt, options);
  Outcome out;
  for (int s = 0; s < steps; ++s) {
    auto b = make_images(32, 500 + s);
    amp.zero_grad();
    auto loss = cross_entropy(amp.forward(model, b.x), b.y);
    amp.scale_loss(loss).backward();
    amp.step();
    if (s == 0) out.first_loss = loss.item<double>();
    out.last_loss = loss.item<double>();
  }
  model->eval();
  auto test = make_images(300, 99999);
  torch::NoGradGuard ng;
  out.accuracy = accuracy(amp.forward(model, test.x), test.y);
  out.skipped = amp.skipped_steps();
  return out;
}

}  // namespace

TEST(AmpTraining, O0EqualsPlainFp32BitForBit) {
  torch::manual_seed(3);
  Mlp a(16, 32, 4);
  torch::manual_seed(3);
  Mlp b(16, 32, 4);
  torch::optim::Adam oa(a->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(1e-4));
  torch::optim::Adam ob(b->parameters(), torch::optim::AdamOptions(1e-2).weight_decay(1e-4));
  auto amp = apex::amp::initialize(b, ob, quiet(OptLevel::O0));
  EXPECT_EQ(train_side_by_side(a, oa, b, amp, 25), 25);
  EXPECT_TRUE(all_equal(a->parameters(), b->parameters()));
  EXPECT_TRUE(all_equal(adam_state(oa), adam_state(ob)));
}

TEST(AmpTraining, MlpConvergesAtEveryLevelAndDtype) {
  const auto base = train_mlp(std::nullopt);
  ASSERT_LT(base.last_loss, 0.5 * base.first_loss);
  ASSERT_GT(base.accuracy, 0.8);
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
      // Pure fp16 (O3) keeps Adam's state in fp16, where eps=1e-8 rounds to 0 (the smallest fp16
      // subnormal is 6e-8) and v underflows: that run needs an eps fp16 can hold.
      const double eps = level == OptLevel::O3 && dtype == at::kHalf ? 1e-4 : 1e-8;
      const auto r = train_mlp(quiet(level).half_dtype(dtype), eps);
      SCOPED_TRACE(apex::amp::to_string(level) + " " + c10::toString(dtype));
      // Band: held-out accuracy within 3 points of fp32, loss at least halved.
      EXPECT_GT(r.accuracy, base.accuracy - 0.03);
      EXPECT_LT(r.last_loss, 0.5 * r.first_loss);
      EXPECT_LE(r.skipped, 5);
    }
  }
}

TEST(AmpTraining, CnnWithBatchNormConvergesAtEveryLevel) {
  const auto base = train_cnn(quiet(OptLevel::O0));
  ASSERT_GT(base.accuracy, 0.9);
  for (auto level : {OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    const auto r = train_cnn(quiet(level).half_dtype(at::kBFloat16));
    SCOPED_TRACE(apex::amp::to_string(level));
    EXPECT_GT(r.accuracy, base.accuracy - 0.05);
    EXPECT_LT(r.last_loss, 0.5 * r.first_loss);
  }
  const auto fp16 = train_cnn(quiet(OptLevel::O2).half_dtype(at::kHalf));
  EXPECT_GT(fp16.accuracy, base.accuracy - 0.05);
}

TEST(AmpTraining, O2Invariants) {
  torch::manual_seed(5);
  Cnn model(3);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  const auto before = snapshot(model->parameters());
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O2));
  for (const auto& np : model->named_parameters()) {
    const bool bn = np.key().rfind("bn", 0) == 0;
    EXPECT_EQ(np.value().scalar_type(), bn ? at::kFloat : at::kHalf) << np.key();
  }
  for (const auto& nb : model->named_buffers()) {
    if (nb.value().is_floating_point()) {
      EXPECT_EQ(nb.value().scalar_type(), at::kFloat) << nb.key();
    }
  }
  const auto masters = amp.master_params();
  const auto params = model->parameters();
  ASSERT_EQ(masters.size(), params.size());
  for (size_t i = 0; i < masters.size(); ++i) {
    EXPECT_EQ(masters[i].scalar_type(), at::kFloat);
    // Masters start as the exact fp32 values the model had.
    EXPECT_TRUE(at::equal(masters[i], before[i]));
    if (params[i].scalar_type() == at::kHalf) {
      EXPECT_FALSE(masters[i].is_same(params[i]));
    } else {
      EXPECT_TRUE(masters[i].is_same(params[i]));  // fp32 BN parameters are their own masters
    }
  }
  for (int s = 0; s < 3; ++s) {
    auto b = make_images(16, s);
    amp.zero_grad();
    amp.scale_loss(cross_entropy(amp.forward(model, b.x), b.y)).backward();
    // Gradients live on the masters, in fp32. The half model keeps the gradient that was folded
    // into them (as apex's O2 and an fp32 model keep theirs) until the next scale_loss, which so
    // sees whether the user cleared it (model->zero_grad()) and the master gradient must restart.
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_TRUE(masters[i].grad().defined());
      EXPECT_EQ(masters[i].grad().scalar_type(), at::kFloat);
      if (params[i].scalar_type() == at::kHalf) {
        EXPECT_EQ(params[i].grad().scalar_type(), at::kHalf);
      }
    }
    ASSERT_TRUE(amp.step());
    for (size_t i = 0; i < masters.size(); ++i) {
      EXPECT_TRUE(at::equal(params[i], masters[i].to(params[i].scalar_type())));
    }
  }
  // forward casts inputs to half and outputs to fp32.
  EXPECT_EQ(amp.forward(model, make_images(4, 1).x).scalar_type(), at::kFloat);
}

TEST(AmpTraining, OverflowInjectionSkipsExactlyThoseStepsAndChangesNothing) {
  for (auto level : {OptLevel::O1, OptLevel::O2}) {
    SCOPED_TRACE(apex::amp::to_string(level));
    torch::manual_seed(9);
    Mlp model(16, 32, 4);
    torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
    auto amp =
        apex::amp::initialize(model, opt, quiet(level).init_loss_scale(1024).growth_interval(3));
    const std::set<int> inject = {1, 4, 5};
    const std::vector<double> expected_scale = {1024, 512, 512, 512, 256, 128, 128, 128, 256, 256};
    for (int s = 0; s < 10; ++s) {
      auto b = blob_batch(s);
      amp.zero_grad();
      const auto params_before = snapshot(model->parameters());
      const auto masters_before = snapshot(amp.master_params());
      const auto state_before = adam_state(opt);
      {
        auto scaled = amp.scale_loss(cross_entropy(amp.forward(model, b.x), b.y));
        scaled.backward();
        if (inject.count(s)) {
          // Set one gradient element of the last parameter to inf (as an fp16 overflow would).
          auto& g = model->fc3->bias.mutable_grad();
          g[g.numel() - 1] = std::numeric_limits<float>::infinity();
        }
      }
      const bool stepped = amp.step();
      EXPECT_EQ(stepped, inject.count(s) == 0) << "step " << s;
      if (!stepped) {
        EXPECT_TRUE(all_equal(snapshot(model->parameters()), params_before)) << "step " << s;
        EXPECT_TRUE(all_equal(snapshot(amp.master_params()), masters_before)) << "step " << s;
        EXPECT_TRUE(all_equal(adam_state(opt), state_before)) << "step " << s;
      } else {
        EXPECT_FALSE(all_equal(snapshot(model->parameters()), params_before)) << "step " << s;
      }
      EXPECT_EQ(amp.loss_scale(), expected_scale[s]) << "step " << s;
    }
    EXPECT_EQ(amp.skipped_steps(), 3);
    // Adam's step counter counts only real steps.
    auto st = adam_state(opt);
    EXPECT_EQ(st[2].item<int64_t>(), 7);
  }
}

TEST(AmpTraining, UnscaledGradientsEqualAutocastReference) {
  // Scaling by a power of two is exact, so O1's unscaled gradients equal plain autocast ones.
  for (bool accumulate_delayed : {false, true}) {
    torch::manual_seed(2);
    Mlp ref(16, 32, 4);
    torch::manual_seed(2);
    Mlp model(16, 32, 4);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto amp = apex::amp::initialize(
        model, opt, quiet(OptLevel::O1).half_dtype(at::kBFloat16).loss_scale(LossScale::dynamic()));
    auto b1 = blob_batch(1, 16);
    auto b2 = blob_batch(2, 16);
    {
      apex::amp::AutocastGuard g(c10::kCPU, at::kBFloat16);
      auto l1 = cross_entropy(ref->forward(b1.x).to(at::kFloat), b1.y);
      auto l2 = cross_entropy(ref->forward(b2.x).to(at::kFloat), b2.y);
      (l1).backward();
      (l2).backward();
    }
    amp.scale_loss(cross_entropy(amp.forward(model, b1.x), b1.y), 0,
                   ScaleLossOptions().delay_unscale(accumulate_delayed))
        .backward();
    if (accumulate_delayed) {
      EXPECT_TRUE(apex::test::throws_with([&] { amp.step(); }, "still holds scaled gradients"));
    }
    amp.scale_loss(cross_entropy(amp.forward(model, b2.x), b2.y)).backward();
    auto rp = ref->parameters();
    auto mp = model->parameters();
    for (size_t i = 0; i < rp.size(); ++i) {
      EXPECT_TRUE(all_close(mp[i].grad(), rp[i].grad(), tolerance_for(at::kFloat)))
          << "parameter " << i << " delayed " << accumulate_delayed;
    }
    EXPECT_TRUE(amp.step());
  }
}

TEST(AmpTraining, SeveralModelsOptimizersAndLosses) {
  torch::manual_seed(4);
  Mlp a(16, 16, 4);
  Mlp b(16, 16, 4);
  torch::optim::Adam oa(a->parameters(), torch::optim::AdamOptions(1e-2));
  torch::optim::Adam ob(b->parameters(), torch::optim::AdamOptions(1e-2));
  auto amp = apex::amp::initialize({a.ptr(), b.ptr()}, {&oa, &ob},
                                   quiet(OptLevel::O2).num_losses(2).init_loss_scale(256));
  for (int s = 0; s < 4; ++s) {
    auto batch = blob_batch(s);
    amp.zero_grad();
    amp.scale_loss(cross_entropy(amp.forward(a, batch.x), batch.y), 0,
                   ScaleLossOptions().optimizers({0}))
        .backward();
    {
      auto scaled = amp.scale_loss(cross_entropy(amp.forward(b, batch.x), batch.y), 1,
                                   ScaleLossOptions().optimizers({1}));
      scaled.backward();
      if (s == 2) b->fc1->weight.mutable_grad()[0][0] = std::nanf("");
    }
    const auto a_before = snapshot(amp.master_params(0));
    const auto b_before = snapshot(amp.master_params(1));
    EXPECT_TRUE(amp.step(0));
    EXPECT_EQ(amp.step(1), s != 2);
    EXPECT_FALSE(all_equal(snapshot(amp.master_params(0)), a_before));
    EXPECT_EQ(all_equal(snapshot(amp.master_params(1)), b_before), s == 2);
  }
  EXPECT_EQ(amp.loss_scale(0), 256);
  EXPECT_EQ(amp.loss_scale(1), 128);
  EXPECT_EQ(amp.skipped_steps(0), 0);
  EXPECT_EQ(amp.skipped_steps(1), 1);
}

TEST(AmpTraining, ConvertNetworkKeepsAffineBatchNormFp32) {
  Cnn model(3);
  auto w = model->conv1->weight;
  apex::amp::convert_network(*model, at::kBFloat16);
  EXPECT_TRUE(w.is_same(model->conv1->weight));  // identity kept
  EXPECT_EQ(model->conv1->weight.scalar_type(), at::kBFloat16);
  EXPECT_EQ(model->fc->bias.scalar_type(), at::kBFloat16);
  EXPECT_EQ(model->bn1->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(model->bn1->running_mean.scalar_type(), at::kFloat);
  EXPECT_EQ(model->bn1->num_batches_tracked.scalar_type(), at::kLong);
  auto bn = torch::nn::BatchNorm1d(torch::nn::BatchNormOptions(4).affine(false));
  apex::amp::convert_network(*bn, at::kHalf);
  EXPECT_EQ(bn->running_mean.scalar_type(), at::kHalf);
}

TEST(AmpTraining, DisabledHandleIsPlainTraining) {
  torch::manual_seed(3);
  Mlp a(16, 8, 4);
  torch::manual_seed(3);
  Mlp b(16, 8, 4);
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ob(b->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(b, ob, quiet(OptLevel::O2).enabled(false));
  EXPECT_EQ(b->fc1->weight.scalar_type(), at::kFloat);
  EXPECT_EQ(train_side_by_side(a, oa, b, amp, 3), 3);
  EXPECT_TRUE(all_equal(a->parameters(), b->parameters()));
}

// The decision whether LibTorch's half matmuls are fast here comes from the CPU's features, read
// from cpuid: checked against the kernel's own reading of them (/proc/cpuinfo's flags), and
// oneDNN's ISA limit (ONEDNN_MAX_CPU_ISA): its names in any case, its partial order, and the
// decision for CPUs that are not this one.
TEST(AmpCpu, OnednnIsaLimit) {
  using apex::amp::onednn_isa_allows;
  using apex::amp::onednn_isa_from_name;
  using apex::amp::OnednnIsa;
  EXPECT_EQ(onednn_isa_from_name("AVX2"), OnednnIsa::kAvx2);
  EXPECT_EQ(onednn_isa_from_name("avx2"), OnednnIsa::kAvx2);
  EXPECT_EQ(onednn_isa_from_name("Avx512_Core"), OnednnIsa::kAvx512Core);
  EXPECT_EQ(onednn_isa_from_name("AVX10_1_512"), OnednnIsa::kAvx512CoreFp16);
  EXPECT_EQ(onednn_isa_from_name("avx512_core_fp16"), OnednnIsa::kAvx512CoreFp16);
  EXPECT_EQ(onednn_isa_from_name("AVX10_1_512_AMX_FP16"), OnednnIsa::kAvx512CoreAmxFp16);
  EXPECT_EQ(onednn_isa_from_name("default"), OnednnIsa::kAll);
  EXPECT_EQ(onednn_isa_from_name("ALL"), OnednnIsa::kAll);
  EXPECT_EQ(onednn_isa_from_name("AVX2 "), std::nullopt);
  EXPECT_EQ(onednn_isa_from_name("AVX3"), std::nullopt);
  EXPECT_EQ(onednn_isa_from_name(""), std::nullopt);

  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAll, OnednnIsa::kAvx512CoreAmxFp16));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAll, OnednnIsa::kAvx2Vnni2));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx2, OnednnIsa::kAvx2));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx2, OnednnIsa::kSse41));
  EXPECT_FALSE(onednn_isa_allows(OnednnIsa::kAvx2, OnednnIsa::kAvx512Core));
  EXPECT_FALSE(onednn_isa_allows(OnednnIsa::kAvx2, OnednnIsa::kAll));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx512CoreBf16, OnednnIsa::kAvx512Core));
  EXPECT_FALSE(onednn_isa_allows(OnednnIsa::kAvx512CoreBf16, OnednnIsa::kAvx512CoreFp16));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx512Core, OnednnIsa::kAvx2));
  EXPECT_FALSE(onednn_isa_allows(OnednnIsa::kAvx512Core, OnednnIsa::kAvx2Vnni));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx512CoreFp16, OnednnIsa::kAvx2Vnni));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx512CoreAmx, OnednnIsa::kAvx2Vnni));
  // Two branches: AVX2_VNNI_2 (AVX-NE-CONVERT) is below no AVX-512 set, and above none of them.
  EXPECT_FALSE(onednn_isa_allows(OnednnIsa::kAvx512CoreAmxFp16, OnednnIsa::kAvx2Vnni2));
  EXPECT_FALSE(onednn_isa_allows(OnednnIsa::kAvx2Vnni2, OnednnIsa::kAvx512Core));
  EXPECT_TRUE(onednn_isa_allows(OnednnIsa::kAvx2Vnni2, OnednnIsa::kAvx2Vnni));

  const auto fast = [](apex::amp::CpuHalfSupport s, OnednnIsa limit, at::ScalarType t) {
    s.onednn_max_isa = limit;
    return apex::amp::cpu_half_matmul_is_fast(t, s);
  };
  apex::amp::CpuHalfSupport zen5;  // AVX-512 with BF16, no FP16
  zen5.onednn = zen5.avx512_core = zen5.avx512_bf16 = true;
  EXPECT_TRUE(fast(zen5, OnednnIsa::kAll, at::kBFloat16));
  // Held to AVX512_CORE, oneDNN emulates bf16: 0.65-0.85x O0 in apex-train (measured).
  EXPECT_FALSE(fast(zen5, OnednnIsa::kAvx512Core, at::kBFloat16));
  EXPECT_FALSE(fast(zen5, OnednnIsa::kAvx2, at::kBFloat16));  // measured ~60x slower
  const auto kind = [](apex::amp::CpuHalfSupport s, OnednnIsa limit, at::ScalarType t) {
    s.onednn_max_isa = limit;
    return apex::amp::cpu_half_matmul_kind(t, s);
  };
  using apex::amp::CpuHalfMatmul;
  EXPECT_EQ(kind(zen5, OnednnIsa::kAll, at::kBFloat16), CpuHalfMatmul::kFast);
  EXPECT_EQ(kind(zen5, OnednnIsa::kAvx512CoreVnni, at::kBFloat16), CpuHalfMatmul::kEmulated);
  EXPECT_EQ(kind(zen5, OnednnIsa::kAvx2, at::kBFloat16), CpuHalfMatmul::kScalar);
  EXPECT_EQ(kind(zen5, OnednnIsa::kAll, at::kHalf), CpuHalfMatmul::kScalar);
  apex::amp::CpuHalfSupport skx;  // Skylake to Ice Lake servers: AVX-512, no bf16 instructions
  skx.onednn = skx.avx512_core = true;
  EXPECT_EQ(kind(skx, OnednnIsa::kAll, at::kBFloat16), CpuHalfMatmul::kEmulated);
  EXPECT_EQ(kind(skx, OnednnIsa::kAll, at::kHalf), CpuHalfMatmul::kScalar);
  EXPECT_FALSE(fast(zen5, OnednnIsa::kAll, at::kHalf));
  apex::amp::CpuHalfSupport spr = zen5;  // Sapphire Rapids: FP16 and AMX too
  spr.avx512_fp16 = spr.amx_bf16 = true;
  EXPECT_TRUE(fast(spr, OnednnIsa::kAll, at::kHalf));
  EXPECT_TRUE(fast(spr, OnednnIsa::kAvx512CoreFp16, at::kHalf));
  EXPECT_FALSE(fast(spr, OnednnIsa::kAvx512CoreBf16, at::kHalf));
  EXPECT_TRUE(fast(spr, OnednnIsa::kAvx512CoreBf16, at::kBFloat16));
  apex::amp::CpuHalfSupport ne;  // an AVX2 CPU with AVX-NE-CONVERT
  ne.onednn = ne.avx_ne_convert = true;
  EXPECT_TRUE(fast(ne, OnednnIsa::kAll, at::kHalf));
  EXPECT_TRUE(fast(ne, OnednnIsa::kAvx2Vnni2, at::kBFloat16));
  EXPECT_FALSE(fast(ne, OnednnIsa::kAvx2Vnni, at::kBFloat16));
  zen5.onednn = false;  // no oneDNN: LibTorch's own loop whatever the CPU
  EXPECT_FALSE(fast(zen5, OnednnIsa::kAll, at::kBFloat16));
}

// initialize warns exactly where the dtype is slow.
TEST(AmpCpu, HalfMatmulDecisionFollowsCpuFlags) {
  EXPECT_TRUE(throws_with([] { apex::amp::cpu_half_matmul_is_fast(at::kFloat); },
                          "expected Half or BFloat16, got Float"));
  EXPECT_TRUE(throws_with([] { apex::amp::cpu_half_matmul_speed(at::kFloat); },
                          "expected Half or BFloat16, got Float"));
  std::ifstream cpuinfo("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(cpuinfo, line)) {
    if (line.rfind("flags", 0) != 0) continue;
    std::istringstream words(line.substr(line.find(':') + 1));
    for (std::string w; words >> w;) flags.insert(w);
    break;
  }
  ASSERT_FALSE(flags.empty()) << "no flags line in /proc/cpuinfo";
  const auto has = [&](const char* f) { return flags.count(f) > 0; };
  const apex::amp::CpuHalfSupport& s = apex::amp::cpu_half_support();
  EXPECT_EQ(s.avx512_core, has("avx512f") && has("avx512bw") && has("avx512vl") && has("avx512dq"));
  EXPECT_EQ(s.avx512_bf16, s.avx512_core && has("avx512_bf16"));
  EXPECT_EQ(s.avx512_fp16, s.avx512_core && has("avx512_fp16"));
  EXPECT_EQ(s.amx_bf16, has("amx_bf16") && has("amx_tile"));
  const bool onednn = at::hasMKLDNN();
  EXPECT_EQ(s.onednn, onednn);
  // oneDNN's ISA limit, as ctest's amp.onednn_limit_* runs set it: AVX2 takes every AVX-512 set
  // (and so bf16) away, AVX512_CORE_BF16 only fp16's.
  const char* limit_env = std::getenv("ONEDNN_MAX_CPU_ISA");
  const std::string limit = limit_env == nullptr ? "" : limit_env;
  if (limit != "" && limit != "AVX2" && limit != "avx2" && limit != "AVX512_CORE" &&
      limit != "AVX512_CORE_BF16") {
    GTEST_SKIP() << "no expectation written here for ONEDNN_MAX_CPU_ISA=" << limit;
  }
  if (std::getenv("DNNL_MAX_CPU_ISA") != nullptr) {
    GTEST_SKIP() << "DNNL_MAX_CPU_ISA set: no expectation written here for it";
  }
  using apex::amp::OnednnIsa;
  const OnednnIsa expected_limit = limit.empty()                 ? OnednnIsa::kAll
                                   : limit == "AVX512_CORE"      ? OnednnIsa::kAvx512Core
                                   : limit == "AVX512_CORE_BF16" ? OnednnIsa::kAvx512CoreBf16
                                                                 : OnednnIsa::kAvx2;
  EXPECT_EQ(s.onednn_max_isa, expected_limit) << "ONEDNN_MAX_CPU_ISA=" << limit;
  const bool avx512_limited = expected_limit == OnednnIsa::kAvx2;  // no AVX-512 set at all
  const bool bf16_limited = avx512_limited || expected_limit == OnednnIsa::kAvx512Core;
  const bool fp16_limited = bf16_limited || expected_limit == OnednnIsa::kAvx512CoreBf16;
  // AVX-512 alone is not enough for bf16: oneDNN's emulation there is slower than fp32.  //
  // AVX-NE-CONVERT (oneDNN's AVX2_VNNI_2) is below none of the limits written here.
  const bool ne_convert = has("avx_ne_convert") && limit.empty();
  const bool bf16_instructions =
      s.avx512_bf16 || (has("amx_bf16") && has("amx_tile")) || has("avx_ne_convert");
  const bool bf16_fast =
      onednn &&
      (((s.avx512_bf16 || (has("amx_bf16") && has("amx_tile"))) && !bf16_limited) || ne_convert);
  EXPECT_EQ(apex::amp::cpu_half_matmul_kind(at::kBFloat16),
            bf16_fast                                    ? apex::amp::CpuHalfMatmul::kFast
            : onednn && s.avx512_core && !avx512_limited ? apex::amp::CpuHalfMatmul::kEmulated
                                                         : apex::amp::CpuHalfMatmul::kScalar);
  EXPECT_EQ(apex::amp::cpu_half_matmul_is_fast(at::kBFloat16), bf16_fast);
  const bool fp16_fast =
      onednn && (((s.avx512_fp16 || has("amx_fp16")) && !fp16_limited) || ne_convert);
  EXPECT_EQ(apex::amp::cpu_half_matmul_is_fast(at::kHalf), fp16_fast);
  // Messages say which: the CPU, or the limit on a CPU that has the instructions.
  const std::string reason = apex::amp::cpu_half_matmul_slow_reason(at::kBFloat16);
  EXPECT_EQ(reason.empty(), bf16_fast);
  const bool limit_to_blame =
      onednn && ((bf16_instructions && bf16_limited) || (s.avx512_core && avx512_limited));
  if (!bf16_fast && limit_to_blame) {
    EXPECT_NE(reason.find(" here: ONEDNN_MAX_CPU_ISA=" + limit +
                          " keeps oneDNN from this CPU's instructions for them"),
              std::string::npos)
        << reason;
  } else if (!bf16_fast) {
    EXPECT_NE(reason.find(" on this CPU ("), std::string::npos) << reason;
  }
  EXPECT_EQ(reason.rfind("in a scalar loop", 0) == 0,
            !bf16_fast && !(onednn && s.avx512_core && !avx512_limited))
      << reason;

  struct Capture : c10::WarningHandler {
    std::vector<std::string> messages;
    void process(const c10::Warning& w) override { messages.push_back(w.msg()); }
  } capture;
  const c10::WarningUtils::WarningHandlerGuard guard(&capture);
  const char* env = std::getenv("APEX_CPU_HALF_FALLBACK");
  const bool route_allowed = env == nullptr || std::string(env) != "0";
  // Each dtype on its own: a CPU may be fast in bf16 and slow in fp16 (AVX512-BF16 without
  // AVX512-FP16), and the fp32 route then takes fp16 alone.
  for (const auto& [dtype, fast] : {std::pair{at::kBFloat16, bf16_fast}, {at::kHalf, fp16_fast}}) {
    capture.messages.clear();
    Mlp model(16, 64, 4);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto amp =
        apex::amp::initialize(model, opt, Options(OptLevel::O2).half_dtype(dtype).verbosity(1));
    bool warned = false;
    const std::string what = std::string("O2 computes matmuls in ") + c10::toString(dtype);
    for (const auto& m : capture.messages) warned = warned || m.find(what) != std::string::npos;
    // Warned only where nothing makes the half dtype fast: neither the CPU nor apex's fp32 route
    // (on unless APEX_CPU_HALF_FALLBACK=0).
    EXPECT_EQ(apex::amp::cpu_half_fallback_available(dtype), !fast && route_allowed) << dtype;
    EXPECT_EQ(warned, !fast && !route_allowed) << dtype;
  }
}
