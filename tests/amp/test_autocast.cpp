#include <apex/amp/autocast.h>

#include "../common/test_util.h"

#include <ATen/autocast_mode.h>

using apex::amp::AutocastGuard;
using apex::test::throws_with;

TEST(Autocast, EnablesSetsDtypeAndRestores) {
  ASSERT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  const auto dtype_before = at::autocast::get_autocast_dtype(c10::kCPU);
  auto fc = torch::nn::Linear(4, 3);
  auto x = torch::randn({2, 4});
  {
    AutocastGuard g(c10::kCPU, at::kBFloat16);
    EXPECT_TRUE(g.enabled());
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(fc->forward(x).scalar_type(), at::kBFloat16);
    // fp32-policy ops (losses) run in fp32 under autocast.
    auto y = fc->forward(x);
    EXPECT_EQ(torch::nn::functional::mse_loss(y, y.detach()).scalar_type(), at::kFloat);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
  EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), dtype_before);
  EXPECT_EQ(fc->forward(x).scalar_type(), at::kFloat);
}

TEST(Autocast, Fp16OnCpu) {
  auto fc = torch::nn::Linear(4, 3);
  AutocastGuard g(c10::kCPU, at::kHalf);
  EXPECT_EQ(fc->forward(torch::randn({2, 4})).scalar_type(), at::kHalf);
}

TEST(Autocast, NestedAndDisabledRegions) {
  auto fc = torch::nn::Linear(4, 3);
  auto x = torch::randn({2, 4});
  {
    AutocastGuard outer(c10::kCPU, at::kBFloat16);
    {
      AutocastGuard inner(c10::kCPU, at::kBFloat16, /*enabled=*/false);
      EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
      EXPECT_EQ(fc->forward(x).scalar_type(), at::kFloat);
      {
        // LibTorch's cast cache is keyed by the weight alone, not by dtype: a nested region with
        // another dtype must not cache, or the enclosing bf16 region would get fp16 weights.
        AutocastGuard innermost(c10::kCPU, at::kHalf, true, /*cache_enabled=*/false);
        EXPECT_EQ(fc->forward(x).scalar_type(), at::kHalf);
      }
      EXPECT_EQ(at::autocast::get_autocast_dtype(c10::kCPU), at::kBFloat16);
      EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
    }
    EXPECT_TRUE(at::autocast::is_autocast_enabled(c10::kCPU));
    EXPECT_EQ(fc->forward(x).scalar_type(), at::kBFloat16);
  }
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
}

TEST(Autocast, CacheIsClearedOnlyWhenOutermostRegionExits) {
  // A cached cast returns the same lower-precision tensor for the same fp32 leaf weight: observe
  // the cache through the storage of the weight cast that `linear` receives.
  auto w = torch::randn({3, 4}).requires_grad_(true);
  auto x = torch::randn({2, 4});
  auto cast_of_w = [&] {
    // at::_to_copy via the autocast cache: cached_cast is what autocast kernels call.
    return at::autocast::cached_cast(at::kBFloat16, w, c10::DeviceType::CPU);
  };
  at::Tensor first, second, third;
  {
    AutocastGuard outer(c10::kCPU, at::kBFloat16);
    first = cast_of_w();
    {
      AutocastGuard inner(c10::kCPU, at::kBFloat16);
      second = cast_of_w();
    }
    // The inner exit did not clear: still the same cached tensor.
    EXPECT_TRUE(second.is_same(first));
    third = cast_of_w();
    EXPECT_TRUE(third.is_same(first));
  }
  {
    AutocastGuard again(c10::kCPU, at::kBFloat16);
    EXPECT_FALSE(cast_of_w().is_same(first)) << "outermost exit must clear the cast cache";
  }
  {
    AutocastGuard no_cache(c10::kCPU, at::kBFloat16, true, /*cache_enabled=*/false);
    EXPECT_FALSE(cast_of_w().is_same(cast_of_w()));
  }
  EXPECT_TRUE(at::autocast::is_autocast_cache_enabled());
}

TEST(Autocast, RejectsNonHalfDtype) {
  EXPECT_TRUE(throws_with([] { AutocastGuard g(c10::kCPU, at::kFloat); },
                          "dtype must be Half or BFloat16, got Float"));
  EXPECT_TRUE(throws_with([] { AutocastGuard g(c10::kCPU, at::kDouble); },
                          "dtype must be Half or BFloat16, got Double"));
  EXPECT_FALSE(at::autocast::is_autocast_enabled(c10::kCPU));
}

TEST(Autocast, CudaRegionWithoutCudaIsDisabled) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "CUDA present";
  AutocastGuard g(c10::kCUDA);
  EXPECT_FALSE(g.enabled());
  EXPECT_EQ(g.dtype(), at::kHalf);
}

TEST(Autocast, StateIsThreadLocal) {
  AutocastGuard g(c10::kCPU, at::kBFloat16);
  bool other_thread_enabled = true;
  std::thread t([&] { other_thread_enabled = at::autocast::is_autocast_enabled(c10::kCPU); });
  t.join();
  EXPECT_FALSE(other_thread_enabled);
}
