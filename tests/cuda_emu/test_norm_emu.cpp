// The CUDA LayerNorm/RMSNorm kernels (src/kernels/cuda/norm.cu), run by the emulation through the
// kernel-layer entry points the library calls (kernels::cuda::norm_forward/norm_backward), against
// float64 references: fp32/fp16/bf16 storage and mixed dtypes, affine on/off, the
// memory-efficient backward, the register and fallback paths (widths on both sides of every
// switch, odd widths, misaligned buffers), the dw/db partial-row reduction, small and large
// devices. The schedule comes from CUDA_EMU_SCHEDULE (CTest runs the suite under two).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "emu_test_util.h"
#include "kernels/norm.h"

namespace {

using apex::kernels::DType;
using apex::kernels::NormBackwardArgs;
using apex::kernels::NormForwardArgs;
using cuda_emu_test::Buffer;
using cuda_emu_test::close;
using cuda_emu_test::guards_intact;
using cuda_emu_test::kBF16;
using cuda_emu_test::kF16;
using cuda_emu_test::kF32;
using cuda_emu_test::tolerance_for;

enum Affine { kNone = 0, kWeight = 1, kWeightBias = 2 };

struct NormCase {
  int64_t rows;
  int64_t cols;
  bool rms = false;
  DType x = kF32;  ///< x and dx
  DType w = kF32;  ///< w and b
  DType y = kF32;  ///< y and dy
  Affine affine = kWeightBias;
  int64_t misalign = 0;  ///< elements x and dx sit past a 64-byte boundary (scalar path)
  int device = 0;        ///< emulated device: 0 has 132 SMs, 1 has 1, 2 has 3
  bool memory_efficient = false;
  bool dwdb = true;
  bool tiny_weights = false;  ///< zeros and |w| < eps among the weights (memory-efficient clamp)
  bool workspace = false;     ///< dw/db scratch from the caller's callback (the library's way)

  std::string name() const {
    std::string s = rms ? "rms" : "ln";
    s += std::string("_") + cuda_emu_test::dtype_name(x) + "_" + cuda_emu_test::dtype_name(w) +
         "_" + cuda_emu_test::dtype_name(y);
    s += affine == kNone ? "_noaffine" : affine == kWeight ? "_w" : "_wb";
    s += "_" + std::to_string(rows) + "x" + std::to_string(cols);
    if (misalign != 0) s += "_misaligned";
    if (device != 0) s += "_dev" + std::to_string(device);
    if (memory_efficient) s += "_memeff";
    if (!dwdb) s += "_nodwdb";
    if (tiny_weights) s += "_tinyw";
    if (workspace) s += "_workspace";
    return s;
  }
};

void PrintTo(const NormCase& c, std::ostream* os) { *os << c.name(); }

constexpr float kEps = 1e-5f;

/// Inputs of one case and their float64 forward reference.
struct Inputs {
  Buffer x, w, b, dy;
  std::vector<double> mean, rstd, y;  // reference, y unrounded

