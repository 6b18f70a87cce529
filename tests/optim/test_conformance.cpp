// One typed suite that every fused optimizer passes (as LibTorch's test/cpp/api/optim.cpp runs
// every optimizer through one template): a step with found_inf set changes nothing, torch::save /
// torch::load resumes bit-identically, state that does not fit its parameter fails before
// anything changes, the Python layout round-trips where a torch.optim counterpart exists, and each
// bad input has its message and leaves everything as it was. A new optimizer is one Traits
// specialization and one entry of the type list.
#include <apex/optim.h>
#include <torch/serialize.h>

#include <functional>
#include <limits>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "optim_test_util.h"

namespace apex::test {
namespace {

using namespace apex::optim;
using ParamState = torch::optim::OptimizerParamState;

/// A bad option: what builds it and the fragment of the message it must give.
struct BadOption {
  std::function<void(const std::vector<at::Tensor>&)> construct;
  std::string message;
};

template <class Opt>
struct Traits;

template <>
struct Traits<FusedAdam> {
  using State = FusedAdamParamState;
  static constexpr const char* kName = "FusedAdam";
  static constexpr bool kPython = true;
  static FusedAdamOptions options() {
    return FusedAdamOptions(1e-2).weight_decay(0.01).master_weights(true);
  }
  static std::vector<at::Tensor> state(const State& s) {
    return {s.exp_avg(), s.exp_avg_sq(), s.master_param(), at::scalar_tensor(s.step())};
  }
  static void misfit(State& s) { s.exp_avg_sq(at::zeros({3})); }
  static std::vector<BadOption> bad_options() {
    return {
        {[](const auto& p) { FusedAdam(p, FusedAdamOptions(-1.0)); }, "lr must be >= 0, got -1"},
        {[](const auto& p) {
           FusedAdam(p, FusedAdamOptions(1e-3).betas({1.0, 0.9}));
         },
         "betas[0] must be in [0, 1), got 1"},
        {[](const auto& p) { FusedAdam(p, FusedAdamOptions(1e-3).weight_decay(-1)); },
         "weight_decay must be >= 0, got -1"},
        {[](const auto& p) { FusedAdam(p, FusedAdamOptions(1e-3).amsgrad(true)); },
         "amsgrad is not supported"}};
  }
};

template <>
struct Traits<FusedSGD> {
  using State = FusedSGDParamState;
  static constexpr const char* kName = "FusedSGD";
  static constexpr bool kPython = true;
  static FusedSGDOptions options() {
    return FusedSGDOptions(0.05).momentum(0.9).weight_decay(0.01).master_weights(true);
  }
  static std::vector<at::Tensor> state(const State& s) {
    return {s.momentum_buffer(), s.master_param()};
  }
  static void misfit(State& s) { s.momentum_buffer(at::zeros({3})); }
  static std::vector<BadOption> bad_options() {
    return {
        {[](const auto& p) { FusedSGD(p, FusedSGDOptions(-0.1)); }, "lr must be >= 0, got -0.1"},
        {[](const auto& p) { FusedSGD(p, FusedSGDOptions(0.1).momentum(-1)); },
         "momentum must be >= 0, got -1"},
        {[](const auto& p) { FusedSGD(p, FusedSGDOptions(0.1).nesterov(true)); },
         "nesterov requires momentum > 0 and dampening = 0, got momentum 0"}};
  }
};

template <>
struct Traits<FusedLAMB> {
  using State = FusedLAMBParamState;
  static constexpr const char* kName = "FusedLAMB";
  static constexpr bool kPython = false;
  static FusedLAMBOptions options() { return FusedLAMBOptions(1e-2).master_weights(true); }
  static std::vector<at::Tensor> state(const State& s) {
    return {s.exp_avg(), s.exp_avg_sq(), s.master_param(), at::scalar_tensor(s.step())};
  }
  static void misfit(State& s) { s.exp_avg(at::zeros({3})); }
  static std::vector<BadOption> bad_options() {
    return {
        {[](const auto& p) { FusedLAMB(p, FusedLAMBOptions(-1.0)); }, "lr must be >= 0, got -1"},
        {[](const auto& p) {
           FusedLAMB(p, FusedLAMBOptions(1e-3).betas({0.9, 1.5}));
         },
         "betas[1] must be in [0, 1), got 1.5"},
        {[](const auto& p) { FusedLAMB(p, FusedLAMBOptions(1e-3).max_grad_norm(-1)); },
         "max_grad_norm must be >= 0, got -1"}};
  }
};

template <>
struct Traits<FusedNovoGrad> {
  using State = FusedNovoGradParamState;
  static constexpr const char* kName = "FusedNovoGrad";
  static constexpr bool kPython = false;
  static FusedNovoGradOptions options() {
    return FusedNovoGradOptions(1e-2).weight_decay(0.01).master_weights(true);
  }
  static std::vector<at::Tensor> state(const State& s) {
    return {s.exp_avg(), s.exp_avg_sq(), s.master_param(), at::scalar_tensor(s.step())};
  }
  static void misfit(State& s) { s.exp_avg(at::zeros({3})); }
  static std::vector<BadOption> bad_options() {
    return {{[](const auto& p) { FusedNovoGrad(p, FusedNovoGradOptions(-1.0)); },
             "lr must be >= 0, got -1"},
            {[](const auto& p) { FusedNovoGrad(p, FusedNovoGradOptions(1e-3).eps(-1)); },
             "eps must be >= 0, got -1"}};
  }
};

template <>
struct Traits<FusedAdagrad> {
  using State = FusedAdagradParamState;
  static constexpr const char* kName = "FusedAdagrad";
  static constexpr bool kPython = true;
  static FusedAdagradOptions options() {
    return FusedAdagradOptions(0.05).weight_decay(0.01).master_weights(true);
  }
  static std::vector<at::Tensor> state(const State& s) {
    return {s.sum(), s.master_param(), at::scalar_tensor(s.step())};
  }
  static void misfit(State& s) { s.sum(at::zeros({3})); }
  static std::vector<BadOption> bad_options() {
    return {{[](const auto& p) { FusedAdagrad(p, FusedAdagradOptions(-1.0)); },
             "lr must be >= 0, got -1"},
            {[](const auto& p) { FusedAdagrad(p, FusedAdagradOptions(0.1).lr_decay(-1)); },
             "lr_decay must be >= 0, got -1"},
            {[](const auto& p) {
               FusedAdagrad(p, FusedAdagradOptions(0.1).initial_accumulator_value(-1));
             },
             "initial_accumulator_value must be >= 0, got -1"}};
  }
};

template <class Opt>
class FusedOptimizerConformance : public ::testing::Test {
 protected:
  using T = Traits<Opt>;

