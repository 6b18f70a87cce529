// Fused LayerNorm / RMSNorm (CPU kernels) against at::layer_norm and float64 references:
// forward, input, weight and bias gradients.
#include <apex/amp/initialize.h>
#include <apex/normalization.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/forward_grad.h>

#include "../common/test_util.h"

namespace apex::test {
namespace {

using apex::normalization::fused_layer_norm;
using apex::normalization::fused_rms_norm;

struct Case {
  std::vector<int64_t> shape;  // input shape; the last `nd` dims are normalized
  size_t nd;
};

std::vector<int64_t> tail(const std::vector<int64_t>& s, size_t nd) {
  return {s.end() - static_cast<std::ptrdiff_t>(nd), s.end()};
}

// Reference in float64 with LibTorch's autograd: returns {y, dx, dw, db}.
std::vector<at::Tensor> reference(const at::Tensor& x, const at::Tensor& w, const at::Tensor& b,
                                  const at::Tensor& dy, const std::vector<int64_t>& shape,
                                  double eps, bool rms) {
  auto xd = x.detach().to(at::kDouble).set_requires_grad(true);
  auto wd = w.defined() ? w.detach().to(at::kDouble).set_requires_grad(true) : at::Tensor();
  auto bd = b.defined() ? b.detach().to(at::kDouble).set_requires_grad(true) : at::Tensor();
  at::Tensor y;
  if (rms) {
    std::vector<int64_t> dims;
    for (int64_t d = xd.dim() - static_cast<int64_t>(shape.size()); d < xd.dim(); ++d) {
      dims.push_back(d);
    }
    y = xd / (xd.square().mean(dims, true) + eps).sqrt();
    if (wd.defined()) y = y * wd;
  } else {
    y = at::layer_norm(xd, shape, wd, bd, eps);
  }
  y.backward(dy.to(at::kDouble));
  return {y.detach(), xd.grad(), wd.defined() ? wd.grad() : at::Tensor(),
          bd.defined() ? bd.grad() : at::Tensor()};
}

// Gradient tolerances: sums over many rows/columns in fp32 (weight/bias) need an absolute floor
// scaled by the number of rows summed.
void check(const Case& c, at::ScalarType dtype, bool affine, bool rms, bool non_contiguous,
           bool memory_efficient = false) {
  auto gen = at::detail::createCPUGenerator(7);
  const auto shape = tail(c.shape, c.nd);
  at::Tensor x = at::randn(c.shape, gen).mul_(2.0).add_(0.5).to(dtype);
  if (non_contiguous) {
    // A strided view with the same logical shape: every other row of a taller tensor.
    auto tall = c.shape;
    tall[0] *= 2;
    x = at::randn(tall, gen).to(dtype).slice(0, 0, tall[0], 2);
  }
  x.set_requires_grad(true);
  at::Tensor w, b;
  if (affine) {
    // memory_efficient divides by the weight: keep it away from zero there.
    w = (memory_efficient ? at::rand(shape, gen) + 0.5 : at::randn(shape, gen) * 0.5 + 1.0)
            .to(dtype)
            .set_requires_grad(true);
    if (!rms) b = (at::randn(shape, gen) * 0.1).to(dtype).set_requires_grad(true);
  }
  const at::Tensor dy = at::randn(c.shape, gen).to(dtype);
  const double eps = 1e-5;
  at::Tensor y = rms ? fused_rms_norm(x, shape, w, eps, memory_efficient)
                     : fused_layer_norm(x, shape, w, b, eps, memory_efficient);
  ASSERT_EQ(y.scalar_type(), dtype);
  y.backward(dy);
  const auto ref = reference(x, w, b, dy, shape, eps, rms);
  const Tolerance tol = tolerance_for(dtype);
  const std::string what = std::string(rms ? "rms" : "ln") + " " + c10::toString(dtype) +
                           (affine ? " affine" : "") + (non_contiguous ? " strided" : "") +
                           (memory_efficient ? " memory_efficient" : "");
  EXPECT_TRUE(all_close(y, ref[0], tol)) << what << " forward";
  // dx mixes terms that cancel; bf16/fp16 storage of dy/dx rounds them: use the storage tolerance
  // with a floor from the size of the terms (|dy| ~ 1, rstd ~ 0.5).
  EXPECT_TRUE(all_close(x.grad(), ref[1], {tol.rtol, std::max(tol.atol, 4 * tol.rtol)}))
      << what << " dx";
  if (affine) {
    const double rows = static_cast<double>(x.numel() / w.numel());
    const Tolerance sum_tol{tol.rtol, tol.rtol * std::sqrt(rows) * 4};
    EXPECT_TRUE(all_close(w.grad(), ref[2], sum_tol)) << what << " dw";
    if (b.defined()) {
      EXPECT_TRUE(all_close(b.grad(), ref[3], sum_tol)) << what << " db";
    }
  }
}

const std::vector<Case> kCases = {
    {{32, 16}, 1},
    {{1, 1000}, 1},
    {{65536, 7}, 1},
    {{5, 1}, 1},
    {{3, 64}, 1},
    {{4, 1024}, 1},
    {{2, 4096}, 1},
    {{2, 12288}, 1},
    {{4, 9, 64}, 1},
    {{3, 4, 5, 6}, 2},
    // Backward partitions (blocks of at least 8 rows and 16k elements, at most 32): 300 rows of
    // 2048 leave two of the 32 blocks empty (blocks of 10, 30 used), 3000 of 512 give blocks of
    // 94 rows (a group of 64 stored, then 30 added), 21 rows of 4096 three blocks of 7 (rows wide
    // enough to be taken in pairs: three pairs and a single row each), 300 of 40 one block
    // (too small for two threads).
    {{300, 2048}, 1},
    {{3000, 512}, 1},
    {{21, 4096}, 1},
    {{300, 40}, 1},
};

TEST(FusedNorm, LayerNormMatchesReferenceFp32) {
  for (const auto& c : kCases) {
    for (bool affine : {true, false}) {
      for (bool mem : {false, true}) check(c, at::kFloat, affine, false, false, mem);
    }
  }
}

TEST(FusedNorm, RMSNormMatchesReferenceFp32) {
  for (const auto& c : kCases) {
    for (bool affine : {true, false}) {
      for (bool mem : {false, true}) check(c, at::kFloat, affine, true, false, mem);
    }
  }
}

TEST(FusedNorm, HalfDtypes) {
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (bool rms : {false, true}) {
      // 1000 columns: the wide-row kernels with a tail that is not a whole vector.
      // 5 x 8192: bf16 rows taken in pairs, and one single row.
      for (const Case& c : {Case{{32, 16}, 1}, Case{{64, 1024}, 1}, Case{{8, 1000}, 1},
                            Case{{3, 7, 64}, 1}, Case{{5, 8192}, 1}}) {
        for (bool mem : {false, true}) check(c, dtype, true, rms, false, mem);
      }
    }
  }
}

// LayerNorm with a bias and no weight (allowed, as in at::layer_norm): the bias is added, and
// memory_efficient recomputes x_hat = y - b. 976 columns: the scratch stride that used to be
// exactly 4 KiB.
TEST(FusedNorm, LayerNormBiasWithoutWeight) {
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (int64_t cols : {16, 976}) {
      for (bool mem : {false, true}) {
        auto gen = at::detail::createCPUGenerator(11);
        auto x = at::randn({8, cols}, gen).to(dtype).set_requires_grad(true);
        auto b = (at::randn({cols}, gen) * 0.5).to(dtype).set_requires_grad(true);
        auto y = fused_layer_norm(x, {cols}, at::Tensor(), b, 1e-5, mem);
        const auto dy = at::randn({8, cols}, gen).to(dtype);
        y.backward(dy);
        const auto ref = reference(x, at::Tensor(), b, dy, {cols}, 1e-5, false);
        const Tolerance tol = tolerance_for(dtype);
        const std::string what = std::string(c10::toString(dtype)) + " cols " +
                                 std::to_string(cols) + " memory_efficient " + std::to_string(mem);
        EXPECT_TRUE(all_close(y, ref[0], tol)) << what;
        EXPECT_TRUE(all_close(x.grad(), ref[1], {tol.rtol, std::max(tol.atol, 4 * tol.rtol)}))
            << what;
        EXPECT_TRUE(all_close(b.grad(), ref[3], {tol.rtol, tol.rtol * 4 * std::sqrt(8.0)})) << what;
      }
    }
  }
}