  explicit Inputs(const NormCase& c) {
    const int64_t n = c.rows * c.cols;
    const uint64_t seed = static_cast<uint64_t>(c.rows * 1000003 + c.cols);
    x = Buffer(c.x, n, c.misalign);
    cuda_emu_test::fill_uniform(x, seed, -0.5, 1.5);  // a non-zero mean: centering matters
    if (c.affine != kNone) {
      w = Buffer(c.w, c.cols);
      cuda_emu_test::fill_uniform(w, seed + 1, 0.5, 1.5);
      if (c.tiny_weights) {
        for (int64_t j = 0; j < c.cols; j += 3) w.set(j, j % 2 == 0 ? 0.0 : -2e-6);
      }
    }
    if (c.affine == kWeightBias) {
      b = Buffer(c.w, c.cols);
      cuda_emu_test::fill_uniform(b, seed + 2, -0.5, 0.5);
    }
    dy = Buffer(c.y, n, c.misalign);
    cuda_emu_test::fill_uniform(dy, seed + 3);

    mean.assign(static_cast<std::size_t>(c.rows), 0.0);
    rstd.assign(static_cast<std::size_t>(c.rows), 0.0);
    y.assign(static_cast<std::size_t>(n), 0.0);
    for (int64_t r = 0; r < c.rows; ++r) {
      double m = 0.0;
      if (!c.rms) {
        for (int64_t j = 0; j < c.cols; ++j) m += x.get(r * c.cols + j);
        m /= static_cast<double>(c.cols);
      }
      double q = 0.0;
      for (int64_t j = 0; j < c.cols; ++j) {
        const double d = x.get(r * c.cols + j) - m;
        q += d * d;
      }
      const double rs = 1.0 / std::sqrt(q / static_cast<double>(c.cols) + kEps);
      mean[static_cast<std::size_t>(r)] = m;
      rstd[static_cast<std::size_t>(r)] = rs;
      for (int64_t j = 0; j < c.cols; ++j) {
        double v = (x.get(r * c.cols + j) - m) * rs;
        if (c.affine != kNone) v *= w.get(j);
        if (c.affine == kWeightBias) v += b.get(j);
        y[static_cast<std::size_t>(r * c.cols + j)] = v;
      }
    }
  }
};

class NormFwdEmu : public ::testing::TestWithParam<NormCase> {
 protected:
  void SetUp() override { ASSERT_EQ(cudaSetDevice(GetParam().device), cudaSuccess); }
  void TearDown() override {
    (void)cudaSetDevice(0);
    EXPECT_EQ(cuda_emu::live_allocations(), 0u) << "scratch memory leaked";
  }
};

class NormBwdEmu : public NormFwdEmu {};

TEST_P(NormFwdEmu, Forward) {
  const NormCase& c = GetParam();
  Inputs in(c);
  Buffer y(c.y, c.rows * c.cols, c.misalign);
  Buffer mean(kF32, c.rows);
  Buffer rstd(kF32, c.rows);
  y.poison();
  mean.poison();
  rstd.poison();

  NormForwardArgs a;
  a.rows = c.rows;
  a.cols = c.cols;
  a.rms = c.rms;
  a.eps = kEps;
  a.x_dtype = c.x;
  a.y_dtype = c.y;
  a.w_dtype = c.w;
  a.x = in.x.data();
  a.w = c.affine != kNone ? in.w.data() : nullptr;
  a.b = c.affine == kWeightBias ? in.b.data() : nullptr;
  a.y = y.data();
  a.mean = c.rms ? nullptr : mean.f32();  // RMSNorm has no mean to write
  a.rstd = rstd.f32();
  apex::kernels::cuda::norm_forward(a, nullptr);

  EXPECT_TRUE(close(y.values(), in.y, tolerance_for(c.y))) << "y";
  EXPECT_TRUE(close(rstd.values(), in.rstd, tolerance_for(kF32))) << "rstd";
  if (c.rms) {
    EXPECT_TRUE(std::isnan(mean.get(0))) << "RMSNorm wrote a mean";
  } else {
    EXPECT_TRUE(close(mean.values(), in.mean, tolerance_for(kF32))) << "mean";
  }
  EXPECT_TRUE(guards_intact(y, "y"));
  EXPECT_TRUE(guards_intact(mean, "mean"));
  EXPECT_TRUE(guards_intact(rstd, "rstd"));
}

double clamp_weight(double w, double eps) {
  return w >= 0.0 ? (w < eps ? eps : w) : (w > -eps ? -eps : w);
}

TEST_P(NormBwdEmu, Backward) {
  const NormCase& c = GetParam();
  Inputs in(c);
  const int64_t n = c.rows * c.cols;
  // Saved statistics as the forward stores them (fp32); the reference uses the same values.
  Buffer mean(kF32, c.rows);
  Buffer rstd(kF32, c.rows);
  for (int64_t r = 0; r < c.rows; ++r) {
    mean.set(r, in.mean[static_cast<std::size_t>(r)]);
    rstd.set(r, in.rstd[static_cast<std::size_t>(r)]);
  }
  Buffer y(c.y, n, c.misalign);  // the forward's output, for the memory-efficient mode
  for (int64_t i = 0; i < n; ++i) y.set(i, in.y[static_cast<std::size_t>(i)]);

  Buffer dx(c.x, n, c.misalign);
  const bool want_w = c.dwdb && c.affine != kNone;
  const bool want_b = c.dwdb && c.affine == kWeightBias;
  Buffer dw(kF32, c.cols);
  Buffer db(kF32, c.cols);
  dx.poison();
  dw.poison();
  db.poison();

  NormBackwardArgs a;
  a.rows = c.rows;
  a.cols = c.cols;
  a.rms = c.rms;
  a.eps = kEps;
  a.x_dtype = c.x;
  a.dy_dtype = c.y;
  a.w_dtype = c.w;
  a.dy = in.dy.data();
  a.x = c.memory_efficient ? nullptr : in.x.data();
  a.y = c.memory_efficient ? y.data() : nullptr;
  a.w = c.affine != kNone ? in.w.data() : nullptr;
  a.b = c.affine == kWeightBias ? in.b.data() : nullptr;
  a.mean = c.rms || c.memory_efficient ? nullptr : mean.f32();
  a.rstd = rstd.f32();
  a.dx = dx.data();
  a.dw = want_w ? dw.data() : nullptr;
  a.db = want_b ? db.data() : nullptr;
  a.dwb_dtype = kF32;
  // The library passes torch's caching allocator; here a poisoned buffer, asked for at most once.
  Buffer scratch;
  int scratch_calls = 0;
  if (c.workspace) {
    a.workspace = [&](std::size_t bytes) -> void* {
      ++scratch_calls;
      scratch = Buffer(kF32, static_cast<int64_t>((bytes + 3) / 4));
      scratch.poison();
      return scratch.data();
    };
  }
  apex::kernels::cuda::norm_backward(a, nullptr);
  if (c.workspace) {
    EXPECT_EQ(scratch_calls, want_w || want_b ? 1 : 0);
    if (scratch_calls == 1) {
      EXPECT_TRUE(guards_intact(scratch, "workspace"));
    }
  }

  // float64 reference from the same stored inputs.
  std::vector<double> ref_dx(static_cast<std::size_t>(n));
  std::vector<double> ref_dw(static_cast<std::size_t>(c.cols), 0.0);
  std::vector<double> ref_db(static_cast<std::size_t>(c.cols), 0.0);
  std::vector<double> abs_dw(static_cast<std::size_t>(c.cols), 0.0);
  std::vector<double> abs_db(static_cast<std::size_t>(c.cols), 0.0);
  std::vector<double> xh(static_cast<std::size_t>(c.cols));
  std::vector<double> g(static_cast<std::size_t>(c.cols));
  for (int64_t r = 0; r < c.rows; ++r) {
    const double m = c.rms ? 0.0 : mean.get(r);
    const double rs = rstd.get(r);
    double sg = 0.0;
    double sgx = 0.0;
    for (int64_t j = 0; j < c.cols; ++j) {
      const auto k = static_cast<std::size_t>(j);
      const int64_t i = r * c.cols + j;
      const double wj = c.affine != kNone ? in.w.get(j) : 1.0;
      if (c.memory_efficient) {
        const double centered = y.get(i) - (c.affine == kWeightBias ? in.b.get(j) : 0.0);
        xh[k] = c.affine != kNone ? centered / clamp_weight(wj, kEps) : centered;
      } else {
        xh[k] = (in.x.get(i) - m) * rs;
      }
      const double d = in.dy.get(i);
      g[k] = d * wj;
      sg += g[k];
      sgx += g[k] * xh[k];
      ref_dw[k] += d * xh[k];
      abs_dw[k] += std::fabs(d * xh[k]);
      ref_db[k] += d;
      abs_db[k] += std::fabs(d);
    }
    const double cx = sgx / static_cast<double>(c.cols);
    const double c0 = c.rms ? 0.0 : sg / static_cast<double>(c.cols);
    for (int64_t j = 0; j < c.cols; ++j) {
      const auto k = static_cast<std::size_t>(j);
      ref_dx[static_cast<std::size_t>(r * c.cols + j)] = rs * (g[k] - c0 - xh[k] * cx);
    }
  }
  EXPECT_TRUE(close(dx.values(), ref_dx, tolerance_for(c.x))) << "dx";
  EXPECT_TRUE(guards_intact(dx, "dx"));
  // dw/db are fp32 sums over the rows: widened by the rounding bound of a sum of `rows` terms,
  // (rows - 1) * u * sum |terms| (a row lost or counted twice is far above it for these sizes).
  const auto bound = [&](const std::vector<double>& abs_sum) {
    std::vector<double> e(abs_sum.size());
    for (std::size_t k = 0; k < e.size(); ++k) {
      e[k] = static_cast<double>(c.rows) * cuda_emu_test::kF32Unit * abs_sum[k];
    }
    return e;
  };
  if (want_w) {
    const std::vector<double> e = bound(abs_dw);
    EXPECT_TRUE(close(dw.values(), ref_dw, tolerance_for(kF32), &e)) << "dw";
  } else {
    EXPECT_TRUE(std::isnan(dw.get(0))) << "dw written though not asked for";
  }
  if (want_b) {
    const std::vector<double> e = bound(abs_db);
    EXPECT_TRUE(close(db.values(), ref_db, tolerance_for(kF32), &e)) << "db";
  }
  EXPECT_TRUE(guards_intact(dw, "dw"));
  EXPECT_TRUE(guards_intact(db, "db"));
}

// ---------------------------------------------------------------------------------------------
// The cases. Path switches (kernels/cuda/norm.cu): a row is held in registers up to 16 elements
// per thread in teams of up to 32 warps (forward) or 16 (backward): fp32 vectors of 4 up to
// 16384 / 8192 columns, fp16/bf16 vectors of 8 the same, scalars (odd widths, misaligned)
// up to 4096 / 2048; wider rows take the block-per-row fallback.
// ---------------------------------------------------------------------------------------------

std::vector<NormCase> cases() {
  const std::vector<std::pair<int64_t, int64_t>> all_shapes = {
      {1, 1},     {3, 7},     {5, 31},    {4, 32},    {7, 33},     {33, 64},   {65, 96},
      {17, 128},  {9, 255},   {6, 256},   {300, 64},  {4, 1000},   {3, 1024},  {2, 2047},
      {2, 2048},  {2, 2049},  {2, 4095},  {2, 4096},  {2, 4097},   {2, 8192},  {9, 8200},
      {2, 16384}, {2, 16385}, {2, 16392}, {3, 20000}, {130, 2048}, {40, 16400}};
  const std::vector<std::pair<int64_t, int64_t>> some_shapes = {
      {1, 1},    {5, 31},   {33, 64},   {300, 64},  {4, 1000}, {2, 2049},
      {2, 4096}, {9, 8200}, {2, 16384}, {2, 16392}, {3, 20000}};
  std::vector<NormCase> out;
  int k = 0;
  const auto add = [&](NormCase c) {
    out.push_back(c);
    ++k;
  };
  // Every shape: LayerNorm fp32 with weight and bias, on each of the three devices in turn.
  for (const auto& [r, c] : all_shapes) add({.rows = r, .cols = c, .device = k % 3});
  // Every shape: RMSNorm fp32 with a weight.
  for (const auto& [r, c] : all_shapes) {
    add({.rows = r, .cols = c, .rms = true, .affine = kWeight, .device = (k + 1) % 3});
  }
  // Half storage, mixed dtypes (half input, fp32 parameters and output), no affine, misaligned.
  struct Dt {
    DType x, w, y;
  };
  const std::vector<Dt> dtypes = {
      {kF16, kF16, kF16}, {kBF16, kBF16, kBF16}, {kF16, kF32, kF32}, {kBF16, kF32, kF32}};
  for (const Dt& d : dtypes) {
    for (const auto& [r, c] : some_shapes) {
      add({.rows = r, .cols = c, .x = d.x, .w = d.w, .y = d.y, .device = k % 3});
      add({.rows = r,
           .cols = c,
           .rms = true,
           .x = d.x,
           .w = d.w,
           .y = d.y,
           .affine = kWeight,
           .device = k % 3});
    }
  }
  for (const auto& [r, c] : some_shapes) {
    add({.rows = r, .cols = c, .affine = kNone, .device = k % 3});
    add({.rows = r, .cols = c, .rms = true, .affine = kNone, .device = k % 3});
    add({.rows = r, .cols = c, .affine = kWeight, .device = k % 3});
    add({.rows = r, .cols = c, .misalign = 1, .device = k % 3});
    add({.rows = r, .cols = c, .x = kBF16, .w = kBF16, .y = kBF16, .misalign = 1});
    add({.rows = r, .cols = c, .device = k % 3, .dwdb = false});
    add({.rows = r, .cols = c, .device = k % 3, .workspace = true});
  }
  // Memory-efficient backward (x_hat from y), with the weight clamp.
  for (const auto& [r, c] : some_shapes) {
    add({.rows = r, .cols = c, .device = k % 3, .memory_efficient = true});
    add({.rows = r,
         .cols = c,
         .rms = true,
         .affine = kWeight,
         .device = k % 3,
         .memory_efficient = true});
    add({.rows = r,
         .cols = c,
         .x = kF16,
         .w = kF16,
         .y = kF16,
         .device = k % 3,
         .memory_efficient = true,
         .tiny_weights = true});
  }
  return out;
}

std::vector<NormCase> forward_cases() {
  std::vector<NormCase> out;
  for (const NormCase& c : cases()) {
    // The others are backward variants.
    if (!c.memory_efficient && c.dwdb && !c.workspace) out.push_back(c);
  }
  return out;
}

std::string case_name(const ::testing::TestParamInfo<NormCase>& i) { return i.param.name(); }

INSTANTIATE_TEST_SUITE_P(Cases, NormFwdEmu, ::testing::ValuesIn(forward_cases()), case_name);
INSTANTIATE_TEST_SUITE_P(Cases, NormBwdEmu, ::testing::ValuesIn(cases()), case_name);

// ---------------------------------------------------------------------------------------------
// The entry points' own checks (host side)
// ---------------------------------------------------------------------------------------------

TEST(NormEmuErrors, MessagesNameTheProblem) {
  NormForwardArgs f;
  f.rows = 2;
  f.cols = 3;
  EXPECT_THROW(
      {
        try {
          apex::kernels::cuda::norm_forward(f, nullptr);
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "apex::kernels::cuda::norm_forward: x, y and rstd are required");
          throw;
        }
      },
      std::runtime_error);
  NormBackwardArgs b;
  b.rows = 2;
  b.cols = 3;
  float dummy[8] = {};
  b.dy = dummy;
  b.dx = dummy;
  b.rstd = dummy;
  b.x = dummy;
  b.dw = dummy;
  b.dwb_dtype = DType::kBFloat16;
  b.rms = true;
  EXPECT_THROW(
      {
        try {
          apex::kernels::cuda::norm_backward(b, nullptr);
        } catch (const std::runtime_error& e) {
          EXPECT_STREQ(e.what(), "apex::kernels::cuda::norm_backward: dw and db must be fp32");
          throw;
        }
      },
      std::runtime_error);
}

TEST(NormEmuErrors, EmptyShapesLaunchNothing) {
  cuda_emu::reset_stats();
  NormForwardArgs f;
  f.rows = 0;
  f.cols = 5;
  apex::kernels::cuda::norm_forward(f, nullptr);
  NormBackwardArgs b;
  b.rows = 4;
  b.cols = 0;
  apex::kernels::cuda::norm_backward(b, nullptr);
  EXPECT_EQ(cuda_emu::stats().launches, 0u);
}

}  // namespace
