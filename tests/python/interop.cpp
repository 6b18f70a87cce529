// Driver for tests/python/test_interop.py: writes and reads state files with apex-cpp so that
// Python's torch can check them. Usage:
//   apex_interop gradscaler-run OUT.pt      run the fixed GradScaler script, save the scaler state
//   apex_interop gradscaler-read IN.pt      load a Python-written scaler state, print it
//   apex_interop amp-write OUT_AMP.pt OUT_PARAMS.pt   O2 bf16, 3 steps; amp state + model params
//   apex_interop amp-train DIR FROM TO OUT.pt [save|resume]
//       O2 fp16 MLP with BatchNorm, steps [FROM, TO) (overflow injected at step 2); `resume` loads
//       model/optimizer/amp from DIR first, `save` writes them there after; OUT.pt gets every
//       parameter, buffer and master plus the loss scale, for a bit-exact comparison in Python.
//   apex_interop optim-run adam|sgd|adagrad IN.pt OUT.pt
//       IN.pt = {"params": [...], "grads": [[...] per step], "state": optimizer state in
//       torch.optim's layout (optional)}; runs the fused optimizer (same options as the Python
//       side) over the steps and writes {"params": [...], "state": python_state_dict()}.
#include <apex/apex.h>

#include <torch/nn/functional/loss.h>
#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/batchnorm.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/adam.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <cstdio>
#include <iostream>
#include <string>

namespace {

// The script test_interop.py replays in Python: w = [1, 2, 3], loss = sum(w * x) with fixed x,
// SGD(lr=0.1), GradScaler(init_scale=1024, growth_interval=2); an inf is written into the
// gradient at steps 1 and 4.
int gradscaler_run(const std::string& out) {
  apex::amp::GradScaler scaler(
      apex::amp::GradScalerOptions().device(c10::kCPU).init_scale(1024).growth_interval(2));
  auto w = at::tensor({1.0f, 2.0f, 3.0f}).requires_grad_(true);
  torch::optim::SGD opt({w}, torch::optim::SGDOptions(0.1));
  const auto x = at::tensor({0.5f, -1.0f, 0.25f});
  for (int step = 0; step < 7; ++step) {
    opt.zero_grad();
    scaler.scale((w * x).sum()).backward();
    if (step == 1 || step == 4) w.mutable_grad()[0] = std::numeric_limits<float>::infinity();
    scaler.step(opt);
    scaler.update();
  }
  scaler.save(out);
  std::cout << "w";
  for (int i = 0; i < 3; ++i) std::printf(" %.9g", w[i].item<double>());
  std::cout << "\n";
  return 0;
}

int gradscaler_read(const std::string& in) {
  apex::amp::GradScaler scaler(apex::amp::GradScalerOptions().device(c10::kCPU));
  scaler.load(in);
  const auto d = scaler.state_dict();
  std::printf(
      "scale %.17g growth_factor %.17g backoff_factor %.17g growth_interval %lld "
      "growth_tracker %lld\n",
      d.at("scale").toDouble(), d.at("growth_factor").toDouble(), d.at("backoff_factor").toDouble(),
      static_cast<long long>(d.at("growth_interval").toInt()),
      static_cast<long long>(d.at("_growth_tracker").toInt()));
  return 0;
}

int amp_write(const std::string& amp_out, const std::string& params_out) {
  torch::manual_seed(0);
  auto model = torch::nn::Linear(5, 3);
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(
      model, opt,
      apex::amp::Options(apex::amp::OptLevel::O2).half_dtype(at::kBFloat16).verbosity(0));
  for (int step = 0; step < 3; ++step) {
    amp.zero_grad();
    amp.scale_loss(amp.forward(model, at::randn({4, 5})).pow(2).mean()).backward();
    amp.step();
  }
  amp.save(amp_out);
  c10::List<at::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().clone());
  apex::save_pickle(params, params_out);
  return 0;
}