TEST(FusedNorm, NonContiguousInput) {
  for (bool rms : {false, true}) {
    for (bool mem : {false, true}) check({{16, 64}, 1}, at::kFloat, true, rms, true, mem);
  }
}

// memory_efficient saves the output, not the input: the graph keeps y alive and x can go.
TEST(FusedNorm, MemoryEfficientSavesTheOutput) {
  auto x = at::randn({8, 32}).set_requires_grad(true);
  auto w = (at::rand({32}) + 0.5).set_requires_grad(true);
  auto b = at::randn({32}).set_requires_grad(true);
  auto y = fused_layer_norm(x * 2, {32}, w, b, 1e-5, /*memory_efficient=*/true);
  auto y_ref = fused_layer_norm(x * 2, {32}, w, b, 1e-5, false);
  EXPECT_TRUE(at::equal(y, y_ref));
  // Modifying the output in place must be caught, since the backward reads it.
  y.add_(1.0);
  EXPECT_TRUE(throws_with([&] { y.sum().backward(); }, "modified by an inplace operation"));
}

// memory_efficient divides y - b by the weight clamped by magnitude to at least eps, as apex does:
// a zero weight (zero-initialised gains) gives finite gradients, not 0/0 in every row's dx. The
// gradients equal a float64 backward from the same y with the same clamp.
TEST(FusedNorm, MemoryEfficientClampsSmallWeightsAsApex) {
  auto gen = at::detail::createCPUGenerator(23);
  const double eps = 1e-5;
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const bool rms : {false, true}) {
      const auto x = at::randn({7, 96}, gen).to(dtype);
      const auto dy = at::randn({7, 96}, gen).to(dtype);
      auto w0 = at::rand({96}, gen) + 0.5;
      w0[3] = 0.0;
      w0[10] = 1e-7;
      w0[20] = -0.0;
      w0[30] = -1e-7;
      w0[40] = -0.7;
      const auto w = w0.to(dtype).set_requires_grad(true);
      const auto b = at::randn({96}, gen).to(dtype).set_requires_grad(true);
      const auto xi = x.detach().set_requires_grad(true);
      const auto y = rms ? fused_rms_norm(xi, {96}, w, eps, true)
                         : fused_layer_norm(xi, {96}, w, b, eps, true);
      y.backward(dy);
      const std::string what = std::string(c10::toString(dtype)) + (rms ? " rms" : " ln");
      ASSERT_TRUE(xi.grad().isfinite().all().item<bool>()) << what;
      ASSERT_TRUE(w.grad().isfinite().all().item<bool>()) << what;

      const auto d = [](const at::Tensor& t) { return t.detach().to(at::kDouble); };
      const auto x64 = d(x);
      const auto xc = rms ? x64 : x64 - x64.mean(-1, true);
      const auto rstd = (xc.square().mean(-1, true) + eps).rsqrt();
      const auto w64 = d(w);
      const auto mag = at::full_like(w64, eps);
      const auto wd = at::where(w64.abs() < eps, at::where(w64 < 0, -mag, mag), w64);
      const auto xh = (rms ? d(y) : d(y) - d(b)) / wd;
      const auto g = d(dy) * w64;
      auto inner = g - xh * (g * xh).mean(-1, true);
      if (!rms) inner = inner - g.mean(-1, true);
      const auto dx_ref = rstd * inner;
      const auto dw_ref = (d(dy) * xh).sum(0);
      const double tol = dtype == at::kFloat ? 1e-4 : 2e-2;
      auto close = [&](const at::Tensor& got, const at::Tensor& ref) {
        return (d(got) - ref).abs().max().item<double>() <= tol * ref.abs().max().item<double>();
      };
      EXPECT_TRUE(close(xi.grad(), dx_ref)) << what;
      EXPECT_TRUE(close(w.grad(), dw_ref)) << what;
      // A zero weight's column: y = b there, so x_hat is 0 and so is its weight gradient.
      if (dtype == at::kFloat) {
        EXPECT_EQ(w.grad()[3].item<float>(), 0.0f) << what;
      }
    }
  }
}