  /// Two groups: bf16 parameters (fp32 masters) and fp32 ones, sizes across the chunk edge.
  static std::vector<torch::optim::OptimizerParamGroup> groups(const std::vector<at::Tensor>& p) {
    std::vector<torch::optim::OptimizerParamGroup> g;
    g.emplace_back(std::vector<at::Tensor>{p[0], p[1]});
    g.emplace_back(std::vector<at::Tensor>{p[2], p[3]});
    return g;
  }
  static std::vector<at::Tensor> params(uint64_t seed) {
    auto half = make_params({7, 65537}, at::kBFloat16, seed);
    auto full = make_params({1, 300}, at::kFloat, seed + 1);
    return {half[0], half[1], full[0], full[1]};
  }
  static std::vector<at::Tensor> clone_params(const std::vector<at::Tensor>& p) {
    std::vector<at::Tensor> out;
    for (const auto& t : p) out.push_back(t.detach().clone().set_requires_grad(true));
    return out;
  }
  /// Every state tensor; an absent one (no master for an fp32 parameter) as an empty tensor.
  static std::vector<at::Tensor> state_of(const Opt& opt) {
    auto out = state_tensors(opt, [](const ParamState& s) {
      return T::state(static_cast<const typename T::State&>(s));
    });
    for (auto& t : out) {
      if (!t.defined()) t = at::empty({0});
    }
    return out;
  }
  static void steps(Opt& opt, const std::vector<at::Tensor>& p, int from, int to) {
    for (int step = from; step < to; ++step) {
      set_grads(p, step, 7);
      opt.step();
    }
  }
};

using FusedOptimizers =
    ::testing::Types<FusedAdam, FusedSGD, FusedLAMB, FusedNovoGrad, FusedAdagrad>;
TYPED_TEST_SUITE(FusedOptimizerConformance, FusedOptimizers);

// found_inf set: parameters, masters, moments and counters stay as they were, and the run then
// continues exactly as one that never saw the skipped step.
TYPED_TEST(FusedOptimizerConformance, SkipOnFoundInfChangesNothing) {
  using T = typename TestFixture::T;
  auto a = this->params(1);
  auto b = this->clone_params(a);
  TypeParam oa(this->groups(a), T::options());
  TypeParam ob(this->groups(b), T::options());
  this->steps(oa, a, 0, 2);
  this->steps(ob, b, 0, 2);
  const auto params_before = snapshot(b);
  const auto state_before = this->state_of(ob);
  set_grads(b, 99, 7, 1e3);
  ob.step(GradScaling{at::full({1}, 0.5f), at::ones({1})});
  EXPECT_TRUE(lists_equal(b, params_before)) << T::kName;
  EXPECT_TRUE(lists_equal(this->state_of(ob), state_before)) << T::kName;
  this->steps(oa, a, 2, 4);
  this->steps(ob, b, 2, 4);
  EXPECT_TRUE(lists_equal(a, b)) << T::kName;
  EXPECT_TRUE(lists_equal(this->state_of(oa), this->state_of(ob))) << T::kName;
}

// A clean step with found_inf present and zero, and the gradients scaled by 1/inv_scale, equals
// a plain step on the unscaled gradients.
TYPED_TEST(FusedOptimizerConformance, InKernelUnscaleMatchesUnscaledGradients) {
  using T = typename TestFixture::T;
  auto a = this->params(2);
  auto b = this->clone_params(a);
  TypeParam oa(this->groups(a), T::options());
  TypeParam ob(this->groups(b), T::options());
  for (int step = 0; step < 3; ++step) {
    set_grads(a, step, 3);
    set_grads(b, step, 3, 4.0);
    oa.step();
    ob.step(GradScaling{at::full({1}, 0.25f), at::zeros({1})});
  }
  // Powers of two: the scaled gradients unscale exactly.
  EXPECT_TRUE(lists_equal(a, b)) << T::kName;
}

// torch::save / torch::load mid-run, then training continues bit-identically.
TYPED_TEST(FusedOptimizerConformance, SaveLoadResumesBitIdentically) {
  using T = typename TestFixture::T;
  auto a = this->params(3);
  TypeParam oa(this->groups(a), T::options());
  this->steps(oa, a, 0, 3);
  std::stringstream buf;
  torch::save(oa, buf);
  auto b = this->clone_params(a);
  TypeParam ob(this->groups(b), T::options());
  torch::load(ob, buf);
  EXPECT_TRUE(lists_equal(this->state_of(oa), this->state_of(ob))) << T::kName;
  this->steps(oa, a, 3, 5);
  this->steps(ob, b, 3, 5);
  EXPECT_TRUE(lists_equal(a, b)) << T::kName;
  EXPECT_TRUE(lists_equal(this->state_of(oa), this->state_of(ob))) << T::kName;
}

// A load replaces the whole state, as Python's load_state_dict does: a parameter that had no
// state when the archive was written has none after the load (LibTorch's loader alone would
// leave the newer one in place), and the run goes on as from the archive.
TYPED_TEST(FusedOptimizerConformance, LoadReplacesTheWholeState) {
  using T = typename TestFixture::T;
  auto a = this->params(6);
  TypeParam opt(this->groups(a), T::options());
  a[3].mutable_grad() = at::Tensor();
  set_grads({a[0], a[1], a[2]}, 0, 7);
  opt.step();  // parameter 3 has no state yet
  ASSERT_EQ(opt.state().count(a[3].unsafeGetTensorImpl()), 0u);
  std::stringstream buf;
  torch::save(opt, buf);
  const auto saved_params = snapshot(a);
  const auto saved_state = this->state_of(opt);
  this->steps(opt, a, 1, 3);  // now every parameter has state
  torch::load(opt, buf);
  EXPECT_EQ(opt.state().count(a[3].unsafeGetTensorImpl()), 0u) << T::kName;
  EXPECT_TRUE(lists_equal(this->state_of(opt), saved_state)) << T::kName;
}

// State that does not fit its parameter (loaded from another model) fails the next step before
// any parameter, state or counter changes.
TYPED_TEST(FusedOptimizerConformance, MisfitStateFailsBeforeAnythingChanges) {
  using T = typename TestFixture::T;
  auto p = this->params(4);
  TypeParam opt(this->groups(p), T::options());
  this->steps(opt, p, 0, 1);
  T::misfit(static_cast<typename T::State&>(*opt.state().at(p[3].unsafeGetTensorImpl())));
  const auto params_before = snapshot(p);
  const auto state_before = this->state_of(opt);
  set_grads(p, 1, 7);
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          "the state of parameter 1 of group 1 has shape [3] but the parameter "
                          "has shape [300]"))
      << T::kName;
  EXPECT_TRUE(lists_equal(p, params_before)) << T::kName;
  EXPECT_TRUE(lists_equal(this->state_of(opt), state_before)) << T::kName;
}

