// GELU and SiLU on the CPU half-precision route: every bf16 and fp16 value, both GELU forms,
// forward and backward, against a long-double reference (one unit in the last place at most; the
// forward is correctly rounded, the reference's conversion may not be); LibTorch's kernel outside
// the scope, for fp32, for layouts the route does not take; strides kept; autograd through it. Run
// once per kernel ISA (tests/amp/CMakeLists.txt).
#include <ATen/ops/gelu_backward_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <apex/amp/cpu_half.h>
#include <apex/amp/cpu_half_testing.h>
#include <apex/amp/utils.h>

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "amp_test_util.h"

namespace {

using apex::amp::CpuHalfFallbackGuard;

using ForceAvailable = apex::test::ForceCpuHalfFallback;

// Every bit pattern of a 16-bit dtype, once.
at::Tensor all_patterns(at::ScalarType t) {
  return at::arange(-32768, 32768, at::kInt).to(at::kShort).view(t);
}

long double gelu_ref(long double x, bool tanh, long double* derivative) {
  if (tanh) {
    // 0.5 (1 + tanh(u)) written as 1 / (1 + exp(-2u)): the same function without the
    // cancellation of 1 + tanh(u) for u << 0.
    const long double k = std::sqrt(2.0L / 3.14159265358979323846264338327950288L);
    const long double u = k * (x + 0.044715L * x * x * x);
    const long double s = 1 / (1 + std::exp(-2 * u));
    const long double ds = std::exp(-2 * u) * s * s;  // sigma'(2u), finite where exp overflows
    *derivative = s + 2 * x * k * (1 + 3 * 0.044715L * x * x) * (std::isnan(ds) ? 0 : ds);
    return x * s;
  }
  const long double phi = 0.5L * std::erfc(-x / std::sqrt(2.0L));
  *derivative =
      phi + x * std::exp(-x * x / 2) / std::sqrt(2 * 3.14159265358979323846264338327950288L);
  return x * phi;
}

// silu(x) = x sigma(x) and silu'(x) = sigma(x) (1 + x (1 - sigma(x))), 1 - sigma(x) as
// exp(-x) sigma(x) (1 where exp(-x) overflows even long double: there sigma(x) is 0).
long double silu_ref(long double x, long double* derivative) {
  const long double e = std::exp(-x);
  const long double s = 1 / (1 + e);
  *derivative = s * (1 + x * (std::isinf(e) ? 1 : e * s));
  return x / (1 + e);
}

using RefFn = long double (*)(long double, bool, long double*);
long double silu_as_ref(long double x, bool, long double* d) { return silu_ref(x, d); }

// The reference over x's values: f (want_y) and g * f' (want_dx), in fp64; f is gelu (of the form
// tanh says) unless given.
void reference(const at::Tensor& x, const at::Tensor& g, bool tanh, at::Tensor& want_y,
               at::Tensor& want_dx, RefFn f = gelu_ref) {
  const at::Tensor xd = x.to(at::kDouble);
  const at::Tensor gd = g.to(at::kDouble);
  want_y = at::empty_like(xd);
  want_dx = at::empty_like(xd);
  const double* xs = xd.const_data_ptr<double>();
  const double* gs = gd.const_data_ptr<double>();
  double* ys = want_y.mutable_data_ptr<double>();
  double* dxs = want_dx.mutable_data_ptr<double>();
  for (int64_t i = 0; i < xd.numel(); ++i) {
    long double d;
    ys[i] = static_cast<double>(f(xs[i], tanh, &d));
    dxs[i] = static_cast<double>(gs[i] * d);
  }
}

// Position of a 16-bit float on the number line (adjacent values differ by one; +0 and -0 are 0).
int32_t ordinal(int16_t bits) {
  return bits < 0 ? -static_cast<int32_t>(bits & 0x7fff) : static_cast<int32_t>(bits);
}

int16_t from_ordinal(int32_t o) { return static_cast<int16_t>(o >= 0 ? o : (0x8000 | -o)); }

double value_of(int16_t bits, at::ScalarType t) {
  const auto u = static_cast<uint16_t>(bits);
  return t == at::kBFloat16 ? static_cast<float>(c10::BFloat16(u, c10::BFloat16::from_bits()))
                            : static_cast<float>(c10::Half(u, c10::Half::from_bits()));
}

// r rounded to nearest (ties to even) in t, found among the neighbours of the fp32-route
// conversion (which may round twice) by their distance to r in fp64.
int16_t nearest_bits(double r, at::ScalarType t) {
  const float f = static_cast<float>(r);
  const auto c = static_cast<int16_t>(t == at::kBFloat16 ? c10::BFloat16(f).x : c10::Half(f).x);
  if (!std::isfinite(r) || !std::isfinite(value_of(c, t))) return c;
  int16_t best = c;
  double best_d = std::abs(value_of(c, t) - r);
  for (const int step : {-1, 1}) {
    const int16_t n = from_ordinal(ordinal(c) + step);
    const double v = value_of(n, t);
    if (!std::isfinite(v)) continue;
    const double d = std::abs(v - r);
    if (d < best_d || (d == best_d && (n & 1) == 0)) {
      best = n;
      best_d = d;
    }
  }
  return best;
}

// got (16-bit) against want64 rounded to nearest in got's dtype: at most `units` units in the
// last place apart (0: equal), NaN exactly where want64 is NaN, infinities equal.
::testing::AssertionResult within(const at::Tensor& got, const at::Tensor& want64, int units) {
  const at::Tensor gc = got.contiguous();
  const auto* gb = static_cast<const int16_t*>(gc.const_data_ptr());
  const double* w64 = want64.const_data_ptr<double>();
  const auto t = got.scalar_type();
  int64_t bad = 0;
  int64_t first = -1;
  for (int64_t i = 0; i < got.numel(); ++i) {
    const double g = value_of(gb[i], t);
    bool ok;
    if (std::isnan(w64[i]) || std::isnan(g)) {
      ok = std::isnan(w64[i]) && std::isnan(g);
    } else {
      ok = std::abs(ordinal(gb[i]) - ordinal(nearest_bits(w64[i], t))) <= units;
    }
    if (!ok && bad++ == 0) first = i;
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << bad << " of " << got.numel() << " elements more than " << units
         << " units off; first: element " << first << ", got " << value_of(gb[first], t)
         << ", want " << w64[first];
}

const char* form(bool tanh) { return tanh ? "tanh" : "none"; }

}  // namespace

TEST(CpuHalfGelu, EveryValueCorrectlyRoundedGradientsWithinOneUnit) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    for (const bool tanh : {false, true}) {
      SCOPED_TRACE(std::string(c10::toString(t)) + " approximate=" + form(tanh));
      const at::Tensor x = all_patterns(t);
      const at::Tensor g = at::randn({x.numel()}, at::detail::createCPUGenerator(7)).to(t);
      at::Tensor want_y, want_dx;
      reference(x, g, tanh, want_y, want_dx);
      at::Tensor y, dx;
      {
        const CpuHalfFallbackGuard on;
        y = at::gelu(x, form(tanh));
        dx = at::gelu_backward(g, x, form(tanh));
      }
      EXPECT_EQ(y.scalar_type(), t);
      EXPECT_TRUE(within(y, want_y, 0));  // correctly rounded
      EXPECT_TRUE(within(dx, want_dx, 1));
      // More accurate than LibTorch's own half kernel, which cancels in the negative tail.
      const at::Tensor theirs = at::cpu::gelu(x, form(tanh)).to(at::kDouble);
      const at::Tensor finite = want_y.isfinite();
      const double ours_err =
          (y.to(at::kDouble) - want_y).abs().masked_select(finite).max().item<double>();
      const double their_err = (theirs - want_y).abs().masked_select(finite).max().item<double>();
      EXPECT_LE(ours_err, their_err);
    }
  }
}

