// Multi-tensor primitives against exact values and LibTorch references.
#include <apex/optim/multi_tensor.h>
#include <torch/nn/utils/clip_grad.h>

#include <cstdlib>
#include <limits>
#include <string>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "optim_test_util.h"

namespace apex::test {
namespace {

using apex::optim::multi_tensor_axpby;
using apex::optim::multi_tensor_check_finite;
using apex::optim::multi_tensor_l2norm;
using apex::optim::multi_tensor_max_norm;
using apex::optim::multi_tensor_scale;
using apex::optim::multi_tensor_unscale_l2norm;

// Sizes straddling the CPU tile (512) and chunk (32768) edges and apex's 65536 chunk.
const std::vector<int64_t> kEdgeSizes = {1,     7,     511,   512,   513,   32767,
                                         32768, 32769, 65535, 65536, 65537, 278011};
const std::vector<at::ScalarType> kDtypes = {at::kFloat, at::kHalf, at::kBFloat16};

at::Tensor flag() { return at::zeros({1}); }

std::vector<at::Tensor> filled(const std::vector<int64_t>& sizes, double v, at::ScalarType t) {
  std::vector<at::Tensor> out;
  for (int64_t n : sizes) out.push_back(at::full({n}, v, at::TensorOptions().dtype(t)));
  return out;
}

TEST(MultiTensorScale, ExactOnConstantFillsAllDtypePairs) {
  for (auto in_t : kDtypes) {
    for (auto out_t : kDtypes) {
      auto in = filled(kEdgeSizes, 4.0, in_t);
      auto out = filled(kEdgeSizes, 0.0, out_t);
      auto f = flag();
      multi_tensor_scale(in, out, 0.25, f);
      EXPECT_EQ(f.item<float>(), 0.0f);
      for (size_t i = 0; i < out.size(); ++i) {
        EXPECT_TRUE(at::equal(out[i], at::ones_like(out[i]))) << in_t << "->" << out_t << " " << i;
      }
    }
  }
}

TEST(MultiTensorScale, InPlaceMatchesMul) {
  auto x = make_params(kEdgeSizes, at::kFloat, 3);
  auto ref = snapshot(x);
  auto f = flag();
  multi_tensor_scale(x, x, 1.0 / 3.0, f);
  for (size_t i = 0; i < x.size(); ++i) {
    EXPECT_TRUE(at::equal(x[i], ref[i] * static_cast<float>(1.0 / 3.0))) << i;
  }
  EXPECT_EQ(f.item<float>(), 0.0f);
}

TEST(MultiTensorScale, FlagsNonFiniteAtFirstMiddleLast) {
  const float bad[] = {std::numeric_limits<float>::quiet_NaN(),
                       std::numeric_limits<float>::infinity(),
                       -std::numeric_limits<float>::infinity()};
  for (auto t : kDtypes) {
    for (float v : bad) {
      for (int where = 0; where < 3; ++where) {
        auto in = filled(kEdgeSizes, 1.0, t);
        auto& victim = in[where == 0 ? 0 : (where == 1 ? in.size() / 2 : in.size() - 1)];
        const int64_t idx = where == 0 ? 0 : (where == 1 ? victim.numel() / 2 : victim.numel() - 1);
        victim[idx].fill_(v);
        auto out = filled(kEdgeSizes, 0.0, t);
        auto f = flag();
        multi_tensor_scale(in, out, 1.0, f);
        EXPECT_EQ(f.item<float>(), 1.0f) << t << " value " << v << " at " << where;
      }
    }
  }
}

TEST(MultiTensorAxpby, ExactAndArgToCheck) {
  for (auto t : kDtypes) {
    auto x = filled(kEdgeSizes, 4.0, t);
    auto y = filled(kEdgeSizes, 16.0, t);
    auto out = filled(kEdgeSizes, 0.0, at::kFloat);
    auto f = flag();
    multi_tensor_axpby(x, y, out, 2.0, 8.0, f);
    EXPECT_EQ(f.item<float>(), 0.0f);
    for (const auto& o : out) EXPECT_TRUE(at::equal(o, at::full_like(o, 136.0)));
  }
  auto x = filled({5, 70000}, 1.0, at::kFloat);
  auto y = filled({5, 70000}, 1.0, at::kFloat);
  auto out = filled({5, 70000}, 0.0, at::kFloat);
  y[1][69999].fill_(std::numeric_limits<float>::infinity());
  auto f = flag();
  multi_tensor_axpby(x, y, out, 1.0, 1.0, f, /*arg_to_check=*/0);
  EXPECT_EQ(f.item<float>(), 0.0f) << "y is not checked with arg_to_check = 0";
  multi_tensor_axpby(x, y, out, 1.0, 1.0, f, /*arg_to_check=*/1);
  EXPECT_EQ(f.item<float>(), 1.0f);
  auto f2 = flag();
  multi_tensor_axpby(x, y, out, 1.0, 1.0, f2, -1);
  EXPECT_EQ(f2.item<float>(), 1.0f);
}

TEST(MultiTensorL2Norm, ConstantFillsAndRandomAgainstFloat64) {
  for (auto t : kDtypes) {
    auto x = filled(kEdgeSizes, 4.0, t);
    auto [total, per] = multi_tensor_l2norm(x, /*per_tensor=*/true);
    double sum = 0;
    for (size_t i = 0; i < x.size(); ++i) {
      const double expect = 4.0 * std::sqrt(static_cast<double>(kEdgeSizes[i]));
      sum += 16.0 * static_cast<double>(kEdgeSizes[i]);
      EXPECT_NEAR(per[i].item<float>(), expect, expect * 1e-6) << t << " " << i;
    }
    EXPECT_NEAR(total.item<float>(), std::sqrt(sum), std::sqrt(sum) * 1e-6);
  }
  auto r = make_params(many_sizes(), at::kFloat, 11);
  auto [total, per] = multi_tensor_l2norm(r, true);
  std::vector<at::Tensor> norms;
  for (const auto& t : r) norms.push_back(t.detach().to(at::kDouble).norm());
  EXPECT_TRUE(all_close(per, at::stack(norms), tolerance_for(at::kFloat)));
  EXPECT_TRUE(all_close(total, at::stack(norms).norm(), tolerance_for(at::kFloat)));
  auto [t2, none] = multi_tensor_l2norm(r);
  EXPECT_FALSE(none.defined());
  EXPECT_EQ(t2.dim(), 0);
}

TEST(MultiTensorL2Norm, UnscaleDoesNotWriteInputs) {
  auto x = filled(kEdgeSizes, 4.0, at::kHalf);
  auto before = snapshot(x);
  auto [total, per] = multi_tensor_unscale_l2norm(x, at::full({1}, 0.5), true);
  auto [ref_total, ref_per] = multi_tensor_l2norm(filled(kEdgeSizes, 2.0, at::kHalf), true);
  EXPECT_TRUE(at::equal(total, ref_total));
  EXPECT_TRUE(at::equal(per, ref_per));
  EXPECT_TRUE(lists_equal(x, before));
}

TEST(MultiTensorMaxNorm, MatchesAbsMaxAndPropagatesNaN) {
  auto r = make_params(many_sizes(), at::kFloat, 5);
  auto [total, per] = multi_tensor_max_norm(r, true);
  std::vector<at::Tensor> m;
  for (const auto& t : r) m.push_back(t.detach().abs().max());
  EXPECT_TRUE(at::equal(per, at::stack(m)));
  EXPECT_EQ(total.item<float>(), at::stack(m).max().item<float>());
  r[17].detach()[3].fill_(std::numeric_limits<float>::quiet_NaN());
  auto [t2, p2] = multi_tensor_max_norm(r, true);
  EXPECT_TRUE(std::isnan(t2.item<float>()));
  EXPECT_TRUE(std::isnan(p2[17].item<float>()));
  EXPECT_FALSE(std::isnan(p2[16].item<float>()));
  auto [t3, p3] = multi_tensor_l2norm(r, true);
  EXPECT_TRUE(std::isnan(t3.item<float>()));
}

// fp32 to bf16 is c10::BFloat16's rounding bit for bit on every instruction set: ties to even,
// denormals kept (AVX512-BF16's conversion flushes them), every NaN to 0x7fc0 (the instruction
// keeps the sign and payload), overflow to infinity. The special values sit among ordinary ones,
// once at the start (the vector steps: 16 or 8 lanes by ISA) and once at the end (the last of which
// are the scalar tail).
TEST(MultiTensorScale, Bf16OutputsRoundAsC10) {
  const std::vector<uint32_t> special = {
      0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0xbf818000,  // ties and near-ties
      0x00000001, 0x00008000, 0x00018000, 0x007fffff, 0x807f8000,  // denormals
      0x00000000, 0x80000000, 0x7f800000, 0xff800000,              // zeros, infinities
      0x7fc00000, 0xffc00000, 0x7f800001, 0xff812345, 0x7fffffff,  // NaNs
      0x7f7fffff, 0x7f7f7fff, 0xff7f8000};                         // overflow or not
  const auto count = static_cast<int64_t>(special.size());
  auto gen = at::detail::createCPUGenerator(17);
  for (int64_t n : {22, 61, 1000, 4099}) {
    for (int64_t first : {int64_t{0}, n - count}) {
      at::Tensor in = at::randn({n}, gen) * at::pow(10.0, at::randint(-30, 30, {n}, gen));
      std::memcpy(in.data_ptr<float>() + first, special.data(), special.size() * 4);
      auto out = filled({n}, 0.0, at::kBFloat16);
      auto f = flag();
      multi_tensor_scale({in}, out, 1.0, f);
      EXPECT_TRUE(bf16_rounding_of(out[0], in)) << n << " elements, specials from " << first;
    }
  }
}

// With MXCSR's denormals-are-zero flag set (and flush-to-zero not), arithmetic still produces
// denormal results, and the AVX512-BF16 class test would take them for zeros and let the
// hardware flush them; the kernels then keep to the bit arithmetic. 1000 elements are one
// chunk, run on this thread, whose MXCSR is the one set here.
TEST(MultiTensorScale, Bf16RoundingUnderDenormalsAreZero) {
#if defined(__x86_64__)
  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x0040);
  auto gen = at::detail::createCPUGenerator(23);
  at::Tensor in = at::rand({1000}, gen).add_(1.0).mul_(2e-38);  // normal; x 0.25 is denormal
  auto out = filled({1000}, 0.0, at::kBFloat16);
  auto f = flag();
  multi_tensor_scale({in}, out, 0.25, f);
  at::Tensor scaled = at::empty({1000});
  for (int64_t i = 0; i < 1000; ++i) {
    scaled.data_ptr<float>()[i] = in.data_ptr<float>()[i] * 0.25f;
  }
  _mm_setcsr(saved);
  ASSERT_TRUE((scaled.abs() < 1.1754944e-38).all().item<bool>());
  EXPECT_TRUE(bf16_rounding_of(out[0], scaled));
#else
  GTEST_SKIP() << "x86 only";
#endif
}

// APEX_CPU_ISA (set by CTest for the forced runs) names the table in use when this CPU runs it.
TEST(CpuKernelIsa, ForcedTableIsUsed) {
  const char* forced = std::getenv("APEX_CPU_ISA");
  if (forced == nullptr) GTEST_SKIP() << "APEX_CPU_ISA not set";
  const std::string want = forced;
#if defined(__x86_64__)
  __builtin_cpu_init();
  const bool has512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
  const bool runs = want == "baseline" ||
                    (want == "avx2" && __builtin_cpu_supports("avx2") &&
                     __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c")) ||
                    (want == "avx512" && has512) ||
                    (want == "avx512bf16" && has512 && __builtin_cpu_supports("avx512bf16"));
  if (!runs) GTEST_SKIP() << "this CPU lacks " << want;
#endif
  EXPECT_EQ(std::string(apex::optim::cpu_kernel_isa()), want);
}

TEST(MultiTensorCheckFinite, ReadsOnly) {
  auto x = filled(kEdgeSizes, 1.0, at::kBFloat16);
  auto f = flag();
  multi_tensor_check_finite(x, f);
  EXPECT_EQ(f.item<float>(), 0.0f);
  x.back()[278010].fill_(std::numeric_limits<float>::infinity());
  multi_tensor_check_finite(x, f);
  EXPECT_EQ(f.item<float>(), 1.0f);
}

// clip_grad_norm_ gives LibTorch's result: same returned norm, same clipped gradients.
TEST(ClipGradNorm, MatchesLibTorch) {
  for (double norm_type : {2.0, std::numeric_limits<double>::infinity()}) {
    for (double max_norm : {0.5, 1e6}) {
      auto ours = make_params(many_sizes(), at::kFloat, 21);
      auto ref = copies(ours, at::kFloat);
      set_grads(ours, 0, 4);
      set_grads(ref, 0, 4);
      const double n1 = apex::optim::clip_grad_norm_(ours, max_norm, norm_type);
      const double n2 = torch::nn::utils::clip_grad_norm_(ref, max_norm, norm_type);
      EXPECT_NEAR(n1, n2, std::abs(n2) * 1e-5) << norm_type << " " << max_norm;
      std::vector<at::Tensor> g1, g2;
      for (size_t i = 0; i < ours.size(); ++i) {
        g1.push_back(ours[i].grad());
        g2.push_back(ref[i].grad());
      }
      EXPECT_TRUE(lists_close(g1, g2, tolerance_for(at::kFloat))) << norm_type << " " << max_norm;
    }
  }
}

TEST(ClipGradNorm, ErrorsAndEdgeCases) {
  auto p = make_params({10}, at::kFloat, 1);
  EXPECT_EQ(apex::optim::clip_grad_norm_(p, 1.0), 0.0) << "no gradients: norm 0";
  p[0].mutable_grad() = at::full({10}, std::numeric_limits<float>::infinity());
  EXPECT_TRUE(throws_with([&] { apex::optim::clip_grad_norm_(p, 1.0, 2.0, true); }, "non-finite"));
  EXPECT_TRUE(throws_with([&] { apex::optim::clip_grad_norm_(p, 1.0, 1.0); },
                          "norm_type must be 2 or infinity, got 1"));
}

TEST(MultiTensorErrors, ClearMessages) {
  auto f = flag();
  auto a = filled({4, 5}, 1.0, at::kFloat);
  auto mixed = a;
  mixed[1] = mixed[1].to(at::kHalf);
  EXPECT_TRUE(throws_with([&] { multi_tensor_scale(mixed, a, 1.0, f); },
                          "all tensors of in must have one dtype, got Float at index 0 and Half "
                          "at index 1"));
  auto meta = a;
  meta[1] = at::empty({5}, at::TensorOptions().device(at::kMeta));
  EXPECT_TRUE(throws_with([&] { multi_tensor_scale(meta, a, 1.0, f); },
                          "all tensors of in must be on one device, got cpu at index 0 and meta"));
  EXPECT_TRUE(throws_with([&] { multi_tensor_scale(a, filled({4}, 1.0, at::kFloat), 1.0, f); },
                          "in and out must have the same length, got 2 and 1"));
  EXPECT_TRUE(throws_with(
      [&] {
        multi_tensor_scale(a, filled({4, 6}, 1.0, at::kFloat), 1.0, f);
      },
      "out[1] has shape [6] but in[1] has shape [5]"));
  EXPECT_TRUE(throws_with([&] { multi_tensor_scale(a, a, 1.0, at::zeros({1}, at::kInt)); },
                          "found_inf must be a one-element float32 tensor, got Int"));
  EXPECT_TRUE(throws_with([&] { multi_tensor_scale({}, {}, 1.0, f); }, "in must not be empty"));
  auto strided = at::ones({20}).slice(0, 0, 20, 2);
  EXPECT_TRUE(throws_with([&] { multi_tensor_l2norm({strided}); },
                          "x[0] must be contiguous (non-overlapping and dense)"));
  EXPECT_TRUE(throws_with([&] { multi_tensor_l2norm({at::ones({3}, at::kDouble)}); },
                          "expected float32, float16 or bfloat16 tensors, got Double"));
  EXPECT_TRUE(throws_with([&] { multi_tensor_axpby(a, a, a, 1, 1, f, 2); },
                          "arg_to_check must be -1 (both), 0 (x) or 1 (y), got 2"));
}

}  // namespace
}  // namespace apex::test
