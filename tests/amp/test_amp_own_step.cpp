// apex's promise: initialize, scale_loss and backward are all a user adds; their own
// optimizer.step() and zero_grad() stay. Every combination of who steps and who zeroes must train
// exactly as amp.step() + amp.zero_grad() does, at every level, dtype and optimizer kind.

#include "amp_test_util.h"

#include <apex/optim/fused_adam.h>
#include <apex/optim/fused_sgd.h>

#include <cmath>
#include <memory>
#include <set>
#include <string>

using apex::amp::OptLevel;
using apex::amp::ScaleLossOptions;
using namespace apex::test;

namespace {

enum class StepBy { kAmp, kOwn };
enum class ZeroBy { kAmp, kModel, kOptimizer };
enum class Kind { kTorchAdam, kTorchSgd, kFusedAdam, kFusedSgd };

std::string name_of(StepBy s, ZeroBy z, Kind k) {
  const char* step = s == StepBy::kAmp ? "amp.step" : "optimizer.step";
  const char* zero = z == ZeroBy::kAmp     ? "amp.zero_grad"
                     : z == ZeroBy::kModel ? "model->zero_grad"
                                           : "optimizer.zero_grad";
  const char* kind = k == Kind::kTorchAdam   ? "torch Adam"
                     : k == Kind::kTorchSgd  ? "torch SGD"
                     : k == Kind::kFusedAdam ? "FusedAdam"
                                             : "FusedSGD";
  return std::string(step) + " + " + zero + " + " + kind;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(Kind kind, std::vector<at::Tensor> params) {
  switch (kind) {
    case Kind::kTorchAdam:
      return std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(1e-2));
    case Kind::kTorchSgd:
      return std::make_unique<torch::optim::SGD>(params,
                                                 torch::optim::SGDOptions(0.05).momentum(0.9));
    case Kind::kFusedAdam:
      return std::make_unique<apex::optim::FusedAdam>(params, apex::optim::FusedAdamOptions(1e-2));
    case Kind::kFusedSgd:
      return std::make_unique<apex::optim::FusedSGD>(
          params, apex::optim::FusedSGDOptions(0.05).momentum(0.9));
  }
  return nullptr;
}

struct Loop {
  OptLevel level = OptLevel::O2;
  c10::ScalarType dtype = at::kHalf;
  Kind kind = Kind::kTorchAdam;
  StepBy step = StepBy::kAmp;
  ZeroBy zero = ZeroBy::kAmp;
  int accumulate = 1;
  bool delay_unscale = false;  // on all but the last micro-batch
  std::set<int> inject;        // steps whose last micro-batch (or first, when delayed) overflows
  bool unscale_in_optimizer = false;
  int steps = 8;
};

struct Result {
  std::vector<at::Tensor> params;
  std::vector<at::Tensor> masters;
  std::vector<double> losses;
  double loss_scale = 0;
  int64_t skipped = 0;
};

Result train(const Loop& loop) {
  torch::manual_seed(3);
  Mlp model(16, 32, 4);
  auto opt = make_optimizer(loop.kind, model->parameters());
  auto amp = apex::amp::initialize(model, *opt,
                                   quiet(loop.level)
                                       .half_dtype(loop.dtype)
                                       .init_loss_scale(1024)
                                       .growth_interval(3)
                                       .unscale_in_optimizer(loop.unscale_in_optimizer));
  Result out;
  for (int s = 0; s < loop.steps; ++s) {
    switch (loop.zero) {
      case ZeroBy::kAmp:
        amp.zero_grad();
        break;
      case ZeroBy::kModel:
        model->zero_grad();
        break;
      case ZeroBy::kOptimizer:
        opt->zero_grad();
        break;
    }
    for (int m = 0; m < loop.accumulate; ++m) {
      const auto b = blob_batch(s * loop.accumulate + m, 24);
      const auto loss = cross_entropy(amp.forward(model, b.x), b.y) / loop.accumulate;
      const bool last = m + 1 == loop.accumulate;
      const bool delay = loop.delay_unscale && !last;
      {
        auto scaled = amp.scale_loss(loss, 0, ScaleLossOptions().delay_unscale(delay));
        scaled.backward();
        const int inject_at = loop.delay_unscale ? 0 : loop.accumulate - 1;
        if (loop.inject.count(s) && m == inject_at) {
          auto& g = model->fc2->weight.mutable_grad();
          g[1][2] = std::numeric_limits<float>::infinity();
        }
      }
      out.losses.push_back(loss.item<double>());
    }
    if (loop.step == StepBy::kAmp) {
      amp.step();
    } else {
      opt->step();
    }
  }
  amp.sync_model();
  out.params = snapshot(model->parameters());
  out.masters = snapshot(amp.master_params());
  out.loss_scale = amp.loss_scale();
  out.skipped = amp.skipped_steps();
  return out;
}

// Bit for bit, NaN equal to NaN (fp16 O3 diverges on purpose: no masters, no scaling).
bool same_bits(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() ||
        !at::allclose(a[i], b[i], 0.0, 0.0, /*equal_nan=*/true)) {
      return false;
    }
  }
  return true;
}

