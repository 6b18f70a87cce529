#include <apex/amp/grad_scaler.h>

#include "../common/test_util.h"

#include <cstdio>
#include <filesystem>

using apex::amp::GradScaler;
using apex::amp::GradScalerOptions;
using apex::test::throws_with;

namespace {

GradScalerOptions cpu() { return GradScalerOptions().device(c10::kCPU); }

struct Problem {
  at::Tensor w = at::tensor({1.0f, -2.0f, 3.0f}).requires_grad_(true);
  torch::optim::SGD opt{std::vector<at::Tensor>{w}, torch::optim::SGDOptions(0.1)};
  at::Tensor loss() { return (w * at::tensor({0.5f, 0.25f, 2.0f})).sum(); }
};

}  // namespace

TEST(GradScaler, ScaleMultipliesByInitScale) {
  GradScaler s(cpu());
  EXPECT_EQ(s.get_scale(), 65536.0);
  auto out = s.scale(at::tensor({1.5f}));
  EXPECT_EQ(out.item<float>(), 1.5f * 65536.0f);
  auto outs = s.scale(std::vector<at::Tensor>{at::tensor({1.0f}), at::tensor({2.0f})});
  EXPECT_EQ(outs[1].item<float>(), 131072.0f);
}

TEST(GradScaler, DisabledIsPassThrough) {
  GradScaler s(cpu().enabled(false));
  auto x = at::tensor({3.0f});
  EXPECT_TRUE(s.scale(x).is_same(x));
  EXPECT_EQ(s.get_scale(), 1.0);
  EXPECT_EQ(s.state_dict().size(), 0u);
  Problem p;
  p.loss().backward();
  s.step(p.opt);  // plain step
  EXPECT_FLOAT_EQ(p.w[0].item<float>(), 1.0f - 0.1f * 0.5f);
}

TEST(GradScaler, CudaScalerWithoutCudaDisablesItself) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA present: the fallback is not exercised";
  GradScaler s;  // device defaults to CUDA, as in torch
  EXPECT_FALSE(s.is_enabled());
}

TEST(GradScaler, StepsOnCleanGradientsSkipsOnInfAndFollowsTorchSchedule) {
  GradScaler s(cpu().init_scale(8).growth_interval(2));
  Problem p;
  // inf injected at step 2 only. torch's schedule: growth after 2 clean steps, backoff on inf.
  const std::vector<bool> inject = {false, false, true, false, false, false};
  const std::vector<double> scale_after = {8, 16, 8, 8, 16, 16};
  const std::vector<int64_t> tracker_after = {1, 0, 0, 1, 0, 1};
  for (size_t i = 0; i < inject.size(); ++i) {
    p.opt.zero_grad();
    s.scale(p.loss()).backward();
    const at::Tensor before = p.w.detach().clone();
    if (inject[i]) p.w.mutable_grad()[1] = std::numeric_limits<float>::infinity();
    const auto result = s.step(p.opt);
    EXPECT_EQ(result.has_value(), !inject[i]) << "step " << i;
    if (inject[i]) {
      EXPECT_TRUE(at::equal(p.w.detach(), before)) << "skipped step changed the parameter";
    } else {
      // The update used the unscaled gradient: w -= lr * g.
      auto want = before - 0.1 * at::tensor({0.5f, 0.25f, 2.0f});
      EXPECT_TRUE(at::allclose(p.w.detach(), want, 0, 1e-6)) << "step " << i;
    }
    s.update();
    EXPECT_EQ(s.get_scale(), scale_after[i]) << "step " << i;
    EXPECT_EQ(s.state_dict().at("_growth_tracker").toInt(), tracker_after[i]) << "step " << i;
  }
}

TEST(GradScaler, UnscaleThenStepUnscalesOnce) {
  GradScaler s(cpu().init_scale(1024));
  Problem p;
  s.scale(p.loss()).backward();
  s.unscale_(p.opt);
  EXPECT_TRUE(at::equal(p.w.grad(), at::tensor({0.5f, 0.25f, 2.0f})));
  s.step(p.opt);
  EXPECT_TRUE(at::allclose(p.w.detach(), at::tensor({0.95f, -2.025f, 2.8f}), 0, 1e-6));
}

