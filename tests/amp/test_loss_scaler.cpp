#include <apex/amp/loss_scaler.h>

#include "../common/test_util.h"

#include <tuple>
#include <vector>

using apex::amp::LossScaler;
using apex::amp::LossScalerOptions;
using apex::test::throws_with;

namespace {

/// Reference written from the rules in apex/Megatron's documentation, step by step: returns the
/// scale after each step of `overflow`.
std::vector<double> expected_scales(double init, double growth, double backoff, int64_t interval,
                                    int64_t hysteresis, const std::vector<bool>& overflow,
                                    double min_scale = 0, double max_scale = 16777216.0) {
  std::vector<double> out;
  double s = std::min(init, max_scale);
  int64_t clean = 0;
  int64_t budget = hysteresis;
  for (bool o : overflow) {
    if (o) {
      clean = 0;
      if (--budget <= 0) {
        budget = 0;
        s = std::max(s * backoff, min_scale);
      }
    } else if (++clean == interval) {
      clean = 0;
      budget = hysteresis;
      s = std::min(s * growth, max_scale);
    }
    out.push_back(s);
  }
  return out;
}

}  // namespace

TEST(LossScaler, DefaultsMatchApex) {
  LossScaler s;
  EXPECT_EQ(s.loss_scale(), 65536.0);
  EXPECT_TRUE(s.dynamic());
  EXPECT_EQ(s.options().growth_interval(), 2000);
  EXPECT_EQ(s.options().max_scale(), 16777216.0);
  // 1999 clean steps keep the scale; the 2000th doubles it.
  for (int i = 0; i < 1999; ++i) EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.loss_scale(), 65536.0);
  EXPECT_EQ(s.unskipped(), 1999);
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.loss_scale(), 131072.0);
  EXPECT_EQ(s.unskipped(), 0);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.loss_scale(), 65536.0);
}

TEST(LossScaler, HandDerivedSequence) {
  // init 8, x2 every 2 clean steps, x0.5 on overflow.
  LossScaler s(LossScalerOptions().init_scale(8).growth_interval(2));
  const std::vector<std::tuple<bool, double, bool>> steps = {
      {false, 8, false}, {false, 16, false}, {true, 8, true},   {false, 8, false},
      {true, 4, true},   {true, 2, true},    {false, 2, false}, {false, 4, false},
      {false, 4, false}, {false, 8, false}};
  for (size_t i = 0; i < steps.size(); ++i) {
    const auto [overflow, scale, skip] = steps[i];
    EXPECT_EQ(s.update(overflow), skip) << "step " << i;
    EXPECT_EQ(s.loss_scale(), scale) << "step " << i;
  }
}

TEST(LossScaler, HysteresisHandDerived) {
  // hysteresis 2: the first overflow is tolerated (still skipped), the second backs off; a growth
  // restores the budget.
  LossScaler s(LossScalerOptions().init_scale(64).growth_interval(2).hysteresis(2));
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.loss_scale(), 64);
  EXPECT_EQ(s.hysteresis_left(), 1);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.loss_scale(), 32);
  EXPECT_TRUE(s.update(true));  // budget exhausted: every further overflow backs off
  EXPECT_EQ(s.loss_scale(), 16);
  EXPECT_FALSE(s.update(false));
  EXPECT_FALSE(s.update(false));
  EXPECT_EQ(s.loss_scale(), 32);
  EXPECT_EQ(s.hysteresis_left(), 2);
  EXPECT_TRUE(s.update(true));
  EXPECT_EQ(s.loss_scale(), 32);
}

TEST(LossScaler, GridAgainstReference) {
  const std::vector<bool> pattern = {false, false, true,  false, false, false, true,  true,
                                     false, false, false, false, false, true,  false, false,
                                     false, false, false, false, true,  true,  true,  false};
  for (double init : {1.0, 1024.0, 65536.0}) {
    for (double growth : {2.0, 4.0}) {
      for (double backoff : {0.5, 0.25}) {
        for (int64_t interval : {1, 3, 5}) {
          for (int64_t hyst : {1, 2, 3}) {
            LossScaler s(LossScalerOptions()
                             .init_scale(init)
                             .growth_factor(growth)
                             .backoff_factor(backoff)
                             .growth_interval(interval)
                             .hysteresis(hyst));
            const auto want = expected_scales(init, growth, backoff, interval, hyst, pattern);
            for (size_t i = 0; i < pattern.size(); ++i) {
              EXPECT_EQ(s.update(pattern[i]), pattern[i]);
              ASSERT_EQ(s.loss_scale(), want[i])
                  << "init " << init << " growth " << growth << " backoff " << backoff
                  << " interval " << interval << " hysteresis " << hyst << " step " << i;
            }
          }
        }
      }
    }
  }
}

