// FusedAdam against LibTorch's Adam/AdamW, plus loss scaling, master weights, capturable mode,
// serialization and bad input.
#include <apex/optim/fused_adam.h>
#include <apex/optim/multi_tensor.h>
#include <torch/serialize.h>

#include <limits>

#include "optim_test_util.h"

namespace apex::test {
namespace {

using apex::optim::FusedAdam;
using apex::optim::FusedAdamOptions;
using apex::optim::FusedAdamParamState;
using apex::optim::GradScaling;

std::vector<at::Tensor> adam_state(const torch::optim::Optimizer& opt) {
  return state_tensors(opt, [](const torch::optim::OptimizerParamState& s) {
    const auto& a = static_cast<const FusedAdamParamState&>(s);
    return std::vector<at::Tensor>{a.exp_avg(), a.exp_avg_sq()};
  });
}

// Two groups with different hyper-parameters, stepped 20 times on identical random gradients.
void compare_with_libtorch(bool adam_w_mode, const std::vector<int64_t>& sizes) {
  auto ours = make_params(sizes, at::kFloat, 7);
  auto ref = copies(ours, at::kFloat);
  const size_t half = ours.size() / 2;
  auto split = [&](const std::vector<at::Tensor>& v) {
    return std::make_pair(std::vector<at::Tensor>(v.begin(), v.begin() + half),
                          std::vector<at::Tensor>(v.begin() + half, v.end()));
  };
  auto [o1, o2] = split(ours);
  auto [r1, r2] = split(ref);
  std::vector<torch::optim::OptimizerParamGroup> og;
  og.emplace_back(o1, std::make_unique<FusedAdamOptions>(
                          FusedAdamOptions(2e-3).weight_decay(0.01).adam_w_mode(adam_w_mode)));
  og.emplace_back(o2, std::make_unique<FusedAdamOptions>(FusedAdamOptions(5e-3)
                                                             .betas({0.8, 0.99})
                                                             .eps(1e-6)
                                                             .weight_decay(0.1)
                                                             .adam_w_mode(adam_w_mode)));
  FusedAdam fused(og);
  std::unique_ptr<torch::optim::Optimizer> peer;
  std::vector<torch::optim::OptimizerParamGroup> rg;
  if (adam_w_mode) {
    rg.emplace_back(r1, std::make_unique<torch::optim::AdamWOptions>(
                            torch::optim::AdamWOptions(2e-3).weight_decay(0.01)));
    rg.emplace_back(
        r2, std::make_unique<torch::optim::AdamWOptions>(
                torch::optim::AdamWOptions(5e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1)));
    peer = std::make_unique<torch::optim::AdamW>(rg);
  } else {
    rg.emplace_back(r1, std::make_unique<torch::optim::AdamOptions>(
                            torch::optim::AdamOptions(2e-3).weight_decay(0.01)));
    rg.emplace_back(
        r2, std::make_unique<torch::optim::AdamOptions>(
                torch::optim::AdamOptions(5e-3).betas({0.8, 0.99}).eps(1e-6).weight_decay(0.1)));
    peer = std::make_unique<torch::optim::Adam>(rg);
  }
  for (int step = 0; step < 20; ++step) {
    set_grads(ours, step, 1);
    set_grads(ref, step, 1);
    fused.step();
    peer->step();
  }
  EXPECT_TRUE(lists_close(ours, ref, tolerance_for(at::kFloat)));
  auto peer_state = state_tensors(*peer, [&](const torch::optim::OptimizerParamState& s) {
    if (adam_w_mode) {
      const auto& a = static_cast<const torch::optim::AdamWParamState&>(s);
      return std::vector<at::Tensor>{a.exp_avg(), a.exp_avg_sq()};
    }
    const auto& a = static_cast<const torch::optim::AdamParamState&>(s);
    return std::vector<at::Tensor>{a.exp_avg(), a.exp_avg_sq()};
  });
  EXPECT_TRUE(lists_close(adam_state(fused), peer_state, tolerance_for(at::kFloat)));
  EXPECT_EQ(fused.step_count(0), 20);
  EXPECT_EQ(fused.step_count(1), 20);
}

TEST(FusedAdam, MatchesAdamWEdgeSizes) { compare_with_libtorch(true, edge_sizes()); }
TEST(FusedAdam, MatchesAdamL2EdgeSizes) { compare_with_libtorch(false, edge_sizes()); }
TEST(FusedAdam, MatchesAdamWManyTensors) { compare_with_libtorch(true, many_sizes()); }
TEST(FusedAdam, MatchesAdamL2ManyTensors) { compare_with_libtorch(false, many_sizes()); }

// Half parameters without masters: fp32 math on the stored values, rounded back each step. The
// reference is LibTorch's AdamW on fp32 copies. Each step is compared on its own (the reference
// restarts from our rounded values), because an update near one ulp of bf16 makes roundings
// diverge across steps whenever fp32 results differ in their last bit.
// Channels-last training of a depthwise or 1-channel convolution gives a weight [C, 1, k, k]
// whose gradient's strides differ from the parameter's only on the size-1 dimension: the same
// memory order, accepted and stepped as the contiguous gradient (torch.optim and apex accept it).
TEST(FusedAdam, GradientStridesDifferingOnlyOnSizeOneDimensions) {
  auto p1 = at::randn({6, 1, 3, 3}).set_requires_grad(true);
  auto p2 = p1.detach().clone().set_requires_grad(true);
  const auto g = at::randn({6, 1, 3, 3});
  p1.mutable_grad() = at::empty_strided({6, 1, 3, 3}, {9, 1, 3, 1}).copy_(g);
  p2.mutable_grad() = g.clone();
  ASSERT_NE(p1.grad().strides(), p1.strides());
  FusedAdam a({p1}, FusedAdamOptions(1e-2));
  FusedAdam b({p2}, FusedAdamOptions(1e-2));
  for (int s = 0; s < 3; ++s) {
    a.step();
    b.step();
  }
  EXPECT_TRUE(at::equal(p1, p2));
  // The multi-tensor ops too (amp_C's scale, as GradScaler's unscale uses it).
  auto out = at::empty_like(g);
  const auto flag = at::zeros({1}, at::kFloat);
  apex::optim::multi_tensor_scale({p1.grad()}, {out}, 0.5, flag);
  EXPECT_TRUE(at::equal(out, g * 0.5));
  // A gradient whose layout really differs (transposed) is still refused, before any change.
  auto p3 = at::randn({4, 5}).set_requires_grad(true);
  p3.mutable_grad() = at::randn({5, 4}).t();
  const auto before = p3.detach().clone();
  FusedAdam c({p3}, FusedAdamOptions(1e-2));
  EXPECT_TRUE(throws_with([&] { c.step(); }, "has strides [1, 4] but the parameter has [5, 1]"));
  EXPECT_TRUE(at::equal(p3, before));
}

TEST(FusedAdam, HalfParamsAgainstFp32ReferenceEachStep) {
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    auto ours = make_params(edge_sizes(), dtype, 3);
    auto ref = copies(ours, at::kFloat);
    FusedAdam fused(ours, FusedAdamOptions(1e-2).weight_decay(0.01));
    torch::optim::AdamW peer(ref, torch::optim::AdamWOptions(1e-2).weight_decay(0.01));
    for (int step = 0; step < 20; ++step) {
      set_grads(ours, step, 2);
      for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = ours[i].grad().to(at::kFloat);
      fused.step();
      peer.step();
      std::vector<at::Tensor> rounded;
      for (const auto& r : ref) rounded.push_back(r.detach().to(dtype));
      ASSERT_TRUE(lists_close(ours, rounded, tolerance_for(dtype))) << dtype << " step " << step;
      const at::NoGradGuard ng;
      for (size_t i = 0; i < ref.size(); ++i) ref[i].copy_(ours[i]);
    }
  }
}

// master_weights: the fp32 master follows LibTorch's fp32 AdamW to fp32 tolerance, and the model
// parameter is exactly the master rounded.
TEST(FusedAdam, MasterWeightsTrackFp32Reference) {
  for (auto dtype : {at::kHalf, at::kBFloat16}) {
    auto ref = make_params(edge_sizes(), at::kFloat, 9);
    auto ours = copies(ref, dtype);
    // The masters start from the rounded values; so must the reference.
    {
      const at::NoGradGuard ng;
      for (auto& r : ref) r.copy_(r.to(dtype).to(at::kFloat));
    }
    FusedAdam fused(ours, FusedAdamOptions(1e-3).weight_decay(0.01).master_weights(true));
    torch::optim::AdamW peer(ref, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    for (int step = 0; step < 20; ++step) {
      set_grads(ref, step, 5, 1, dtype);
      for (size_t i = 0; i < ours.size(); ++i) ours[i].mutable_grad() = ref[i].grad().clone();
      for (auto& r : ref) r.mutable_grad() = r.grad().to(at::kFloat);
      fused.step();
      peer.step();
    }
    auto masters = state_tensors(fused, [](const torch::optim::OptimizerParamState& s) {
      return std::vector<at::Tensor>{static_cast<const FusedAdamParamState&>(s).master_param()};
    });
    EXPECT_TRUE(lists_close(masters, ref, tolerance_for(at::kFloat))) << dtype;
    for (size_t i = 0; i < ours.size(); ++i) {
      EXPECT_TRUE(at::equal(ours[i], masters[i].to(dtype))) << dtype << " " << i;
    }
  }
}

// Gradients scaled by 2^10 with inv_scale 2^-10 inside the kernel: the same result as unscaled
// gradients (powers of two scale exactly).
TEST(FusedAdam, InKernelUnscaleEqualsUnscaledGradients) {
  auto a = make_params(edge_sizes(), at::kFloat, 4);
  auto b = copies(a, at::kFloat);
  FusedAdam fa(a, FusedAdamOptions(1e-3).weight_decay(0.05));
  FusedAdam fb(b, FusedAdamOptions(1e-3).weight_decay(0.05));
  const GradScaling scaling{at::full({1}, 1.0 / 1024), at::zeros({1})};
  for (int step = 0; step < 5; ++step) {
    set_grads(a, step, 8);
    set_grads(b, step, 8, 1024.0);
    fa.step();
    fb.step(scaling);
  }
  EXPECT_TRUE(lists_equal(a, b));
  EXPECT_TRUE(lists_equal(adam_state(fa), adam_state(fb)));
}

// found_inf set: parameters, moments and the step counter are untouched; the next clean step
// then proceeds as if the skipped one never happened.
TEST(FusedAdam, OverflowSkipsEverything) {
  for (bool bad_last : {false, true}) {
    auto a = make_params(many_sizes(), at::kFloat, 6);
    auto b = copies(a, at::kFloat);
    FusedAdam fa(a, FusedAdamOptions(1e-3));
    FusedAdam fb(b, FusedAdamOptions(1e-3));
    for (int step = 0; step < 3; ++step) {
      set_grads(a, step, 3);
      fa.step();
      set_grads(b, step, 3);
      fb.step();
      if (step == 1) {
        // An overflowing step on b only: inf in one element, detected by the check pass.
        set_grads(b, 100, 3);
        auto& victim = b[bad_last ? b.size() - 1 : 0];
        victim.mutable_grad()[victim.numel() - 1].fill_(std::numeric_limits<float>::infinity());
        auto found = at::zeros({1});
        std::vector<at::Tensor> grads;
        for (auto& p : b) grads.push_back(p.grad());
        apex::optim::multi_tensor_check_finite(grads, found);
        ASSERT_EQ(found.item<float>(), 1.0f);
        const auto params_before = snapshot(b);
        const auto state_before = adam_state(fb);
        fb.step(GradScaling{at::full({1}, 0.5), found});
        EXPECT_TRUE(lists_equal(b, params_before));
        EXPECT_TRUE(lists_equal(adam_state(fb), state_before));
        EXPECT_EQ(fb.step_count(0), 2);
      }
    }
    EXPECT_TRUE(lists_equal(a, b)) << "bad_last " << bad_last;
    EXPECT_EQ(fb.step_count(0), 3);
  }
}

TEST(FusedAdam, CapturableMatchesAndReadsLrTensor) {
  auto a = make_params(edge_sizes(), at::kFloat, 12);
  auto b = copies(a, at::kFloat);
  FusedAdam fa(a, FusedAdamOptions(1e-3));
  FusedAdam fb(b, FusedAdamOptions(1e-3).capturable(true));
  for (int step = 0; step < 4; ++step) {
    set_grads(a, step, 1);
    set_grads(b, step, 1);
    fa.step();
    fb.step();
  }
  EXPECT_TRUE(lists_close(a, b, tolerance_for(at::kFloat)));
  // The device lr tensor is what the kernel reads.
  fb.lr_tensor(0).fill_(0.0);
  const auto before = snapshot(b);
  set_grads(b, 9, 1);
  fb.step();
  EXPECT_TRUE(lists_close(b, before, {0, 0}));
  EXPECT_EQ(fb.step_count(0), 5);
}

TEST(FusedAdam, GradsWithoutParamsAreSkippedAndNoGradStepsAreNoops) {
  auto p = make_params({10, 20}, at::kFloat, 1);
  FusedAdam opt(p, FusedAdamOptions(1e-2));
  opt.step();  // no gradients at all
  EXPECT_EQ(opt.step_count(0), 0);
  EXPECT_TRUE(opt.state().empty());
  p[1].mutable_grad() = at::ones({20});
  const auto before = p[0].detach().clone();
  opt.step();
  EXPECT_TRUE(at::equal(p[0], before));
  EXPECT_EQ(opt.state().size(), 1u);
  opt.zero_grad();
  EXPECT_FALSE(p[1].grad().defined()) << "set_grad_none defaults to true";
}

// torch::save/torch::load of the optimizer, then training continues bit-identically.
TEST(FusedAdam, ArchiveRoundTripResumesBitIdentically) {
  auto a = make_params(edge_sizes(), at::kHalf, 2);
  auto b = copies(a, at::kHalf);
  const auto opts = FusedAdamOptions(1e-3).weight_decay(0.01).master_weights(true);
  FusedAdam fa(a, opts);
  for (int step = 0; step < 3; ++step) {
    set_grads(a, step, 1);
    fa.step();
  }
  std::stringstream buf;
  torch::save(fa, buf);
  FusedAdam fb(b, opts);
  {
    const at::NoGradGuard ng;
    for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  torch::load(fb, buf);
  EXPECT_EQ(fb.step_count(0), 3);
  for (int step = 3; step < 6; ++step) {
    set_grads(a, step, 1);
    set_grads(b, step, 1);
    fa.step();
    fb.step();
  }
  EXPECT_TRUE(lists_equal(a, b));
  EXPECT_TRUE(lists_equal(adam_state(fa), adam_state(fb)));
}

TEST(FusedAdam, PythonLayoutRoundTrip) {
  auto a = make_params({5, 7}, at::kFloat, 2);
  auto b = copies(a, at::kFloat);
  FusedAdam fa(a, FusedAdamOptions(1e-3).weight_decay(0.02));
  for (int step = 0; step < 2; ++step) {
    set_grads(a, step, 1);
    fa.step();
  }
  const StateDict layout = fa.python_state_dict();
  const auto groups = layout.at("param_groups").toList();
  ASSERT_EQ(groups.size(), 1u);
  const auto g0 = groups.get(0).toGenericDict();
  EXPECT_EQ(g0.at("lr").toDouble(), 1e-3);
  EXPECT_TRUE(g0.at("decoupled_weight_decay").toBool());
  const auto s1 = layout.at("state").toGenericDict().at(1).toGenericDict();
  EXPECT_EQ(s1.at("step").toTensor().item<float>(), 2.0f);
  FusedAdam fb(b, FusedAdamOptions(0.5));
  {
    const at::NoGradGuard ng;
    for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
  }
  fb.load_python_state_dict(layout);
  for (int step = 2; step < 4; ++step) {
    set_grads(a, step, 1);
    set_grads(b, step, 1);
    fa.step();
    fb.step();
  }
  EXPECT_TRUE(lists_equal(a, b));
  // A layout for another model changes nothing and says why.
  FusedAdam fc(make_params({5}, at::kFloat, 1), FusedAdamOptions(0.5));
  EXPECT_TRUE(throws_with([&] { fc.load_python_state_dict(layout); },
                          "param_groups[0] has 2 parameters but the optimizer's group has 1"));
  EXPECT_TRUE(fc.state().empty());
}

TEST(FusedAdam, BadInputClearMessagesAndNothingChanges) {
  auto p = make_params({4, 6}, at::kFloat, 1);
  EXPECT_TRUE(throws_with([&] { FusedAdam(p, FusedAdamOptions(-1.0)); },
                          "FusedAdam: lr must be >= 0, got -1"));
  EXPECT_TRUE(throws_with([&] { FusedAdam(p, FusedAdamOptions(1e-3).eps(-1e-8)); },
                          "eps must be >= 0, got -1e-08"));
  EXPECT_TRUE(throws_with(
      [&] {
        FusedAdam(p, FusedAdamOptions(1e-3).betas({1.0, 0.9}));
      },
      "betas[0] must be in [0, 1), got 1"));
  EXPECT_TRUE(throws_with(
      [&] {
        FusedAdam(p, FusedAdamOptions(1e-3).betas({0.9, -0.1}));
      },
      "betas[1] must be in [0, 1), got -0.1"));
  EXPECT_TRUE(throws_with([&] { FusedAdam(p, FusedAdamOptions(1e-3).amsgrad(true)); },
                          "amsgrad is not supported"));
  FusedAdam opt(p, FusedAdamOptions(1e-3));
  set_grads(p, 0, 1);
  opt.step();
  const auto before = snapshot(p);
  const auto state_before = adam_state(opt);
  // A gradient of another shape on the second parameter: the first is not updated either.
  set_grads(p, 1, 1);
  p[1].mutable_grad() = at::ones({3});
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "the gradient of parameter 1 of group 0 has shape [3], expected the "
                          "parameter's shape [6]"));
  p[1].mutable_grad() = at::ones({6}).to_sparse();
  EXPECT_TRUE(throws_with([&] { opt.step(); }, "sparse gradients are not supported"));
  p[1].mutable_grad() = at::ones({6});
  EXPECT_TRUE(throws_with(
      [&] {
        opt.step(GradScaling{at::ones({2}), {}});
      },
      "inv_scale must be a one-element float32 tensor"));
  static_cast<FusedAdamOptions&>(opt.param_groups()[0].options()).lr(-3);
  EXPECT_TRUE(throws_with([&] { opt.step(); }, "lr must be >= 0, got -3"));
  EXPECT_TRUE(lists_equal(p, before));
  EXPECT_TRUE(lists_equal(adam_state(opt), state_before));
  EXPECT_EQ(opt.step_count(0), 1);
  auto d = at::ones({3}, at::kDouble).set_requires_grad(true);
  d.mutable_grad() = at::ones({3}, at::kDouble);
  FusedAdam od(std::vector<at::Tensor>{d});
  EXPECT_TRUE(throws_with([&] { od.step(); },
                          "FusedAdam: expected float32, float16 or bfloat16 tensors, got Double"));
  auto m = at::empty({3}, at::TensorOptions().device(at::kMeta)).set_requires_grad(true);
  m.mutable_grad() = at::empty({3}, at::TensorOptions().device(at::kMeta));
  auto c = make_params({3}, at::kFloat, 1);
  set_grads(c, 0, 1);
  FusedAdam om(std::vector<at::Tensor>{c[0], m});
  EXPECT_TRUE(throws_with([&] { om.step(); },
                          "all parameters of group 0 must be on one device, got cpu and meta"));
}

// A scheduler writing the options' lr is honoured in capturable mode too.
TEST(FusedAdam, CapturableFollowsOptionLr) {
  auto a = make_params({64}, at::kFloat, 3);
  FusedAdam opt(a, FusedAdamOptions(1e-3).capturable(true));
  set_grads(a, 0, 1);
  opt.step();
  opt.param_groups()[0].options().set_lr(0.0);
  const auto before = snapshot(a);
  set_grads(a, 1, 1);
  opt.step();
  EXPECT_TRUE(lists_equal(a, before));
  EXPECT_EQ(opt.lr_tensor(0).item<float>(), 0.0f);
}

// State that does not fit its parameter (e.g. loaded from another model) is an error before any
// parameter or counter changes, not halfway through a step.
TEST(FusedAdam, MisfitStateFailsBeforeAnythingChanges) {
  auto p = make_params({8, 5}, at::kFloat, 2);
  FusedAdam opt(p, FusedAdamOptions(1e-3));
  set_grads(p, 0, 1);
  opt.step();
  static_cast<FusedAdamParamState&>(*opt.state().at(p[1].unsafeGetTensorImpl()))
      .exp_avg(at::zeros({3}));
  const auto before = snapshot(p);
  set_grads(p, 1, 1);
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "the state of parameter 1 of group 0 has shape [3] but the parameter "
                          "has shape [5]"));
  EXPECT_TRUE(lists_equal(p, before));
  EXPECT_EQ(opt.step_count(0), 1);
}

