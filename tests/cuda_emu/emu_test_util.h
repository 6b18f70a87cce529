// Helpers of the emulated CUDA kernel tests: storage buffers in any kernel dtype with guard
// canaries, an independent fp16/bf16 encoding, float64 comparisons with the project's tolerance
// table, and the schedule parameter. No LibTorch: the kernels take plain structs.
#pragma once

#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cuda_emu.h"
#include "kernels/multi_tensor.h"

namespace cuda_emu_test {

using apex::kernels::DType;

inline constexpr DType kF32 = DType::kFloat32;
inline constexpr DType kF16 = DType::kFloat16;
inline constexpr DType kBF16 = DType::kBFloat16;

// ---------------------------------------------------------------------------------------------
// Schedules
// ---------------------------------------------------------------------------------------------

/// A test run under the schedule named by its parameter (restored afterwards).
class ScheduleTest : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    saved_ = cuda_emu::schedule();
    cuda_emu::Schedule s;
    ASSERT_TRUE(cuda_emu::parse_schedule(GetParam(), &s)) << GetParam();
    cuda_emu::set_schedule(s);
    cuda_emu::reset_stats();
  }
  void TearDown() override {
    cuda_emu::set_schedule(saved_);
    // Tests of faults leave the launch error set, as a GPU would: clear it for the next test.
    (void)cudaGetLastError();
  }

 private:
  cuda_emu::Schedule saved_;
};

inline auto all_schedules() {
  return ::testing::Values("warp-forward", "warp-reverse", "warp-random:1", "rr-forward",
                           "rr-reverse", "rr-random:2");
}

