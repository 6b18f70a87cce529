// FusedSGD and FusedAdagrad against LibTorch; FusedLAMB, FusedNovoGrad and LARC against float64
// reference implementations written here.
#include <apex/optim.h>

#include <limits>

#include "optim_test_util.h"

namespace apex::test {
namespace {

using namespace apex::optim;

constexpr int kSteps = 20;

std::vector<at::Tensor> to_double(const std::vector<at::Tensor>& v) {
  return copies(v, at::kDouble);
}

// ---------------------------------------------------------------------------------------------
// FusedSGD
// ---------------------------------------------------------------------------------------------

struct SgdCase {
  double momentum, dampening, weight_decay;
  bool nesterov;
};

TEST(FusedSGD, MatchesLibTorchSGD) {
  const SgdCase cases[] = {{0.0, 0.0, 0.0, false},
                           {0.9, 0.0, 0.01, false},
                           {0.9, 0.1, 0.0, false},
                           {0.9, 0.0, 1e-3, true}};
  for (const auto& c : cases) {
    for (const auto& sizes : {edge_sizes(), many_sizes()}) {
      auto ours = make_params(sizes, at::kFloat, 31);
      auto ref = copies(ours, at::kFloat);
      FusedSGD fused(ours, FusedSGDOptions(0.05)
                               .momentum(c.momentum)
                               .dampening(c.dampening)
                               .weight_decay(c.weight_decay)
                               .nesterov(c.nesterov));
      torch::optim::SGD peer(ref, torch::optim::SGDOptions(0.05)
                                      .momentum(c.momentum)
                                      .dampening(c.dampening)
                                      .weight_decay(c.weight_decay)
                                      .nesterov(c.nesterov));
      for (int step = 0; step < kSteps; ++step) {
        set_grads(ours, step, 3);
        set_grads(ref, step, 3);
        fused.step();
        peer.step();
      }
      EXPECT_TRUE(lists_close(ours, ref, tolerance_for(at::kFloat)))
          << "momentum " << c.momentum << " dampening " << c.dampening << " nesterov "
          << c.nesterov;
    }
  }
}

// Weight decay after momentum (apex's option), against a float64 loop.
TEST(FusedSGD, WeightDecayAfterMomentumAgainstFloat64) {
  auto ours = make_params(edge_sizes(), at::kFloat, 2);
  auto ref = to_double(ours);
  FusedSGD fused(ours,
                 FusedSGDOptions(0.1).momentum(0.9).weight_decay(0.01).wd_after_momentum(true));
  std::vector<at::Tensor> buf(ref.size());
  for (int step = 0; step < kSteps; ++step) {
    set_grads(ours, step, 4);
    fused.step();
    for (size_t i = 0; i < ref.size(); ++i) {
      const at::Tensor g = grad_for(ours[i], step, i, 4).to(at::kDouble);
      buf[i] = step == 0 ? g.clone() : buf[i] * 0.9 + g;
      const at::NoGradGuard ng;
      ref[i].sub_((buf[i] + ref[i] * 0.01) * 0.1);
    }
  }
  EXPECT_TRUE(lists_close(ours, ref, tolerance_for(at::kFloat)));
}

// A skipped first step must not seed the momentum buffers; a skipped later step changes nothing.
TEST(FusedSGD, OverflowOnFirstAndLaterSteps) {
  auto a = make_params(edge_sizes(), at::kFloat, 8);
  auto b = copies(a, at::kFloat);
  const auto opts = FusedSGDOptions(0.1).momentum(0.9).dampening(0.5);
  FusedSGD fa(a, opts);
  FusedSGD fb(b, opts);
  const GradScaling skip{at::ones({1}), at::ones({1})};
  set_grads(b, 99, 1);
  fb.step(skip);
  for (const auto& p : b) {
    auto it = fb.state().find(p.unsafeGetTensorImpl());
    ASSERT_TRUE(it == fb.state().end() ||
                !static_cast<FusedSGDParamState&>(*it->second).momentum_buffer().defined());
  }
  for (int step = 0; step < 4; ++step) {
    set_grads(a, step, 1);
    set_grads(b, step, 1);
    fa.step();
    fb.step(GradScaling{at::ones({1}), at::zeros({1})});
    if (step == 2) {
      const auto before = snapshot(b);
      set_grads(b, 98, 1);
      fb.step(skip);
      EXPECT_TRUE(lists_equal(b, before));
    }
  }
  EXPECT_TRUE(lists_equal(a, b));
}

TEST(FusedSGD, MasterWeightsAndPythonLayout) {
  auto ref = make_params(edge_sizes(), at::kFloat, 5);
  {
    const at::NoGradGuard ng;
    for (auto& r : ref) r.copy_(r.to(at::kBFloat16).to(at::kFloat));
  }
  auto ours = copies(ref, at::kBFloat16);
  FusedSGD fused(ours, FusedSGDOptions(0.1).momentum(0.9).master_weights(true));
  torch::optim::SGD peer(ref, torch::optim::SGDOptions(0.1).momentum(0.9));
  for (int step = 0; step < kSteps; ++step) {
    set_grads(ours, step, 6);
    for (size_t i = 0; i < ref.size(); ++i) ref[i].mutable_grad() = ours[i].grad().to(at::kFloat);
    fused.step();
    peer.step();
  }
  auto masters = state_tensors(fused, [](const torch::optim::OptimizerParamState& s) {
    return std::vector<at::Tensor>{static_cast<const FusedSGDParamState&>(s).master_param()};
  });
  EXPECT_TRUE(lists_close(masters, ref, tolerance_for(at::kFloat))) << "master = fp32 SGD";
  for (size_t i = 0; i < ours.size(); ++i) {
    EXPECT_TRUE(at::equal(ours[i], masters[i].to(at::kBFloat16))) << "model = master rounded";
  }
  const StateDict layout = fused.python_state_dict();
  const auto s0 = layout.at("state").toGenericDict().at(0).toGenericDict();
  EXPECT_TRUE(s0.at("momentum_buffer").isTensor());
  EXPECT_EQ(layout.at("param_groups").toList().get(0).toGenericDict().at("momentum").toDouble(),
            0.9);
  auto c = copies(ours, at::kBFloat16);
  FusedSGD fc(c, FusedSGDOptions(1.0));
  fc.load_python_state_dict(layout);
  EXPECT_EQ(static_cast<FusedSGDOptions&>(fc.param_groups()[0].options()).momentum(), 0.9);
}

TEST(FusedSGD, BadInput) {
  auto p = make_params({3}, at::kFloat, 1);
  EXPECT_TRUE(throws_with([&] { FusedSGD(p, FusedSGDOptions(-0.1)); },
                          "FusedSGD: lr must be >= 0, got -0.1"));
  EXPECT_TRUE(throws_with([&] { FusedSGD(p, FusedSGDOptions(0.1).nesterov(true)); },
                          "nesterov requires momentum > 0 and dampening = 0"));
  EXPECT_TRUE(throws_with([&] { FusedSGD(p, FusedSGDOptions(0.1).momentum(-1)); },
                          "momentum must be >= 0, got -1"));
}

// ---------------------------------------------------------------------------------------------
// FusedAdagrad
// ---------------------------------------------------------------------------------------------

TEST(FusedAdagrad, MatchesLibTorchAdagrad) {
  for (const auto& sizes : {edge_sizes(), many_sizes()}) {
    auto ours = make_params(sizes, at::kFloat, 41);
    auto ref = copies(ours, at::kFloat);
    FusedAdagrad fused(
        ours,
        FusedAdagradOptions(0.05).lr_decay(0.01).weight_decay(0.01).initial_accumulator_value(0.1));
    torch::optim::Adagrad peer(ref, torch::optim::AdagradOptions(0.05)
                                        .lr_decay(0.01)
                                        .weight_decay(0.01)
                                        .initial_accumulator_value(0.1));
    for (int step = 0; step < kSteps; ++step) {
      set_grads(ours, step, 7);
      set_grads(ref, step, 7);
      fused.step();
      peer.step();
    }
    EXPECT_TRUE(lists_close(ours, ref, tolerance_for(at::kFloat)));
  }
}

TEST(FusedAdagrad, DecoupledModeAgainstFloat64) {
  auto ours = make_params(edge_sizes(), at::kFloat, 4);
  auto ref = to_double(ours);
  FusedAdagrad fused(ours, FusedAdagradOptions(0.05).weight_decay(0.1).adagrad_w_mode(true));
  std::vector<at::Tensor> h(ref.size());
  for (int step = 0; step < kSteps; ++step) {
    set_grads(ours, step, 2);
    fused.step();
    const at::NoGradGuard ng;
    for (size_t i = 0; i < ref.size(); ++i) {
      const at::Tensor g = grad_for(ours[i], step, i, 2).to(at::kDouble);
      h[i] = step == 0 ? g * g : h[i] + g * g;
      ref[i].copy_(ref[i] * (1 - 0.05 * 0.1) - 0.05 * g / (h[i].sqrt() + 1e-10));
    }
  }
  EXPECT_TRUE(lists_close(ours, ref, tolerance_for(at::kFloat)));
}

TEST(FusedAdagrad, SkipWithScalerChangesNothing) {
  auto p = make_params(edge_sizes(), at::kHalf, 4);
  FusedAdagrad opt(p, FusedAdagradOptions(0.05).master_weights(true));
  set_grads(p, 0, 1);
  opt.step();
  const auto before = snapshot(p);
  set_grads(p, 1, 1);
  opt.step(GradScaling{at::full({1}, 0.5), at::ones({1})});
  EXPECT_TRUE(lists_equal(p, before));
  for (const auto& param : p) {
    EXPECT_EQ(
        static_cast<FusedAdagradParamState&>(*opt.state().at(param.unsafeGetTensorImpl())).step(),
        1);
  }
}

// ---------------------------------------------------------------------------------------------
// FusedLAMB against a float64 reference
// ---------------------------------------------------------------------------------------------

struct LambCase {
  double weight_decay;
  double max_grad_norm;
  bool adam_w_mode, use_nvlamb, grad_averaging;
};

void reference_lamb(std::vector<at::Tensor>& p, std::vector<at::Tensor>& m,
                    std::vector<at::Tensor>& v, const std::vector<at::Tensor>& grads, int step,
                    const LambCase& c, double lr, double b1, double b2, double eps) {
  double gsq = 0;
  for (const auto& g : grads) gsq += g.square().sum().item<double>();
  const double gnorm = std::sqrt(gsq);
  const double clip =
      (c.max_grad_norm > 0 && gnorm > c.max_grad_norm) ? gnorm / c.max_grad_norm : 1;
  const double bc1 = 1 - std::pow(b1, step);
  const double bc2 = 1 - std::pow(b2, step);
  const double b3 = c.grad_averaging ? 1 - b1 : 1;
  for (size_t i = 0; i < p.size(); ++i) {
    at::Tensor g = grads[i] / clip;
    if (!c.adam_w_mode) g = g + c.weight_decay * p[i];
    m[i] = b1 * m[i] + b3 * g;
    v[i] = b2 * v[i] + (1 - b2) * g * g;
    at::Tensor u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps);
    if (c.adam_w_mode) u = u + c.weight_decay * p[i];
    const double pn = p[i].norm().item<double>();
    const double un = u.norm().item<double>();
    double ratio = lr;
    if ((c.use_nvlamb || c.weight_decay != 0) && pn != 0 && un != 0) ratio = lr * pn / un;
    p[i] = p[i] - ratio * u;
  }
}

TEST(FusedLAMB, MatchesFloat64ReferenceInEveryBranch) {
  const LambCase cases[] = {
      {0.01, 1.0, true, false, true},    // trust ratio, clipping (norms here are ~600)
      {0.0, 1.0, true, false, true},     // no decay: plain Adam-style step, no trust ratio
      {0.0, 1e9, true, true, true},      // NVLAMB: trust ratio without decay, no clipping
      {0.01, 0.0, false, false, false},  // L2 mode, clipping disabled, no grad averaging
  };
  for (const auto& c : cases) {
    auto ours = make_params(edge_sizes(), at::kFloat, 51);
    std::vector<at::Tensor> p = to_double(ours);
    std::vector<at::Tensor> m, v;
    for (const auto& t : p) {
      m.push_back(at::zeros_like(t));
      v.push_back(at::zeros_like(t));
    }
    FusedLAMB fused(ours, FusedLAMBOptions(5e-3)
                              .weight_decay(c.weight_decay)
                              .max_grad_norm(c.max_grad_norm)
                              .adam_w_mode(c.adam_w_mode)
                              .use_nvlamb(c.use_nvlamb)
                              .grad_averaging(c.grad_averaging));
    for (int step = 1; step <= 10; ++step) {
      set_grads(ours, step, 5);
      std::vector<at::Tensor> grads;
      for (const auto& t : ours) grads.push_back(t.grad().to(at::kDouble));
      const auto grads_before = snapshot(grads);
      fused.step();
      for (size_t i = 0; i < ours.size(); ++i) {
        ASSERT_TRUE(at::equal(ours[i].grad().to(at::kDouble), grads_before[i]))
            << "FusedLAMB must not write the gradients";
      }
      reference_lamb(p, m, v, grads, step, c, 5e-3, 0.9, 0.999, 1e-6);
    }
    EXPECT_TRUE(lists_close(ours, p, {2e-5, 1e-6}))
        << "wd " << c.weight_decay << " clip " << c.max_grad_norm << " w " << c.adam_w_mode
        << " nvlamb " << c.use_nvlamb;
  }
}

TEST(FusedLAMB, ScaledGradientsAndSkip) {
  auto a = make_params(edge_sizes(), at::kFloat, 3);
  auto b = copies(a, at::kFloat);
  FusedLAMB fa(a);
  FusedLAMB fb(b);
  for (int step = 0; step < 3; ++step) {
    set_grads(a, step, 9);
    set_grads(b, step, 9, 256.0);
    fa.step();
    fb.step(GradScaling{at::full({1}, 1.0 / 256), at::zeros({1})});
  }
  EXPECT_TRUE(lists_close(a, b, tolerance_for(at::kFloat)));
  const auto before = snapshot(b);
  fb.step(GradScaling{at::full({1}, 1.0 / 256), at::ones({1})});
  EXPECT_TRUE(lists_equal(b, before));
}

// ---------------------------------------------------------------------------------------------
// FusedNovoGrad against a float64 reference of apex's algorithm
// ---------------------------------------------------------------------------------------------

struct NovoCase {
  NovoGradNorm norm;
  bool reg_inside_moment, init_zero, grad_averaging;
  double weight_decay;
};

TEST(FusedNovoGrad, MatchesFloat64Reference) {
  const NovoCase cases[] = {{NovoGradNorm::kL2, false, false, true, 0.01},
                            {NovoGradNorm::kL2, true, true, true, 0.01},
                            {NovoGradNorm::kInf, false, true, false, 0.0},
                            {NovoGradNorm::kInf, true, false, true, 0.1}};
  const double lr = 1e-2, b1 = 0.95, b2 = 0.98, eps = 1e-8;
  for (const auto& c : cases) {
    auto ours = make_params(edge_sizes(), at::kFloat, 61);
    std::vector<at::Tensor> p = to_double(ours);
    std::vector<at::Tensor> m;
    std::vector<double> v(p.size(), 0.0);
    for (const auto& t : p) m.push_back(at::zeros_like(t));
    FusedNovoGrad fused(ours, FusedNovoGradOptions(lr)
                                  .betas({b1, b2})
                                  .weight_decay(c.weight_decay)
                                  .norm_type(c.norm)
                                  .reg_inside_moment(c.reg_inside_moment)
                                  .init_zero(c.init_zero)
                                  .grad_averaging(c.grad_averaging));
    for (int step = 1; step <= 10; ++step) {
      set_grads(ours, step, 6);
      fused.step();
      const double bc1 = 1 - std::pow(b1, step);
      const double bc2 = std::sqrt(1 - std::pow(b2, step));
      const double b3 = c.grad_averaging ? 1 - b1 : 1;
      for (size_t i = 0; i < p.size(); ++i) {
        const at::Tensor g = ours[i].grad().to(at::kDouble);
        const double n =
            c.norm == NovoGradNorm::kL2 ? g.norm().item<double>() : g.abs().max().item<double>();
        if (step == 1) v[i] = c.init_zero ? 0.0 : n;
        v[i] = c.norm == NovoGradNorm::kL2 ? std::sqrt(b2 * v[i] * v[i] + (1 - b2) * n * n)
                                           : b2 * v[i] + (1 - b2) * n;
        const double d = v[i] / bc2 + eps;
        if (c.reg_inside_moment) {
          m[i] = b1 * m[i] + b3 * (g / d + c.weight_decay * p[i]);
          p[i] = p[i] - lr * m[i] / bc1;
        } else {
          m[i] = b1 * m[i] + b3 * g;
          p[i] = p[i] - lr * ((m[i] / bc1) / d + c.weight_decay * p[i]);
        }
      }
    }
    EXPECT_TRUE(lists_close(ours, p, tolerance_for(at::kFloat)))
        << "inf " << (c.norm == NovoGradNorm::kInf) << " reg " << c.reg_inside_moment << " zero "
        << c.init_zero;
  }
}

// ---------------------------------------------------------------------------------------------
// LARC
// ---------------------------------------------------------------------------------------------

TEST(LARC, ClipAndScaleModesAgainstFloat64) {
  for (bool clip : {true, false}) {
    auto ours = make_params(edge_sizes(), at::kFloat, 71);
    // One all-zero parameter: LARC must leave its gradient alone.
    {
      const at::NoGradGuard ng;
      ours[1].zero_();
    }
    auto ref = to_double(ours);
    const double lr = 0.1, wd = 1e-3, tc = 0.02;
    FusedSGD sgd(ours, FusedSGDOptions(lr).weight_decay(wd));
    LARC larc(sgd, LARCOptions().clip(clip));
    for (int step = 0; step < 5; ++step) {
      set_grads(ours, step, 8);
      larc.step();
      EXPECT_EQ(static_cast<FusedSGDOptions&>(sgd.param_groups()[0].options()).weight_decay(), wd);
      const at::NoGradGuard ng;
      for (size_t i = 0; i < ref.size(); ++i) {
        at::Tensor g = grad_for(ours[i], step, i, 8).to(at::kDouble);
        const double pn = ref[i].norm().item<double>();
        const double gn = g.norm().item<double>();
        if (pn != 0 && gn != 0) {
          double local = tc * pn / (gn + pn * wd + 1e-8);
          if (clip) local = std::min(local / lr, 1.0);
          g = (g + wd * ref[i]) * local;
        }
        ref[i].sub_(lr * g);
      }
    }
    EXPECT_TRUE(lists_close(ours, ref, tolerance_for(at::kFloat))) << "clip " << clip;
  }
}

}  // namespace
}  // namespace apex::test