// The norms' own autograd node behaves as LibTorch's: named, guarded against changes to what it
// saved, freed after one backward unless the graph is retained, and computing only the gradients
// asked for (frozen parameters, autograd::grad of one input) with the same values.
TEST(FusedNorm, AutogradNodeBehavesAsLibTorchs) {
  const auto x = at::randn({6, 40}).set_requires_grad(true);
  const auto w = (at::rand({40}) + 0.5).set_requires_grad(true);
  const auto b = at::randn({40}).set_requires_grad(true);
  const auto dy = at::randn({6, 40});
  EXPECT_EQ(fused_layer_norm(x, {40}, w, b).grad_fn()->name(), "FusedLayerNormBackward");
  EXPECT_EQ(fused_rms_norm(x, {40}, w).grad_fn()->name(), "FusedRMSNormBackward");

  // Modifying the saved input in place is caught.
  auto x2 = x * 1.0;
  auto y2 = fused_layer_norm(x2, {40}, w, b);
  x2.mul_(2.0);
  EXPECT_TRUE(throws_with([&] { y2.backward(dy); }, "modified by an inplace operation"));

  // One backward frees what was saved; retain_graph keeps it, and gradients accumulate.
  auto y = fused_layer_norm(x, {40}, w, b);
  y.backward(dy, /*retain_graph=*/true);
  const auto gx = x.grad().clone();
  const auto gw = w.grad().clone();
  const auto gb = b.grad().clone();
  y.backward(dy);
  EXPECT_TRUE(at::allclose(x.grad(), 2 * gx));
  EXPECT_TRUE(at::allclose(w.grad(), 2 * gw));
  EXPECT_TRUE(throws_with([&] { y.backward(dy); }, "backward through the graph a second time"));
  const auto xr = x.detach().set_requires_grad(true);
  const auto ref = at::layer_norm(xr, {40}, w.detach(), b.detach());
  EXPECT_TRUE(at::allclose(torch::autograd::grad({ref}, {xr}, {dy})[0], gx, 1e-4, 1e-5));

  // Gradients of some inputs only: equal to the full backward's.
  for (const bool frozen_w : {true, false}) {
    const auto w2 = w.detach().set_requires_grad(!frozen_w);
    const auto xs = x.detach().set_requires_grad(true);
    auto out = fused_layer_norm(xs, {40}, w2, b.detach());
    const auto g = torch::autograd::grad({out}, {frozen_w ? xs : w2}, {dy});
    EXPECT_TRUE(at::allclose(g[0], frozen_w ? gx : gw, 1e-5, 1e-6)) << frozen_w;
  }
  const auto xs = x.detach().set_requires_grad(true);
  const auto wf = w.detach();  // frozen
  const auto bs = b.detach().set_requires_grad(true);
  fused_layer_norm(xs, {40}, wf, bs).backward(dy);
  EXPECT_FALSE(wf.grad().defined());
  EXPECT_TRUE(at::allclose(xs.grad(), gx, 1e-5, 1e-6));
  EXPECT_TRUE(at::allclose(bs.grad(), gb, 1e-5, 1e-6));

  // Each parameter's gradient in its own dtype: a float64 bias next to a float weight (the
  // float64 path takes them) gets its float64 sum, not one rounded to float.
  const auto x64 = x.detach().to(at::kDouble);
  const auto b64 = b.detach().to(at::kDouble).set_requires_grad(true);
  const auto dy64 = dy.to(at::kDouble) / 3.0;
  fused_layer_norm(x64, {40}, w.detach(), b64).backward(dy64);
  EXPECT_EQ(b64.grad().scalar_type(), at::kDouble);
  EXPECT_TRUE(at::allclose(b64.grad(), dy64.sum(0), 1e-14, 0.0));
}

// An input that needs no gradient (frozen, or autograd::grad of the parameters alone): the CPU
// backward reads each row once for dw/db and writes no dx. Its dw/db are the full backward's bit
// for bit (the same terms in the same order), across the kernel's paths: short rows, rows with a
// vector tail, paired wide rows, fp16 rows through scratch, several blocks and groups of rows,
// memory-efficient mode.
TEST(FusedNorm, FrozenInputGivesTheSameParameterGradients) {
  auto gen = at::detail::createCPUGenerator(17);
  for (const auto dtype : {at::kFloat, at::kBFloat16, at::kHalf}) {
    for (const auto& size :
         std::vector<std::vector<int64_t>>{{1, 40}, {130, 40}, {3, 1000}, {70, 1000}, {6, 4096}}) {
      for (const bool rms : {false, true}) {
        for (const bool memory_efficient : {false, true}) {
          const auto x = at::randn(size, gen).to(dtype);
          const auto dy = at::randn(size, gen).to(dtype);
          const auto w0 = (at::rand({size[1]}, gen) + 0.5).to(dtype);
          const auto b0 = at::randn({size[1]}, gen).to(dtype);
          auto run = [&](bool input_grad) {
            const auto xi = x.detach().set_requires_grad(input_grad);
            const auto w = w0.clone().set_requires_grad(true);
            const auto b = b0.clone().set_requires_grad(true);
            const auto y = rms ? fused_rms_norm(xi, {size[1]}, w, 1e-5, memory_efficient)
                               : fused_layer_norm(xi, {size[1]}, w, b, 1e-5, memory_efficient);
            y.backward(dy);
            EXPECT_EQ(xi.grad().defined(), input_grad);
            return std::pair{w.grad(), rms ? at::Tensor() : b.grad()};
          };
          const auto full = run(true);
          const auto frozen = run(false);
          const std::string what = std::string(c10::toString(dtype)) + " " +
                                   std::to_string(size[0]) + "x" + std::to_string(size[1]) +
                                   (rms ? " rms" : " ln") + (memory_efficient ? " mem-eff" : "");
          EXPECT_TRUE(at::equal(frozen.first, full.first)) << what;
          if (!rms) {
            EXPECT_TRUE(at::equal(frozen.second, full.second)) << what;
          }
        }
      }
    }
  }
  // autograd::grad of the weight alone skips dx the same way.
  const auto x = at::randn({5, 64}, gen).set_requires_grad(true);
  const auto w = (at::rand({64}, gen) + 0.5).set_requires_grad(true);
  const auto dy = at::randn({5, 64}, gen);
  const auto gw = torch::autograd::grad({fused_rms_norm(x, {64}, w)}, {w}, {dy})[0];
  const auto xr = x.detach().to(at::kDouble);
  const auto ref = (dy.to(at::kDouble) * xr * (xr.pow(2).mean(-1, true) + 1e-5).rsqrt()).sum(0);
  EXPECT_TRUE(at::allclose(gw.to(at::kDouble), ref, 1e-5, 1e-5));
}

// A LayerNorm whose weight or bias is frozen: the row kernels then add only the partials wanted
// (dw alone; or db, with dw's partials computed and dropped), with and without dx. What is
// computed equals the all-trainable backward's bit for bit.
TEST(FusedNorm, FrozenParameterGivesTheSameOtherGradients) {
  auto gen = at::detail::createCPUGenerator(23);
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const auto& size :
         std::vector<std::vector<int64_t>>{{3, 40}, {130, 40}, {70, 1000}, {6, 4096}}) {
      for (const bool memory_efficient : {false, true}) {
        const auto x0 = at::randn(size, gen).to(dtype);
        const auto dy = at::randn(size, gen).to(dtype);
        const auto w0 = (at::rand({size[1]}, gen) + 0.5).to(dtype);
        const auto b0 = at::randn({size[1]}, gen).to(dtype);
        auto run = [&](bool x_grad, bool w_grad, bool b_grad) {
          const auto x = x0.clone().set_requires_grad(x_grad);
          const auto w = w0.clone().set_requires_grad(w_grad);
          const auto b = b0.clone().set_requires_grad(b_grad);
          fused_layer_norm(x, {size[1]}, w, b, 1e-5, memory_efficient).backward(dy);
          EXPECT_EQ(w.grad().defined(), w_grad);
          EXPECT_EQ(b.grad().defined(), b_grad);
          return std::array<at::Tensor, 3>{x.grad(), w.grad(), b.grad()};
        };
        const auto all = run(true, true, true);
        const std::string what = std::string(c10::toString(dtype)) + " " + std::to_string(size[0]) +
                                 "x" + std::to_string(size[1]) +
                                 (memory_efficient ? " mem-eff" : "");
        for (const bool x_grad : {true, false}) {
          const auto only_w = run(x_grad, true, false);
          const auto only_b = run(x_grad, false, true);
          EXPECT_TRUE(at::equal(only_w[1], all[1])) << what;
          EXPECT_TRUE(at::equal(only_b[2], all[2])) << what;
          if (x_grad) {
            EXPECT_TRUE(at::equal(only_w[0], all[0])) << what;
            EXPECT_TRUE(at::equal(only_b[0], all[0])) << what;
          }
        }
        const auto none = run(true, false, false);  // dx alone: no partials at all
        EXPECT_TRUE(at::equal(none[0], all[0])) << what;
      }
    }
  }
}