inline std::string schedule_name(const ::testing::TestParamInfo<const char*>& info) {
  std::string s = info.param;
  for (char& c : s) {
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// Storage dtypes, encoded independently of the toolkit's conversions
// ---------------------------------------------------------------------------------------------

inline const char* dtype_name(DType t) {
  switch (t) {
    case DType::kFloat32:
      return "f32";
    case DType::kFloat16:
      return "f16";
    case DType::kBFloat16:
      return "bf16";
  }
  return "?";
}

inline uint16_t bf16_bits(float f) {  // round to nearest even; NaN stays a quiet NaN
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

inline float bf16_value(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t f16_bits(float f) {
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t b;
  std::memcpy(&b, &h, 2);
  return b;
}

inline float f16_value(uint16_t b) {
  _Float16 h;
  std::memcpy(&h, &b, 2);
  return static_cast<float>(h);
}

/// v rounded to the storage dtype t (as a kernel's store would round an fp32 value).
inline double round_to(DType t, double v) {
  const float f = static_cast<float>(v);
  switch (t) {
    case DType::kFloat32:
      return f;
    case DType::kFloat16:
      return f16_value(f16_bits(f));
    case DType::kBFloat16:
      return bf16_value(bf16_bits(f));
  }
  return f;
}

/// Elements of dtype t in kernel memory, with kGuard canary elements on both sides and an
/// optional misalignment of `offset` elements from a 64-byte boundary.
class Buffer {
 public:
  static constexpr int64_t kGuard = 16;

  Buffer() = default;
  Buffer(DType t, int64_t n, int64_t offset = 0) : t_(t), n_(n), offset_(offset) {
    const std::size_t bytes = static_cast<std::size_t>((n + 2 * kGuard + offset) * elem()) + 64;
    storage_.reset(static_cast<unsigned char*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)));
    std::memset(storage_.get(), kCanary, (bytes + 63) / 64 * 64);
    total_ = (bytes + 63) / 64 * 64;
  }

  DType dtype() const { return t_; }
  int64_t size() const { return n_; }
  void* data() { return storage_.get() + (kGuard + offset_) * elem(); }
  const void* data() const { return storage_.get() + (kGuard + offset_) * elem(); }
  float* f32() { return static_cast<float*>(data()); }

  double get(int64_t i) const {
    const unsigned char* p = static_cast<const unsigned char*>(data()) + i * elem();
    if (t_ == DType::kFloat32) {
      float f;
      std::memcpy(&f, p, 4);
      return f;
    }
    uint16_t b;
    std::memcpy(&b, p, 2);
    return t_ == DType::kFloat16 ? f16_value(b) : bf16_value(b);
  }

  void set(int64_t i, double v) {
    unsigned char* p = static_cast<unsigned char*>(data()) + i * elem();
    const float f = static_cast<float>(v);
    if (t_ == DType::kFloat32) {
      std::memcpy(p, &f, 4);
      return;
    }
    const uint16_t b = t_ == DType::kFloat16 ? f16_bits(f) : bf16_bits(f);
    std::memcpy(p, &b, 2);
  }

  /// Fills the elements with NaN (bytes 0xFF): outputs a kernel forgets to write show.
  void poison() { std::memset(data(), 0xFF, static_cast<std::size_t>(n_ * elem())); }

  std::vector<double> values() const {
    std::vector<double> v(static_cast<std::size_t>(n_));
    for (int64_t i = 0; i < n_; ++i) v[static_cast<std::size_t>(i)] = get(i);
    return v;
  }

  /// Empty when the canaries around the elements are intact, else where they were overwritten.
  std::string guard_damage() const {
    const unsigned char* base = storage_.get();
    const int64_t lo = (kGuard + offset_) * elem();
    const int64_t hi = lo + n_ * elem();
    for (int64_t b = 0; b < static_cast<int64_t>(total_); ++b) {
      if (b >= lo && b < hi) continue;
      if (base[b] != kCanary) {
        std::ostringstream out;
        out << "guard byte " << (b < lo ? b - lo : b - hi) << (b < lo ? " before" : " after")
            << " the " << n_ << " elements was overwritten";
        return out.str();
      }
    }
    return {};
  }

  bool same_bits(const Buffer& o) const {
    return n_ == o.n_ && t_ == o.t_ &&
           std::memcmp(data(), o.data(), static_cast<std::size_t>(n_ * elem())) == 0;
  }

  Buffer clone() const {
    Buffer b(t_, n_, offset_);
    std::memcpy(b.storage_.get(), storage_.get(), total_);
    return b;
  }

 private:
  static constexpr unsigned char kCanary = 0xA5;
  struct Free {
    void operator()(unsigned char* p) const { std::free(p); }
  };
  int64_t elem() const { return apex::kernels::dtype_size(t_); }

  DType t_ = DType::kFloat32;
  int64_t n_ = 0;
  int64_t offset_ = 0;
  std::size_t total_ = 0;
  std::unique_ptr<unsigned char, Free> storage_;
};

/// Uniform values in [lo, hi), reproducible per seed, already representable in dtype t.
inline void fill_uniform(Buffer& b, uint64_t seed, double lo = -1.0, double hi = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> dist(lo, hi);
  for (int64_t i = 0; i < b.size(); ++i) b.set(i, dist(rng));
}

// ---------------------------------------------------------------------------------------------
// Comparison with a float64 reference: the tolerance table of docs/design.md
// ---------------------------------------------------------------------------------------------

struct Tolerance {
  double rtol;
  double atol;
};

inline Tolerance tolerance_for(DType t) {
  switch (t) {
    case DType::kFloat32:
      return {1e-5, 1e-6};
    case DType::kBFloat16:
      return {1.6e-2, 1e-3};
    case DType::kFloat16:
      return {1e-3, 1e-4};
  }
  return {0, 0};
}

/// Checks |got - ref| <= atol + rtol * |ref| + extra[i] (extra: a written widening, e.g. the
/// rounding bound of a long fp32 sum) per element, NaN only where the reference is NaN.
inline ::testing::AssertionResult close(const std::vector<double>& got,
                                        const std::vector<double>& ref, Tolerance tol,
                                        const std::vector<double>* extra = nullptr) {
  if (got.size() != ref.size()) {
    return ::testing::AssertionFailure() << "size " << got.size() << " != " << ref.size();
  }
  int64_t bad = 0;
  int64_t worst = -1;
  double worst_ratio = 0;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double allow = tol.atol + tol.rtol * std::fabs(ref[i]) + (extra ? (*extra)[i] : 0.0);
    const double err = std::fabs(got[i] - ref[i]);
    const bool ok = std::isnan(ref[i]) ? std::isnan(got[i]) : (got[i] == ref[i] || err <= allow);
    if (!ok) {
      ++bad;
      const double ratio = std::isnan(err) ? INFINITY : err / allow;
      if (worst < 0 || ratio > worst_ratio) {
        worst = static_cast<int64_t>(i);
        worst_ratio = ratio;
      }
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  const auto w = static_cast<std::size_t>(worst);
  return ::testing::AssertionFailure()
         << bad << " of " << got.size() << " elements off; worst [" << worst << "]: got " << got[w]
         << ", float64 reference " << ref[w] << " (rtol " << tol.rtol << ", atol " << tol.atol
         << (extra ? " + a rounding bound" : "") << ")";
}

inline ::testing::AssertionResult guards_intact(const Buffer& b, const std::string& what) {
  const std::string damage = b.guard_damage();
  if (damage.empty()) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << what << ": " << damage;
}

/// Unit roundoff of fp32.
inline constexpr double kF32Unit = 5.9604644775390625e-08;

}  // namespace cuda_emu_test
