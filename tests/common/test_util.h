#pragma once

// Shared test helpers: the tolerance table (docs/design.md, "Tolerances"), small models and
// learnable data.

#include <gtest/gtest.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim.h>

#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <string>

/// At the top of a CUDA test: skips it, saying why, where torch sees no GPU.
#define APEX_REQUIRE_CUDA()                                                  \
  if (!torch::cuda::is_available()) {                                        \
    GTEST_SKIP() << "no CUDA device (torch::cuda::is_available() is false)"; \
  }

namespace apex::test {

struct Tolerance {
  double rtol;
  double atol;
};

/// One table for every test (relative to a float64 reference, with an absolute floor).
inline Tolerance tolerance_for(c10::ScalarType t) {
  switch (t) {
    case c10::kBFloat16:
      return {1.6e-2, 1e-3};
    case c10::kHalf:
      return {1e-3, 1e-4};
    default:
      return {1e-5, 1e-6};
  }
}

/// Element-wise |actual - expected| <= atol + rtol * |expected|, compared in float64.
inline ::testing::AssertionResult all_close(const at::Tensor& actual, const at::Tensor& expected,
                                            Tolerance tol) {
  if (actual.sizes() != expected.sizes()) {
    return ::testing::AssertionFailure()
           << "shape " << actual.sizes() << " vs " << expected.sizes();
  }
  auto a = actual.detach().to(at::kDouble).cpu();
  auto e = expected.detach().to(at::kDouble).cpu();
  auto bound = tol.atol + tol.rtol * e.abs();
  auto err = (a - e).abs();
  auto bad = err.gt(bound);
  if (bad.any().item<bool>()) {
    auto idx = bad.flatten().nonzero()[0].item<int64_t>();
    return ::testing::AssertionFailure()
           << bad.sum().item<int64_t>() << " element(s) out of tolerance; first at flat index "
           << idx << ": " << a.flatten()[idx].item<double>() << " vs "
           << e.flatten()[idx].item<double>() << " (rtol " << tol.rtol << ", atol " << tol.atol
           << ")";
  }
  return ::testing::AssertionSuccess();
}

/// Whether the bf16 tensor `actual` holds, bit for bit, the fp32 tensor `exact` rounded as
/// c10::BFloat16 rounds one value (to nearest even; every NaN to 0x7fc0; denormals kept).
/// near_tie > 0 forgives a result one bf16 unit off where `exact` lies within near_tie fp32 units
/// of a rounding tie: two fp32 computations of the same formula may differ in their last bit (a
/// compiler fuses a multiply and an add into one FMA in one loop and not in another; the
/// sanitizer build does so differently), and only there can that change the rounding.
inline ::testing::AssertionResult bf16_rounding_of(const at::Tensor& actual,
                                                   const at::Tensor& exact, int near_tie = 0) {
  if (actual.scalar_type() != c10::kBFloat16 || exact.scalar_type() != c10::kFloat ||
      actual.sizes() != exact.sizes()) {
    return ::testing::AssertionFailure()
           << "expected a bf16 and an fp32 tensor of one shape, got " << actual.toString()
           << actual.sizes() << " and " << exact.toString() << exact.sizes();
  }
  const auto a = actual.detach().cpu().contiguous();
  const auto e = exact.detach().cpu().contiguous();
  const auto* got = a.data_ptr<c10::BFloat16>();
  const float* want = e.data_ptr<float>();
  int64_t bad = 0;
  int64_t first = -1;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const uint16_t expected = c10::BFloat16(want[i]).x;
    if (got[i].x == expected) continue;
    uint32_t bits = 0;
    std::memcpy(&bits, want + i, 4);
    const int off_tie = static_cast<int>(bits & 0xffffu) - 0x8000;
    const bool one_unit = std::isfinite(want[i]) && (got[i].x ^ expected) < 0x8000 &&
                          (got[i].x + 1 == expected || expected + 1 == got[i].x);
    if (near_tie > 0 && one_unit && std::abs(off_tie) <= near_tie) continue;
    if (bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  uint32_t bits = 0;
  std::memcpy(&bits, want + first, 4);
  std::ostringstream hex;
  hex << std::hex << "0x" << got[first].x << " for fp32 0x" << bits << ", expected 0x"
      << c10::BFloat16(want[first]).x;
  return ::testing::AssertionFailure()
         << bad << " element(s) differ; first at flat index " << first << ": " << hex.str();
}

/// A fresh temporary folder per test (named after the process and the test), removed afterwards.
class TempDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = std::filesystem::temp_directory_path() /
           ("apex_test_" + std::to_string(::getpid()) + "_" + info->name());
    std::filesystem::remove_all(dir_);
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string path(const std::string& name) const { return (dir_ / name).string(); }
  std::filesystem::path dir_;
};

/// Detached clones of `ts`.
inline std::vector<at::Tensor> snapshot(const std::vector<at::Tensor>& ts) {
  std::vector<at::Tensor> out;
  for (const auto& t : ts) out.push_back(t.detach().clone());
  return out;
}

/// Asserts that `fn` throws a c10::Error whose message contains `fragment`.
template <typename Fn>
::testing::AssertionResult throws_with(Fn&& fn, const std::string& fragment) {
  try {
    fn();
  } catch (const c10::Error& e) {
    const std::string msg = e.what_without_backtrace();
    if (msg.find(fragment) != std::string::npos) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure()
           << "message \"" << msg << "\" lacks \"" << fragment << "\"";
  }
  return ::testing::AssertionFailure() << "no exception; expected one with \"" << fragment << "\"";
}

/// A small MLP classifier.
struct MlpImpl : torch::nn::Module {
  MlpImpl(int64_t in, int64_t hidden, int64_t classes)
      : fc1(register_module("fc1", torch::nn::Linear(in, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, hidden))),
        fc3(register_module("fc3", torch::nn::Linear(hidden, classes))) {}
  at::Tensor forward(const at::Tensor& x) {
    return fc3->forward(torch::relu(fc2->forward(torch::relu(fc1->forward(x)))));
  }
  torch::nn::Linear fc1, fc2, fc3;
};
TORCH_MODULE(Mlp);

/// A small CNN with BatchNorm (so keep_batchnorm_fp32 matters).
struct CnnImpl : torch::nn::Module {
  explicit CnnImpl(int64_t classes)
      : conv1(register_module("conv1",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)))),
        bn1(register_module("bn1", torch::nn::BatchNorm2d(8))),
        conv2(register_module("conv2",
                              torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 16, 3).padding(1)))),
        bn2(register_module("bn2", torch::nn::BatchNorm2d(16))),
        fc(register_module("fc", torch::nn::Linear(16, classes))) {}
  at::Tensor forward(const at::Tensor& x) {
    auto h = torch::relu(bn1->forward(conv1->forward(x)));
    h = torch::max_pool2d(h, 2);
    h = torch::relu(bn2->forward(conv2->forward(h)));
    h = h.mean({2, 3});
    return fc->forward(h);
  }
  torch::nn::Conv2d conv1;
  torch::nn::BatchNorm2d bn1;
  torch::nn::Conv2d conv2;
  torch::nn::BatchNorm2d bn2;
  torch::nn::Linear fc;
};
TORCH_MODULE(Cnn);

