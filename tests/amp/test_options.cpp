#include <apex/amp/options.h>

#include "../common/test_util.h"

using apex::amp::LossScale;
using apex::amp::Options;
using apex::amp::OptLevel;
using apex::amp::Properties;
using apex::test::throws_with;

TEST(Options, OptLevelTableMatchesApex) {
  // apex's table is CUDA's, where the half dtype defaults to fp16.
  const auto cuda = c10::kCUDA;
  const auto o0 = Properties::resolve(Options(OptLevel::O0), cuda);
  EXPECT_EQ(o0.cast_model_type, at::kFloat);
  EXPECT_FALSE(o0.patch_torch_functions);
  EXPECT_FALSE(o0.master_weights);
  EXPECT_EQ(o0.loss_scale, LossScale(1.0));

  const auto o1 = Properties::resolve(Options(OptLevel::O1), cuda);
  EXPECT_FALSE(o1.cast_model_type.has_value());
  EXPECT_TRUE(o1.patch_torch_functions);
  EXPECT_FALSE(o1.master_weights);
  EXPECT_TRUE(o1.loss_scale.is_dynamic());

  const auto o2 = Properties::resolve(Options(OptLevel::O2), cuda);
  EXPECT_EQ(o2.cast_model_type, at::kHalf);
  EXPECT_FALSE(o2.patch_torch_functions);
  EXPECT_TRUE(o2.keep_batchnorm_fp32);
  EXPECT_TRUE(o2.master_weights);
  EXPECT_TRUE(o2.loss_scale.is_dynamic());

  const auto o3 = Properties::resolve(Options(OptLevel::O3), cuda);
  EXPECT_EQ(o3.cast_model_type, at::kHalf);
  EXPECT_FALSE(o3.keep_batchnorm_fp32);
  EXPECT_FALSE(o3.master_weights);
  EXPECT_EQ(o3.loss_scale, LossScale(1.0));
}

// An unset half dtype follows the device: fp16 on CUDA (apex's), bf16 on the CPU, which needs no
// loss scaling; a set one wins anywhere.
TEST(Options, HalfDtypeFollowsTheDevice) {
  EXPECT_EQ(Properties::default_half_dtype(c10::kCUDA), at::kHalf);
  EXPECT_EQ(Properties::default_half_dtype(c10::kCPU), at::kBFloat16);
  for (auto level : {OptLevel::O1, OptLevel::O2}) {
    const auto cpu = Properties::resolve(Options(level));
    EXPECT_EQ(cpu.half_dtype, at::kBFloat16);
    EXPECT_EQ(cpu.loss_scale, LossScale(1.0));
    const auto cuda = Properties::resolve(Options(level), c10::kCUDA);
    EXPECT_EQ(cuda.half_dtype, at::kHalf);
    EXPECT_TRUE(cuda.loss_scale.is_dynamic());
    EXPECT_EQ(Properties::resolve(Options(level).half_dtype(at::kHalf)).half_dtype, at::kHalf);
  }
}

TEST(Options, Bf16DefaultsToStaticScaleOne) {
  for (auto level : {OptLevel::O1, OptLevel::O2}) {
    const auto p = Properties::resolve(Options(level).half_dtype(at::kBFloat16));
    EXPECT_EQ(p.loss_scale, LossScale(1.0));
    if (level == OptLevel::O2) {
      EXPECT_EQ(p.cast_model_type, at::kBFloat16);
    }
  }
  // An explicit override wins.
  const auto p = Properties::resolve(
      Options(OptLevel::O2).half_dtype(at::kBFloat16).loss_scale(LossScale::dynamic()));
  EXPECT_TRUE(p.loss_scale.is_dynamic());
}

TEST(Options, OverridesApply) {
  const auto p = Properties::resolve(
      Options(OptLevel::O2).keep_batchnorm_fp32(false).master_weights(false).loss_scale(128.0));
  EXPECT_FALSE(p.keep_batchnorm_fp32);
  EXPECT_FALSE(p.master_weights);
  EXPECT_EQ(p.loss_scale.value(), 128.0);
  const auto o3 = Properties::resolve(Options(OptLevel::O3).keep_batchnorm_fp32(true));
  EXPECT_TRUE(o3.keep_batchnorm_fp32);
}

TEST(Options, InvalidOverridesAreErrors) {
  EXPECT_TRUE(throws_with(
      [] { Properties::resolve(Options(OptLevel::O1).keep_batchnorm_fp32(true)); },
      "with O1, batchnorm runs in fp32 through autocast; keep_batchnorm_fp32 must be unset"));
  EXPECT_TRUE(throws_with([] { Properties::resolve(Options(OptLevel::O1).master_weights(true)); },
                          "master_weights makes no sense; it must be unset under O1"));
  EXPECT_TRUE(
      throws_with([] { Properties::resolve(Options(OptLevel::O1).cast_model_type(at::kHalf)); },
                  "cast_model_type must be unset or Float under O1, got Half"));
  EXPECT_TRUE(
      throws_with([] { Properties::resolve(Options(OptLevel::O2).patch_torch_functions(true)); },
                  "patch_torch_functions=true (autocast) is only valid with O1, got opt_level O2"));
  EXPECT_TRUE(throws_with([] { Properties::resolve(Options().half_dtype(at::kFloat)); },
                          "half_dtype must be Half or BFloat16, got Float"));
  EXPECT_TRUE(
      throws_with([] { Properties::resolve(Options(OptLevel::O2).cast_model_type(at::kInt)); },
                  "cast_model_type must be Float, Half or BFloat16, got Int"));
  EXPECT_TRUE(throws_with([] { Properties::resolve(Options().num_losses(0)); },
                          "num_losses must be >= 1, got 0"));
  EXPECT_TRUE(throws_with([] { Properties::resolve(Options().min_loss_scale(-1.0)); },
                          "min_loss_scale must be in (0, max_loss_scale="));
  // O1 with fp32 is allowed (apex allowed it).
  EXPECT_NO_THROW(Properties::resolve(Options(OptLevel::O1).cast_model_type(at::kFloat)));
}

TEST(Options, ParsingAndLossScaleValues) {
  EXPECT_EQ(apex::amp::parse_opt_level("O2"), OptLevel::O2);
  EXPECT_TRUE(throws_with([] { apex::amp::parse_opt_level("02"); },
                          "unknown opt_level '02'; expected O0, O1, O2 or O3 (the letter O"));
  EXPECT_TRUE(LossScale::parse("dynamic").is_dynamic());
  EXPECT_EQ(LossScale::parse("512").value(), 512.0);
  EXPECT_TRUE(throws_with([] { LossScale::parse("big"); }, "invalid loss_scale 'big'"));
  EXPECT_TRUE(throws_with([] { LossScale(0.0); }, "loss_scale must be finite and > 0, got 0"));
  EXPECT_TRUE(throws_with([] { LossScale(-4.0); }, "loss_scale must be finite and > 0, got -4"));
}

TEST(Options, DisabledResolvesToFp32PassThrough) {
  const auto p = Properties::resolve(Options(OptLevel::O2).enabled(false));
  EXPECT_FALSE(p.cast_model_type.has_value());
  EXPECT_FALSE(p.master_weights);
  EXPECT_EQ(p.loss_scale, LossScale(1.0));
}
