// CUDA kernels against the CPU kernels (which the unit tests check against LibTorch and float64
// references). Skipped with a message where there is no GPU.
#include <apex/optim.h>

#include <limits>

#include "optim_test_util.h"

namespace apex::test {
namespace {

using namespace apex::optim;

std::vector<at::Tensor> to_cuda(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) {
    auto c = t.detach().to(at::kCUDA).set_requires_grad(t.requires_grad());
    if (t.grad().defined()) c.mutable_grad() = t.grad().to(at::kCUDA);
    out.push_back(c);
  }
  return out;
}

std::vector<at::Tensor> to_cpu(const std::vector<at::Tensor>& v) {
  std::vector<at::Tensor> out;
  for (const auto& t : v) out.push_back(t.detach().cpu());
  return out;
}

TEST(OptimCuda, PrimitivesMatchCpu) {
  APEX_REQUIRE_CUDA();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    auto x = make_params(many_sizes(), dtype, 3);
    auto y = make_params(many_sizes(), dtype, 4);
    auto xc = to_cuda(x);
    auto yc = to_cuda(y);
    auto [t_cpu, p_cpu] = multi_tensor_l2norm(x, true);
    auto [t_gpu, p_gpu] = multi_tensor_l2norm(xc, true);
    EXPECT_TRUE(all_close(t_gpu.cpu(), t_cpu, {1e-5, 1e-6})) << dtype;
    EXPECT_TRUE(all_close(p_gpu.cpu(), p_cpu, {1e-5, 1e-6})) << dtype;
    auto [m_cpu, mp_cpu] = multi_tensor_max_norm(x, true);
    auto [m_gpu, mp_gpu] = multi_tensor_max_norm(xc, true);
    EXPECT_TRUE(at::equal(mp_gpu.cpu(), mp_cpu)) << dtype;
    auto f_cpu = at::zeros({1});
    auto f_gpu = at::zeros({1}, at::kCUDA);
    auto out_cpu = copies(x, at::kFloat);
    auto out_gpu = to_cuda(out_cpu);
    multi_tensor_axpby(x, y, out_cpu, 2.0, -0.5, f_cpu);
    multi_tensor_axpby(xc, yc, out_gpu, 2.0, -0.5, f_gpu);
    EXPECT_TRUE(lists_close(to_cpu(out_gpu), out_cpu, tolerance_for(at::kFloat))) << dtype;
    EXPECT_EQ(f_gpu.item<float>(), 0.0f);
    xc.back().detach()[xc.back().numel() - 1].fill_(std::numeric_limits<float>::quiet_NaN());
    multi_tensor_scale(xc, xc, 0.5, f_gpu);
    EXPECT_EQ(f_gpu.item<float>(), 1.0f) << dtype;
  }
}

template <class Opt, class Options>
void compare_optimizer(const Options& options, at::ScalarType dtype, bool with_scaling) {
  auto cpu = make_params(edge_sizes(), dtype, 5);
  auto gpu = to_cuda(cpu);
  Opt oc(cpu, options);
  Opt og(gpu, options);
  // fp16/bf16 parameters without masters: one step, as a last-bit fp32 difference (the GPU fuses
  // multiply-adds) can flip a rounding, and flips add up over steps.
  const int steps = dtype == at::kFloat || options.master_weights() ? 5 : 1;
  for (int step = 0; step < steps; ++step) {
    set_grads(cpu, step, 2, with_scaling ? 64.0 : 1.0);
    for (size_t i = 0; i < cpu.size(); ++i) gpu[i].mutable_grad() = cpu[i].grad().to(at::kCUDA);
    if (with_scaling) {
      oc.step(GradScaling{at::full({1}, 1.0 / 64), at::zeros({1})});
      og.step(GradScaling{at::full({1}, 1.0 / 64, at::kCUDA), at::zeros({1}, at::kCUDA)});
    } else {
      oc.step();
      og.step();
    }
  }
  const Tolerance tol = dtype == at::kFloat ? Tolerance{1e-5, 1e-6} : tolerance_for(dtype);
  EXPECT_TRUE(lists_close(to_cpu(gpu), cpu, tol)) << dtype << " scaling " << with_scaling;
}

TEST(OptimCuda, OptimizersMatchCpu) {
  APEX_REQUIRE_CUDA();
  for (auto dtype : {at::kFloat, at::kHalf, at::kBFloat16}) {
    for (bool scaling : {false, true}) {
      compare_optimizer<FusedAdam>(FusedAdamOptions(1e-3).weight_decay(0.01), dtype, scaling);
      compare_optimizer<FusedAdam>(
          FusedAdamOptions(1e-3).weight_decay(0.01).master_weights(true).capturable(true), dtype,
          scaling);
      compare_optimizer<FusedSGD>(FusedSGDOptions(0.1).momentum(0.9).weight_decay(1e-3), dtype,
                                  scaling);
      compare_optimizer<FusedAdagrad>(FusedAdagradOptions(0.05).weight_decay(1e-3), dtype, scaling);
      compare_optimizer<FusedLAMB>(FusedLAMBOptions(1e-3), dtype, scaling);
      compare_optimizer<FusedNovoGrad>(FusedNovoGradOptions(1e-3).weight_decay(1e-3), dtype,
                                       scaling);
    }
  }
}

TEST(OptimCuda, OverflowSkipsOnTheDevice) {
  APEX_REQUIRE_CUDA();
  auto p = to_cuda(make_params(edge_sizes(), at::kFloat, 9));
  FusedAdam opt(p, FusedAdamOptions(1e-3).capturable(true));
  set_grads(p, 0, 1);
  for (auto& t : p) t.mutable_grad() = t.grad().to(at::kCUDA);
  opt.step();
  const auto before = snapshot(p);
  opt.step(GradScaling{at::ones({1}, at::kCUDA), at::ones({1}, at::kCUDA)});
  EXPECT_TRUE(lists_equal(p, before));
  EXPECT_EQ(opt.step_count(0), 1);
}

// 64-bit indexing: a tensor of more than 2^31 elements (fp16, ~26 GB with its Adam state) has
// its last elements updated exactly as a small tensor holding the same values would be.
TEST(OptimCuda, TensorsBeyondTwoToThe31Elements) {
  APEX_REQUIRE_CUDA();
  const int64_t n = (int64_t{1} << 31) + 4099;
  auto big = at::full({n}, 1.0, at::TensorOptions().dtype(at::kHalf).device(at::kCUDA))
                 .set_requires_grad(true);
  big.mutable_grad() = at::full({n}, 0.5, big.options());
  big.grad().narrow(0, n - 7, 7).fill_(-2.0);
  auto small = big.detach().narrow(0, n - 16, 16).clone().set_requires_grad(true);
  small.mutable_grad() = big.grad().narrow(0, n - 16, 16).clone();
  FusedAdam ob(std::vector<at::Tensor>{big}, FusedAdamOptions(1e-2));
  FusedAdam os(std::vector<at::Tensor>{small}, FusedAdamOptions(1e-2));
  ob.step();
  os.step();
  EXPECT_TRUE(at::equal(big.detach().narrow(0, n - 16, 16).cpu(), small.detach().cpu()));
  EXPECT_TRUE(at::equal(big.detach().narrow(0, 0, 16).cpu(), small.detach()[0].expand({16}).cpu()));
}

}  // namespace
}  // namespace apex::test