// Each half dtype is decided on its own (a CPU with AVX-512 but no AVX512-FP16, as AMD Zen 4
// and 5, multiplies bf16 through oneDNN and fp16 in a scalar loop): in a scope, an op in a dtype
// takes the route exactly where that dtype's is available. GELU tells the two apart.
TEST(CpuHalfGelu, EachDtypeTakesTheRouteWhereItsDecisionSays) {
  const char* env = std::getenv("APEX_CPU_HALF_FALLBACK");
  const std::string setting = env != nullptr ? env : "";
  const auto bits = [](const at::Tensor& t) { return t.view(at::kShort); };
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(t));
    const at::Tensor x = all_patterns(t);
    const at::Tensor theirs = at::cpu::gelu(x);
    at::Tensor route;
    {
      const ForceAvailable force;
      const CpuHalfFallbackGuard on;
      route = at::gelu(x);
    }
    ASSERT_FALSE(at::equal(bits(route), bits(theirs)));
    const bool want = setting == "1" || (setting != "0" && !apex::amp::cpu_half_matmul_is_fast(t));
    EXPECT_EQ(apex::amp::cpu_half_fallback_available(t), want);
    const CpuHalfFallbackGuard scope;
    EXPECT_TRUE(at::equal(bits(at::gelu(x)), bits(want ? route : theirs)));
  }
  EXPECT_EQ(apex::amp::cpu_half_fallback_available(),
            apex::amp::cpu_half_fallback_available(at::kBFloat16) ||
                apex::amp::cpu_half_fallback_available(at::kHalf));
  EXPECT_THROW(apex::amp::cpu_half_fallback_available(at::kFloat), c10::Error);
}