TEST(FusedAdam, SameTensorTwiceIsAnError) {
  auto p = make_params({4}, at::kFloat, 1);
  set_grads(p, 0, 1);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  groups.emplace_back(std::vector<at::Tensor>{p[0]});
  groups.emplace_back(std::vector<at::Tensor>{p[0]});
  FusedAdam opt(groups);
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "parameter 0 of group 1 is the same tensor as parameter 0 of group 0"));
}

// Python's load_state_dict replaces the whole state; integer betas (Python allows them) load.
TEST(FusedAdam, PythonLoadReplacesStateAndAcceptsIntegerBetas) {
  auto p = make_params({3, 4}, at::kFloat, 5);
  FusedAdam donor(std::vector<at::Tensor>{p[0], p[1]});
  p[0].mutable_grad() = at::ones({3});
  donor.step();  // only parameter 0 has state
  StateDict layout = donor.python_state_dict();
  auto g0 = layout.at("param_groups").toList().get(0).toGenericDict();
  g0.insert_or_assign("betas", c10::ivalue::Tuple::create(int64_t{0}, 0.99));
  auto q = copies(p, at::kFloat);
  FusedAdam opt(q);
  set_grads(q, 0, 1);
  opt.step();  // both parameters have state now
  opt.load_python_state_dict(layout);
  EXPECT_EQ(opt.state().size(), 1u);
  EXPECT_EQ(opt.state().count(q[1].unsafeGetTensorImpl()), 0u);
  const auto betas = static_cast<FusedAdamOptions&>(opt.param_groups()[0].options()).betas();
  EXPECT_EQ(std::get<0>(betas), 0.0);
  EXPECT_EQ(std::get<1>(betas), 0.99);
}

}  // namespace
}  // namespace apex::test
