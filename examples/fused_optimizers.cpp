// apex::optim in a training loop: FusedAdam with a GradScaler (in-kernel unscale, device-side
// skip) and gradient clipping on the multi-tensor kernels, next to the same loop with LibTorch's
// AdamW. Built-in synthetic data, no files needed.
//
//   fused_optimizers [--steps N]
#include <apex/apex.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>

namespace {

constexpr int64_t kDim = 64, kClasses = 10, kBatch = 256;

struct Result {
  double loss = 0, ms_per_step = 0, accuracy = 0;
};

Result train(bool fused, int steps) {
  torch::manual_seed(0);  // same weights and data for both runs
  torch::nn::Sequential model(torch::nn::Linear(kDim, 1024), torch::nn::ReLU(),
                              torch::nn::Linear(1024, 1024), torch::nn::ReLU(),
                              torch::nn::Linear(1024, kClasses));
  const auto centers = torch::randn({kClasses, kDim}) * 0.25;
  std::unique_ptr<torch::optim::Optimizer> opt;
  if (fused) {
    opt = std::make_unique<apex::optim::FusedAdam>(
        model->parameters(), apex::optim::FusedAdamOptions(1e-3).weight_decay(0.01));
  } else {
    opt = std::make_unique<torch::optim::AdamW>(
        model->parameters(), torch::optim::AdamWOptions(1e-3).weight_decay(0.01));
  }
  apex::amp::GradScaler scaler(apex::amp::GradScalerOptions().device(c10::kCPU));
  auto batch = [&](int64_t step, at::Tensor& y) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(step) + 1);
    y = at::randint(kClasses, {kBatch}, gen, at::TensorOptions().dtype(at::kLong));
    return centers.index_select(0, y) + at::randn({kBatch, kDim}, gen);
  };
  Result r;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    at::Tensor y;
    const at::Tensor x = batch(step, y);
    opt->zero_grad();
    const auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    scaler.scale(loss).backward();
    scaler.unscale_(*opt);  // clip the true gradients
    if (fused) {
      apex::optim::clip_grad_norm_(model->parameters(), 1.0);
    } else {
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
    }
    scaler.step(*opt);  // FusedAdam: the kernel skips an overflowing step on the device
    scaler.update();
    r.loss = loss.item<double>();
  }
  r.ms_per_step =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      steps;
  at::Tensor y;
  const at::Tensor x = batch(1 << 20, y);
  const at::NoGradGuard no_grad;
  r.accuracy = model->forward(x).argmax(1).eq(y).to(at::kDouble).mean().item<double>();
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 200;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--steps") == 0 && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else {
      std::fprintf(stderr, "usage: fused_optimizers [--steps N]\n");
      return 2;
    }
  }
  std::printf("%-26s %12s %10s %10s\n", "optimizer", "final loss", "ms/step", "accuracy");
  for (bool fused : {false, true}) {
    const Result r = train(fused, steps);
    std::printf("%-26s %12.4f %10.2f %9.1f%%\n",
                fused ? "apex::optim::FusedAdam" : "torch::optim::AdamW", r.loss, r.ms_per_step,
                100 * r.accuracy);
  }
  std::printf("CPU kernels: %s\n", apex::optim::cpu_kernel_isa());
  return 0;
}