int amp_train(const std::string& dir, int from, int to, const std::string& out,
              const std::string& mode) {
  torch::manual_seed(mode == "resume" ? 123 : 0);  // a resumed run must not depend on its init
  torch::nn::Sequential model(torch::nn::Linear(8, 32), torch::nn::BatchNorm1d(32),
                              torch::nn::ReLU(), torch::nn::Linear(32, 3));
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-2));
  auto amp = apex::amp::initialize(model, opt,
                                   apex::amp::Options(apex::amp::OptLevel::O2)
                                       .growth_interval(3)
                                       .init_loss_scale(4096)
                                       .verbosity(0));
  if (mode == "resume") {
    torch::load(model, dir + "/model.pt");
    torch::load(opt, dir + "/optim.pt");
    amp.load(dir + "/amp.pt");
  }
  for (int step = from; step < to; ++step) {
    auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(step) + 7);
    const auto x = at::randn({16, 8}, gen);
    const auto y = at::randint(3, {16}, gen, at::TensorOptions().dtype(at::kLong));
    amp.zero_grad();
    {
      auto scaled = amp.scale_loss(torch::nn::functional::cross_entropy(amp.forward(model, x), y));
      scaled.backward();
      if (step == 2) {
        auto g = model->parameters().back().mutable_grad();
        g[0] = std::numeric_limits<float>::infinity();
      }
    }
    amp.step();
  }
  if (mode == "save") {
    torch::save(model, dir + "/model.pt");
    torch::save(opt, dir + "/optim.pt");
    amp.save(dir + "/amp.pt");
  }
  auto result = apex::make_state_dict();
  c10::impl::GenericList tensors(c10::AnyType::get());
  for (const auto& p : model->parameters()) tensors.push_back(p.detach().clone());
  for (const auto& b : model->buffers()) tensors.push_back(b.clone());
  for (const auto& m : amp.master_params()) tensors.push_back(m.detach().clone());
  result.insert("tensors", tensors);
  result.insert("loss_scale", amp.loss_scale());
  result.insert("skipped", amp.skipped_steps());
  apex::save_pickle(result, out);
  return 0;
}

std::unique_ptr<apex::optim::FusedOptimizer> make_optimizer(const std::string& kind,
                                                            std::vector<at::Tensor> params) {
  using namespace apex::optim;
  if (kind == "adam") {
    return std::make_unique<FusedAdam>(std::move(params),
                                       FusedAdamOptions(1e-2).weight_decay(0.01).adam_w_mode(true));
  }
  if (kind == "sgd") {
    return std::make_unique<FusedSGD>(
        std::move(params), FusedSGDOptions(0.1).momentum(0.9).weight_decay(1e-3).nesterov(true));
  }
  if (kind == "adagrad") {
    return std::make_unique<FusedAdagrad>(
        std::move(params),
        FusedAdagradOptions(0.1).lr_decay(0.01).weight_decay(1e-3).initial_accumulator_value(0.1));
  }
  throw std::invalid_argument("unknown optimizer kind " + kind);
}

int optim_run(const std::string& kind, const std::string& in, const std::string& out) {
  const auto input = apex::load_pickle(in).toGenericDict();
  std::vector<at::Tensor> params;
  for (const auto& t : input.at("params").toList()) {
    params.push_back(t.get().toTensor().clone().set_requires_grad(true));
  }
  auto opt = make_optimizer(kind, params);
  if (input.contains("state")) opt->load_python_state_dict(input.at("state").toGenericDict());
  for (const auto& step : input.at("grads").toList()) {
    const auto grads = step.get().toList();
    for (size_t i = 0; i < params.size(); ++i) {
      params[i].mutable_grad() = grads.get(i).toTensor();
    }
    opt->step();
  }
  c10::impl::GenericList final_params(c10::AnyType::get());
  for (const auto& p : params) final_params.push_back(p.detach());
  auto result = apex::make_state_dict();
  result.insert("params", final_params);
  result.insert("state", opt->python_state_dict());
  apex::save_pickle(result, out);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "gradscaler-run" && argc == 3) return gradscaler_run(argv[2]);
    if (mode == "gradscaler-read" && argc == 3) return gradscaler_read(argv[2]);
    if (mode == "amp-write" && argc == 4) return amp_write(argv[2], argv[3]);
    if (mode == "amp-train" && (argc == 6 || argc == 7)) {
      return amp_train(argv[2], std::stoi(argv[3]), std::stoi(argv[4]), argv[5],
                       argc == 7 ? argv[6] : "");
    }
    if (mode == "optim-run" && argc == 5) return optim_run(argv[2], argv[3], argv[4]);
    std::cerr
        << "usage: apex_interop gradscaler-run OUT | gradscaler-read IN | amp-write AMP PARAMS | "
           "amp-train DIR FROM TO OUT [save|resume] | optim-run KIND IN OUT\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "apex_interop: " << e.what() << "\n";
    return 1;
  }
}