TEST(CpuHalfGelu, LibTorchsKernelWhereTheRouteDoesNotApply) {
  const ForceAvailable force;
  const at::Tensor x = at::randn({64, 48}, at::detail::createCPUGenerator(3)) * 3;
  const at::Tensor xb = x.to(at::kBFloat16);
  // Outside the scope, and for fp32 inside it: LibTorch's result, bit for bit.
  EXPECT_TRUE(at::equal(at::gelu(xb), at::cpu::gelu(xb)));
  {
    const CpuHalfFallbackGuard on;
    EXPECT_TRUE(at::equal(at::gelu(x), at::cpu::gelu(x)));
    EXPECT_TRUE(at::equal(at::gelu_backward(x, x * 2), at::cpu::gelu_backward(x, x * 2)));
    // Not dense (every other column): LibTorch's kernel.
    const at::Tensor strided = xb.slice(1, 0, 48, 2);
    EXPECT_TRUE(at::equal(at::gelu(strided), at::cpu::gelu(strided)));
    // An approximate mode LibTorch refuses: its error.
    EXPECT_THROW(at::gelu(xb, "sigmoid"), c10::Error);
    // Empty.
    EXPECT_EQ(at::gelu(xb.slice(0, 0, 0)).numel(), 0);
  }
}

TEST(CpuHalfGelu, KeepsTheLayoutOfDenseInputs) {
  const ForceAvailable force;
  const CpuHalfFallbackGuard on;
  const at::Tensor x =
      (at::randn({2, 5, 6, 7}, at::detail::createCPUGenerator(4)) * 2).to(at::kHalf);
  const at::Tensor want = at::gelu(x);
  for (const at::Tensor& v : {x.contiguous(at::MemoryFormat::ChannelsLast), x.transpose(1, 3)}) {
    const at::Tensor y = at::gelu(v);
    EXPECT_EQ(y.strides(), v.strides());
    EXPECT_TRUE(
        at::equal(y.contiguous(),
                  (v.is_contiguous(at::MemoryFormat::ChannelsLast) ? want : want.transpose(1, 3))
                      .contiguous()));
    const at::Tensor g = at::ones_like(v);
    EXPECT_TRUE(at::equal(at::gelu_backward(g, v).contiguous(),
                          at::gelu_backward(g.contiguous(), v.contiguous())));
  }
  // A gradient laid out differently from the input: LibTorch's kernel, the same values.
  const at::Tensor g = at::randn_like(x);
  const at::Tensor xl = x.contiguous(at::MemoryFormat::ChannelsLast);
  EXPECT_TRUE(at::allclose(at::gelu_backward(g, xl).to(at::kFloat),
                           at::gelu_backward(g, x).to(at::kFloat), 1e-2, 1e-3));
}

TEST(CpuHalfGelu, AutogradThroughTheRoute) {
  const ForceAvailable force;
  const at::Tensor x =
      (at::randn({300}, at::detail::createCPUGenerator(5)) * 3).to(at::kBFloat16).requires_grad_();
  const at::Tensor g = at::randn({300}, at::detail::createCPUGenerator(6)).to(at::kBFloat16);
  const CpuHalfFallbackGuard on;
  at::gelu(x, "tanh").backward(g);
  EXPECT_TRUE(at::equal(x.grad(), at::gelu_backward(g, x.detach(), "tanh")));
  at::Tensor want_y, want_dx;
  reference(x.detach(), g, true, want_y, want_dx);
  EXPECT_TRUE(within(x.grad(), want_dx, 1));
}

