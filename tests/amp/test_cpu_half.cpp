// The CPU half-precision fallback: each covered op, bf16 and fp16, against the fp32 op on the
// same (exactly representable) inputs rounded once; the scope's on/off, nesting, threads and
// exceptions. Availability is forced on, so these run on every CPU.
#include <ATen/ops/mm_cpu_dispatch.h>
#include <apex/amp/cpu_half.h>

#include <functional>
#include <thread>

#include "amp_test_util.h"

namespace {

using apex::amp::CpuHalfFallbackGuard;

using ForceAvailable = apex::test::ForceCpuHalfFallback;

// Values exactly representable in `t` (so the fp32 reference sees the same inputs).
at::Tensor exact(at::IntArrayRef sizes, at::ScalarType t, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, gen).to(t);
}

// `got` (half) is `want32` (fp32) rounded to got's dtype, within one unit in the last place.
::testing::AssertionResult rounded_once(const at::Tensor& got, const at::Tensor& want32) {
  if (got.scalar_type() == at::kFloat || got.sizes() != want32.sizes()) {
    return ::testing::AssertionFailure()
           << "got " << got.toString() << got.sizes() << " for " << want32.sizes();
  }
  const at::Tensor want = want32.to(got.scalar_type()).to(at::kDouble);
  const at::Tensor g = got.to(at::kDouble);
  // One ulp of the half dtype at the value's magnitude (bf16: 8 bits, fp16: 11 bits).
  const double eps = got.scalar_type() == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  const at::Tensor ulp = (want.abs() * eps).clamp_min(1e-30);
  const at::Tensor bad = (g - want).abs().gt(ulp);
  if (bad.any().item<bool>()) {
    return ::testing::AssertionFailure() << bad.sum().item<int64_t>() << " of " << g.numel()
                                         << " elements off by more than one ulp";
  }
  return ::testing::AssertionSuccess();
}

// An op on inputs from `in(sizes, seed)`: run once with half inputs, once with the same values
// widened to fp32 (the reference).
using Input = std::function<at::Tensor(at::IntArrayRef, uint64_t)>;
struct Case {
  const char* name;
  std::function<at::Tensor(const Input&)> run;
};

std::vector<Case> cases() {
  return {
      {"mm",
       [](const Input& in) {
         return at::mm(in({7, 33}, 1), in({33, 5}, 2));
       }},
      {"mm transposed",
       [](const Input& in) {
         return at::mm(in({33, 7}, 3).t(), in({5, 33}, 4).t());
       }},
      {"mm k=1",
       [](const Input& in) {
         return at::mm(in({9, 1}, 5), in({1, 4}, 6));
       }},
      {"mm empty",
       [](const Input& in) {
         return at::mm(in({0, 3}, 5), in({3, 4}, 6));
       }},
      {"addmm",
       [](const Input& in) {
         return at::addmm(in({4}, 7), in({6, 17}, 8), in({17, 4}, 9), 0.5, 2.0);
       }},
      {"bmm",
       [](const Input& in) {
         return at::bmm(in({3, 5, 8}, 10), in({3, 8, 2}, 11));
       }},
      {"baddbmm",
       [](const Input& in) {
         return at::baddbmm(in({3, 5, 2}, 12), in({3, 5, 8}, 13), in({3, 8, 2}, 14));
       }},
      {"matmul broadcast batch",
       [](const Input& in) {
         return at::matmul(in({2, 3, 5, 8}, 15), in({8, 6}, 16));
       }},
      {"linear 3-D",
       [](const Input& in) {
         return at::linear(in({2, 7, 16}, 17), in({10, 16}, 18), in({10}, 19));
       }},
      {"conv2d",
       [](const Input& in) {
         return at::conv2d(in({2, 3, 9, 9}, 20), in({4, 3, 3, 3}, 21), in({4}, 22), 1, 1);
       }},
      {"conv2d depthwise strided",
       [](const Input& in) {
         return at::conv2d(in({2, 4, 9, 9}, 23), in({4, 1, 3, 3}, 24), {}, 2, 1, 1, 4);
       }},
      {"conv2d channels-last",
       [](const Input& in) {
         return at::conv2d(in({2, 3, 8, 8}, 25).contiguous(at::MemoryFormat::ChannelsLast),
                           in({5, 3, 3, 3}, 26));
       }},
      {"conv1d (wav2vec2's encoder)",
       [](const Input& in) {
         return at::conv1d(in({2, 1, 400}, 27), in({8, 1, 10}, 28), {}, 5);
       }},
      {"conv_transpose2d",
       [](const Input& in) {
         return at::conv_transpose2d(in({2, 4, 5, 5}, 29), in({4, 3, 4, 4}, 30), in({3}, 31), 2, 1);
       }},
      {"scaled_dot_product_attention",
       [](const Input& in) {
         return at::scaled_dot_product_attention(in({2, 2, 16, 8}, 32), in({2, 2, 16, 8}, 33),
                                                 in({2, 2, 16, 8}, 34));
       }},
  };
}

}  // namespace