TEST(GradScaler, MisuseErrors) {
  {
    GradScaler s(cpu());
    Problem p;
    EXPECT_TRUE(throws_with([&] { s.step(p.opt); }, "scale is not initialized"));
  }
  {
    GradScaler s(cpu());
    Problem p;
    s.scale(p.loss()).backward();
    s.unscale_(p.opt);
    EXPECT_TRUE(throws_with([&] { s.unscale_(p.opt); },
                            "unscale_() has already been called on this optimizer since the last "
                            "update()"));
    s.step(p.opt);
    EXPECT_TRUE(throws_with([&] { s.unscale_(p.opt); }, "unscale_() is being called after step()"));
    EXPECT_TRUE(throws_with([&] { s.step(p.opt); },
                            "step() has already been called since the last update()"));
    s.update();
    EXPECT_TRUE(throws_with([&] { s.update(); }, "no inf checks were recorded prior to update()"));
  }
  {
    GradScaler s(cpu());
    auto w = at::ones({4}, at::TensorOptions().dtype(at::kHalf)).requires_grad_(true);
    torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
    s.scale(w.sum()).backward();
    EXPECT_TRUE(throws_with([&] { s.unscale_(opt); }, "attempting to unscale FP16 gradients"));
  }
  {
    GradScaler s(cpu());
    Problem p;
    s.scale(p.loss());  // no backward: nothing to check
    EXPECT_TRUE(
        throws_with([&] { s.step(p.opt); }, "no inf checks were recorded for this optimizer"));
  }
  EXPECT_TRUE(throws_with([] { GradScaler(cpu().growth_factor(0.9)); },
                          "the growth factor must be > 1.0, got 0.9"));
  EXPECT_TRUE(throws_with([] { GradScaler(cpu().backoff_factor(1.0)); },
                          "the backoff factor must be in (0, 1.0), got 1"));
}

TEST(GradScaler, UpdateWithExplicitScale) {
  GradScaler s(cpu());
  s.scale(at::tensor({1.0f}));
  s.update(4.0);
  EXPECT_EQ(s.get_scale(), 4.0);
  s.update(at::tensor({2.0f}));
  EXPECT_EQ(s.get_scale(), 2.0);
  EXPECT_TRUE(throws_with(
      [&] {
        s.update(at::tensor({1.0f, 2.0f}));
      },
      "new_scale should be a float or a one-element tensor"));
  EXPECT_TRUE(throws_with([&] { s.update(-1.0); }, "new_scale must be finite and > 0, got -1"));
}

TEST(GradScaler, StateDictHasTorchKeysAndRoundTrips) {
  GradScaler a(cpu().init_scale(256).growth_interval(3));
  Problem p;
  for (int i = 0; i < 2; ++i) {
    a.scale(p.loss()).backward();
    a.step(p.opt);
    a.update();
  }
  auto d = a.state_dict();
  EXPECT_EQ(d.size(), 5u);
  EXPECT_TRUE(d.at("scale").isDouble());
  EXPECT_EQ(d.at("scale").toDouble(), 256.0);
  EXPECT_EQ(d.at("growth_factor").toDouble(), 2.0);
  EXPECT_EQ(d.at("backoff_factor").toDouble(), 0.5);
  EXPECT_EQ(d.at("growth_interval").toInt(), 3);
  EXPECT_EQ(d.at("_growth_tracker").toInt(), 2);

  const auto path = (std::filesystem::temp_directory_path() / "apex_gradscaler_test.pt").string();
  a.save(path);
  GradScaler b(cpu());
  b.load(path);
  std::remove(path.c_str());
  EXPECT_EQ(b.get_scale(), 256.0);
  EXPECT_EQ(b.get_growth_interval(), 3);
  // One more clean step grows both (tracker 2 -> 3 == interval).
  for (GradScaler* s : {&a, &b}) {
    Problem q;
    s->scale(q.loss()).backward();
    s->step(q.opt);
    s->update();
  }
  EXPECT_EQ(a.get_scale(), 512.0);
  EXPECT_EQ(b.get_scale(), 512.0);
}

TEST(GradScaler, LoadRejectsBadState) {
  GradScaler s(cpu());
  EXPECT_TRUE(throws_with([&] { s.load_state_dict(apex::make_state_dict()); },
                          "the source state dict is empty"));
  auto d = GradScaler(cpu()).state_dict();
  d.insert_or_assign("scale", std::numeric_limits<double>::infinity());
  EXPECT_TRUE(throws_with([&] { s.load_state_dict(d); }, "scale must be finite and > 0, got inf"));
  d.insert_or_assign("scale", 0.0);
  EXPECT_TRUE(throws_with([&] { s.load_state_dict(d); }, "scale must be finite and > 0, got 0"));
  EXPECT_EQ(s.get_scale(), 65536.0);
  (void)d.erase("growth_interval");
  d.insert_or_assign("scale", 2.0);
  EXPECT_TRUE(throws_with([&] { s.load_state_dict(d); }, "missing key 'growth_interval'"));
  EXPECT_TRUE(throws_with([&] { s.load("/nonexistent/dir/scaler.pt"); }, "cannot read"));
}