::testing::AssertionResult same_run(const Result& a, const Result& ref) {
  if (!same_bits(a.masters, ref.masters)) return ::testing::AssertionFailure() << "masters differ";
  if (!same_bits(a.params, ref.params)) return ::testing::AssertionFailure() << "model differs";
  for (size_t i = 0; i < a.losses.size() && i < ref.losses.size(); ++i) {
    const bool both_nan = std::isnan(a.losses[i]) && std::isnan(ref.losses[i]);
    if (!both_nan && a.losses[i] != ref.losses[i]) {
      return ::testing::AssertionFailure()
             << "loss " << i << ": " << a.losses[i] << " vs " << ref.losses[i];
    }
  }
  if (a.losses.size() != ref.losses.size()) return ::testing::AssertionFailure() << "loss count";
  if (a.loss_scale != ref.loss_scale) {
    return ::testing::AssertionFailure()
           << "loss scale " << a.loss_scale << " vs " << ref.loss_scale;
  }
  if (a.skipped != ref.skipped) {
    return ::testing::AssertionFailure() << "skipped " << a.skipped << " vs " << ref.skipped;
  }
  return ::testing::AssertionSuccess();
}

// Levels whose scaler checks gradients for overflow with this dtype (dynamic fp16 scaling, or
// O2's masters): an injected inf must skip the step there.
bool checks_overflow(OptLevel level, c10::ScalarType dtype) {
  return level == OptLevel::O2 || (level == OptLevel::O1 && dtype == at::kHalf);
}

}  // namespace

TEST(AmpOwnStep, EveryCombinationEqualsAmpStep) {
  struct Accumulation {
    int k;
    bool delay;
  };
  for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    for (auto dtype : {at::kHalf, at::kBFloat16}) {
      for (auto kind : {Kind::kTorchAdam, Kind::kTorchSgd, Kind::kFusedAdam, Kind::kFusedSgd}) {
        for (auto acc : {Accumulation{1, false}, Accumulation{3, false}, Accumulation{3, true}}) {
          Loop loop;
          loop.level = level;
          loop.dtype = dtype;
          loop.kind = kind;
          loop.accumulate = acc.k;
          loop.delay_unscale = acc.delay;
          if (checks_overflow(level, dtype)) loop.inject = {1, 4, 5};
          const Result ref = train(loop);
          if (checks_overflow(level, dtype)) {
            EXPECT_EQ(ref.skipped, 3);
          }
          for (auto step : {StepBy::kAmp, StepBy::kOwn}) {
            for (auto zero : {ZeroBy::kAmp, ZeroBy::kModel, ZeroBy::kOptimizer}) {
              if (step == StepBy::kAmp && zero == ZeroBy::kAmp) continue;
              loop.step = step;
              loop.zero = zero;
              EXPECT_TRUE(same_run(train(loop), ref))
                  << apex::amp::to_string(level) << " " << c10::toString(dtype) << " "
                  << name_of(step, zero, kind) << " accumulate " << acc.k
                  << (acc.delay ? " delayed" : "");
            }
          }
        }
      }
    }
  }
}