// Lengths and offsets that leave the vector loops a tail of every size (and a start that is not
// aligned), in both dtypes.
TEST(CpuHalfGelu, TailsAndUnalignedStarts) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(t));
    const at::Tensor x = all_patterns(t);
    const at::Tensor g = at::randn({x.numel()}, at::detail::createCPUGenerator(8)).to(t);
    at::Tensor want_y, want_dx;
    reference(x, g, false, want_y, want_dx);
    const CpuHalfFallbackGuard on;
    for (const auto& [offset, n] : std::vector<std::pair<int64_t, int64_t>>{
             {0, 1}, {3, 7}, {5, 15}, {1, 17}, {40000, 31}, {100, 33}, {17000, 1003}}) {
      SCOPED_TRACE("offset " + std::to_string(offset) + ", " + std::to_string(n) + " elements");
      const at::Tensor xs = x.slice(0, offset, offset + n);
      const at::Tensor gs = g.slice(0, offset, offset + n);
      EXPECT_TRUE(within(at::gelu(xs), want_y.slice(0, offset, offset + n).contiguous(), 0));
      EXPECT_TRUE(
          within(at::gelu_backward(gs, xs), want_dx.slice(0, offset, offset + n).contiguous(), 1));
    }
  }
}

TEST(CpuHalfSilu, EveryValueCorrectlyRoundedGradientsWithinOneUnit) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(t));
    const at::Tensor x = all_patterns(t);
    const at::Tensor g = at::randn({x.numel()}, at::detail::createCPUGenerator(9)).to(t);
    at::Tensor want_y, want_dx;
    reference(x, g, false, want_y, want_dx, silu_as_ref);
    at::Tensor y, dx, in_place;
    {
      const CpuHalfFallbackGuard on;
      const uint64_t before = apex::amp::detail::cpu_half_route_calls();
      y = at::silu(x);
      dx = at::silu_backward(g, x);
      in_place = x.clone();
      at::silu_(in_place);
      EXPECT_EQ(apex::amp::detail::cpu_half_route_calls(), before + 3);
    }
    EXPECT_EQ(y.scalar_type(), t);
    EXPECT_TRUE(within(y, want_y, 0));  // correctly rounded
    EXPECT_TRUE(within(dx, want_dx, 1));
    EXPECT_TRUE(at::equal(in_place.view(at::kShort), y.view(at::kShort)));  // NaNs too
  }
}

TEST(CpuHalfSilu, LayoutsAutogradAndLibTorchsKernelElsewhere) {
  const ForceAvailable force;
  const at::Tensor x =
      (at::randn({2, 5, 6, 7}, at::detail::createCPUGenerator(10)) * 4).to(at::kBFloat16);
  const at::Tensor g = at::randn({2, 5, 6, 7}, at::detail::createCPUGenerator(11)).to(x.dtype());
  at::Tensor want_y, want_dx;
  reference(x.flatten(), g.flatten(), false, want_y, want_dx, silu_as_ref);
  const CpuHalfFallbackGuard on;
  // Dense layouts keep their strides.
  const at::Tensor cl = x.contiguous(at::MemoryFormat::ChannelsLast);
  EXPECT_EQ(at::silu(cl).strides(), cl.strides());
  EXPECT_TRUE(at::equal(at::silu(cl).contiguous(), at::silu(x)));
  // Not dense, fp32, a gradient laid out unlike its input: LibTorch's kernels.
  const at::Tensor strided = x.slice(3, 0, 7, 2);
  EXPECT_TRUE(at::equal(at::silu(strided), at::cpu::silu(strided)));
  const at::Tensor xf = x.to(at::kFloat);
  EXPECT_TRUE(at::equal(at::silu(xf), at::cpu::silu(xf)));
  EXPECT_TRUE(at::allclose(at::silu_backward(g, cl).to(at::kFloat),
                           at::silu_backward(g, x).to(at::kFloat), 1e-2, 1e-3));
  // Autograd: the backward is the table's.
  const at::Tensor leaf = x.clone().requires_grad_();
  at::silu(leaf).backward(g);
  EXPECT_TRUE(within(leaf.grad().flatten(), want_dx, 1));
}
