// CUDA norm kernels against the CPU kernels (which the unit tests check against float64 and
// at::layer_norm). Skipped with a message where there is no GPU.
#include <apex/normalization.h>
#include <torch/cuda.h>

#include "../common/test_util.h"

namespace apex::test {
namespace {

using apex::normalization::fused_layer_norm;
using apex::normalization::fused_rms_norm;

struct NormRun {
  at::Tensor y, dx, dw, db;
};

NormRun run_norm(const at::Tensor& x0, const at::Tensor& w0, const at::Tensor& b0,
                 const at::Tensor& dy0, at::Device device, bool rms, bool mem) {
  auto x = x0.to(device).set_requires_grad(true);
  auto w = w0.defined() ? w0.to(device).set_requires_grad(true) : at::Tensor();
  auto b = b0.defined() ? b0.to(device).set_requires_grad(true) : at::Tensor();
  const int64_t cols = x0.size(-1);
  auto y =
      rms ? fused_rms_norm(x, {cols}, w, 1e-5, mem) : fused_layer_norm(x, {cols}, w, b, 1e-5, mem);
  y.backward(dy0.to(device));
  return {y.detach().cpu(), x.grad().cpu(), w.defined() ? w.grad().cpu() : at::Tensor(),
          b.defined() ? b.grad().cpu() : at::Tensor()};
}

TEST(NormCuda, MatchesCpu) {
  APEX_REQUIRE_CUDA();
  auto gen = at::detail::createCPUGenerator(21);
  for (auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (int64_t cols : {1, 7, 64, 1000, 1024, 4096, 12288}) {
      for (int64_t rows : {1, 3, 300}) {
        for (bool rms : {false, true}) {
          for (bool affine : {true, false}) {
            for (bool mem : {false, true}) {
              auto x = (at::randn({rows, cols}, gen) * 2 + 0.5).to(dtype);
              auto w = affine ? (at::rand({cols}, gen) + 0.5).to(dtype) : at::Tensor();
              auto b = affine && !rms ? (at::randn({cols}, gen) * 0.1).to(dtype) : at::Tensor();
              auto dy = at::randn({rows, cols}, gen).to(dtype);
              const NormRun c = run_norm(x, w, b, dy, at::kCPU, rms, mem);
              const NormRun g = run_norm(x, w, b, dy, at::kCUDA, rms, mem);
              const Tolerance tol = tolerance_for(dtype);
              const std::string what = c10::toString(dtype) + std::string(" ") +
                                       std::to_string(rows) + "x" + std::to_string(cols) +
                                       (rms ? " rms" : " ln") + (affine ? " affine" : "") +
                                       (mem ? " memory_efficient" : "");
              EXPECT_TRUE(all_close(g.y, c.y, tol)) << what << " y";
              EXPECT_TRUE(all_close(g.dx, c.dx, {tol.rtol, std::max(tol.atol, 4 * tol.rtol)}))
                  << what << " dx";
              const Tolerance sum_tol{tol.rtol, tol.rtol * std::sqrt(double(rows)) * 4};
              if (g.dw.defined()) {
                EXPECT_TRUE(all_close(g.dw, c.dw, sum_tol)) << what << " dw";
              }
              if (g.db.defined()) {
                EXPECT_TRUE(all_close(g.db, c.db, sum_tol)) << what << " db";
              }
            }
          }
        }
      }
    }
  }
}

// memory_efficient with zero and tiny weights: the CUDA kernels clamp the divisor as the CPU ones
// do (apex's clamp by magnitude), so both give the same finite gradients.
TEST(NormCuda, MemoryEfficientClampsSmallWeights) {
  APEX_REQUIRE_CUDA();
  auto gen = at::detail::createCPUGenerator(29);
  for (bool rms : {false, true}) {
    auto x = at::randn({9, 1000}, gen);
    auto w = at::rand({1000}, gen) + 0.5;
    w[3] = 0.0;
    w[10] = 1e-7;
    w[20] = -1e-7;
    auto b = rms ? at::Tensor() : at::randn({1000}, gen);
    auto dy = at::randn({9, 1000}, gen);
    const NormRun c = run_norm(x, w, b, dy, at::kCPU, rms, true);
    const NormRun g = run_norm(x, w, b, dy, at::kCUDA, rms, true);
    ASSERT_TRUE(c.dx.isfinite().all().item<bool>());
    const Tolerance tol = tolerance_for(at::kFloat);
    EXPECT_TRUE(all_close(g.dx, c.dx, {tol.rtol, std::max(tol.atol, 4 * tol.rtol)})) << rms;
    EXPECT_TRUE(all_close(g.dw, c.dw, {tol.rtol, tol.rtol * 12})) << rms;
  }
}

// The mixed variants on CUDA: fp32 output from bf16 input, gradients in each tensor's dtype.
TEST(NormCuda, MixedAndDeterministic) {
  APEX_REQUIRE_CUDA();
  auto x = at::randn({4096, 1024}, at::kCUDA).to(at::kBFloat16).set_requires_grad(true);
  auto w = (at::rand({1024}, at::kCUDA) + 0.5).set_requires_grad(true);
  auto b = at::randn({1024}, at::kCUDA).set_requires_grad(true);
  auto y = apex::normalization::mixed_fused_layer_norm(x, {1024}, w, b);
  ASSERT_EQ(y.scalar_type(), at::kFloat);
  const auto dy = at::randn_like(y);
  y.backward(dy);
  const auto dw1 = w.grad().clone();
  w.mutable_grad() = at::Tensor();
  apex::normalization::mixed_fused_layer_norm(x, {1024}, w, b).backward(dy);
  // No atomics: the weight gradient is the same bits on every run.
  EXPECT_TRUE(at::equal(dw1, w.grad()));
  EXPECT_EQ(x.grad().scalar_type(), at::kBFloat16);
}

}  // namespace
}  // namespace apex::test
