// apex-bench optim: one optimizer step over parameter lists shaped like ResNet-50 and BERT-base,
// ours against LibTorch's C++ optimizers and ATen's fused kernels, in the same run.
#include <ATen/ops/_amp_foreach_non_finite_check_and_unscale.h>
#include <ATen/ops/_foreach_add.h>
#include <ATen/ops/_foreach_copy.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/_fused_sgd.h>
#include <apex/optim.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/types.h>

#include <cmath>
#include <cstdio>

#include "bench_common.h"

namespace apex::bench {
namespace {

using Shapes = std::vector<std::vector<int64_t>>;

// ResNet-50 (torchvision layout): 161 tensors, 25.56M parameters.
Shapes resnet50() {
  Shapes s = {{64, 3, 7, 7}, {64}, {64}};
  int64_t in = 64;
  const int blocks[] = {3, 4, 6, 3};
  for (int layer = 0; layer < 4; ++layer) {
    const int64_t w = 64LL << layer;
    for (int b = 0; b < blocks[layer]; ++b) {
      s.push_back({w, in, 1, 1});
      s.push_back({w});
      s.push_back({w});
      s.push_back({w, w, 3, 3});
      s.push_back({w});
      s.push_back({w});
      s.push_back({4 * w, w, 1, 1});
      s.push_back({4 * w});
      s.push_back({4 * w});
      if (b == 0) {
        s.push_back({4 * w, in, 1, 1});
        s.push_back({4 * w});
        s.push_back({4 * w});
      }
      in = 4 * w;
    }
  }
  s.push_back({1000, 2048});
  s.push_back({1000});
  return s;
}

// BERT-base (uncased) with its pooler: 199 tensors, 109.5M parameters.
Shapes bert_base() {
  const int64_t h = 768;
  Shapes s = {{30522, h}, {512, h}, {2, h}, {h}, {h}};
  for (int l = 0; l < 12; ++l) {
    for (int k = 0; k < 4; ++k) {  // query, key, value, attention output
      s.push_back({h, h});
      s.push_back({h});
    }
    s.push_back({h});
    s.push_back({h});
    s.push_back({4 * h, h});
    s.push_back({4 * h});
    s.push_back({h, 4 * h});
    s.push_back({h});
    s.push_back({h});
    s.push_back({h});
  }
  s.push_back({h, h});
  s.push_back({h});
  return s;
}

int64_t numel(const Shapes& shapes) {
  int64_t n = 0;
  for (const auto& s : shapes) {
    int64_t k = 1;
    for (int64_t d : s) k *= d;
    n += k;
  }
  return n;
}

// Parameters with random gradients (never all-zero data), on cfg.device.
std::vector<at::Tensor> make_params(const Config& cfg, const Shapes& shapes) {
  std::vector<at::Tensor> out;
  const auto opts = torch::TensorOptions().device(cfg.device);
  for (const auto& s : shapes) {
    auto p = torch::randn(s, opts).mul_(0.05).set_requires_grad(true);
    p.mutable_grad() = torch::randn(s, opts).mul_(1e-3);
    out.push_back(p);
  }
  return out;
}

std::vector<at::Tensor> grads_of(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> g;
  for (const auto& p : params) g.push_back(p.grad());
  return g;
}

std::vector<at::Tensor> zeros_like_all(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(torch::zeros_like(p));
  return out;
}

// LAMB as a LibTorch user writes it without a fused kernel: ATen ops per parameter.
struct OpsLamb {
  std::vector<at::Tensor> params, m, v;
  int64_t step = 0;
  void operator()() {
    const at::NoGradGuard ng;
    ++step;
    const double b1 = 0.9, b2 = 0.999, eps = 1e-6, wd = 0.01, lr = 1e-3;
    std::vector<at::Tensor> norms;
    for (const auto& p : params) norms.push_back(p.grad().norm());
    const at::Tensor gnorm = torch::stack(norms).norm();
    const at::Tensor clip = torch::clamp_min(gnorm / 1.0, 1.0);
    const double bc1 = 1 - std::pow(b1, static_cast<double>(step));
    const double bc2 = 1 - std::pow(b2, static_cast<double>(step));
    for (size_t i = 0; i < params.size(); ++i) {
      const at::Tensor g = params[i].grad() / clip;
      m[i].mul_(b1).add_(g, 1 - b1);
      v[i].mul_(b2).addcmul_(g, g, 1 - b2);
      const at::Tensor u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps) + wd * params[i];
      const at::Tensor ratio = params[i].norm() / u.norm();
      params[i].sub_(u * (lr * ratio));
    }
  }
};

// ATen's fused Adam(W) as Python's Adam(fused=True) calls it: bump the float step tensors, then
// the kernel.
struct AtenAdamW {
  std::vector<at::Tensor> params, grads, m, v, steps;
  void operator()() {
    at::_foreach_add_(steps, 1);
    at::_fused_adamw_(params, grads, m, v, {}, steps, 1e-3, 0.9, 0.999, 0.01, 1e-8, false, false);
  }
};

std::vector<at::Tensor> detached(const std::vector<at::Tensor>& params) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach());
  return out;
}

