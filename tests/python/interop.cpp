// Driver for tests/python/test_interop.py: writes and reads state files with apex-cpp so that
// Python's torch can check them. Usage:
//   apex_interop gradscaler-run OUT.pt      run the fixed GradScaler script, save the scaler state
//   apex_interop gradscaler-read IN.pt      load a Python-written scaler state, print it
//   apex_interop amp-write OUT_AMP.pt OUT_PARAMS.pt   O2 bf16, 3 steps; amp state + model params
#include <apex/apex.h>

#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>

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

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::string mode = argc > 1 ? argv[1] : "";
    if (mode == "gradscaler-run" && argc == 3) return gradscaler_run(argv[2]);
    if (mode == "gradscaler-read" && argc == 3) return gradscaler_read(argv[2]);
    if (mode == "amp-write" && argc == 4) return amp_write(argv[2], argv[3]);
    std::cerr
        << "usage: apex_interop gradscaler-run OUT | gradscaler-read IN | amp-write AMP PARAMS\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "apex_interop: " << e.what() << "\n";
    return 1;
  }
}