// The trap as a new user hit it: pytorch/examples' loop (model->zero_grad(), optimizer.step())
// plus the three amp lines, at O2: the model's half weights must move with the masters.
TEST(AmpOwnStep, O2ExamplesLoopTrains) {
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    SCOPED_TRACE(c10::toString(dtype));
    torch::manual_seed(1);
    Mlp model(16, 32, 4);
    torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
    auto amp = apex::amp::initialize(model, optimizer, quiet(OptLevel::O2).half_dtype(dtype));
    const auto b = blob_batch(0, 64);
    std::vector<double> losses;
    for (int s = 0; s < 10; ++s) {
      model->zero_grad();
      const auto before = snapshot(model->parameters());
      auto loss = cross_entropy(amp.forward(model, b.x), b.y);
      // The previous step reached the half model by this forward.
      EXPECT_EQ(all_equal(before, snapshot(model->parameters())), s == 0) << "step " << s;
      amp.scale_loss(loss).backward();
      optimizer.step();
      losses.push_back(loss.item<double>());
    }
    EXPECT_LT(losses.back(), losses.front() * 0.8) << losses.front() << " -> " << losses.back();
    // After the last own step, sync_model brings the last update to the bare model.
    const auto stale = snapshot(model->parameters());
    amp.sync_model();
    EXPECT_FALSE(all_equal(stale, snapshot(model->parameters())));
    for (size_t i = 0; i < model->parameters().size(); ++i) {
      EXPECT_TRUE(at::equal(model->parameters()[i], amp.master_params()[i].to(dtype)));
    }
  }
}

// Micro-batches accumulated under the user's own step give the gradient of the whole batch.
TEST(AmpOwnStep, AccumulationEqualsOneBigBatch) {
  for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2}) {
    SCOPED_TRACE(apex::amp::to_string(level));
    torch::manual_seed(5);
    Mlp model(16, 32, 4);
    torch::manual_seed(5);
    Mlp big(16, 32, 4);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto amp = apex::amp::initialize(model, opt, quiet(level).half_dtype(at::kBFloat16));
    const auto b = blob_batch(7, 48);
    opt.zero_grad();
    for (int m = 0; m < 3; ++m) {
      const auto x = b.x.slice(0, m * 16, (m + 1) * 16);
      const auto y = b.y.slice(0, m * 16, (m + 1) * 16);
      amp.scale_loss(cross_entropy(amp.forward(model, x), y) / 3).backward();
    }
    std::vector<at::Tensor> grads;
    for (const auto& p : amp.master_params()) grads.push_back(p.grad().clone());
    at::Tensor loss;
    {
      apex::amp::AutocastGuard autocast(c10::kCPU, at::kBFloat16, level == OptLevel::O1);
      if (level == OptLevel::O2) big->to(at::kBFloat16);
      loss = cross_entropy(
          big->forward(level == OptLevel::O2 ? b.x.to(at::kBFloat16) : b.x).to(at::kFloat), b.y);
    }
    loss.backward();
    const auto ref = big->parameters();
    for (size_t i = 0; i < grads.size(); ++i) {
      EXPECT_TRUE(all_close(grads[i], ref[i].grad().to(at::kFloat),
                            tolerance_for(level == OptLevel::O0 ? at::kFloat : at::kBFloat16)))
          << "parameter " << i;
    }
    opt.step();
  }
}