TEST(LossScaler, FloorAndCap) {
  LossScaler low(LossScalerOptions().init_scale(4).min_scale(1.0));
  for (int i = 0; i < 10; ++i) low.update(true);
  EXPECT_EQ(low.loss_scale(), 1.0);  // apex had no floor: 4 * 2^-10

  LossScaler high(LossScalerOptions().init_scale(1 << 22).growth_interval(1));
  for (int i = 0; i < 10; ++i) high.update(false);
  EXPECT_EQ(high.loss_scale(), 16777216.0);

  // apex starts at min(init, max).
  LossScaler capped(LossScalerOptions().init_scale(1e9).max_scale(1024));
  EXPECT_EQ(capped.loss_scale(), 1024);
}

TEST(LossScaler, StaticScalerSkipsButKeepsScale) {
  LossScaler s(LossScalerOptions().dynamic(false).init_scale(128));
  EXPECT_TRUE(s.update(true));
  EXPECT_FALSE(s.update(false));
  for (int i = 0; i < 5000; ++i) s.update(false);
  EXPECT_EQ(s.loss_scale(), 128);
}

TEST(LossScaler, UnscaleAndDetectOnDevice) {
  LossScaler s(LossScalerOptions().init_scale(4));
  std::vector<at::Tensor> grads = {at::full({7}, 1.0f), at::full({65537}, 8.0f),
                                   at::full({3}, 2.0f, at::TensorOptions().dtype(at::kBFloat16))};
  std::vector<at::Tensor> flags;
  s.unscale_(grads, flags);
  ASSERT_EQ(flags.size(), 1u);
  EXPECT_EQ(flags[0].item<float>(), 0.0f);
  EXPECT_TRUE(at::equal(grads[0], at::full({7}, 0.25f)));
  EXPECT_TRUE(at::equal(grads[1], at::full({65537}, 2.0f)));
  EXPECT_TRUE(at::equal(grads[2], at::full({3}, 0.5f, at::TensorOptions().dtype(at::kBFloat16))));
  for (int64_t pos : {int64_t{0}, int64_t{32768}, int64_t{65536}}) {
    std::vector<at::Tensor> g = {at::ones({65537})};
    g[0][pos] = std::nanf("");
    std::vector<at::Tensor> f;
    s.unscale_(g, f);
    EXPECT_EQ(f[0].item<float>(), 1.0f) << "NaN at " << pos;
  }
}

TEST(LossScaler, StateDictRoundTrip) {
  LossScaler a(LossScalerOptions().init_scale(512).growth_interval(3).hysteresis(2));
  a.update(false);
  a.update(true);
  LossScaler b(LossScalerOptions().growth_interval(3).hysteresis(2));
  b.load_state_dict(a.state_dict());
  EXPECT_EQ(b.loss_scale(), a.loss_scale());
  EXPECT_EQ(b.unskipped(), a.unskipped());
  EXPECT_EQ(b.hysteresis_left(), a.hysteresis_left());
  for (bool o : {false, false, true, false, false, false}) EXPECT_EQ(a.update(o), b.update(o));
  EXPECT_EQ(b.loss_scale(), a.loss_scale());
}

TEST(LossScaler, BadOptionsAndStateAreRejected) {
  EXPECT_TRUE(throws_with([] { LossScaler(LossScalerOptions().init_scale(-1)); },
                          "init_scale must be finite and > 0, got -1"));
  EXPECT_TRUE(throws_with([] { LossScaler(LossScalerOptions().growth_factor(1.0)); },
                          "growth_factor must be > 1, got 1"));
  EXPECT_TRUE(throws_with([] { LossScaler(LossScalerOptions().backoff_factor(1.5)); },
                          "backoff_factor must be in (0, 1), got 1.5"));
  EXPECT_TRUE(throws_with([] { LossScaler(LossScalerOptions().growth_interval(0)); },
                          "growth_interval must be >= 1, got 0"));
  EXPECT_TRUE(throws_with([] { LossScaler(LossScalerOptions().hysteresis(0)); },
                          "hysteresis must be >= 1, got 0"));
  EXPECT_TRUE(throws_with([] { LossScaler(LossScalerOptions().min_scale(1e30)); },
                          "min_scale must be in (0, max_scale="));

  LossScaler s;
  for (double bad : {0.0, -2.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    auto d = apex::make_state_dict();
    d.insert("loss_scale", bad);
    d.insert("unskipped", int64_t{0});
    EXPECT_TRUE(throws_with([&] { s.load_state_dict(d); }, "loss_scale must be finite and > 0"));
    EXPECT_EQ(s.loss_scale(), 65536.0);  // unchanged
  }
  auto d = apex::make_state_dict();
  d.insert("loss_scale", 2.0);
  d.insert("bogus", int64_t{1});
  EXPECT_TRUE(throws_with([&] { s.load_state_dict(d); }, "unexpected key 'bogus'"));
}
