// CPU driver of the activations of bf16/fp16 tensors: the function's tables, built in fp64 on
// first use, and contiguous ranges in parallel on ATen's thread pool, each by the lookup kernels
// of the best instruction set (kernels/cpu/isa.h). Elementwise: the result does not depend on the
// split.
#include <c10/util/Exception.h>
#include "kernels/cpu/parallel.h"

#include <xmmintrin.h>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#include "kernels/activation.h"
#include "kernels/cpu/half_bits.h"
#include "kernels/cpu/isa.h"

namespace apex::kernels::cpu {
namespace {

// Elements per task: a few microseconds of lookups, so small tensors stay on the calling thread.
constexpr int64_t kGrain = 32768;
constexpr int64_t kPatterns = 65536;

// Clears the SSE flush-to-zero and denormals-are-zero bits for its lifetime.
class ExactSubnormals {
 public:
  ExactSubnormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ & ~kFlushBits); }
  ~ExactSubnormals() { _mm_setcsr(saved_); }
  ExactSubnormals(const ExactSubnormals&) = delete;
  ExactSubnormals& operator=(const ExactSubnormals&) = delete;

 private:
  static constexpr unsigned kFlushBits = 0x8040;  // FTZ (bit 15) and DAZ (bit 6)
  unsigned saved_;
};

struct Tables {
  std::array<uint16_t, kPatterns + 1> y{};  // f(x), rounded to the dtype; one entry of padding
  std::array<float, kPatterns> dy{};        // f'(x), rounded to fp32
};

// v rounded to nearest even in t, correctly: through fp32 rounded to odd (the inexact fp32 result
// gets an odd last bit), which keeps every tie of the 16-bit format a tie only where v is one;
// then c10's rounding to nearest even.
uint16_t round_to(double v, DType t) {
  float f = static_cast<float>(v);
  if (std::isfinite(v) && static_cast<double>(f) != v) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 1) == 0) {
      f = std::nextafter(f, static_cast<double>(f) < v ? INFINITY : -INFINITY);
    }
  }
  return float_to_half_bits(f, t);
}

// gelu and gelu' in fp64: x Phi(x) with Phi(x) = erfc(-x / sqrt 2) / 2 (exact form), or the tanh
// form and its derivative. 0.5 (1 + tanh(u)) is evaluated as sigma(2u) = 1 / (1 + exp(-2u)),
// which does not cancel where tanh(u) is near -1 (x < -3), and 1 - sigma(2u) as exp(-2u) sigma(2u).
void gelu64(double x, bool tanh, double& y, double& dy) {
  if (tanh) {
    constexpr double kScale = 0.79788456080286535588;  // sqrt(2 / pi)
    constexpr double kCubic = 0.044715;
    const double u = kScale * (x + kCubic * x * x * x);
    const double e = std::exp(-2.0 * u);
    const double s = 1.0 / (1.0 + e);
    const double one_minus_s = std::isinf(e) ? 1.0 : e * s;
    y = x * s;
    dy = s + 2.0 * x * s * one_minus_s * kScale * (1.0 + 3.0 * kCubic * x * x);
    return;
  }
  const double phi = 0.5 * std::erfc(-x * 0.70710678118654752440);
  y = x * phi;
  dy = phi + x * std::exp(-0.5 * x * x) * 0.39894228040143267794;  // + x * pdf(x)
}

// silu and silu' in fp64: x sigma(x), sigma(x) (1 + x (1 - sigma(x))) with 1 - sigma(x) as
// exp(-x) sigma(x) (no cancellation for large x). At x = -inf both are NaN, as x / (1 + exp(-x))
// evaluates there and LibTorch's kernel gives; at +inf, silu is +inf and silu' NaN, likewise.
void silu64(double x, double& y, double& dy) {
  const double e = std::exp(-x);
  const double s = 1.0 / (1.0 + e);
  y = x / (1.0 + e);
  dy = s * (1.0 + x * (std::isinf(e) ? 1.0 : e * s));
}

enum Fn { kGeluErf, kGeluTanh, kSilu, kFns };

const Tables& tables_of(DType t, Fn fn) {
  TORCH_CHECK(t == DType::kBFloat16 || t == DType::kFloat16,
              "apex activation kernels: expected bf16 or fp16 elements");
  static std::once_flag once[2][kFns];
  static std::unique_ptr<Tables> tables[2][kFns];
  const int d = t == DType::kBFloat16 ? 0 : 1;
  std::call_once(once[d][fn], [&] {
    // Subnormal inputs and results must stay what they are, whatever flush-to-zero mode the
    // building thread runs in (torch.set_flush_denormal): the tables serve every thread after.
    const ExactSubnormals exact;
    auto tb = std::make_unique<Tables>();
    for (int64_t i = 0; i < kPatterns; ++i) {
      double y, dy;
      const double x = half_bits_to_float(static_cast<uint16_t>(i), t);
      if (fn == kSilu) {
        silu64(x, y, dy);
      } else {
        gelu64(x, fn == kGeluTanh, y, dy);
      }
      tb->y[static_cast<size_t>(i)] = round_to(y, t);
      tb->dy[static_cast<size_t>(i)] = static_cast<float>(dy);
    }
    tables[d][fn] = std::move(tb);
  });
  return *tables[d][fn];
}

const uint16_t* at16(const void* p, int64_t i) { return static_cast<const uint16_t*>(p) + i; }
uint16_t* at16(void* p, int64_t i) { return static_cast<uint16_t*>(p) + i; }

void apply(const void* x, void* y, DType t, int64_t n, Fn fn) {
  const Tables& tb = tables_of(t, fn);
  const auto* k = cpu_kernels().lookup;
  parallel_for(0, n, kGrain,
               [&](int64_t b, int64_t e) { k->map16(at16(x, b), at16(y, b), e - b, tb.y.data()); });
}

void apply_backward(const void* g, const void* x, void* dx, DType t, int64_t n, Fn fn) {
  const Tables& tb = tables_of(t, fn);
  const auto* k = cpu_kernels().lookup;
  parallel_for(0, n, kGrain, [&](int64_t b, int64_t e) {
    k->scale16(at16(g, b), at16(x, b), at16(dx, b), e - b, tb.dy.data(), t);
  });
}

}  // namespace

void gelu(const void* x, void* y, DType t, int64_t n, bool tanh) {
  apply(x, y, t, n, tanh ? kGeluTanh : kGeluErf);
}

void gelu_backward(const void* g, const void* x, void* dx, DType t, int64_t n, bool tanh) {
  apply_backward(g, x, dx, t, n, tanh ? kGeluTanh : kGeluErf);
}

void silu(const void* x, void* y, DType t, int64_t n) { apply(x, y, t, n, kSilu); }

void silu_backward(const void* g, const void* x, void* dx, DType t, int64_t n) {
  apply_backward(g, x, dx, t, n, kSilu);
}

}  // namespace apex::kernels::cpu