TEST(CpuHalfFallback, OpsEqualFp32RoundedOnce) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    const Input half = [t](at::IntArrayRef s, uint64_t seed) { return exact(s, t, seed); };
    const Input widened = [t](at::IntArrayRef s, uint64_t seed) {
      return exact(s, t, seed).to(at::kFloat);
    };
    for (const auto& c : cases()) {
      const at::Tensor want = c.run(widened);
      at::Tensor got;
      {
        const CpuHalfFallbackGuard guard;
        ASSERT_TRUE(apex::amp::cpu_half_fallback_active());
        got = c.run(half);
      }
      EXPECT_EQ(got.scalar_type(), t) << c.name;
      EXPECT_TRUE(rounded_once(got, want)) << c.name << " " << t;
      // Bit-identical between runs.
      const CpuHalfFallbackGuard guard;
      EXPECT_TRUE(c.run(half).equal(got)) << c.name << " " << t;
    }
  }
}

// Gradients likewise: each op's backward on the same values (upstream gradients exactly
// representable too), every input's gradient against the fp32 one rounded once.
TEST(CpuHalfFallback, GradientsEqualFp32RoundedOnce) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    for (const auto& c : cases()) {
      std::vector<at::Tensor> grads[2];
      for (const bool wide : {true, false}) {
        std::vector<at::Tensor> leaves;
        const Input in = [&](at::IntArrayRef s, uint64_t seed) {
          at::Tensor x = exact(s, t, seed);
          if (wide) x = x.to(at::kFloat);
          leaves.push_back(x.requires_grad_());
          return x;
        };
        std::optional<CpuHalfFallbackGuard> guard;
        if (!wide) guard.emplace();
        const at::Tensor y = c.run(in);
        const at::Tensor g = exact(y.sizes(), t, 99);
        y.backward(wide ? g.to(at::kFloat) : g);
        for (const auto& l : leaves) grads[wide ? 0 : 1].push_back(l.grad());
      }
      for (size_t i = 0; i < grads[0].size(); ++i) {
        if (grads[0][i].numel() == 0) continue;
        if (std::string(c.name) == "scaled_dot_product_attention") {
          // Widened on purpose: attention's backward also takes the forward's output, which the
          // half path saved rounded to the half dtype (and the fp32 path did not): an fp16 output
          // error of 2^-11 moves these gradients by up to ~2 %, so the bf16 row of the table.
          EXPECT_TRUE(apex::test::all_close(grads[1][i], grads[0][i],
                                            apex::test::tolerance_for(at::kBFloat16)))
              << c.name << " " << t << " input " << i;
          continue;
        }
        EXPECT_TRUE(rounded_once(grads[1][i], grads[0][i])) << c.name << " " << t << " input " << i;
      }
    }
  }
}

