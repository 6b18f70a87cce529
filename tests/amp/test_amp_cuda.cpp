// CUDA tests: run wherever a GPU is visible, skip with a reason elsewhere.
#include "amp_test_util.h"

#include <apex/amp/grad_scaler.h>

using apex::amp::Options;
using apex::amp::OptLevel;
using namespace apex::test;

namespace {
#define REQUIRE_CUDA()                            \
  if (!torch::cuda::is_available())               \
  GTEST_SKIP() << "no CUDA device visible; this " \
                  "test runs on a GPU machine"
}  // namespace

TEST(AmpCuda, AutocastFp16OnCuda) {
  REQUIRE_CUDA();
  auto fc = torch::nn::Linear(8, 4);
  fc->to(torch::kCUDA);
  apex::amp::AutocastGuard g(c10::kCUDA, at::kHalf);
  EXPECT_EQ(fc->forward(torch::randn({2, 8}, torch::kCUDA)).scalar_type(), at::kHalf);
}

TEST(AmpCuda, O2Fp16TrainsAndMatchesMasters) {
  REQUIRE_CUDA();
  torch::manual_seed(1);
  Mlp model(16, 64, 4);
  model->to(torch::kCUDA);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(3e-3));
  auto amp = apex::amp::initialize(model, opt, Options(OptLevel::O2).verbosity(0));
  double first = 0, last = 0;
  for (int s = 0; s < 100; ++s) {
    auto b = blob_batch(s);
    amp.zero_grad();
    auto loss = cross_entropy(amp.forward(model, b.x.cuda()), b.y.cuda());
    amp.scale_loss(loss).backward();
    amp.step();
    if (s == 0) first = loss.item<double>();
    last = loss.item<double>();
  }
  EXPECT_LT(last, 0.5 * first);
  auto masters = amp.master_params();
  auto params = model->parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    EXPECT_TRUE(at::equal(params[i], masters[i].to(at::kHalf)));
  }
}

TEST(AmpCuda, OverflowOnCudaIsSkipped) {
  REQUIRE_CUDA();
  Mlp model(16, 16, 4);
  model->to(torch::kCUDA);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, opt, Options(OptLevel::O2).verbosity(0));
  auto b = blob_batch(0);
  const auto before = snapshot(amp.master_params());
  {
    auto scaled = amp.scale_loss(cross_entropy(amp.forward(model, b.x.cuda()), b.y.cuda()));
    scaled.backward();
    model->fc1->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
  }
  EXPECT_FALSE(amp.step());
  EXPECT_TRUE(all_equal(snapshot(amp.master_params()), before));
  EXPECT_EQ(amp.loss_scale(), 32768.0);
}

TEST(AmpCuda, GradScalerOnCuda) {
  REQUIRE_CUDA();
  apex::amp::GradScaler scaler;  // CUDA by default
  ASSERT_TRUE(scaler.is_enabled());
  auto w = torch::ones({4}, torch::TensorOptions().device(torch::kCUDA)).requires_grad_(true);
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.5));
  scaler.scale(w.sum()).backward();
  EXPECT_TRUE(scaler.step(opt).has_value());
  scaler.update();
  EXPECT_TRUE(at::equal(w.detach().cpu(), torch::full({4}, 0.5f)));
  EXPECT_EQ(scaler.get_scale(), 65536.0);
}
