// pytorch/examples' C++ MNIST program (cpp/mnist), ported to apex::amp as a user would: the model,
// the data loaders, the optimizer and the loops are the example's, including its own
// optimizer.zero_grad() and optimizer.step(); the lines marked "apex" are the whole change.
//
// Without --data it trains on built-in 28x28 "digits" (ten fixed random strokes patterns plus
// noise), so it needs no files; with --data DIR it reads the MNIST files in DIR as the original.
//
//   mnist_amp [--data DIR] [--epochs N] [--opt-level O0|O1|O2|O3] [--half bf16|fp16]
//             [--train-size N] [--min-accuracy PERCENT]
//
// Exits non-zero when the test accuracy ends below --min-accuracy (CI runs it so).
#include <apex/apex.h>

#include <torch/data.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/functional/loss.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/dropout.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

namespace {

constexpr int64_t kTrainBatchSize = 64;
constexpr int64_t kTestBatchSize = 1000;
constexpr int64_t kLogInterval = 10;

// The example's network, unchanged.
struct Net : torch::nn::Module {
  Net()
      : conv1(torch::nn::Conv2dOptions(1, 10, /*kernel_size=*/5)),
        conv2(torch::nn::Conv2dOptions(10, 20, /*kernel_size=*/5)),
        fc1(320, 50),
        fc2(50, 10) {
    register_module("conv1", conv1);
    register_module("conv2", conv2);
    register_module("conv2_drop", conv2_drop);
    register_module("fc1", fc1);
    register_module("fc2", fc2);
  }

  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(torch::max_pool2d(conv1->forward(x), 2));
    x = torch::relu(torch::max_pool2d(conv2_drop->forward(conv2->forward(x)), 2));
    x = x.view({-1, 320});
    x = torch::relu(fc1->forward(x));
    x = torch::dropout(x, /*p=*/0.5, /*train=*/is_training());
    x = fc2->forward(x);
    return torch::log_softmax(x, /*dim=*/1);
  }

  torch::nn::Conv2d conv1;
  torch::nn::Conv2d conv2;
  torch::nn::Dropout2d conv2_drop;
  torch::nn::Linear fc1;
  torch::nn::Linear fc2;
};

// Built-in data in MNIST's shape: class c is template c (a few random strokes) plus noise,
// normalised as the example normalises MNIST.
class Digits : public torch::data::datasets::Dataset<Digits> {
 public:
  Digits(int64_t n, uint64_t seed) {
    auto tgen = at::detail::createCPUGenerator(2024);
    auto templates = at::zeros({10, 1, 28, 28});
    for (int64_t c = 0; c < 10; ++c) {
      for (int stroke = 0; stroke < 3; ++stroke) {
        const auto r = at::randint(4, 24, {4}, tgen, at::TensorOptions().dtype(at::kLong));
        const auto* v = r.const_data_ptr<int64_t>();
        const bool across = (c + stroke) % 2 == 0;
        for (int64_t k = std::min(v[0], v[1]); k <= std::max(v[0], v[1]); ++k) {
          if (across) {
            templates[c][0][v[2]][k] = 2.0f;
          } else {
            templates[c][0][k][v[3]] = 2.0f;
          }
        }
      }
    }
    auto gen = at::detail::createCPUGenerator(seed);
    targets_ = at::randint(10, {n}, gen, at::TensorOptions().dtype(at::kLong));
    images_ = templates.index_select(0, targets_) + at::randn({n, 1, 28, 28}, gen) * 0.3;
    images_ = (images_ - 0.1307) / 0.3081;
  }
  torch::data::Example<> get(size_t index) override {
    const auto i = static_cast<int64_t>(index);
    return {images_[i], targets_[i]};
  }
  torch::optional<size_t> size() const override { return static_cast<size_t>(targets_.size(0)); }

 private:
  at::Tensor images_, targets_;
};

template <typename DataLoader>
void train(size_t epoch, Net& model, torch::Device device, DataLoader& data_loader,
           torch::optim::Optimizer& optimizer, size_t dataset_size, apex::amp::Amp& amp) {
  model.train();
  size_t batch_idx = 0;
  for (auto& batch : data_loader) {
    auto data = batch.data.to(device), targets = batch.target.to(device);
    optimizer.zero_grad();
    auto output = amp.forward(model, data);  // apex (was: model.forward(data))
    auto loss = torch::nll_loss(output, targets);
    AT_ASSERT(!std::isnan(loss.template item<float>()));
    amp.scale_loss(loss).backward();  // apex (was: loss.backward())
    optimizer.step();

    if (batch_idx++ % kLogInterval == 0) {
      std::printf("\rTrain Epoch: %zu [%5zu/%5zu] Loss: %.4f", epoch,
                  batch_idx * batch.data.size(0), dataset_size, loss.template item<float>());
    }
  }
}