// Numerical gradient check in float64 (the ATen float64 path runs the kernels' formulas), and a
// directional finite-difference check of the fp32 kernels themselves.
TEST(FusedNorm, GradcheckFloat64) {
  auto gen = at::detail::createCPUGenerator(11);
  for (bool rms : {false, true}) {
    for (bool mem : {false, true}) {
      for (bool affine : {true, false}) {
        auto x = at::randn({3, 5}, gen, at::kDouble).set_requires_grad(true);
        auto w =
            affine ? (at::rand({5}, gen, at::kDouble) + 0.5).set_requires_grad(true) : at::Tensor();
        auto b = affine && !rms ? at::randn({5}, gen, at::kDouble).set_requires_grad(true)
                                : at::Tensor();
        const auto f = [&] {
          return rms ? fused_rms_norm(x, {5}, w, 1e-3, mem)
                     : fused_layer_norm(x, {5}, w, b, 1e-3, mem);
        };
        const auto r = at::randn({3, 5}, gen, at::kDouble);
        std::vector<at::Tensor> inputs{x};
        if (w.defined()) inputs.push_back(w);
        if (b.defined()) inputs.push_back(b);
        const auto analytic = torch::autograd::grad({(f() * r).sum()}, inputs);
        at::NoGradGuard no_grad;
        for (size_t k = 0; k < inputs.size(); ++k) {
          auto flat = inputs[k].view({-1});
          for (int64_t i = 0; i < flat.numel(); ++i) {
            const double h = 1e-6;
            const double v = flat[i].item<double>();
            flat[i].fill_(v + h);
            const double up = (f() * r).sum().item<double>();
            flat[i].fill_(v - h);
            const double down = (f() * r).sum().item<double>();
            flat[i].fill_(v);
            const double numeric = (up - down) / (2 * h);
            EXPECT_NEAR(analytic[k].view({-1})[i].item<double>(), numeric, 1e-6)
                << "rms " << rms << " memory_efficient " << mem << " input " << k << " elem " << i;
          }
        }
      }
    }
  }
}

TEST(FusedNorm, FiniteDifferencesFp32Kernels) {
  auto gen = at::detail::createCPUGenerator(5);
  for (bool rms : {false, true}) {
    for (bool mem : {false, true}) {
      auto x = at::randn({6, 40}, gen).set_requires_grad(true);
      auto w = (at::rand({40}, gen) + 0.5).set_requires_grad(true);
      auto b = rms ? at::Tensor() : at::randn({40}, gen).set_requires_grad(true);
      const auto r = at::randn({6, 40}, gen);
      const auto loss = [&](const at::Tensor& xx, const at::Tensor& ww, const at::Tensor& bb) {
        return (rms ? fused_rms_norm(xx, {40}, ww, 1e-5, mem)
                    : fused_layer_norm(xx, {40}, ww, bb, 1e-5, mem)) *
               r;
      };
      loss(x, w, b).sum().backward();
      at::NoGradGuard no_grad;
      // Along a random direction v: <grad, v> against (L(p + h v) - L(p - h v)) / 2h, in float64
      // sums of the fp32 outputs.
      std::vector<at::Tensor> params{x, w};
      if (b.defined()) params.push_back(b);
      for (size_t k = 0; k < params.size(); ++k) {
        const auto v = at::randn(params[k].sizes(), gen);
        const double h = 1e-2;
        auto shifted = [&](double s) {
          std::vector<at::Tensor> p{x, w, b};
          p[k] = params[k] + s * h * v;
          return loss(p[0], p[1], p[2]).to(at::kDouble).sum().item<double>();
        };
        const double numeric = (shifted(1) - shifted(-1)) / (2 * h);
        const double analytic = (params[k].grad().to(at::kDouble) * v).sum().item<double>();
        EXPECT_NEAR(analytic, numeric, 2e-3 * std::max(1.0, std::abs(numeric)))
            << "rms " << rms << " memory_efficient " << mem << " param " << k;
      }
    }
  }
}

// Same numbers as at::layer_norm itself, not just the float64 reference.
TEST(FusedNorm, LayerNormAgreesWithATen) {
  auto x = at::randn({33, 257});
  auto w = at::randn({257});
  auto b = at::randn({257});
  EXPECT_TRUE(all_close(fused_layer_norm(x, {257}, w, b), at::layer_norm(x, {257}, w, b),
                        tolerance_for(at::kFloat)));
}

// Rows whose statistics are hard to get in fp32. The forward sums x - k in one pass, k the mean
// of the row's first 64 elements, and falls back to a second, centred pass when the mean is far
// from k (cancellation): a row with a large offset, one whose first 64 elements are far from
// the rest (at 8192 columns, without the fallback the variance would lose ~127x the rounding of
// its sum), a constant row, and a row of ones with a few large values.
TEST(FusedNorm, StatisticsOfHardRows) {
  for (int64_t cols : {256, 1000, 8192}) {
    auto gen = at::detail::createCPUGenerator(11);
    at::Tensor x = at::randn({5, cols}, gen);
    x[0] = x[0] * 0.1 + 1000.0;
    x[1] = x[1] * 1e-3 + 0.3;
    x[1].slice(0, 0, 64) += 7.77;
    x[2].fill_(3.25);
    x[3].fill_(1.0);
    x[3].slice(0, cols / 2, cols / 2 + 3) = 1e4;
    x[4] = x[4] * 1e-3 - 0.5;
    x[4].slice(0, 0, 64) -= 3.3;
    const auto w = at::randn({cols}, gen);
    const auto b = at::randn({cols}, gen);
    const auto y = fused_layer_norm(x, {cols}, w, b);
    const auto ref =
        at::layer_norm(x.to(at::kDouble), {cols}, w.to(at::kDouble), b.to(at::kDouble), 1e-5);
    // Some of these rows are beyond fp32's tolerance for any fp32 kernel (x - mean at an offset
    // of 1000 loses 3e-5 absolute): each row's error is held to LibTorch's fp32 layer_norm's on
    // the same row. Measured: at most 2.3x ATen's (and 13x better at 8192 columns, offset 1000);
    // without the fallback rows 1 and 4 were 24x and 42x worse.
    const auto aten = at::layer_norm(x, {cols}, w, b, 1e-5);
    for (int64_t r = 0; r < 5; ++r) {
      const double ours_err = (y[r].to(at::kDouble) - ref[r]).abs().max().item<double>();
      const double aten_err = (aten[r].to(at::kDouble) - ref[r]).abs().max().item<double>();
      EXPECT_LE(ours_err, 4 * aten_err + 2e-6) << cols << " columns, row " << r;
    }
  }
}

