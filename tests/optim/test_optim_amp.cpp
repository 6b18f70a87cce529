// The fused optimizers with apex::amp (O0-O3) and with GradScaler's fused protocol.
#include <apex/amp/grad_scaler.h>
#include <apex/amp/initialize.h>
#include <apex/optim.h>

#include <functional>
#include <limits>

#include "../amp/amp_test_util.h"
#include "optim_test_util.h"

namespace apex::test {
namespace {

using apex::amp::GradScaler;
using apex::amp::GradScalerOptions;
using apex::amp::OptLevel;
using apex::optim::FusedAdam;
using apex::optim::FusedAdamOptions;

std::vector<at::Tensor> params_of(const Mlp& m) { return snapshot(m->parameters()); }

// One GradScaler run: MLP, 12 steps, an inf injected at steps 3 and 7. Returns the final
// parameters and the scale after each step.
template <class MakeOpt>
std::pair<std::vector<at::Tensor>, std::vector<double>> scaler_run(const MakeOpt& make_opt) {
  torch::manual_seed(3);
  Mlp model(16, 32, 4);
  auto opt = make_opt(model->parameters());
  GradScaler scaler(GradScalerOptions().device(c10::kCPU).init_scale(1024.0).growth_interval(3));
  std::vector<double> scales;
  for (int step = 0; step < 12; ++step) {
    auto batch = blob_batch(step);
    opt->zero_grad();
    scaler.scale(cross_entropy(model->forward(batch.x), batch.y)).backward();
    if (step == 3 || step == 7) {
      model->parameters()[2].mutable_grad()[0][0].fill_(std::numeric_limits<float>::infinity());
    }
    scaler.step(*opt);
    scaler.update();
    scales.push_back(scaler.get_scale());
  }
  return {params_of(model), scales};
}

TEST(OptimWithGradScaler, FusedAdamMatchesAdamWAndSkipsOnTheDevice) {
  auto [ours, our_scales] = scaler_run([](std::vector<at::Tensor> p) {
    return std::make_unique<FusedAdam>(std::move(p), FusedAdamOptions(1e-2).weight_decay(0.01));
  });
  auto [ref, ref_scales] = scaler_run([](std::vector<at::Tensor> p) {
    return std::make_unique<torch::optim::AdamW>(
        std::move(p), torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
  });
  EXPECT_EQ(our_scales, ref_scales);
  EXPECT_TRUE(lists_close(ours, ref, {1e-4, 1e-5}));
}

// torch's GradScaler contract: p.grad holds the unscaled gradient after scaler.step(), stepped or
// skipped (the kernel writes g * inv_scale back in the update's own pass). Every fused
// optimizer, fp32 and bf16 parameters, 4 steps with an inf at step 2: the gradients after each
// step equal the scaled ones times 1/scale, rounded to their dtype as torch's unscale_ does, and
// the parameters are bit-identical to the same steps without the write-back (the update reads
// what it read before).
TEST(OptimWithGradScaler, EveryFusedOptimizerLeavesUnscaledGradients) {
  using Make = std::function<std::unique_ptr<apex::optim::FusedOptimizer>(std::vector<at::Tensor>)>;
  const std::vector<std::pair<const char*, Make>> makers = {
      {"FusedAdam",
       [](std::vector<at::Tensor> p) {
         return std::make_unique<FusedAdam>(std::move(p),
                                            FusedAdamOptions(1e-2).weight_decay(0.01));
       }},
      {"FusedSGD",
       [](std::vector<at::Tensor> p) {
         return std::make_unique<apex::optim::FusedSGD>(
             std::move(p), apex::optim::FusedSGDOptions(0.1).momentum(0.9));
       }},
      {"FusedLAMB",
       [](std::vector<at::Tensor> p) {
         return std::make_unique<apex::optim::FusedLAMB>(std::move(p));
       }},
      {"FusedNovoGrad",
       [](std::vector<at::Tensor> p) {
         return std::make_unique<apex::optim::FusedNovoGrad>(std::move(p));
       }},
      {"FusedAdagrad",
       [](std::vector<at::Tensor> p) {
         return std::make_unique<apex::optim::FusedAdagrad>(std::move(p));
       }},
  };
  for (const auto& [name, make] : makers) {
    for (const auto dtype : {at::kFloat, at::kBFloat16}) {
      // a: through GradScaler (write-back); b: the same steps without it.
      const std::vector<at::Tensor> pa = make_params({37, 35, 3000}, dtype, 10);
      const std::vector<at::Tensor> pb = copies(pa, dtype);
      auto oa = make(pa);
      auto ob = make(pb);
      GradScaler scaler(GradScalerOptions().device(c10::kCPU).init_scale(1024.0));
      scaler.scale(at::ones({}));  // the scale tensor exists from here
      for (int step = 0; step < 4; ++step) {
        const float scale = static_cast<float>(scaler.get_scale());
        std::vector<at::Tensor> scaled;
        for (size_t i = 0; i < pa.size(); ++i) {
          at::Tensor g = grad_for(pa[i], step, i, 7, scale);
          if (step == 2 && i == 1) g.view(-1)[3] = std::numeric_limits<float>::infinity();
          scaled.push_back(g);
          pa[i].mutable_grad() = g.clone();
          pb[i].mutable_grad() = g.clone();
        }
        const at::Tensor inv = at::full({1}, 1.0 / static_cast<double>(scale), at::kFloat);
        const at::Tensor found = at::full({1}, step == 2 ? 1.0f : 0.0f, at::kFloat);
        scaler.step(*oa);
        scaler.update();
        ob->step(apex::optim::GradScaling{inv, found});
        for (size_t i = 0; i < pa.size(); ++i) {
          const std::string where = std::string(name) + " " + c10::toString(dtype) + " step " +
                                    std::to_string(step) + " tensor " + std::to_string(i);
          const at::Tensor want = (scaled[i].to(at::kFloat) * inv).to(dtype);
          EXPECT_TRUE(at::equal(pa[i].grad(), want)) << where << ": gradient not unscaled";
          EXPECT_TRUE(at::equal(pb[i].grad(), scaled[i])) << where << ": written without asking";
          EXPECT_TRUE(at::equal(pa[i].detach(), pb[i].detach())) << where << ": update changed";
        }
      }
    }
  }
}

// unscale_ first (e.g. to clip with apex::optim::clip_grad_norm_), then step: the fused step
// takes the already-unscaled gradients and only the flag.
TEST(OptimWithGradScaler, UnscaleThenClipThenFusedStep) {
  auto run = [](bool fused) {
    torch::manual_seed(5);
    Mlp model(16, 32, 4);
    std::unique_ptr<torch::optim::Optimizer> opt;
    if (fused) {
      opt = std::make_unique<apex::optim::FusedSGD>(
          model->parameters(), apex::optim::FusedSGDOptions(0.1).momentum(0.9));
    } else {
      opt = std::make_unique<torch::optim::SGD>(model->parameters(),
                                                torch::optim::SGDOptions(0.1).momentum(0.9));
    }
    GradScaler scaler(GradScalerOptions().device(c10::kCPU).init_scale(64.0));
    for (int step = 0; step < 6; ++step) {
      auto batch = blob_batch(step);
      opt->zero_grad();
      scaler.scale(cross_entropy(model->forward(batch.x), batch.y)).backward();
      scaler.unscale_(*opt);
      if (fused) {
        apex::optim::clip_grad_norm_(model->parameters(), 0.5);
      } else {
        torch::nn::utils::clip_grad_norm_(model->parameters(), 0.5);
      }
      scaler.step(*opt);
      scaler.update();
    }
    return params_of(model);
  };
  EXPECT_TRUE(lists_close(run(true), run(false), {1e-4, 1e-5}));
}

TEST(OptimWithGradScaler, HostReadOptimizersSkipToo) {
  auto [ours, scales] = scaler_run([](std::vector<at::Tensor> p) {
    return std::make_unique<apex::optim::FusedLAMB>(std::move(p));
  });
  EXPECT_EQ(scales[3], scales[2] / 2);
  for (const auto& t : ours) EXPECT_TRUE(at::isfinite(t).all().item<bool>());
}

// Amp at every opt level with FusedAdam against the same run with LibTorch's AdamW. O3 keeps no
// fp32 copy, so a last-bit fp32 difference flips a bf16 rounding and training paths drift apart:
// there one step is compared; the other levels train 15 steps.
TEST(OptimWithAmp, FusedAdamMatchesAdamWAtEveryLevel) {
  for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    auto run = [&](bool fused) {
      torch::manual_seed(11);
      Mlp model(16, 32, 4);
      std::unique_ptr<torch::optim::Optimizer> opt;
      // eps 1e-4: pure fp16/bf16 O3 parameters cannot represent Adam's 1e-8 (see docs/amp.md).
      if (fused) {
        opt = std::make_unique<FusedAdam>(model->parameters(),
                                          FusedAdamOptions(1e-2).eps(1e-4).weight_decay(0.01));
      } else {
        opt = std::make_unique<torch::optim::AdamW>(
            model->parameters(), torch::optim::AdamWOptions(1e-2).eps(1e-4).weight_decay(0.01));
      }
      auto amp = apex::amp::initialize(model, *opt, quiet(level).half_dtype(at::kBFloat16));
      const int steps = level == OptLevel::O3 ? 1 : 15;
      for (int step = 0; step < steps; ++step) {
        auto batch = blob_batch(step);
        amp.zero_grad();
        amp.scale_loss(cross_entropy(amp.forward(model, batch.x), batch.y)).backward();
        amp.step();
      }
      return params_of(model);
    };
    const auto ours = run(true);
    const auto ref = run(false);
    const auto dtype = ours.front().scalar_type();
    const Tolerance tol = dtype == at::kFloat ? Tolerance{1e-4, 1e-5} : tolerance_for(dtype);
    EXPECT_TRUE(lists_close(ours, ref, tol)) << "level " << static_cast<int>(level);
  }
}

// O1, bf16, a dynamic scale starting at `init_scale`, unscaling in the optimizer or not.
apex::amp::Options o1_dynamic(double init_scale, bool in_kernel) {
  return quiet(OptLevel::O1)
      .half_dtype(at::kBFloat16)
      .loss_scale(apex::amp::LossScale::dynamic())
      .init_loss_scale(init_scale)
      .unscale_in_optimizer(in_kernel);
}

// Options::unscale_in_optimizer: at O1 the gradients stay scaled and FusedAdam unscales them in
// its kernel. The result is bit-identical to unscaling in place (same fp32 product), including
// with two scale_loss scopes accumulating before one step and with an overflowing step.
TEST(OptimWithAmp, UnscaleInOptimizerIsBitIdentical) {
  auto run = [](bool in_kernel, bool accumulate) {
    torch::manual_seed(4);
    Mlp model(16, 32, 4);
    FusedAdam opt(model->parameters(), FusedAdamOptions(1e-2));
    auto amp = apex::amp::initialize(model, opt, o1_dynamic(1024.0, in_kernel));
    std::vector<double> grad_sums;
    for (int step = 0; step < 8; ++step) {
      amp.zero_grad();
      for (int micro = 0; micro < (accumulate ? 2 : 1); ++micro) {
        auto batch = blob_batch(step * 2 + micro);
        auto loss = cross_entropy(amp.forward(model, batch.x), batch.y);
        if (step == 5) loss = loss * std::numeric_limits<float>::infinity();
        amp.scale_loss(loss).backward();
      }
      // From the second step on: the first amp.step() tells amp that it passes the factor to the
      // kernel (the user's own step() would not, so until then the scope unscales).
      if (step == 1) grad_sums.push_back(model->parameters()[0].grad().abs().sum().item<double>());
      amp.step();
    }
    return std::make_tuple(params_of(model), amp.loss_scale(), grad_sums.front(),
                           amp.skipped_steps(0));
  };
  for (bool accumulate : {false, true}) {
    const auto [p_ref, scale_ref, g_ref, skipped_ref] = run(false, accumulate);
    const auto [p_in, scale_in, g_in, skipped_in] = run(true, accumulate);
    EXPECT_TRUE(lists_equal(p_in, p_ref)) << "accumulate " << accumulate;
    EXPECT_EQ(scale_in, scale_ref);
    EXPECT_EQ(skipped_in, 1);
    EXPECT_EQ(skipped_ref, 1);
    if (!accumulate) {
      // Left scaled by 1024 until the optimizer's kernel: the documented trade-off.
      EXPECT_NEAR(g_in / g_ref, 1024.0, 1e-2);
    }
  }
}

// Without zero_grad() between steps the gradients accumulate across the step; the ones a fused
// kernel left scaled must be unscaled before that.
TEST(OptimWithAmp, UnscaleInOptimizerAccumulatesAcrossStepsCorrectly) {
  auto run = [](bool in_kernel) {
    torch::manual_seed(8);
    Mlp model(16, 32, 4);
    FusedAdam opt(model->parameters(), FusedAdamOptions(1e-2));
    auto amp = apex::amp::initialize(model, opt, o1_dynamic(512.0, in_kernel));
    for (int step = 0; step < 4; ++step) {
      auto batch = blob_batch(step);
      amp.scale_loss(cross_entropy(amp.forward(model, batch.x), batch.y)).backward();
      amp.step();  // no zero_grad: gradients keep accumulating
    }
    return params_of(model);
  };
  EXPECT_TRUE(lists_equal(run(true), run(false)));
}

// O2 with an fp16 model: an overflowing step is skipped by Amp, and FusedAdam's state and
// counter do not move.
TEST(OptimWithAmp, O2OverflowSkipsFusedAdam) {
  torch::manual_seed(2);
  Mlp model(16, 32, 4);
  FusedAdam opt(model->parameters(), FusedAdamOptions(1e-3));
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O2));
  for (int step = 0; step < 4; ++step) {
    auto batch = blob_batch(step);
    amp.zero_grad();
    auto loss = cross_entropy(amp.forward(model, batch.x), batch.y);
    if (step == 2) loss = loss * std::numeric_limits<float>::infinity();
    amp.scale_loss(loss).backward();
    const auto before = snapshot(opt.parameters());
    const bool stepped = amp.step();
    EXPECT_EQ(stepped, step != 2);
    if (step == 2) {
      EXPECT_TRUE(lists_equal(opt.parameters(), before));
    }
  }
  EXPECT_EQ(opt.step_count(0), 3);
  EXPECT_EQ(amp.skipped_steps(0), 1);
}

}  // namespace
}  // namespace apex::test