template <typename DataLoader>
double test(Net& model, torch::Device device, DataLoader& data_loader, size_t dataset_size,
            apex::amp::Amp& amp) {
  torch::NoGradGuard no_grad;
  model.eval();
  double test_loss = 0;
  int32_t correct = 0;
  for (const auto& batch : data_loader) {
    auto data = batch.data.to(device), targets = batch.target.to(device);
    auto output = amp.forward(model, data);  // apex (was: model.forward(data))
    test_loss += torch::nll_loss(output, targets, /*weight=*/{}, torch::Reduction::Sum)
                     .template item<float>();
    auto pred = output.argmax(1);
    correct += pred.eq(targets).sum().template item<int64_t>();
  }
  test_loss /= static_cast<double>(dataset_size);
  const double accuracy = 100.0 * correct / static_cast<double>(dataset_size);
  std::printf("\nTest set: Average loss: %.4f | Accuracy: %.1f %%\n", test_loss, accuracy);
  return accuracy;
}

template <typename Dataset>
double run(Dataset train_set, Dataset test_set, Net& model, torch::Device device,
           torch::optim::Optimizer& optimizer, apex::amp::Amp& amp, size_t epochs) {
  auto train_dataset = train_set.map(torch::data::transforms::Stack<>());
  const size_t train_dataset_size = train_dataset.size().value();
  auto train_loader = torch::data::make_data_loader<torch::data::samplers::SequentialSampler>(
      std::move(train_dataset), kTrainBatchSize);
  auto test_dataset = test_set.map(torch::data::transforms::Stack<>());
  const size_t test_dataset_size = test_dataset.size().value();
  auto test_loader = torch::data::make_data_loader(std::move(test_dataset), kTestBatchSize);
  double accuracy = 0;
  for (size_t epoch = 1; epoch <= epochs; ++epoch) {
    train(epoch, model, device, *train_loader, optimizer, train_dataset_size, amp);
    accuracy = test(model, device, *test_loader, test_dataset_size, amp);
  }
  return accuracy;
}

}  // namespace

int main(int argc, char** argv) try {
  std::string data_root;
  size_t epochs = 2;
  int64_t train_size = 6000;
  double min_accuracy = 0;
  apex::amp::Options options(apex::amp::OptLevel::O2);
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    const std::string value = argv[i + 1];
    if (flag == "--data") {
      data_root = value;
    } else if (flag == "--epochs") {
      epochs = std::stoul(value);
    } else if (flag == "--train-size") {
      train_size = std::stol(value);
    } else if (flag == "--opt-level") {
      options.opt_level(apex::amp::parse_opt_level(value));
    } else if (flag == "--half") {
      options.half_dtype(value == "fp16" ? at::kHalf : at::kBFloat16);
    } else if (flag == "--min-accuracy") {
      min_accuracy = std::stod(value);
    } else {
      std::fprintf(stderr, "mnist_amp: unknown option %s\n", flag.c_str());
      return 2;
    }
  }
  torch::manual_seed(1);
  const torch::Device device(torch::kCPU);

  Net model;
  model.to(device);
  torch::optim::SGD optimizer(model.parameters(), torch::optim::SGDOptions(0.01).momentum(0.5));
  auto amp = apex::amp::initialize(model, optimizer, options);  // apex

  double accuracy = 0;
  if (data_root.empty()) {
    accuracy = run(Digits(train_size, 1), Digits(1000, 2), model, device, optimizer, amp, epochs);
  } else {
    using torch::data::datasets::MNIST;
    accuracy = run(MNIST(data_root), MNIST(data_root, MNIST::Mode::kTest), model, device, optimizer,
                   amp, epochs);
  }
  std::printf("opt level %s: test accuracy %.1f %%, loss scale %g, skipped steps %lld\n",
              apex::amp::to_string(amp.properties().opt_level).c_str(), accuracy, amp.loss_scale(),
              static_cast<long long>(amp.skipped_steps()));
  if (accuracy < min_accuracy) {
    std::fprintf(stderr, "mnist_amp: test accuracy %.1f %% is below --min-accuracy %.1f\n",
                 accuracy, min_accuracy);
    return 1;
  }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "mnist_amp: %s\n", e.what());
  return 1;
}