// The bf16 and fp32 outputs of a norm come from separate loops whose multiply-adds the compiler
// may fuse differently (last-bit differences), so the comparisons below forgive one bf16 unit
// within a few fp32 units of a rounding tie (bf16_rounding_of).
constexpr int kNearTie = 8;

// Values beyond ~FLT_MAX / 64 overflow the fp32 row sums; such rows are summed again in fp64. In
// fp32 only a constant row of them has a finite variance (any spread of such values is wider than
// sqrt(FLT_MAX)), and its output is the bias, as at::layer_norm gives up to a few hundred
// columns (at 1000 its own sums overflow to NaN), rather than NaN; rows holding NaN still give NaN.
TEST(FusedNorm, RowsOfHugeValues) {
  auto gen = at::detail::createCPUGenerator(31);
  for (const int64_t cols : {100, 300, 1000}) {
    auto x = at::randn({3, cols}, gen);
    x[0].fill_(1e37);
    x[1].fill_(-3e37);
    const auto w = at::rand({cols}, gen) + 0.5;
    const auto b = at::randn({cols}, gen);
    const auto y = fused_layer_norm(x, {cols}, w, b);
    EXPECT_TRUE(at::equal(y[0], b)) << cols;
    EXPECT_TRUE(at::equal(y[1], b)) << cols;
    EXPECT_TRUE(at::allclose(y[2], at::layer_norm(x, {cols}, w, b)[2], 1e-5, 1e-5)) << cols;
    auto bad = x.clone();
    bad[2][5] = std::numeric_limits<float>::quiet_NaN();
    const auto yb = fused_layer_norm(bad, {cols}, w, b);
    EXPECT_TRUE(yb[2].isnan().all().item<bool>()) << cols;
    EXPECT_TRUE(at::equal(yb[0], b)) << cols;
  }
}

// A bf16 output (y of the forward, dx of the backward) is the fp32 result rounded once: the same
// norm on the same values with fp32 storage, rounded by c10::BFloat16, bit for bit. The rows
// hold denormal results (half the columns have denormal weights; dy is tiny) and a row of NaNs
// from a negative NaN with a payload (0xffc1, written as bits: a float NaN assigned to a bf16
// tensor becomes 0x7fc0), which the hardware's bf16 conversion would keep. 96 columns take the
// short-row kernels, 1000 the wide ones with a partial last vector, 8192 the backward's row pairs,
// 23 one block of 16 and a tail (the AVX2 kernels read bf16 rows 16 elements at a time,
// interleaved with zeros). LayerNorm with and without weight and bias, RMSNorm, and
// LayerNorm whose weight holds a NaN with a payload in one column, and RMSNorm whose weight holds
// +Inf over a column of zeros (0 * Inf: the x86 default NaN, 0xffc00000): the AVX2 forward looks
// at the parameters once, to skip the rounding's NaN test where they are finite. (Not
// memory_efficient: its backward recomputes x_hat from the rounded bf16 output, so it is not the
// fp32 computation rounded.)
TEST(FusedNorm, Bf16OutputsAreRoundedFp32Results) {
  enum class Variant { kLayerNorm, kLayerNormPlain, kRMSNorm, kLayerNormNanWeight, kRMSInfWeight };
  for (auto variant : {Variant::kLayerNorm, Variant::kLayerNormPlain, Variant::kRMSNorm,
                       Variant::kLayerNormNanWeight, Variant::kRMSInfWeight}) {
    for (int64_t cols : {23, 96, 1000, 8192}) {
      auto gen = at::detail::createCPUGenerator(19);
      auto x = at::randn({18, cols}, gen).to(at::kBFloat16);
      x.view(at::kShort)[5][cols / 3] = static_cast<int16_t>(0xffc1);
      auto w = at::randn({cols}, gen);
      auto b = at::randn({cols}, gen);
      w.slice(0, 0, cols, 2).fill_(3e-39);
      b.slice(0, 0, cols, 2).zero_();
      const bool affine = variant != Variant::kLayerNormPlain;
      w = affine ? w.to(at::kBFloat16) : at::Tensor();
      const bool nan_weight = variant == Variant::kLayerNormNanWeight;
      const bool inf_weight = variant == Variant::kRMSInfWeight;
      const int64_t bad_col = nan_weight ? cols / 2 : cols / 4;
      if (nan_weight) w.view(at::kShort)[bad_col] = static_cast<int16_t>(0x7f81);
      if (inf_weight) {
        w.view(at::kShort)[bad_col] = static_cast<int16_t>(0x7f80);
        x.select(1, bad_col).zero_();
      }
      b = variant == Variant::kLayerNorm || nan_weight ? b.to(at::kBFloat16) : at::Tensor();
      const auto dy = (at::randn({18, cols}, gen) * 2e-38).to(at::kBFloat16);
      std::vector<at::Tensor> y, dx;
      for (auto t : {at::kBFloat16, at::kFloat}) {
        auto xt = x.to(t, /*non_blocking=*/false, /*copy=*/true).set_requires_grad(true);
        const auto wt = w.defined() ? w.to(t) : w;
        const auto bt = b.defined() ? b.to(t) : b;
        const bool rms = variant == Variant::kRMSNorm || inf_weight;
        y.push_back(rms ? fused_rms_norm(xt, {cols}, wt) : fused_layer_norm(xt, {cols}, wt, bt));
        y.back().backward(dy.to(t));
        dx.push_back(xt.grad());
      }
      const std::string what = std::to_string(static_cast<int>(variant)) + " variant, " +
                               std::to_string(cols) + " columns";
      ASSERT_TRUE(y[1][5].isnan().all().item<bool>()) << what;
      const auto denormal = [](const at::Tensor& t) {
        return (t.abs() < 1.1754944e-38).logical_and(t != 0).any().item<bool>();
      };
      if (affine) {
        ASSERT_TRUE(denormal(y[1])) << what;
      }
      if (nan_weight || inf_weight) {
        // NaN in every row's dx (through the row sums) and in one column of y.
        ASSERT_TRUE(y[1].select(1, bad_col).isnan().all().item<bool>()) << what;
        ASSERT_TRUE(dx[1].isnan().all().item<bool>()) << what;
      } else {
        ASSERT_TRUE(denormal(dx[1])) << what;
      }
      EXPECT_TRUE(bf16_rounding_of(y[0], y[1], kNearTie)) << what << ", forward";
      EXPECT_TRUE(bf16_rounding_of(dx[0], dx[1], kNearTie)) << what << ", backward";
    }
  }
}