// ATen's fused AdamW over `params` (their data and gradients), its moments and step counters new.
AtenAdamW aten_adamw(const Config& cfg, const std::vector<at::Tensor>& params) {
  AtenAdamW a{
      detached(params), grads_of(params), zeros_like_all(params), zeros_like_all(params), {}};
  for (size_t i = 0; i < params.size(); ++i) {
    a.steps.push_back(torch::zeros({}, torch::TensorOptions().device(cfg.device)));
  }
  return a;
}

void bench_model(const Config& cfg, const std::string& name, const Shapes& shapes,
                 std::vector<Row>& rows) {
  const int64_t count = numel(shapes);
  const auto n = static_cast<double>(count);
  std::printf("%s: %zu tensors, %.2fM parameters\n", name.c_str(), shapes.size(), n / 1e6);
  std::fflush(stdout);
  StreamLoop stream(cfg, count);
  auto add_rows = [&](const std::string& ours_name, double bytes, const std::vector<double>& ms,
                      const std::vector<std::string>& peers) {
    const double limit = stream.bytes() / (ms.back() * 1e6);
    for (size_t k = 0; k < peers.size(); ++k) {
      Row r{name, ours_name + " vs " + peers[k], ms[0], ms[k + 1], bytes, {}};
      r.extra["stream_gbs"] = limit;
      rows.push_back(r);
    }
  };

  {  // Adam(W), fp32: 28 bytes per parameter (read p, g, m, v; write p, m, v).
    auto p1 = make_params(cfg, shapes);
    apex::optim::FusedAdam ours(p1, apex::optim::FusedAdamOptions(1e-3).weight_decay(0.01));
    auto p2 = make_params(cfg, shapes);
    torch::optim::AdamW peer(p2, torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
    auto p3 = make_params(cfg, shapes);
    AtenAdamW aten = aten_adamw(cfg, p3);
    const auto ms = interleaved_ms(
        cfg, {[&] { ours.step(); }, [&] { peer.step(); }, [&] { aten(); }, [&] { stream(); }});
    add_rows("FusedAdam", 28 * n, ms, {"torch::optim::AdamW", "at::_fused_adamw_"});
  }
  {  // Under a GradScaler (scale 1, so that repeated steps keep their values): the step unscales
     // inside the kernel and leaves p.grad unscaled, writing it back in the same pass (torch's
     // contract; 32 bytes per parameter), against the same step that only reads the gradients
     // (what it did before: 28 bytes), ATen's fused AdamW given the scale (torch's fused AdamW
     // under GradScaler: it writes the gradients back too), and the unfused route: GradScaler's
     // unscale pass (read and write g), then ATen's fused AdamW.
    const auto f32 = torch::TensorOptions().dtype(at::kFloat).device(cfg.device);
    const at::Tensor inv = torch::ones({1}, f32);
    const at::Tensor found = torch::zeros({1}, f32);
    auto p1 = make_params(cfg, shapes);
    apex::optim::FusedAdam ours(p1, apex::optim::FusedAdamOptions(1e-3).weight_decay(0.01));
    auto p2 = make_params(cfg, shapes);
    apex::optim::FusedAdam read_only(p2, apex::optim::FusedAdamOptions(1e-3).weight_decay(0.01));
    auto p3 = make_params(cfg, shapes);
    AtenAdamW aten = aten_adamw(cfg, p3);
    at::Tensor aten_found = torch::zeros({1}, f32);
    const at::Tensor aten_scale = torch::ones({}, f32);
    const auto ms = interleaved_ms(
        cfg, {[&] {
                ours.step(apex::optim::GradScaling{inv, found, true});
              },
              [&] {
                read_only.step(apex::optim::GradScaling{inv, found, false});
              },
              [&] {
                // torch.optim.AdamW(fused=True) under GradScaler: the kernel unscales and
                // writes the gradients back, as ours does.
                at::_foreach_add_(aten.steps, 1);
                at::_fused_adamw_(aten.params, aten.grads, aten.m, aten.v, {}, aten.steps, 1e-3,
                                  0.9, 0.999, 0.01, 1e-8, false, false, aten_scale, aten_found);
              },
              [&] {
                at::_amp_foreach_non_finite_check_and_unscale_(aten.grads, aten_found, inv);
                aten();
              },
              [&] { stream(); }});
    add_rows("FusedAdam under GradScaler", 32 * n, ms,
             {"the same, grads only read (before)", "at::_fused_adamw_(grad_scale)",
              "unscale_ + at::_fused_adamw_"});
  }
  {  // bf16 model, fp32 masters (AMP O2 style): ours updates the master and writes the bf16
     // parameter in one pass (read g 2, master/m/v 12; write master/m/v 12, param 2 = 28 B).
     // LibTorch's route: grads to fp32, ATen's fused AdamW on the masters, masters copied back.
    auto p1 = make_params(cfg, shapes);
    std::vector<at::Tensor> half1;
    for (const auto& p : p1) {
      auto h = p.detach().to(at::kBFloat16).set_requires_grad(true);
      h.mutable_grad() = p.grad().to(at::kBFloat16);
      half1.push_back(h);
    }
    apex::optim::FusedAdam ours(
        half1, apex::optim::FusedAdamOptions(1e-3).weight_decay(0.01).master_weights(true));
    auto p3 = make_params(cfg, shapes);
    std::vector<at::Tensor> model, model_grads;
    for (const auto& p : p3) {
      model.push_back(p.detach().to(at::kBFloat16));
      model_grads.push_back(p.grad().to(at::kBFloat16));
    }
    AtenAdamW aten = aten_adamw(cfg, p3);
    const auto ms = interleaved_ms(cfg, {[&] { ours.step(); },
                                         [&] {
                                           at::_foreach_copy_(aten.grads, model_grads);
                                           aten();
                                           at::_foreach_copy_(model, aten.params);
                                         },
                                         [&] { stream(); }});
    add_rows("FusedAdam bf16+master", 28 * n, ms, {"ATen fused + copies"});
  }
  {  // SGD with momentum, fp32: 20 bytes per parameter (read p, g, buf; write p, buf).
    auto p1 = make_params(cfg, shapes);
    apex::optim::FusedSGD ours(p1, apex::optim::FusedSGDOptions(0.1).momentum(0.9));
    auto p2 = make_params(cfg, shapes);
    torch::optim::SGD peer(p2, torch::optim::SGDOptions(0.1).momentum(0.9));
    auto p3 = make_params(cfg, shapes);
    auto data = detached(p3);
    auto grads = grads_of(p3);
    auto bufs = zeros_like_all(p3);
    bool first = true;
    const auto ms = interleaved_ms(cfg, {[&] { ours.step(); }, [&] { peer.step(); },
                                         [&] {
                                           at::_fused_sgd_(data, grads, bufs, 0.0, 0.9, 0.1, 0.0,
                                                           false, false, first);
                                           first = false;
                                         },
                                         [&] { stream(); }});
    add_rows("FusedSGD", 20 * n, ms, {"torch::optim::SGD", "at::_fused_sgd_"});
  }
  {  // LAMB: grad norm (read g) + stage 1 (read p, g, m, v; write m, v) + stage 2 (read p, m, v;
     // write p) = 44 bytes per parameter.
    auto p1 = make_params(cfg, shapes);
    apex::optim::FusedLAMB ours(p1);
    auto p2 = make_params(cfg, shapes);
    OpsLamb peer{p2, zeros_like_all(p2), zeros_like_all(p2)};
    const auto ms = interleaved_ms(cfg, {[&] { ours.step(); }, [&] { peer(); }, [&] { stream(); }});
    add_rows("FusedLAMB", 44 * n, ms, {"LAMB in ATen ops"});
  }
}

}  // namespace

int run_optim(const Config& cfg) {
  std::vector<Row> rows;
  if (selected(cfg, "resnet50")) bench_model(cfg, "resnet50", resnet50(), rows);
  if (selected(cfg, "bert")) bench_model(cfg, "bert", bert_base(), rows);
  report(cfg, "optim", rows);
  return 0;
}

}  // namespace apex::bench