// The layout of the torch.optim counterpart round-trips; optimizers without one say so and keep
// their state.
TYPED_TEST(FusedOptimizerConformance, PythonLayout) {
  using T = typename TestFixture::T;
  auto a = make_params({5, 9}, at::kFloat, 5);
  auto b = this->clone_params(a);
  TypeParam oa(a, T::options().master_weights(false));
  TypeParam ob(b, T::options().master_weights(false));
  this->steps(oa, a, 0, 2);
  if constexpr (!T::kPython) {
    EXPECT_TRUE(throws_with([&] { oa.python_state_dict(); }, "has no torch.optim counterpart"));
    this->steps(ob, b, 0, 1);
    const auto before = this->state_of(ob);
    EXPECT_TRUE(throws_with([&] { ob.load_python_state_dict(make_state_dict()); },
                            "has no torch.optim counterpart"));
    EXPECT_TRUE(lists_equal(this->state_of(ob), before));
  } else {
    {
      const at::NoGradGuard no_grad;
      for (size_t i = 0; i < a.size(); ++i) b[i].copy_(a[i]);
    }
    ob.load_python_state_dict(oa.python_state_dict());
    this->steps(oa, a, 2, 4);
    this->steps(ob, b, 2, 4);
    EXPECT_TRUE(lists_equal(a, b)) << T::kName;
    // A layout for another model changes nothing.
    auto c = make_params({5}, at::kFloat, 6);
    TypeParam oc(c, T::options().master_weights(false));
    this->steps(oc, c, 0, 1);
    const auto before = this->state_of(oc);
    EXPECT_TRUE(throws_with([&] { oc.load_python_state_dict(oa.python_state_dict()); },
                            "param_groups[0] has 2 parameters but the optimizer's group has 1"))
        << T::kName;
    EXPECT_TRUE(lists_equal(this->state_of(oc), before)) << T::kName;
  }
}