// The bf16 backward's row sums are the fp32 backward's, partial for partial (the AVX2 kernels read
// bf16 rows 16 elements at a time in their own order, and put the partials back in place before
// combining them): summed in another order, the constants differ in their last bits, and where
// dx cancels the difference is far beyond the rounding. Two rows built so that other orders round
// differently: 32 columns (one register of partials; found in review), where sum(dy) is 1 and
// dx at column 2 is exactly 0; 256 columns (two registers), where sum(dy) is 2^-22 (even/odd
// halves give 5 * 2^-24, the AVX2 order without putting the lanes back 3 * 2^-23) and is all of
// dx at every column where dy is 0. And the same 256 dy on an RMSNorm row of ones, where they are
// the terms of sum(g * x_hat) (eps 1e-30, so that rstd is exactly 1).
TEST(FusedNorm, Bf16BackwardSumsAsFp32) {
  for (const int64_t cols : {32, 256, -256}) {
    const bool rms = cols < 0;
    const int64_t n = rms ? -cols : cols;
    auto x = rms ? at::ones({1, n}) : at::zeros({1, n});
    auto dy = at::zeros({1, n});
    if (n == 32) {
      x[0][3] = 1.0;
      x[0][4] = -1.0;
      dy[0][0] = 31.0 / 32;
      dy[0][2] = 1.0 / 32;
      dy[0][8] = std::ldexp(1.0, -24);
      dy[0][9] = std::ldexp(1.0, -24);
    } else {
      if (!rms) {
        x[0][20] = 1.0;
        x[0][21] = -1.0;
      }
      dy[0][0] = 1.0;
      dy[0][1] = -1.0;
      dy[0][4] = 3 * std::ldexp(1.0, -24);
      dy[0][8] = std::ldexp(1.0, -24);
      dy[0][12] = std::ldexp(1.0, -24);
    }
    std::vector<at::Tensor> dx;
    for (auto t : {at::kBFloat16, at::kFloat}) {
      auto xt = x.to(t).set_requires_grad(true);
      const auto y = rms ? fused_rms_norm(xt, {n}, at::Tensor(), 1e-30)
                         : fused_layer_norm(xt, {n}, at::Tensor(), at::Tensor());
      y.backward(dy.to(t));
      dx.push_back(xt.grad());
    }
    const std::string what = std::to_string(n) + (rms ? " columns, RMSNorm" : " columns");
    if (n == 32) {
      EXPECT_EQ(dx[1][0][2].item<float>(), 0.0f);
    } else {
      // The sum is 2^-22 (other orders: 3 * 2^-23 or 5 * 2^-24).
      const double rstd = rms ? 1.0 : 1.0 / std::sqrt(2.0 / n + 1e-5);
      const double want = -rstd * std::ldexp(1.0, -22) / n;
      EXPECT_NEAR(dx[1][0][30].item<double>(), want, 1e-4 * std::abs(want)) << what;
    }
    EXPECT_TRUE(bf16_rounding_of(dx[0], dx[1], kNearTie)) << what;
  }
}

// A bf16 LayerNorm large and wide enough to read its bf16 weight and bias in place (16 MB of
// input, 4096 columns) gives the fp32 computation rounded, as the converted parameters do.
TEST(FusedNorm, Bf16ParametersReadInPlace) {
  auto gen = at::detail::createCPUGenerator(29);
  const int64_t rows = 2048;
  const int64_t cols = 4096;
  const auto x = at::randn({rows, cols}, gen).to(at::kBFloat16);
  const auto w = (at::randn({cols}, gen) * 0.5 + 1.0).to(at::kBFloat16);
  const auto b = (at::randn({cols}, gen) * 0.1).to(at::kBFloat16);
  const at::NoGradGuard no_grad;
  const auto exact = fused_layer_norm(x.to(at::kFloat), {cols}, w.to(at::kFloat), b.to(at::kFloat));
  EXPECT_TRUE(bf16_rounding_of(fused_layer_norm(x, {cols}, w, b), exact, kNearTie));
  const auto exact_rms = fused_rms_norm(x.to(at::kFloat), {cols}, w.to(at::kFloat));
  EXPECT_TRUE(bf16_rounding_of(fused_rms_norm(x, {cols}, w), exact_rms, kNearTie));
}

// Rows so wide that the backward's fp64 block sums (2 blocks x 540000 columns x 8 B, 8.6 MB each)
// are over the size the kernels keep between calls: they are released after each call and
// allocated again by the next (the second call checks that), with the same results as ATen.
TEST(FusedNorm, WorkMemoryOfHugeRows) {
  auto gen = at::detail::createCPUGenerator(13);
  const int64_t cols = 540000;
  const auto x0 = at::randn({9, cols}, gen);
  const auto w0 = at::randn({cols}, gen);
  const auto b0 = at::randn({cols}, gen);
  const auto dy = at::randn({9, cols}, gen);
  auto xr = x0.clone().set_requires_grad(true);
  auto wr = w0.clone().set_requires_grad(true);
  auto br = b0.clone().set_requires_grad(true);
  at::layer_norm(xr, {cols}, wr, br).backward(dy);
  for (int call = 0; call < 2; ++call) {
    auto x = x0.clone().set_requires_grad(true);
    auto w = w0.clone().set_requires_grad(true);
    auto b = b0.clone().set_requires_grad(true);
    const auto y = fused_layer_norm(x, {cols}, w, b);
    y.backward(dy);
    EXPECT_TRUE(all_close(y, at::layer_norm(x0, {cols}, w0, b0), {1e-4, 1e-5})) << call;
    EXPECT_TRUE(all_close(x.grad(), xr.grad(), {1e-4, 1e-5})) << call;
    EXPECT_TRUE(all_close(w.grad(), wr.grad(), {1e-4, 1e-4})) << call;
    EXPECT_TRUE(all_close(b.grad(), br.grad(), {1e-4, 1e-4})) << call;
  }
}

// The rows are split into fixed blocks whatever the thread count, and the blocks' dw/db sums
// combined in order (split by columns across the threads from a few thousand sums: 300 x 2048
// and 3000 x 512, 30 and 32 blocks): every output is bitwise the same with 1, 2 or 3 threads.
TEST(FusedNorm, ThreadCountDoesNotChangeResults) {
  const int threads = at::get_num_threads();
  for (const auto& size : std::vector<std::vector<int64_t>>{
           {300, 40}, {8, 4096}, {3000, 24}, {300, 2048}, {3000, 512}}) {
    auto gen = at::detail::createCPUGenerator(3);
    const auto x0 = at::randn(size, gen);
    const auto w0 = at::randn({size[1]}, gen);
    const auto b0 = at::randn({size[1]}, gen);
    const auto dy = at::randn(size, gen);
    std::vector<std::vector<at::Tensor>> runs;
    for (int n : {1, 2, 3}) {
      at::set_num_threads(n);
      auto x = x0.clone().set_requires_grad(true);
      auto w = w0.clone().set_requires_grad(true);
      auto b = b0.clone().set_requires_grad(true);
      auto y = fused_layer_norm(x, {size[1]}, w, b);
      y.backward(dy);
      runs.push_back({y.detach(), x.grad(), w.grad(), b.grad()});
    }
    at::set_num_threads(threads);
    for (size_t r = 1; r < runs.size(); ++r) {
      for (size_t k = 0; k < 4; ++k) {
        EXPECT_TRUE(at::equal(runs[0][k], runs[r][k]))
            << size[0] << "x" << size[1] << " output " << k << " with " << r + 1 << " threads";
      }
    }
  }
}