/// Learnable synthetic classification data: `classes` Gaussian blobs around centres that are
/// fixed for a given (dim, classes); `seed` draws the samples.
struct Blobs {
  at::Tensor x, y;
};
inline Blobs make_blobs(int64_t n, int64_t dim, int64_t classes, uint64_t seed) {
  auto centers_gen = at::detail::createCPUGenerator(12345);
  auto centers = at::randn({classes, dim}, centers_gen) * 1.5;
  auto gen = at::detail::createCPUGenerator(seed);
  auto y = at::randint(classes, {n}, gen, at::TensorOptions().dtype(at::kLong));
  auto x = centers.index_select(0, y) + at::randn({n, dim}, gen);
  return {x, y};
}

/// Images 1x8x8: class 0 a horizontal bar, 1 a vertical bar, 2 a diagonal, with noise.
inline Blobs make_images(int64_t n, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  auto y = at::randint(3, {n}, gen, at::TensorOptions().dtype(at::kLong));
  auto x = at::randn({n, 1, 8, 8}, gen) * 0.5;
  auto ya = y.accessor<int64_t, 1>();
  auto xa = x.accessor<float, 4>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t pos = (i * 7) % 6 + 1;
    for (int64_t k = 0; k < 8; ++k) {
      if (ya[i] == 0) xa[i][0][pos][k] += 2.0f;
      if (ya[i] == 1) xa[i][0][k][pos] += 2.0f;
      if (ya[i] == 2) xa[i][0][k][k] += 2.0f;
    }
  }
  return {x, y};
}

inline at::Tensor cross_entropy(const at::Tensor& logits, const at::Tensor& y) {
  return torch::nn::functional::cross_entropy(logits, y);
}

inline double accuracy(const at::Tensor& logits, const at::Tensor& y) {
  return logits.argmax(1).eq(y).to(at::kDouble).mean().item<double>();
}

}  // namespace apex::test