// Bad options fail at construction with their message; bad gradients and scaling inputs fail the
// step with theirs, and nothing changes.
TYPED_TEST(FusedOptimizerConformance, BadInputClearMessagesAndNothingChanges) {
  using T = typename TestFixture::T;
  const auto p = make_params({4, 6}, at::kFloat, 8);
  for (const auto& bad : T::bad_options()) {
    EXPECT_TRUE(throws_with([&] { bad.construct(p); }, std::string(T::kName) + ": " + bad.message));
  }
  TypeParam opt(p, T::options());
  set_grads(p, 0, 1);
  opt.step();
  const auto params_before = snapshot(p);
  const auto state_before = this->state_of(opt);
  set_grads(p, 1, 1);
  p[1].mutable_grad() = at::ones({3});
  EXPECT_TRUE(throws_with([&] { opt.step(); },
                          std::string(T::kName) +
                              ": the gradient of parameter 1 of group 0 has shape [3], expected "
                              "the parameter's shape [6]"));
  p[1].mutable_grad() = at::ones({6}).to_sparse();
  EXPECT_TRUE(throws_with([&] { opt.step(); }, "sparse gradients are not supported"));
  p[1].mutable_grad() = at::ones({6}, at::kDouble);
  EXPECT_TRUE(throws_with([&] { opt.step(); }, "expected float32, float16 or bfloat16 tensors"));
  p[1].mutable_grad() = at::ones({6});
  EXPECT_TRUE(throws_with(
      [&] {
        opt.step(GradScaling{at::ones({2}), {}});
      },
      "inv_scale must be a one-element float32 tensor"));
  EXPECT_TRUE(throws_with(
      [&] {
        opt.step(GradScaling{{}, at::zeros({1}, at::kInt)});
      },
      "found_inf must be a one-element float32 tensor"));
  EXPECT_TRUE(lists_equal(p, params_before)) << T::kName;
  EXPECT_TRUE(lists_equal(this->state_of(opt), state_before)) << T::kName;
}

}  // namespace
}  // namespace apex::test