// Without anything to differentiate the norms skip the autograd node: same values, no grad_fn.
// A weight that requires grad is enough for the node to be recorded.
TEST(FusedNorm, NoGradPathMatchesTheAutogradPath) {
  auto gen = at::detail::createCPUGenerator(5);
  const auto x = at::randn({6, 96}, gen).to(at::kBFloat16);
  const auto w = at::randn({96}, gen).to(at::kBFloat16);
  const auto b = at::randn({96}, gen).to(at::kBFloat16);
  const auto recorded = fused_layer_norm(x, {96}, w.clone().set_requires_grad(true), b);
  ASSERT_TRUE(recorded.grad_fn() != nullptr);
  const auto plain = fused_layer_norm(x, {96}, w, b);
  EXPECT_TRUE(plain.grad_fn() == nullptr);
  EXPECT_TRUE(at::equal(plain, recorded.detach()));
  {
    const torch::NoGradGuard no_grad;
    const auto in_no_grad = normalization::mixed_fused_rms_norm(
        x.set_requires_grad(false), {96}, w.to(at::kFloat).set_requires_grad(true));
    EXPECT_TRUE(in_no_grad.grad_fn() == nullptr);
    EXPECT_EQ(in_no_grad.scalar_type(), at::kFloat);
  }
}

// Forward-mode AD is not supported (as for any C++ custom Function): a dual input is rejected
// with an error, also under no_grad, instead of losing its tangent.
TEST(FusedNorm, ForwardModeTangentsAreRejected) {
  const uint64_t level = torch::autograd::ForwardADLevel::get_next_idx();
  const auto x =
      at::_make_dual(at::randn({4, 32}), at::randn({4, 32}), static_cast<int64_t>(level));
  const torch::NoGradGuard no_grad;
  EXPECT_THROW(fused_layer_norm(x, {32}), c10::Error);
  torch::autograd::ForwardADLevel::release_idx(level);
}

TEST(FusedNorm, BadInput) {
  auto x = at::randn({4, 8});
  EXPECT_TRUE(throws_with([&] { fused_layer_norm(x, {7}); },
                          "normalized_shape [7] does not match the trailing dimensions of an "
                          "input of shape [4, 8]"));
  EXPECT_TRUE(throws_with([&] { fused_layer_norm(x, {8}, at::ones({4})); },
                          "weight must have shape [8], got [4]"));
  EXPECT_TRUE(throws_with([&] { fused_rms_norm(x, {8}, {}, 0.0); }, "eps must be > 0, got 0"));
  EXPECT_TRUE(throws_with(
      [&] {
        fused_layer_norm(at::ones({4, 8}, at::kLong), {8});
      },
      "input must be a floating-point tensor, got Long"));
  EXPECT_TRUE(throws_with(
      [&] { fused_layer_norm(x, {8}, at::ones({8}, at::TensorOptions().device(at::kMeta))); },
      "weight is on meta but the input is on cpu"));
}

TEST(FusedNorm, DoubleBackwardIsRejected) {
  // create_graph itself is allowed: the gradients are the usual ones...
  auto x = at::randn({4, 8}).set_requires_grad(true);
  auto w = (at::rand({8}) + 0.5).set_requires_grad(true);
  auto y = fused_rms_norm(x, {8}, w);
  const auto g = torch::autograd::grad({y.sum()}, {x, w}, {}, /*retain_graph=*/true,
                                       /*create_graph=*/true);
  auto x2 = x.detach().set_requires_grad(true);
  auto w2 = w.detach().set_requires_grad(true);
  const auto ref = torch::autograd::grad({fused_rms_norm(x2, {8}, w2).sum()}, {x2, w2});
  EXPECT_TRUE(at::equal(g[0], ref[0]));
  EXPECT_TRUE(at::equal(g[1], ref[1]));
  // ...and a backward through them fails with a clear message when it runs.
  ASSERT_TRUE(g[0].requires_grad());
  EXPECT_TRUE(throws_with([&] { g[0].sum().backward(); }, "double backward is not supported"));
  EXPECT_TRUE(throws_with([&] { torch::autograd::grad({g[1].sum()}, {x}); },
                          "double backward is not supported"));
  // Multi-dimensional parameters (their gradients are views of [cols] sums) too.
  auto x3 = at::randn({3, 2, 4}).set_requires_grad(true);
  auto w3 = (at::rand({2, 4}) + 0.5).set_requires_grad(true);
  auto b3 = at::randn({2, 4}).set_requires_grad(true);
  const auto g3 = torch::autograd::grad({fused_layer_norm(x3, {2, 4}, w3, b3).square().sum()},
                                        {w3, b3}, {}, true, true);
  EXPECT_EQ(g3[0].sizes(), w3.sizes());
  EXPECT_TRUE(throws_with([&] { (g3[0].sum() + g3[1].sum()).backward(); },
                          "double backward is not supported"));
  // A non-contiguous input (saved as a contiguous copy without history), a frozen weight and a dy
  // without history: dx still leads to the error, not to a gradient without a graph.
  for (const bool mem : {false, true}) {
    auto x4 = at::randn({4, 8}).set_requires_grad(true);
    const auto xt = x4.t();
    const auto w4 = at::rand({4}) + 0.5;
    const auto y4 = fused_layer_norm(xt, {4}, w4, at::Tensor(), 1e-5, mem);
    const auto g4 = torch::autograd::grad({y4}, {x4}, {at::randn({8, 4})}, true, true);
    ASSERT_TRUE(g4[0].requires_grad()) << mem;
    EXPECT_TRUE(throws_with([&] { torch::autograd::grad({g4[0].sum()}, {x4}); },
                            "double backward is not supported"))
        << mem;
  }
}

// The modules: parameters registered as apex's (ones/zeros), trainable, same math as functional.
TEST(FusedNorm, ModulesTrainAndMatchFunctional) {
  apex::normalization::FusedLayerNorm ln(apex::normalization::FusedNormOptions({6, 8}).eps(1e-6));
  apex::normalization::FusedRMSNorm rms(apex::normalization::FusedNormOptions({8}));
  EXPECT_EQ(ln->parameters().size(), 2u);
  EXPECT_EQ(rms->parameters().size(), 1u);
  auto x = at::randn({3, 6, 8});
  EXPECT_TRUE(at::equal(ln->forward(x), fused_layer_norm(x, {6, 8}, ln->weight, ln->bias, 1e-6)));
  torch::optim::SGD opt(rms->parameters(), torch::optim::SGDOptions(0.1));
  const auto target = at::randn({3, 6, 8});
  const double first = (rms->forward(x) - target).square().mean().item<double>();
  for (int i = 0; i < 20; ++i) {
    opt.zero_grad();
    (rms->forward(x) - target).square().mean().backward();
    opt.step();
  }
  EXPECT_LT((rms->forward(x) - target).square().mean().item<double>(), first);
  apex::normalization::FusedLayerNorm plain(
      apex::normalization::FusedNormOptions({8}).elementwise_affine(false));
  EXPECT_TRUE(plain->parameters().empty());
  EXPECT_TRUE(throws_with(
      [&] {
        apex::normalization::FusedRMSNorm(apex::normalization::FusedNormOptions({8}).eps(-1));
      },
      "FusedRMSNorm: eps must be > 0, got -1"));
}

