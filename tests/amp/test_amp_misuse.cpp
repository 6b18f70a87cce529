#include "amp_test_util.h"

using apex::amp::Options;
using apex::amp::OptLevel;
using apex::amp::ScaleLossOptions;
using namespace apex::test;

TEST(AmpMisuse, ModelNotFp32BeforeInitialize) {
  Mlp model(4, 4, 2);
  model->to(at::kHalf);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  EXPECT_TRUE(throws_with([&] { apex::amp::initialize(model, opt, quiet(OptLevel::O2)); },
                          "model 0 parameter 'fc1.weight' has dtype Half; initialize expects an "
                          "fp32 model"));
  // Nothing was registered: a corrected model can use the same optimizer.
  model->to(at::kFloat);
  EXPECT_NO_THROW(apex::amp::initialize(model, opt, quiet(OptLevel::O2)));
}

TEST(AmpMisuse, OptimizerInitializedTwice) {
  Mlp model(4, 4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O1));
  Mlp other(4, 4, 2);
  EXPECT_TRUE(throws_with([&] { apex::amp::initialize(other, opt, quiet(OptLevel::O1)); },
                          "optimizer 0 was already passed to initialize; each optimizer may be "
                          "initialized once"));
  EXPECT_TRUE(throws_with(
      [&] {
        torch::optim::SGD o2(other->parameters(), torch::optim::SGDOptions(0.1));
        apex::amp::initialize({other.ptr()}, {&o2, &o2}, quiet(OptLevel::O1));
      },
      "optimizer 1 was already passed to initialize"));
}

TEST(AmpMisuse, NonScalarLossAndBadLossId) {
  Mlp model(4, 4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O1));
  auto out = amp.forward(model, torch::randn({3, 4}));
  EXPECT_TRUE(throws_with([&] { amp.scale_loss(out); },
                          "loss must be a scalar (one element), got shape [3, 2]"));
  EXPECT_TRUE(throws_with([&] { amp.scale_loss(out.sum(), 1); },
                          "loss_id 1 out of range; initialize made 1 loss scaler(s)"));
  EXPECT_TRUE(throws_with([&] { amp.scale_loss(at::ones({}, at::kLong)); },
                          "loss must be floating point, got Long"));
  EXPECT_TRUE(throws_with([&] { amp.scale_loss(out.sum(), 0, ScaleLossOptions().optimizers({3})); },
                          "optimizer index 3 out of range"));
}

TEST(AmpMisuse, StepWithoutBackward) {
  Mlp model(4, 4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  for (auto level : {OptLevel::O0, OptLevel::O2}) {
    Mlp m(4, 4, 2);
    torch::optim::SGD o(m->parameters(), torch::optim::SGDOptions(0.1));
    auto amp = apex::amp::initialize(m, o, quiet(level));
    EXPECT_TRUE(
        throws_with([&] { amp.step(); }, "no backward since the last step for optimizer 0"));
    amp.scale_loss(amp.forward(m, torch::randn({3, 4})).sum()).backward();
    amp.step();  // may skip (fp16 overflow at the initial scale): either way a step happened
    EXPECT_TRUE(throws_with([&] { amp.step(0); }, "no backward since the last step"));
  }
}

TEST(AmpMisuse, BackwardTwiceInOneScope) {
  Mlp model(4, 4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O2));
  auto scaled = amp.scale_loss(amp.forward(model, torch::randn({3, 4})).sum());
  scaled.backward(/*retain_graph=*/true);
  EXPECT_TRUE(throws_with([&] { scaled.backward(); },
                          "backward was already called in this scale_loss scope"));
}

TEST(AmpMisuse, ErrorAtScopeExitIsRaisedByTheNextCall) {
  // A sparse gradient cannot be unscaled into a master: the scope's destructor finds that and
  // the next call on the handle raises it.
  auto emb = torch::nn::Embedding(torch::nn::EmbeddingOptions(10, 4).sparse(true));
  torch::optim::SGD opt(emb->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(emb, opt, quiet(OptLevel::O1));
  amp.scale_loss(amp.forward(emb, torch::tensor({1, 2, 3})).sum()).backward();
  EXPECT_TRUE(throws_with([&] { amp.step(); }, "sparse gradients are not supported"));
}

TEST(AmpMisuse, DelayedScopesMustShareTheLossId) {
  Mlp model(4, 4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O1).num_losses(2));
  amp.scale_loss(amp.forward(model, torch::randn({3, 4})).sum(), 0,
                 ScaleLossOptions().delay_unscale(true))
      .backward();
  EXPECT_TRUE(throws_with(
      [&] {
        amp.scale_loss(amp.forward(model, torch::randn({3, 4})).sum(), 1);
      },
      "holds gradients still scaled by loss scaler 0 (delay_unscale=true)"));
}

TEST(AmpMisuse, LoadRejectsBadStateAndChangesNothing) {
  Mlp model(4, 4, 2);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(model, opt, quiet(OptLevel::O2));
  const auto good = amp.state_dict();
  const auto masters = snapshot(amp.master_params());

  auto bad_scale = good.copy();
  auto scaler = apex::make_state_dict();
  scaler.insert("loss_scale", std::numeric_limits<double>::infinity());
  scaler.insert("unskipped", int64_t{0});
  bad_scale.insert_or_assign("loss_scaler0", scaler);
  // A good master list alongside: it must not be applied when the scaler entry fails.
  EXPECT_TRUE(throws_with([&] { amp.load_state_dict(bad_scale); },
                          "loss_scale must be finite and > 0, got inf"));
  auto neg = scaler.copy();
  neg.insert_or_assign("loss_scale", -1.0);
  bad_scale.insert_or_assign("loss_scaler0", neg);
  EXPECT_TRUE(throws_with([&] { amp.load_state_dict(bad_scale); },
                          "loss_scale must be finite and > 0, got -1"));

  auto wrong_level = good.copy();
  wrong_level.insert_or_assign("opt_level", std::string("O1"));
  EXPECT_TRUE(throws_with([&] { amp.load_state_dict(wrong_level); },
                          "the state was written at opt_level O1, this handle is O2"));

  auto no_masters = good.copy();
  (void)no_masters.erase("master_params");
  EXPECT_TRUE(throws_with([&] { amp.load_state_dict(no_masters); }, "missing 'master_params'"));

  auto extra = good.copy();
  extra.insert("loss_scaler1", good.at("loss_scaler0"));
  EXPECT_TRUE(throws_with([&] { amp.load_state_dict(extra); },
                          "'loss_scaler1' but this handle has 1 loss scaler(s)"));

  auto shape = good.copy();
  c10::impl::GenericList outer(c10::ListType::ofTensors());
  c10::List<at::Tensor> inner;
  for (size_t i = 0; i < masters.size(); ++i) inner.push_back(at::zeros({1}));
  outer.push_back(inner);
  shape.insert_or_assign("master_params", outer);
  EXPECT_TRUE(throws_with([&] { amp.load_state_dict(shape); },
                          "master_params[0][0] has shape [1] and dtype Float, expected a floating "
                          "tensor of shape [4, 4]"));

  EXPECT_TRUE(all_equal(snapshot(amp.master_params()), masters));
  EXPECT_EQ(amp.loss_scale(), 65536.0);
  EXPECT_TRUE(throws_with([&] { amp.load("/nonexistent/amp.pt"); }, "cannot read"));
}