TEST(CpuHalfFallback, ScopeOnOffNestedThreadsExceptions) {
  const ForceAvailable force;
  const at::Tensor a = exact({16, 24}, at::kBFloat16, 50), b = exact({24, 8}, at::kBFloat16, 51);
  const at::Tensor libtorch = at::cpu::mm(a, b);  // LibTorch's own CPU kernel
  const at::Tensor fp32 = at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(at::kBFloat16);
  EXPECT_FALSE(apex::amp::cpu_half_fallback_active());
  {
    const CpuHalfFallbackGuard outer;
    {
      const CpuHalfFallbackGuard inner;
      EXPECT_TRUE(at::mm(a, b).equal(fp32));
    }
    EXPECT_TRUE(apex::amp::cpu_half_fallback_active());  // the outer scope still holds
    // Another thread is not in a scope: LibTorch's kernel there.
    at::Tensor other;
    std::thread([&] {
      EXPECT_FALSE(apex::amp::cpu_half_fallback_active());
      other = at::mm(a, b);
    }).join();
    EXPECT_TRUE(other.equal(libtorch));
    // fp32 ops are LibTorch's, bit for bit.
    const at::Tensor af = a.to(at::kFloat), bf = b.to(at::kFloat);
    EXPECT_TRUE(at::mm(af, bf).equal(at::cpu::mm(af, bf)));
    const CpuHalfFallbackGuard off(false);
    EXPECT_TRUE(apex::amp::cpu_half_fallback_active());
  }
  EXPECT_FALSE(apex::amp::cpu_half_fallback_active());
  EXPECT_TRUE(at::mm(a, b).equal(libtorch));  // off again: LibTorch's result
  try {
    const CpuHalfFallbackGuard guard;
    throw std::runtime_error("inside the scope");
  } catch (const std::runtime_error&) {
  }
  EXPECT_FALSE(apex::amp::cpu_half_fallback_active());
  // Where it is not available (a CPU with fast half matmuls, or APEX_CPU_HALF_FALLBACK=0) the
  // guard does nothing.
  apex::amp::detail::force_cpu_half_fallback_available(false);
  {
    const CpuHalfFallbackGuard guard;
    EXPECT_FALSE(apex::amp::cpu_half_fallback_active());
    EXPECT_TRUE(at::mm(a, b).equal(libtorch));
  }
}

// The amp handle turns the scope on for its forward and its scaled-loss backward.
bool seen_in_forward = false, seen_in_backward = false;
struct Probe : torch::autograd::Function<Probe> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) {
    seen_in_forward = apex::amp::cpu_half_fallback_active();
    return x.clone();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 torch::autograd::variable_list g) {
    seen_in_backward = apex::amp::cpu_half_fallback_active();
    return g;
  }
};
struct ProbeNetImpl : torch::nn::Module {
  ProbeNetImpl() { fc = register_module("fc", torch::nn::Linear(8, 4)); }
  at::Tensor forward(const at::Tensor& x) { return Probe::apply(fc->forward(x)); }
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(ProbeNet);

TEST(CpuHalfFallback, AmpUsesTheScope) {
  const ForceAvailable force;
  for (const auto level : {apex::amp::OptLevel::O1, apex::amp::OptLevel::O2}) {
    ProbeNet model;
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto amp = apex::amp::initialize(
        model, opt, apex::amp::Options(level).half_dtype(at::kBFloat16).verbosity(0));
    seen_in_forward = seen_in_backward = false;
    const at::Tensor y = amp.forward(model, at::randn({5, 8}));
    amp.scale_loss(y.to(at::kFloat).sum()).backward();
    EXPECT_TRUE(seen_in_forward) << static_cast<int>(level);
    EXPECT_TRUE(seen_in_backward) << static_cast<int>(level);
    EXPECT_FALSE(apex::amp::cpu_half_fallback_active());
    // O0 computes in fp32: no scope.
  }
  ProbeNet model;
  torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
  auto amp =
      apex::amp::initialize(model, opt, apex::amp::Options(apex::amp::OptLevel::O0).verbosity(0));
  seen_in_forward = true;
  amp.forward(model, at::randn({5, 8}));
  EXPECT_FALSE(seen_in_forward);
}