TEST(AmpOwnStep, InKernelUnscaleWithOwnStep) {
  for (auto step : {StepBy::kAmp, StepBy::kOwn}) {
    Loop loop;
    loop.level = OptLevel::O1;
    loop.kind = Kind::kFusedAdam;
    loop.inject = {2};
    const Result ref = train(loop);
    loop.unscale_in_optimizer = true;
    loop.step = step;
    EXPECT_TRUE(same_run(train(loop), ref)) << (step == StepBy::kAmp ? "amp.step" : "own step");
  }
}

TEST(AmpOwnStep, BothStepsInOneIterationIsAnError) {
  torch::manual_seed(1);
  Mlp model(16, 32, 4);
  apex::optim::FusedAdam optimizer(model->parameters(), apex::optim::FusedAdamOptions(1e-3));
  auto amp = apex::amp::initialize(model, optimizer,
                                   quiet(OptLevel::O2).half_dtype(at::kHalf).init_loss_scale(64));
  const auto b = blob_batch(0);
  amp.scale_loss(cross_entropy(amp.forward(model, b.x), b.y)).backward();
  optimizer.step();
  EXPECT_TRUE(
      throws_with([&] { amp.step(); },
                  "was already stepped after the last backward (its own optimizer.step())"));
}

// Model held by std::shared_ptr (pytorch/examples' style), not by a TORCH_MODULE holder.
TEST(AmpOwnStep, SharedPtrModelsInitialize) {
  torch::manual_seed(1);
  auto model = std::make_shared<MlpImpl>(16, 32, 4);
  torch::optim::SGD optimizer(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, optimizer, OptLevel::O2);
  EXPECT_EQ(model->fc1->weight.scalar_type(), at::kBFloat16);  // the CPU's default half dtype
  const auto b = blob_batch(0);
  EXPECT_EQ(amp.forward(model, b.x).scalar_type(), at::kFloat);
  auto eval = std::make_shared<MlpImpl>(16, 32, 4);
  auto inference = apex::amp::initialize(eval, apex::amp::Options(OptLevel::O3).verbosity(0));
  EXPECT_EQ(eval->fc3->bias.scalar_type(), at::kBFloat16);
}

// An O2/O3 model called directly (not through amp.forward) with fp32 input: amp's message.
TEST(AmpOwnStep, HalfModelCalledOutsideForwardSaysSo) {
  for (auto level : {OptLevel::O2, OptLevel::O3}) {
    SCOPED_TRACE(apex::amp::to_string(level));
    torch::manual_seed(1);
    Mlp mlp(16, 32, 4);
    Cnn cnn(3);
    torch::optim::SGD opt(mlp->parameters(), torch::optim::SGDOptions(0.1));
    {
      auto amp = apex::amp::initialize({mlp.ptr(), cnn.ptr()}, {&opt},
                                       quiet(level).half_dtype(at::kBFloat16));
      const auto x = blob_batch(0).x;
      EXPECT_TRUE(
          throws_with([&] { mlp->forward(x); },
                      "apex::amp: linear (addmm) got Float input and BFloat16 weights. A model "
                      "that amp::initialize cast to BFloat16 (O2/O3) must be called "
                      "through amp.forward(model, x)"));
      EXPECT_TRUE(throws_with([&] { cnn->forward(make_images(2, 1).x); },
                              "apex::amp: convolution got Float input and BFloat16 weights"));
      // Through amp.forward, or with the input cast by hand, both run.
      EXPECT_EQ(amp.forward(mlp, x).scalar_type(), at::kFloat);
      EXPECT_EQ(mlp->forward(x.to(at::kBFloat16)).scalar_type(), at::kBFloat16);
      // Other dtype pairs keep LibTorch's behaviour.
      EXPECT_EQ(at::matmul(x, x.t()).scalar_type(), at::kFloat);
    }
    // No handle alive: LibTorch's own message again.
    EXPECT_TRUE(throws_with([&] { mlp->forward(blob_batch(0).x); }, "same dtype"));
  }
}