// Mixed variants: bf16/fp16 input, fp32 parameters, fp32 output; gradients in each tensor's dtype.
TEST(FusedNorm, MixedVariantsOutputParameterDtype) {
  // 96 columns take the short-row kernels, 1000 the wide ones (with a partial last vector);
  // memory_efficient recomputes x_hat from the fp32 output for a half dx.
  for (auto dtype : {at::kBFloat16, at::kHalf}) {
    for (bool rms : {false, true}) {
      for (int64_t cols : {96, 1000}) {
        for (bool mem : {false, true}) {
          auto gen = at::detail::createCPUGenerator(3);
          auto x = at::randn({48, cols}, gen).to(dtype).set_requires_grad(true);
          auto w = ((mem ? at::rand({cols}, gen) + 0.5 : at::randn({cols}, gen) * 0.5 + 1.0))
                       .set_requires_grad(true);
          auto b = rms ? at::Tensor() : (at::randn({cols}, gen) * 0.1).set_requires_grad(true);
          auto y = rms ? apex::normalization::mixed_fused_rms_norm(x, {cols}, w, 1e-5, mem)
                       : apex::normalization::mixed_fused_layer_norm(x, {cols}, w, b, 1e-5, mem);
          ASSERT_EQ(y.scalar_type(), at::kFloat);
          const auto dy = at::randn({48, cols}, gen);
          y.backward(dy);
          const auto ref = reference(x, w, b, dy, {cols}, 1e-5, rms);
          const std::string what = std::string(c10::toString(dtype)) + " rms " +
                                   std::to_string(rms) + " cols " + std::to_string(cols) +
                                   " memory_efficient " + std::to_string(mem);
          // The input is exactly representable in fp32, so the forward is fp32-accurate.
          EXPECT_TRUE(all_close(y, ref[0], {1e-5, 1e-5})) << what;
          EXPECT_EQ(x.grad().scalar_type(), dtype);
          EXPECT_TRUE(all_close(x.grad(), ref[1],
                                {tolerance_for(dtype).rtol, 4 * tolerance_for(dtype).rtol}))
              << what;
          EXPECT_EQ(w.grad().scalar_type(), at::kFloat);
          // memory_efficient's x_hat = (y - b) / w loses a few fp32 ulps.
          EXPECT_TRUE(all_close(w.grad(), ref[2], {mem ? 1e-4 : 1e-5, 1e-4})) << what;
        }
      }
    }
  }
  apex::normalization::MixedFusedLayerNorm m(apex::normalization::FusedNormOptions({16}));
  EXPECT_EQ(m->forward(at::randn({2, 16}).to(at::kBFloat16)).scalar_type(), at::kFloat);
  EXPECT_TRUE(throws_with(
      [&] {
        apex::normalization::MixedFusedRMSNorm(
            apex::normalization::FusedNormOptions({16}).elementwise_affine(false));
      },
      "elementwise_affine must be true"));
}

// clone() copies the class it is called on (the mixed modules used to come back as the plain
// ones, whose output is the input's dtype), with its own copies of the parameters.
TEST(FusedNorm, CloneKeepsTheModuleClass) {
  namespace an = apex::normalization;
  const at::Tensor x = at::randn({3, 16}).to(at::kBFloat16);
  const auto check = [&](auto m, const char* name) {
    torch::NoGradGuard no_grad;
    m->weight.uniform_(0.5, 1.5);
    const auto copy = std::dynamic_pointer_cast<typename decltype(m)::Impl>(m->clone());
    ASSERT_TRUE(copy != nullptr) << name << ": clone() returned another class";
    EXPECT_TRUE(copy->forward(x).equal(m->forward(x))) << name;
    EXPECT_EQ(copy->forward(x).scalar_type(), m->forward(x).scalar_type()) << name;
    EXPECT_NE(copy->weight.data_ptr(), m->weight.data_ptr()) << name;
  };
  check(an::MixedFusedLayerNorm(an::FusedNormOptions({16})), "MixedFusedLayerNorm");
  check(an::MixedFusedRMSNorm(an::FusedNormOptions({16})), "MixedFusedRMSNorm");
  check(an::FusedLayerNorm(an::FusedNormOptions({16})), "FusedLayerNorm");
  check(an::FusedRMSNorm(an::FusedNormOptions({16})), "FusedRMSNorm");
}

// What comes out of the norms at each opt level (the table in docs/normalization.md): a Linear
// feeds a FusedLayerNorm and a MixedFusedLayerNorm; statistics are fp32 at every level, checked
// against a float64 reference of the same (rounded) input.
struct NormNetImpl : torch::nn::Module {
  NormNetImpl()
      : lin(register_module("lin", torch::nn::Linear(16, 32))),
        ln(register_module("ln", apex::normalization::FusedLayerNorm(
                                     apex::normalization::FusedNormOptions({32})))),
        mixed(register_module("mixed", apex::normalization::MixedFusedLayerNorm(
                                           apex::normalization::FusedNormOptions({32})))) {}
  at::Tensor forward(const at::Tensor& x) {
    hidden = lin->forward(x);
    ln_out = ln->forward(hidden);
    mixed_out = mixed->forward(hidden);
    return ln_out.to(at::kFloat) + mixed_out.to(at::kFloat);
  }
  torch::nn::Linear lin;
  apex::normalization::FusedLayerNorm ln;
  apex::normalization::MixedFusedLayerNorm mixed;
  at::Tensor hidden, ln_out, mixed_out;
};
TORCH_MODULE(NormNet);

TEST(FusedNorm, DtypesPerOptLevel) {
  using apex::amp::OptLevel;
  struct Expect {
    OptLevel level;
    at::ScalarType ln, mixed;
  };
  const auto bf16 = at::kBFloat16;
  for (const Expect& e :
       {Expect{OptLevel::O0, at::kFloat, at::kFloat}, Expect{OptLevel::O1, bf16, at::kFloat},
        Expect{OptLevel::O2, bf16, bf16}, Expect{OptLevel::O3, bf16, bf16}}) {
    NormNet net;
    torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1));
    auto amp =
        apex::amp::initialize(net, opt, apex::amp::Options(e.level).half_dtype(bf16).verbosity(0));
    const auto out = amp.forward(net, at::randn({8, 16}));
    EXPECT_EQ(out.scalar_type(), at::kFloat);
    EXPECT_EQ(net->ln_out.scalar_type(), e.ln) << apex::amp::to_string(e.level);
    EXPECT_EQ(net->mixed_out.scalar_type(), e.mixed) << apex::amp::to_string(e.level);
    // fp32 statistics whatever the storage: the result is the float64 reference rounded once.
    const auto ref = reference(net->hidden, net->ln->weight, net->ln->bias,
                               at::zeros_like(net->hidden), {32}, 1e-5, false)[0];
    EXPECT_TRUE(all_close(net->ln_out, ref, tolerance_for(e.ln))) << apex::amp::to_string(e.level);
  }
}

}  // namespace
}  // namespace apex::test
