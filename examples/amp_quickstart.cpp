// apex-cpp quick start: a plain fp32 training loop, then the same loop with the three-line apex
// change, at every opt level. Built-in synthetic data (learnable: which of 10 fixed centres a
// point lies nearest to), so it needs no files.
//
//   amp_quickstart [--steps N] [--half bf16|fp16]
#include <apex/apex.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>

namespace {

constexpr int64_t kDim = 64, kClasses = 10, kBatch = 256;

struct Data {
  at::Tensor centers;
  at::Tensor batch_x(int64_t step, at::Tensor& y) const {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(step) + 1);
    y = at::randint(kClasses, {kBatch}, gen, at::TensorOptions().dtype(at::kLong));
    return centers.index_select(0, y) + at::randn({kBatch, kDim}, gen);
  }
};

torch::nn::Sequential make_model() {
  torch::manual_seed(0);  // same initial weights at every level
  return torch::nn::Sequential(torch::nn::Linear(kDim, 512), torch::nn::ReLU(),
                               torch::nn::Linear(512, 512), torch::nn::ReLU(),
                               torch::nn::Linear(512, kClasses));
}

struct Result {
  double loss = 0, ms_per_step = 0, accuracy = 0;
  int64_t skipped = 0;
  double scale = 1;
};

// level == nullopt: the plain fp32 loop, no apex at all.
Result train(const Data& data, std::optional<apex::amp::OptLevel> level, at::ScalarType half,
             int steps) {
  auto model = make_model();
  torch::optim::Adam optimizer(model->parameters(), torch::optim::AdamOptions(1e-3));
  std::optional<apex::amp::Amp> amp;
  if (level) {
    // apex change 1 of 3: initialize.
    amp.emplace(apex::amp::initialize(model, optimizer,
                                      apex::amp::Options(*level).half_dtype(half).verbosity(0)));
  }
  namespace F = torch::nn::functional;
  Result r;
  const auto start = std::chrono::steady_clock::now();
  for (int step = 0; step < steps; ++step) {
    at::Tensor y;
    const at::Tensor x = data.batch_x(step, y);
    if (!amp) {
      optimizer.zero_grad();
      auto loss = F::cross_entropy(model->forward(x), y);
      loss.backward();
      optimizer.step();
      r.loss = loss.item<double>();
    } else {
      amp->zero_grad();
      // apex change 2 of 3: forward through the handle (autocast or input casts).
      auto loss = F::cross_entropy(amp->forward(model, x), y);
      // apex change 3 of 3: backward through the scaled loss; step skips on overflow.
      amp->scale_loss(loss).backward();
      amp->step();
      r.loss = loss.item<double>();
    }
  }
  r.ms_per_step =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count() /
      steps;
  at::Tensor y;
  const at::Tensor x = data.batch_x(1'000'000, y);
  at::NoGradGuard no_grad;
  const auto logits = amp ? amp->forward(model, x) : model->forward(x);
  r.accuracy = logits.argmax(1).eq(y).to(at::kDouble).mean().item<double>();
  if (amp) {
    r.skipped = amp->skipped_steps();
    r.scale = amp->loss_scale();
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int steps = 200;
  at::ScalarType half = at::kBFloat16;  // the CPU's fast half type
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--steps") && i + 1 < argc) {
      steps = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--half") && i + 1 < argc) {
      const std::string h = argv[++i];
      if (h != "bf16" && h != "fp16") {
        std::fprintf(stderr, "amp_quickstart: --half must be bf16 or fp16, got '%s'\n", h.c_str());
        return 2;
      }
      half = h == "bf16" ? at::kBFloat16 : at::kHalf;
    } else {
      std::fprintf(stderr, "usage: amp_quickstart [--steps N] [--half bf16|fp16]\n");
      return 2;
    }
  }
  if (steps < 1) {
    std::fprintf(stderr, "amp_quickstart: --steps must be >= 1, got %d\n", steps);
    return 2;
  }
  try {
    auto gen = at::detail::createCPUGenerator(1234);
    const Data data{at::randn({kClasses, kDim}, gen) * 0.6};
    std::printf("apex-cpp amp quick start: MLP %lldx512x512x%lld, batch %lld, %d steps, half=%s\n",
                static_cast<long long>(kDim), static_cast<long long>(kClasses),
                static_cast<long long>(kBatch), steps, half == at::kHalf ? "fp16" : "bf16");
    std::printf("%-8s %12s %12s %10s %10s %10s\n", "run", "final loss", "ms/step", "accuracy",
                "skipped", "loss scale");
    const auto print = [](const char* name, const Result& r) {
      std::printf("%-8s %12.4f %12.2f %9.1f%% %10lld %10g\n", name, r.loss, r.ms_per_step,
                  100.0 * r.accuracy, static_cast<long long>(r.skipped), r.scale);
      std::fflush(stdout);
    };
    print("fp32", train(data, std::nullopt, half, steps));
    using apex::amp::OptLevel;
    for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
      print(apex::amp::to_string(level).c_str(), train(data, level, half, steps));
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "amp_quickstart: %s\n", e.what());
    return 1;
  }
  return 0;
}
