// The CPU half-precision fallback: each covered op, bf16 and fp16, against the fp32 op on the
// same (exactly representable) inputs rounded once; the scope's on/off, nesting, threads and
// exceptions. Availability is forced on, so these run on every CPU.
#include <ATen/ops/mm_cpu_dispatch.h>
#include <apex/amp/autocast.h>
#include <apex/amp/cpu_half.h>
#include <apex/amp/cpu_half_testing.h>
#include <apex/amp/utils.h>

#include <functional>
#include <limits>
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
  // NaN exactly where the reference has it (a NaN reference would pass any comparison below).
  if (!g.isnan().equal(want.isnan())) {
    return ::testing::AssertionFailure()
           << "NaN in " << g.isnan().sum().item<int64_t>() << " elements, the reference's in "
           << want.isnan().sum().item<int64_t>();
  }
  // One ulp of the half dtype at the value's magnitude (bf16: 8 bits, fp16: 11 bits), and what
  // fp32 sums taken in another order than the reference's (the few-vector products) can differ
  // by where terms cancel: a few fp32 units of the tensor's largest value.
  const double eps = got.scalar_type() == at::kBFloat16 ? 1.0 / 128 : 1.0 / 1024;
  const double fp32_order = want.numel() > 0 ? want.abs().max().item<double>() * 0x1p-20 : 0.0;
  const at::Tensor ulp = (want.abs() * eps).clamp_min(1e-30) + fp32_order;
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
  bool differentiable = true;  // out= variants are not
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
      // One row or one column: the matrix read in place (kernels/gemv.h), in either layout; a few
      // rows or columns too where the matrix has 64 Ki elements or more.
      {"mm one row (b's columns strided: by columns)",
       [](const Input& in) {
         return at::mm(in({1, 33}, 44), in({33, 1100}, 45));
       }},
      {"mm one row (b transposed, batch-1 linear: by rows)",
       [](const Input& in) {
         return at::mm(in({1, 600}, 46), in({70, 600}, 47).t());
       }},
      {"mm one column, and a transposed",
       [](const Input& in) {
         return at::cat({at::mm(in({70, 33}, 48), in({33, 1}, 49)),
                         at::mm(in({33, 70}, 50).t(), in({33, 1}, 61))});
       }},
      {"mm one row and column",
       [](const Input& in) {
         return at::mm(in({1, 33}, 51), in({33, 1}, 52));
       }},
      {"mm five rows (four vectors, then one), by columns and by rows",
       [](const Input& in) {
         return at::cat({at::mm(in({5, 40}, 62), in({40, 1700}, 63)),
                         at::mm(in({5, 40}, 70), in({1700, 40}, 64).t())});
       }},
      {"mm six columns, a transposed",
       [](const Input& in) {
         return at::mm(in({35, 2000}, 65).t(), in({35, 6}, 66));
       }},
      {"addmm eight rows (small-batch linear)",
       [](const Input& in) {
         return at::addmm(in({1, 2000}, 67), in({8, 33}, 68), in({2000, 33}, 69).t(), 1.0, 0.5);
       }},
      {"mm 31 rows (vector groups of four, register tiles and their remainders), by rows",
       [](const Input& in) {
         return at::mm(in({31, 70}, 82), in({1001, 70}, 83).t());
       }},
      {"mm 31 rows, by columns",
       [](const Input& in) {
         return at::mm(in({31, 70}, 84), in({70, 1003}, 85));
       }},
      {"mm 64 columns, and 65 rows (vector kernels up to 64 without the own product, 32 with it)",
       [](const Input& in) {
         return at::cat({at::mm(in({1100, 60}, 86), in({60, 64}, 87)).t(),
                         at::mm(in({65, 60}, 88), in({60, 1100}, 89))});
       }},
      // Few rows with a 1-D bias, beta = alpha = 1: the half result written by the kernels'
      // driver (widening, sums, bias and rounding there, no ATen calls but the output's).
      {"linear 5 rows with bias, addmv with self, mm of transposed rows (rounded by the driver)",
       [](const Input& in) {
         return at::cat({at::linear(in({5, 33}, 90), in({70, 33}, 91), in({70}, 92)).flatten(),
                         at::addmv(in({70}, 93), in({70, 33}, 94), in({33}, 95)),
                         at::mm(in({40, 3}, 96).t(), in({40, 100}, 97)).flatten()});
       }},
      {"mm one row, b strided both ways (widened)",
       [](const Input& in) {
         return at::mm(in({1, 33}, 53), in({66, 140}, 54).slice(0, 0, 66, 2).slice(1, 0, 140, 2));
       }},
      {"addmm one row (batch-1 linear with bias)",
       [](const Input& in) {
         return at::addmm(in({70}, 55), in({1, 33}, 56), in({70, 33}, 57).t(), 0.5, 2.0);
       }},
      {"linear 1-D input",
       [](const Input& in) {
         return at::linear(in({33}, 58), in({70, 33}, 59), in({70}, 60));
       }},
      {"addmv, and mv of a transposed matrix",
       [](const Input& in) {
         return at::cat({at::addmv(in({70}, 71), in({70, 33}, 72), in({33}, 73), 0.5, 2.0),
                         at::mv(in({33, 70}, 74).t(), in({33}, 75))});
       }},
      {"addmv broadcast self, k = 0",
       [](const Input& in) {
         return at::cat({at::addmv(in({1}, 76), in({9, 40}, 77), in({40}, 78)),
                         at::addmv(in({5}, 79), in({5, 0}, 80), in({0}, 81), 2.0, 1.0)});
       }},
      // More than 64 rows and columns: apex's own product where the CPU's kernel table has it
      // (kernels/gemm.h): k in several blocks of 256 and a tail, rows and columns that fill
      // neither a 6 x 16 tile nor a 72-row block, each operand's layout, strided rows.
      // (Each product its own leaves: a leaf used twice gets its gradient summed in the half
      // dtype, rounded twice.)
      {"mm 100x600 by 600x77, each layout",
       [](const Input& in) {
         return at::cat({at::mm(in({100, 600}, 90), in({600, 77}, 91)),
                         at::mm(in({600, 100}, 92).t(), in({77, 600}, 93).t()),
                         at::mm(in({100, 600}, 90), in({77, 600}, 93).t()),
                         at::mm(in({600, 100}, 92).t(), in({600, 77}, 91))});
       }},
      {"mm with rows strided in k, k = 1, k = 7",
       [](const Input& in) {
         return at::cat({at::mm(in({90, 300}, 94).slice(1, 3, 203, 2), in({100, 70}, 95)),
                         at::mm(in({90, 1}, 96), in({1, 70}, 97)),
                         at::mm(in({90, 7}, 98), in({70, 7}, 99).t())});
       }},
      {"addmm 1-D bias, full self with alpha and beta, a column with beta 0",
       [](const Input& in) {
         return at::cat(
             {at::addmm(in({80}, 102), in({130, 300}, 100), in({300, 80}, 101)),
              at::addmm(in({130, 80}, 103), in({130, 300}, 100), in({300, 80}, 101), 0.5, 2.0),
              at::addmm(in({130, 1}, 104), in({130, 300}, 100), in({300, 80}, 101), 0.0, 1.0)});
       }},
      {"bmm a broadcast batch (stride 0)",
       [](const Input& in) {
         return at::bmm(in({1, 70, 90}, 106).expand({3, 70, 90}), in({3, 90, 80}, 105));
       },
       false},  // its gradient is a sum over the batch in the half dtype (rounded twice)
      {"bmm, baddbmm: transposed operands, a 1-D self",
       [](const Input& in) {
         return at::cat(
             {at::bmm(in({3, 90, 70}, 107).transpose(1, 2), in({3, 80, 90}, 108).transpose(1, 2)),
              at::baddbmm(in({80}, 109), in({3, 70, 90}, 110), in({3, 90, 80}, 105), 0.5, 1.5)});
       }},
      {"addbmm 4 batches of 100x300 by 300x90 summed, alpha and beta; a 1-D self",
       [](const Input& in) {
         return at::cat({at::addbmm(in({100, 90}, 114), in({4, 100, 300}, 115),
                                    in({4, 300, 90}, 116), 0.5, 2.0),
                         at::addbmm(in({90}, 117), in({3, 300, 100}, 118).transpose(1, 2),
                                    in({3, 300, 90}, 119))});
       }},
      {"linear 3-D, 2 x 50 tokens of 300 features to 130 (C++ Linear: matmul, bias in place)",
       [](const Input& in) {
         return at::linear(in({2, 50, 300}, 111), in({130, 300}, 112), in({130}, 113));
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
      {"addbmm",
       [](const Input& in) {
         return at::addbmm(in({5, 2}, 35), in({3, 5, 8}, 36), in({3, 8, 2}, 37), 0.5, 2.0);
       }},
      // In place (fairseq's conv_tbc is addmm_ on slices: ConvTbcTakesTheRoute) and out=.
      {"addmm_ in place",
       [](const Input& in) {
         return in({6, 4}, 38).clone().addmm_(in({6, 17}, 8), in({17, 4}, 9), 0.5, 2.0);
       }},
      {"baddbmm_ in place, self transposed",
       [](const Input& in) {
         return in({3, 2, 5}, 39)
             .clone()
             .transpose(1, 2)
             .baddbmm_(in({3, 5, 8}, 13), in({3, 8, 2}, 14));
       }},
      {"addbmm_ in place",
       [](const Input& in) {
         return in({5, 2}, 40).clone().addbmm_(in({3, 5, 8}, 36), in({3, 8, 2}, 37), 1.0, 0.5);
       }},
      {"mm out= (resized)",
       [](const Input& in) {
         const at::Tensor a = in({7, 33}, 1);
         at::Tensor out = at::empty({0}, a.options());
         at::mm_out(out, a, in({33, 5}, 2));
         return out;
       },
       false},
      {"bmm out= (transposed out)",
       [](const Input& in) {
         const at::Tensor a = in({3, 5, 8}, 10);
         at::Tensor out = at::empty({3, 2, 5}, a.options()).transpose(1, 2);
         at::bmm_out(out, a, in({3, 8, 2}, 11));
         EXPECT_FALSE(out.is_contiguous());  // written in place, its layout kept
         return out;
       },
       false},
      {"addmv_ in place, addmv out=",
       [](const Input& in) {
         const at::Tensor m = in({70, 33}, 72), v = in({33}, 73);
         at::Tensor out = at::empty({0}, m.options());
         at::addmv_out(out, in({70}, 71), m, v, 0.5, 2.0);
         return at::cat({in({70}, 82).clone().addmv_(m, v, 1.0, 0.5), out});
       },
       false},
      {"addmm, baddbmm, addbmm out=",
       [](const Input& in) {
         const at::Tensor a = in({3, 5, 8}, 13), b = in({3, 8, 2}, 14);
         at::Tensor o1 = at::empty({0}, a.options()), o2 = at::empty({0}, a.options()),
                    o3 = at::empty({0}, a.options());
         at::addmm_out(o1, in({2}, 7), a[0], b[0], 0.5, 2.0);
         at::baddbmm_out(o2, in({3, 5, 2}, 12), a, b);
         at::addbmm_out(o3, in({5, 2}, 35), a, b);
         return at::cat({o1.flatten(), o2.flatten(), o3.flatten()});
       },
       false},
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
      // 1-D convolutions with 16 or more output channels (per group): apex's own product, a sum
      // over the taps reading the input through strides (cpu_half/conv1d.h). Lengths that fill
      // the packing's stride-2 runs and leave a tail; the input's gradient a residue at a time.
      {"conv1d k3 s2 32 -> 32 channels (wav2vec2's encoder layers)",
       [](const Input& in) {
         return at::conv1d(in({2, 32, 101}, 130), in({32, 32, 3}, 131), {}, 2);
       }},
      {"conv1d one input channel, k10 s5 to 16, bias (the taps are k)",
       [](const Input& in) {
         return at::conv1d(in({2, 1, 400}, 132), in({16, 1, 10}, 133), in({16}, 134), 5);
       }},
      {"conv1d 2 groups, k7, dilation 2, padding 3, bias",
       [](const Input& in) {
         return at::conv1d(in({2, 16, 60}, 135), in({32, 8, 7}, 136), in({32}, 137), 1, 3, 2, 2);
       }},
      {"conv1d stride 3, dilation 3 (two residues without taps), padding 1",
       [](const Input& in) {
         return at::conv1d(in({2, 8, 50}, 138), in({16, 8, 2}, 139), {}, 3, 1, 3);
       }},
      {"conv1d of a transposed input, k5 padding 2 (wav2vec2's positional convolution)",
       [](const Input& in) {
         return at::conv1d(in({2, 40, 16}, 140).transpose(1, 2), in({16, 16, 5}, 141),
                           in({16}, 142), 1, 2);
       }},
      {"conv1d of a transposed input, no padding (read in place), one sample",
       [](const Input& in) {
         return at::conv1d(in({1, 40, 16}, 143).transpose(1, 2), in({16, 16, 3}, 144), {}, 2);
       }},
      {"conv1d stride 4, dilation 2 (residues of three, two and no taps)",
       [](const Input& in) {
         return at::conv1d(in({2, 8, 80}, 145), in({16, 8, 5}, 146), {}, 4, at::IntArrayRef{0}, 2);
       }},
      {"conv1d 80 output channels (two blocks of rows), padding past the kernel's span",
       [](const Input& in) {
         return at::conv1d(in({4, 8, 30}, 147), in({80, 8, 3}, 148), in({80}, 149), 1, 4);
       }},
      {"conv_transpose1d stride 2, padding 1, bias",
       [](const Input& in) {
         return at::conv_transpose1d(in({2, 16, 20}, 170), in({16, 8, 4}, 171), in({8}, 172), 2, 1);
       }},
      {"conv_transpose1d stride 3, dilation 2, output padding 1, 2 groups, bias",
       [](const Input& in) {
         return at::conv_transpose1d(in({2, 32, 17}, 173), in({32, 8, 3}, 174), in({16}, 178), 3, 2,
                                     1, 2, 2);
       }},
      {"conv_transpose1d one tap, dilation 3, output padding 2 (LibTorch allows it below the "
       "dilation)",
       [](const Input& in) {
         return at::conv_transpose1d(in({2, 16, 20}, 185), in({16, 8, 1}, 186), {}, 1, 0, 2, 1, 3);
       }},
      {"conv_transpose1d stride 4, two taps (steps no tap reaches: the bias)",
       [](const Input& in) {
         return at::conv_transpose1d(in({2, 16, 20}, 175), in({16, 8, 2}, 176), in({8}, 177), 4);
       }},
      {"conv2d 1x1 (pointwise), 2 groups, bias: a 1-D convolution over H * W",
       [](const Input& in) {
         return at::conv2d(in({2, 16, 5, 6}, 179), in({32, 8, 1, 1}, 180), in({32}, 181), 1,
                           at::IntArrayRef{0}, 1, 2);
       }},
      {"conv1d 16 steps out; depthwise with 16 outputs per channel",
       [](const Input& in) {
         return at::cat(
             {at::conv1d(in({1, 8, 18}, 161), in({16, 8, 3}, 162)).flatten(),
              at::conv1d(in({2, 2, 50}, 163), in({32, 1, 5}, 164), {}, 1, 2, 1, 2).flatten()});
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
        const uint64_t before = apex::amp::detail::cpu_half_route_calls();
        got = c.run(half);
        // Computed by the route, not by LibTorch's half kernel (whose results may also be
        // within one unit).
        EXPECT_GT(apex::amp::detail::cpu_half_route_calls(), before) << c.name << " " << t;
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
      if (!c.differentiable) continue;
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

// LSTM and GRU (torch::nn modules cast to half, as O2 does): the fp32 layer on the widened
// values, outputs rounded once; gradients of the half weights and input through the widenings;
// packed sequences and inference mode too; outside a scope LibTorch's composite, step by step in
// the half dtype.
TEST(CpuHalfFallback, LstmAndGruRunInFp32) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(t));
    torch::nn::LSTM lstm(torch::nn::LSTMOptions(6, 5).num_layers(2).batch_first(true));
    torch::nn::GRU gru(torch::nn::GRUOptions(6, 5).bidirectional(true));
    lstm->to(t);
    gru->to(t);
    const at::Tensor x = exact({3, 7, 6}, t, 80);
    std::vector<at::Tensor> got[2];  // [0]: the fp32 modules on the widened values
    for (const bool half : {false, true}) {
      auto l = std::dynamic_pointer_cast<torch::nn::LSTMImpl>(lstm->clone());
      auto g = std::dynamic_pointer_cast<torch::nn::GRUImpl>(gru->clone());
      if (!half) {
        l->to(at::kFloat);
        g->to(at::kFloat);
      }
      // One input per module: a tensor feeding both would get two rounded gradients added.
      const at::Tensor in = (half ? x : x.to(at::kFloat)).requires_grad_();
      const at::Tensor in_g = (half ? x : x.to(at::kFloat)).clone().detach().requires_grad_();
      const CpuHalfFallbackGuard guard(half);
      const uint64_t before = apex::amp::detail::cpu_half_route_calls();
      const at::Tensor y = std::get<0>(l->forward(in));
      const at::Tensor z = std::get<0>(g->forward(in_g));
      if (half) {
        EXPECT_GE(apex::amp::detail::cpu_half_route_calls(), before + 2);
      }
      (y.to(at::kFloat).sum() + z.to(at::kFloat).sum()).backward();
      got[half] = {y,
                   z,
                   in.grad(),
                   in_g.grad(),
                   l->named_parameters()["weight_hh_l1"].grad(),
                   g->named_parameters()["weight_ih_l0_reverse"].grad()};
    }
    EXPECT_TRUE(got[1][0].equal(got[0][0].to(t)));  // bit for bit: the same fp32 computation
    EXPECT_TRUE(got[1][1].equal(got[0][1].to(t)));
    for (size_t i = 2; i < got[0].size(); ++i) {
      EXPECT_EQ(got[1][i].scalar_type(), t);
      EXPECT_TRUE(rounded_once(got[1][i], got[0][i])) << "gradient " << i;
    }
    const CpuHalfFallbackGuard guard;
    // Packed sequences (lengths 7, 4, 2): the same values as the fp32 layers on them.
    namespace rnn = torch::nn::utils::rnn;
    const at::Tensor lengths = at::tensor({7, 4, 2}, at::kLong);
    const auto packed = [&](const at::Tensor& v) {
      return rnn::pack_padded_sequence(v, lengths, /*batch_first=*/true);
    };
    auto l32 = std::dynamic_pointer_cast<torch::nn::LSTMImpl>(lstm->clone());
    auto g32 = std::dynamic_pointer_cast<torch::nn::GRUImpl>(gru->clone());
    l32->to(at::kFloat);
    g32->to(at::kFloat);
    const uint64_t before_packed = apex::amp::detail::cpu_half_route_calls();
    const at::Tensor pl = std::get<0>(lstm->forward_with_packed_input(packed(x))).data();
    const at::Tensor pg = std::get<0>(gru->forward_with_packed_input(packed(x))).data();
    EXPECT_GE(apex::amp::detail::cpu_half_route_calls(), before_packed + 2);
    const at::Tensor xf = x.to(at::kFloat);
    EXPECT_TRUE(pl.equal(std::get<0>(l32->forward_with_packed_input(packed(xf))).data().to(t)));
    EXPECT_TRUE(pg.equal(std::get<0>(g32->forward_with_packed_input(packed(xf))).data().to(t)));
    const c10::InferenceMode inference;
    const uint64_t before = apex::amp::detail::cpu_half_route_calls();
    EXPECT_TRUE(std::get<0>(lstm->forward(x)).equal(got[1][0]));
    EXPECT_GT(apex::amp::detail::cpu_half_route_calls(), before);
  }
}

// The plain RNNs (tanh and relu) likewise: outputs bit-equal to the fp32 layer's rounded once,
// gradients within one unit, packed sequences too.
TEST(CpuHalfFallback, PlainRnnsRunInFp32) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    for (const auto nonlinearity : {torch::nn::RNNOptions::nonlinearity_t(torch::kTanh),
                                    torch::nn::RNNOptions::nonlinearity_t(torch::kReLU)}) {
      const bool tanh = std::holds_alternative<torch::enumtype::kTanh>(nonlinearity);
      SCOPED_TRACE(std::string(c10::toString(t)) + (tanh ? " tanh" : " relu"));
      torch::nn::RNN rnn(
          torch::nn::RNNOptions(6, 5).num_layers(2).bidirectional(!tanh).nonlinearity(
              nonlinearity));
      rnn->to(t);
      const at::Tensor x = exact({7, 3, 6}, t, 83);
      std::vector<at::Tensor> got[2];
      for (const bool half : {false, true}) {
        auto r = std::dynamic_pointer_cast<torch::nn::RNNImpl>(rnn->clone());
        if (!half) r->to(at::kFloat);
        const at::Tensor in = (half ? x : x.to(at::kFloat)).requires_grad_();
        const CpuHalfFallbackGuard guard(half);
        const uint64_t before = apex::amp::detail::cpu_half_route_calls();
        auto [y, h] = r->forward(in);
        EXPECT_EQ(apex::amp::detail::cpu_half_route_calls() > before, half);
        (y.to(at::kFloat).sum() + h.to(at::kFloat).sum()).backward();
        got[half] = {y, h, in.grad(), r->named_parameters()["weight_hh_l1"].grad(),
                     r->named_parameters()["bias_ih_l0"].grad()};
      }
      EXPECT_TRUE(got[1][0].equal(got[0][0].to(t)));
      EXPECT_TRUE(got[1][1].equal(got[0][1].to(t)));
      for (size_t i = 2; i < got[0].size(); ++i) {
        EXPECT_EQ(got[1][i].scalar_type(), t);
        EXPECT_TRUE(rounded_once(got[1][i], got[0][i])) << "gradient " << i;
      }
      namespace rnn_utils = torch::nn::utils::rnn;
      const at::Tensor lengths = at::tensor({7, 4, 2}, at::kLong);
      auto r32 = std::dynamic_pointer_cast<torch::nn::RNNImpl>(rnn->clone());
      r32->to(at::kFloat);
      const CpuHalfFallbackGuard guard;
      const uint64_t before = apex::amp::detail::cpu_half_route_calls();
      const at::Tensor p =
          std::get<0>(rnn->forward_with_packed_input(rnn_utils::pack_padded_sequence(x, lengths)))
              .data();
      EXPECT_GT(apex::amp::detail::cpu_half_route_calls(), before);
      EXPECT_TRUE(
          p.equal(std::get<0>(r32->forward_with_packed_input(
                                  rnn_utils::pack_padded_sequence(x.to(at::kFloat), lengths)))
                      .data()
                      .to(t)));
    }
  }
}

// conv_tbc (fairseq's ConvTBC, on autocast's half list) adds one product per kernel tap into
// its output with addmm_, so its result is rounded after each tap, by LibTorch's half kernel as
// by the route: the two agree (to one unit where their fp32 sums differ in order), and not with a
// single rounding of the fp32 op. Gradients (mm and addmm_ on slices) within the half tolerance.
TEST(CpuHalfFallback, ConvTbcTakesTheRoute) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    std::vector<at::Tensor> results[2];
    for (const bool route : {false, true}) {
      const at::Tensor x = exact({9, 2, 6}, t, 41).requires_grad_();
      const at::Tensor w = exact({3, 6, 4}, t, 42).requires_grad_();
      const at::Tensor b = exact({4}, t, 43).requires_grad_();
      const CpuHalfFallbackGuard guard(route);
      const uint64_t before = apex::amp::detail::cpu_half_route_calls();
      const at::Tensor y = at::conv_tbc(x, w, b, 1);
      y.backward(exact(y.sizes(), t, 44));
      EXPECT_EQ(apex::amp::detail::cpu_half_route_calls() > before, route) << t;
      results[route] = {y, x.grad(), w.grad(), b.grad()};
    }
    EXPECT_TRUE(rounded_once(results[1][0], results[0][0].to(at::kFloat))) << t;
    for (size_t i = 1; i < 4; ++i) {
      EXPECT_EQ(results[1][i].scalar_type(), t);
      EXPECT_TRUE(apex::test::all_close(results[1][i], results[0][i], apex::test::tolerance_for(t)))
          << t << " gradient " << i;
    }
  }
}

// In place and out= in a scope: what LibTorch refuses is refused with its message and nothing
// written; an operand aliasing the output reads its values from before the call.
TEST(CpuHalfFallback, InPlaceAndOutVariantsRefuseWhatLibTorchRefuses) {
  const ForceAvailable force;
  const CpuHalfFallbackGuard guard;
  const at::Tensor a = exact({4, 4}, at::kBFloat16, 60), b = exact({4, 4}, at::kBFloat16, 61);
  at::Tensor bias = exact({4}, at::kBFloat16, 62);
  const at::Tensor bias_before = bias.clone();
  EXPECT_THROW(bias.addmm_(a, b), c10::Error);  // in place cannot broadcast the result into it
  EXPECT_TRUE(bias.equal(bias_before));
  at::Tensor out32 = at::zeros({4, 4});
  EXPECT_THROW(at::mm_out(out32, a, b), c10::Error);  // LibTorch's dtype check
  EXPECT_TRUE(out32.equal(at::zeros({4, 4})));
  EXPECT_THROW(at::mm(a, exact({3, 4}, at::kBFloat16, 63)), c10::Error);
  at::Tensor v = exact({1}, at::kBFloat16, 64);
  EXPECT_THROW(v.addmv_(a, bias), c10::Error);
  EXPECT_TRUE(v.equal(exact({1}, at::kBFloat16, 64)));
  // self.addmm_(self, b): the product reads self before it is overwritten.
  at::Tensor s = a.clone();
  const at::Tensor want = at::addmm(a.to(at::kFloat), a.to(at::kFloat), b.to(at::kFloat), 1, 1);
  s.addmm_(s, b);
  EXPECT_TRUE(s.equal(want.to(at::kBFloat16)));
  at::Tensor o = a.clone();
  at::mm_out(o, o, b);
  EXPECT_TRUE(o.equal(at::mm(a.to(at::kFloat), b.to(at::kFloat)).to(at::kBFloat16)));
}

// `x += bias` with x half and bias fp32 (LibTorch's C++ Linear on an N-d input at O1): one pass in
// the scope, the same values as LibTorch's widen-add-round; other shapes, layouts and a 0-dim
// bias go to LibTorch's kernel.
TEST(CpuHalfFallback, HalfPlusFp32InPlaceInOnePass) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(t));
    const at::Tensor x = exact({2, 7, 16}, t, 90);
    const at::Tensor wide = exact({3, 40000}, t, 91);  // over several tiles and threads
    auto gen = at::detail::createCPUGenerator(92);
    const at::Tensor b = at::randn({16}, gen), b_wide = at::randn({40000}, gen);
    const at::Tensor b7 = at::randn({7, 16}, gen), b71 = at::randn({7, 1}, gen);
    struct AddCase {
      const char* name;
      at::Tensor self, other;
      double alpha;
      bool taken;
    };
    const std::vector<AddCase> adds = {
        {"bias", x, b, 1.0, true},
        {"bias, alpha 0.5", x, b, 0.5, true},
        {"bias with leading ones", x, b.view({1, 1, 16}), 1.0, true},
        {"trailing two dims", x, b7, 1.0, true},
        {"long rows", wide, b_wide, 1.0, true},
        {"column broadcast", x, b71, 1.0, false},
        {"0-dim", x, at::scalar_tensor(0.3), 1.0, false},
        {"self transposed", x.transpose(1, 2), b.narrow(0, 0, 7), 1.0, false},
    };
    for (const auto& c : adds) {
      const at::Tensor want = c.self.clone().add_(c.other, c.alpha);  // outside a scope: LibTorch
      at::Tensor got = c.self.clone();
      if (!c.self.is_contiguous()) got = got.transpose(1, 2).contiguous().transpose(1, 2);
      const CpuHalfFallbackGuard guard;
      const uint64_t before = apex::amp::detail::cpu_half_route_calls();
      got.add_(c.other, c.alpha);
      EXPECT_EQ(apex::amp::detail::cpu_half_route_calls() > before, c.taken) << c.name;
      EXPECT_EQ(got.scalar_type(), t) << c.name;
      EXPECT_TRUE(got.equal(want)) << c.name;
    }
    // fp32 `other` that is not a vector of x's trailing sizes and would broadcast x: refused as
    // LibTorch refuses it, x unchanged.
    at::Tensor small = exact({16}, t, 93);
    const CpuHalfFallbackGuard guard;
    EXPECT_THROW(small.add_(b7), c10::Error);
    EXPECT_TRUE(small.equal(exact({16}, t, 93)));
  }
  // LibTorch's C++ Linear on a 3-D input under autocast: its bias add takes the route, and the
  // output is the routed product with the bias added as LibTorch adds it.
  torch::nn::Linear fc(16, 10);
  const at::Tensor in = at::randn({2, 7, 16});
  at::Tensor got;
  {
    const apex::amp::AutocastGuard autocast(c10::kCPU, at::kBFloat16);
    const CpuHalfFallbackGuard guard;
    const uint64_t before = apex::amp::detail::cpu_half_route_calls();
    got = fc->forward(in);
    EXPECT_GE(apex::amp::detail::cpu_half_route_calls(), before + 2);  // the product and the add
  }
  const at::Tensor product = at::matmul(in.to(at::kBFloat16).to(at::kFloat),
                                        fc->weight.to(at::kBFloat16).to(at::kFloat).t())
                                 .to(at::kBFloat16);
  EXPECT_TRUE(got.equal(product.clone().add_(fc->bias.detach())));
}

// The kernels for products with a few rows or columns sum each output in an order fixed by k
// alone: the same bits on any number of threads, and for a row whether it comes alone or in a
// batch of up to 32 (register tiles of any size, vector groups of any count).
TEST(CpuHalfFallback, VectorProductsDoNotDependOnThreadsOrBatch) {
  const ForceAvailable force;
  const int threads = at::get_num_threads();
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    const at::Tensor a = exact({31, 301}, t, 70), b = exact({301, 3001}, t, 71);
    const at::Tensor w = exact({3001, 301}, t, 72);
    std::vector<at::Tensor> got[2];
    for (const int n : {1, 4}) {
      at::set_num_threads(n);
      const CpuHalfFallbackGuard guard;
      got[n == 4] = {at::mm(a, b), at::mm(a, w.t()), at::mm(w, a.t()),
                     at::mm(a[0].view({1, -1}), b)};
    }
    for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(got[0][i].equal(got[1][i])) << t << i;
    const CpuHalfFallbackGuard guard;
    for (const int64_t row : {0, 5, 30}) {
      const at::Tensor one = a.slice(0, row, row + 1);
      EXPECT_TRUE(at::mm(one, b).equal(got[0][0].slice(0, row, row + 1))) << t << row;
      EXPECT_TRUE(at::mm(one, w.t()).equal(got[0][1].slice(0, row, row + 1))) << t << row;
      EXPECT_TRUE(at::mm(a.slice(0, 0, 9), b).equal(got[0][0].slice(0, 0, 9))) << t;
    }
  }
  at::set_num_threads(threads);
}

// apex's own product (kernels/gemm.h) sums each output in an order fixed by k alone: the same bits
// on 1 and 4 threads, and for a block of rows or columns computed alone (other splits, tiles and
// blocks). It takes the larger products wherever the CPU has AVX2 with FMA (unless a narrower
// kernel table or APEX_CPU_HALF_GEMM=0 is asked for).
TEST(CpuHalfFallback, OwnProductDoesNotDependOnThreadsOrSplit) {
  const ForceAvailable force;
  const char* isa = std::getenv("APEX_CPU_ISA");
  const char* off = std::getenv("APEX_CPU_HALF_GEMM");
  const bool own = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                   !(isa != nullptr && std::string(isa) == "baseline") &&
                   !(off != nullptr && std::string(off) == "0");
  EXPECT_EQ(apex::amp::detail::cpu_half_own_gemm(), own);
  const int threads = at::get_num_threads();
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    const at::Tensor a = exact({300, 700}, t, 120), b = exact({700, 500}, t, 121);
    const at::Tensor w = exact({3, 150, 700}, t, 122);
    std::vector<at::Tensor> got[2];
    for (const int n : {1, 4}) {
      at::set_num_threads(n);
      const CpuHalfFallbackGuard guard;
      const uint64_t before = apex::amp::detail::cpu_half_gemm_calls();
      got[n == 4] = {at::mm(a, b), at::mm(b.t(), a.t()), at::bmm(w, b.expand({3, 700, 500})),
                     at::addbmm(a.slice(0, 0, 150).slice(1, 0, 500), w, b.expand({3, 700, 500}))};
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls() - before, own ? 4u : 0u) << t;
    }
    for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(got[0][i].equal(got[1][i])) << t << i;
    const CpuHalfFallbackGuard guard;
    EXPECT_TRUE(at::mm(a.slice(0, 72, 200), b).equal(got[0][0].slice(0, 72, 200))) << t;
    EXPECT_TRUE(at::mm(a, b.slice(1, 16, 400)).equal(got[0][0].slice(1, 16, 400))) << t;
    EXPECT_TRUE(at::mm(w[1], b).equal(got[0][2][1])) << t;
    const at::Tensor want = at::mm(a.to(at::kFloat), b.to(at::kFloat));
    EXPECT_TRUE(rounded_once(got[0][0], want)) << t;
    EXPECT_TRUE(rounded_once(got[0][1], want.t())) << t;
  }
  at::set_num_threads(threads);
}

// The 1-D convolutions the product takes: counted as its calls (forward, and backward once for
// all gradients), the same bits for 1 and 4 threads; those it does not take (too few channels,
// too short an output) widened.
TEST(CpuHalfFallback, Conv1dThroughOwnProduct) {
  const ForceAvailable force;
  const bool own = apex::amp::detail::cpu_half_own_gemm();
  const int threads = at::get_num_threads();
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    std::vector<at::Tensor> got[2];
    for (const int n : {1, 4}) {
      at::set_num_threads(n);
      const at::Tensor x = exact({3, 64, 199}, t, 150).requires_grad_();
      const at::Tensor w = exact({64, 64, 3}, t, 151).requires_grad_();
      const CpuHalfFallbackGuard guard;
      const uint64_t before = apex::amp::detail::cpu_half_gemm_calls();
      const at::Tensor y = at::conv1d(x, w, {}, 2);
      y.backward(exact(y.sizes(), t, 152));
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls() - before, own ? 2u : 0u) << t;
      got[n == 4] = {y, x.grad(), w.grad()};
      const uint64_t taken = apex::amp::detail::cpu_half_gemm_calls();
      at::conv1d(exact({3, 64, 50}, t, 153), exact({8, 64, 3}, t, 154));
      at::conv1d(exact({3, 4, 50}, t, 155), exact({32, 4, 3}, t, 156));
      at::conv1d(exact({3, 64, 17}, t, 159), exact({64, 64, 3}, t, 160));           // 15 steps out
      at::conv_transpose1d(exact({3, 64, 50}, t, 157), exact({64, 4, 3}, t, 158));  // 4 out
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls(), taken) << t;
      at::conv_transpose1d(exact({3, 64, 50}, t, 157), exact({64, 32, 3}, t, 158), {}, 2);
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls(), taken + (own ? 1 : 0)) << t;
      // 1x1 2-D: NCHW taken; channels-last, stride 2, padded: LibTorch's kernels on fp32.
      const at::Tensor img = exact({2, 32, 8, 8}, t, 182), pw = exact({32, 32, 1, 1}, t, 183);
      const at::Tensor pw_leaf = pw.clone().requires_grad_();
      at::conv2d(img, pw_leaf).backward(exact({2, 32, 8, 8}, t, 184));
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls(), taken + (own ? 3 : 0)) << t;
      EXPECT_EQ(pw_leaf.grad().sizes(), pw.sizes()) << t;
      const at::Tensor cl = at::conv2d(img.contiguous(at::MemoryFormat::ChannelsLast), pw);
      EXPECT_TRUE(cl.is_contiguous(at::MemoryFormat::ChannelsLast)) << t;
      at::conv2d(img, pw, {}, 2);
      at::conv2d(img, pw, {}, 1, 1);
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls(), taken + (own ? 3 : 0)) << t;
      // An output padding of the wrong length is LibTorch's to refuse.
      EXPECT_ANY_THROW(at::convolution(exact({2, 16, 40}, t, 165), exact({16, 16, 3}, t, 166), {},
                                       {1}, {0}, {1}, false, {}, 1));
    }
    for (size_t i = 0; i < got[0].size(); ++i) EXPECT_TRUE(got[0][i].equal(got[1][i])) << t << i;
    // A gradient with zero strides (of a sum) reaches the product unpadded where one tap at
    // stride 2 needs no padding: the input's gradient against the fp32 one.
    const CpuHalfFallbackGuard guard;
    const at::Tensor x = exact({2, 8, 40}, t, 167).requires_grad_();
    const at::Tensor w = exact({16, 8, 1}, t, 168);
    at::conv1d(x, w, {}, 2).sum().backward();
    const at::Tensor xf = x.detach().to(at::kFloat).requires_grad_();
    at::conv1d(xf, w.to(at::kFloat), {}, 2).sum().backward();
    EXPECT_TRUE(rounded_once(x.grad(), xf.grad())) << t;
  }
  at::set_num_threads(threads);
}

// Attention through apex's own kernels (kernels/attention.h): the output and each gradient against
// LibTorch's fp32 flash attention on the same values rounded once (the backward given the same
// rounded output and logsumexp), the logsumexp within fp32 summation order; contiguous and
// [B, L, H, D] layouts, queries and keys of different lengths,
// causal either way round, a given scale, one token, the longest sequence taken; the same bits on
// 1 and 4 threads; additive masks ([Lq, Lk], padding [B, 1, 1, Lk], a query with every key
// hidden); NaN and infinity as in fp32; longer sequences left to the widening path.
TEST(CpuHalfFallback, AttentionThroughOwnKernels) {
  const ForceAvailable force;
  // The kernels exist from AVX2 on, unless APEX_CPU_HALF_GEMM=0 or APEX_CPU_HALF_ATTENTION=0
  // (then these compare LibTorch's widened path with the same reference).
  const bool own = apex::amp::detail::cpu_half_attention_available(at::kBFloat16);
  EXPECT_EQ(apex::amp::detail::cpu_half_attention_available(at::kHalf), own);
  const int threads = at::get_num_threads();
  enum Mask { kNone, kAdditive2d, kPadding, kFullRow, kPerQuery, kPerHead };
  struct Shape {
    int64_t b, h, lq, lk, d, dv;
    bool bhld_transposed, causal;
    std::optional<double> scale;
    Mask mask = kNone;
  };
  const Shape shapes[] = {
      {2, 3, 64, 64, 64, 64, false, false, std::nullopt},
      {2, 2, 17, 33, 40, 40, true, false, 0.3},
      {1, 2, 33, 17, 8, 8, false, true, std::nullopt},
      {2, 1, 20, 50, 16, 16, true, true, std::nullopt},
      {1, 1, 256, 256, 32, 32, false, true, std::nullopt},
      {1, 1, 1, 1, 1, 1, false, false, std::nullopt},
      {2, 2, 24, 40, 16, 16, false, false, std::nullopt, kAdditive2d},
      {3, 2, 30, 30, 16, 16, true, true, 0.5, kPadding},
      {2, 3, 12, 20, 8, 8, false, false, std::nullopt, kFullRow},
      // A negative scale: the smallest score leads (not causal: LibTorch's fp32 kernel gives NaN
      // for a causal one with a negative scale).
      {2, 2, 16, 24, 8, 8, false, false, -0.4},
      {1, 1, 256, 256, 256, 256, true, false, std::nullopt},  // every buffer at its largest
      {2, 2, 10, 14, 8, 8, false, false, std::nullopt, kPerQuery},
      {2, 3, 10, 14, 8, 8, true, true, std::nullopt, kPerHead},
  };
  uint64_t seed = 300;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    for (const Shape& s : shapes) {
      SCOPED_TRACE(::testing::Message()
                   << t << " " << s.b << "x" << s.h << " q" << s.lq << " k" << s.lk << " d" << s.d
                   << "/" << s.dv << " causal " << s.causal);
      const auto make = [&](int64_t l, int64_t d) {
        // [B, L, H, D] in memory, seen as [B, H, L, D] (a projection's heads), or contiguous.
        return s.bhld_transposed ? exact({s.b, l, s.h, d}, t, seed++).transpose(1, 2)
                                 : exact({s.b, s.h, l, d}, t, seed++);
      };
      const at::Tensor q = make(s.lq, s.d), k = make(s.lk, s.d), v = make(s.lk, s.dv);
      // The output's gradient strided (every other element of a wider one) where q is
      // transposed, and broadcast over heads (a zero stride) otherwise.
      const at::Tensor dout =
          s.bhld_transposed ? exact({s.b, s.h, s.lq, 2 * s.dv}, t, seed++).slice(3, 0, 2 * s.dv, 2)
                            : exact({s.b, 1, s.lq, s.dv}, t, seed++).expand({s.b, s.h, s.lq, s.dv});
      // Masks in the query's dtype, -inf where a key is hidden: [Lq, Lk] values and some -inf;
      // [B, 1, 1, Lk] hiding each sample's last keys (padding); [B, H, Lq, Lk] hiding every key of
      // one query (zeros out, as LibTorch's kernel).
      at::Tensor mask;
      const float inf = std::numeric_limits<float>::infinity();
      if (s.mask == kAdditive2d) {
        mask = exact({s.lq, s.lk}, t, seed++);
        mask.masked_fill_(exact({s.lq, s.lk}, t, seed++).gt(1.0), -inf);
      } else if (s.mask == kPadding) {
        mask = at::zeros({s.b, 1, 1, s.lk}, q.options());
        for (int64_t i = 0; i < s.b; ++i)
          mask.index_put_({i, 0, 0, at::indexing::Slice(s.lk - 3 * i, at::indexing::None)}, -inf);
      } else if (s.mask == kPerQuery) {  // [Lq, 1]: one value per query for every key
        mask = exact({s.lq, 1}, t, seed++);
      } else if (s.mask == kPerHead) {  // [1, H, Lq, Lk]: the cached widening changes per head
        mask = exact({1, s.h, s.lq, s.lk}, t, seed++);
        mask.masked_fill_(exact({1, s.h, s.lq, s.lk}, t, seed++).gt(1.2), -inf);
      } else if (s.mask == kFullRow) {
        mask = exact({s.b, s.h, s.lq, s.lk}, t, seed++);
        mask.index_put_({1, 2, 5}, -inf);
      }
      const std::optional<at::Tensor> m =
          mask.defined() ? std::optional<at::Tensor>(mask) : std::nullopt;
      const std::optional<at::Tensor> wm =
          mask.defined() ? std::optional<at::Tensor>(mask.to(at::kFloat)) : std::nullopt;
      const auto wide = [](const at::Tensor& x) { return x.to(at::kFloat); };
      std::vector<at::Tensor> runs[2];
      for (const int n : {1, 4}) {
        at::set_num_threads(n);
        const CpuHalfFallbackGuard guard;
        const uint64_t before = apex::amp::detail::cpu_half_gemm_calls();
        auto [out, lse] =
            at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, s.causal, m, s.scale);
        auto [gq, gk, gv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, s.causal, m, s.scale);
        EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls() - before, own ? 2u : 0u);
        runs[n == 4] = {out, lse, gq, gk, gv};
      }
      for (size_t i = 0; i < runs[0].size(); ++i) EXPECT_TRUE(runs[0][i].equal(runs[1][i])) << i;
      const at::Tensor out = runs[0][0], lse = runs[0][1];
      EXPECT_EQ(out.scalar_type(), t);
      EXPECT_EQ(lse.scalar_type(), at::kFloat);
      auto [want, want_lse] = at::_scaled_dot_product_flash_attention_for_cpu(
          wide(q), wide(k), wide(v), 0.0, s.causal, wm, s.scale);
      EXPECT_TRUE(rounded_once(out, want));
      EXPECT_TRUE(apex::test::all_close(lse, want_lse, {1e-5, 1e-5}));
      auto [wq, wk, wv] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
          wide(dout), wide(q), wide(k), wide(v), wide(out), lse, 0.0, s.causal, wm, s.scale);
      EXPECT_TRUE(rounded_once(runs[0][2], wq)) << "dq";
      EXPECT_TRUE(rounded_once(runs[0][3], wk)) << "dk";
      EXPECT_TRUE(rounded_once(runs[0][4], wv)) << "dv";
      // LibTorch's layouts: the output like the query, the gradients [B, L, H, D] transposed.
      EXPECT_EQ(out.strides(), want.strides());
      EXPECT_EQ(lse.strides(), want_lse.strides());
      EXPECT_EQ(runs[0][2].strides(), wq.strides());
      EXPECT_EQ(runs[0][3].strides(), wk.strides());
      EXPECT_EQ(runs[0][4].strides(), wv.strides());
    }
    // NaN in a query, infinity in a key: where the fp32 kernel has NaN or infinity, so do we.
    {
      at::Tensor q = exact({1, 2, 24, 16}, t, seed++), k = exact({1, 2, 24, 16}, t, seed++);
      const at::Tensor v = exact({1, 2, 24, 16}, t, seed++);
      q.index_put_({0, 0, 3, 5}, std::numeric_limits<float>::quiet_NaN());
      k.index_put_({0, 1, 7, 2}, std::numeric_limits<float>::infinity());
      const at::Tensor want = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(
          q.to(at::kFloat), k.to(at::kFloat), v.to(at::kFloat)));
      const CpuHalfFallbackGuard guard;
      const at::Tensor got = std::get<0>(at::_scaled_dot_product_flash_attention_for_cpu(q, k, v));
      EXPECT_TRUE(got.isnan().equal(want.isnan())) << t;
      EXPECT_TRUE(got.isinf().equal(want.isinf())) << t;
      EXPECT_GT(want.isnan().sum().item<int64_t>(), 0) << t;
    }
    // Not taken: a sequence past the longest.
    const CpuHalfFallbackGuard guard;
    const uint64_t before = apex::amp::detail::cpu_half_gemm_calls();
    const at::Tensor longer = exact({1, 1, 257, 8}, t, seed++);
    at::_scaled_dot_product_flash_attention_for_cpu(longer, longer, longer);
    EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls(), before);
  }
  at::set_num_threads(threads);
}

// Attention's kernels also serve where LibTorch's half matmuls are fast (its half attention is
// ~0.4x its fp32 kernel there): decided per dtype from the CPU and the environment, unforced
// here. In a scope, attention takes them wherever they exist, a product only where the route
// serves the dtype; outside a scope neither; APEX_CPU_HALF_FALLBACK=0 or
// APEX_CPU_HALF_ATTENTION=0 (ctest runs both) leave attention to LibTorch's half kernel.
TEST(CpuHalfFallback, AttentionKernelsServeWhereMatmulsAreFast) {
  const auto off = [](const char* name) {
    const char* env = std::getenv(name);
    return env != nullptr && std::string(env) == "0";
  };
  const bool kernels = apex::amp::detail::cpu_half_own_gemm() && !off("APEX_CPU_HALF_ATTENTION");
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    SCOPED_TRACE(c10::toString(t));
    const bool route = apex::amp::cpu_half_fallback_available(t);
    const bool attention = kernels && !off("APEX_CPU_HALF_FALLBACK");
    EXPECT_EQ(apex::amp::detail::cpu_half_attention_available(t), attention);
    const at::Tensor q = exact({2, 2, 16, 8}, t, 400), a = exact({40, 40}, t, 401);
    for (const bool scoped : {false, true}) {
      const CpuHalfFallbackGuard guard(scoped);
      EXPECT_EQ(apex::amp::cpu_half_fallback_active(),
                scoped && (attention || apex::amp::cpu_half_fallback_available()));
      const uint64_t gemm = apex::amp::detail::cpu_half_gemm_calls();
      const uint64_t calls = apex::amp::detail::cpu_half_route_calls();
      at::_scaled_dot_product_flash_attention_for_cpu(q, q, q);
      EXPECT_EQ(apex::amp::detail::cpu_half_gemm_calls() - gemm, scoped && attention ? 1u : 0u);
      const uint64_t after_attention = apex::amp::detail::cpu_half_route_calls();
      EXPECT_EQ(after_attention - calls, scoped && (attention || route) ? 1u : 0u);
      at::mm(a, a);
      EXPECT_EQ(apex::amp::detail::cpu_half_route_calls() - after_attention,
                scoped && route ? 1u : 0u);
    }
  }
}

// NaN and infinity reach the output as in the fp32 product rounded once, on every product path:
// widened (many rows), the vector kernels' fp32 result (few columns), their driver's rounded
// result with and without a bias (few rows), addmv, a 1-D convolution through apex's product.
TEST(CpuHalfFallback, NonFiniteValuesPropagate) {
  const ForceAvailable force;
  for (const auto t : {at::kBFloat16, at::kHalf}) {
    at::Tensor a = exact({70, 40}, t, 98), w = exact({300, 40}, t, 99), bias = exact({300}, t, 100);
    a[2][5] = std::numeric_limits<float>::quiet_NaN();
    a[3][7] = std::numeric_limits<float>::infinity();
    w[9][1] = -std::numeric_limits<float>::infinity();
    const auto wide = [](const at::Tensor& x) { return x.to(at::kFloat); };
    const std::vector<std::pair<std::function<at::Tensor()>, at::Tensor>> cases = {
        {[&] { return at::mm(a, w.t()); }, at::mm(wide(a), wide(w).t())},
        {[&] { return at::mm(w, a.slice(0, 0, 6).t()); },
         at::mm(wide(w), wide(a).slice(0, 0, 6).t())},
        {[&] { return at::mm(a.slice(0, 0, 6), w.t()); },
         at::mm(wide(a).slice(0, 0, 6), wide(w).t())},
        {[&] { return at::linear(a.slice(0, 0, 6), w, bias); },
         at::linear(wide(a).slice(0, 0, 6), wide(w), wide(bias))},
        {[&] { return at::addmv(bias, w, a[2]); }, at::addmv(wide(bias), wide(w), wide(a)[2])},
        // A 1-D convolution through the product (its weight holds the -inf).
        {[&] {
           return at::conv1d(a.view({2, 35, 40}), w.flatten().slice(0, 0, 1680).view({16, 35, 3}));
         },
         at::conv1d(wide(a).view({2, 35, 40}),
                    wide(w).flatten().slice(0, 0, 1680).view({16, 35, 3}))},
    };
    for (size_t i = 0; i < cases.size(); ++i) {
      at::Tensor got;
      {
        const CpuHalfFallbackGuard guard;
        got = cases[i].first();
      }
      const at::Tensor want = cases[i].second.to(t);
      ASSERT_TRUE(at::isnan(want).any().item<bool>()) << i;  // the case has them
      EXPECT_TRUE(at::isnan(got).equal(at::isnan(want))) << t << " case " << i;
      EXPECT_TRUE(at::isinf(got).equal(at::isinf(want))) << t << " case " << i;
      const at::Tensor finite = at::isfinite(want);
      EXPECT_TRUE(rounded_once(got.masked_select(finite), cases[i].second.masked_select(finite)))
          << t << " case " << i;
    }
  }
}

// Products large enough for apex's own product (more than 32 rows and columns): what LibTorch
// refuses (operands of the wrong rank, a self that does not broadcast, even with beta 0) it
// refuses too, with LibTorch's message.
TEST(CpuHalfFallback, OwnProductRefusesWhatLibTorchRefuses) {
  const ForceAvailable force;
  const CpuHalfFallbackGuard guard;
  const at::Tensor a3 = exact({2, 40, 50}, at::kBFloat16, 130);
  const at::Tensor b3 = exact({2, 50, 40}, at::kBFloat16, 131);
  const at::Tensor a = a3[0], b = b3[0], bad = exact({3}, at::kBFloat16, 132);
  EXPECT_THROW(at::mm(a3, b3), c10::Error);
  EXPECT_THROW(at::bmm(a, b), c10::Error);
  EXPECT_THROW(at::addmm(at::zeros({2, 40, 40}, a.options()), a3, b3), c10::Error);
  EXPECT_THROW(at::addmm(bad, a, b, 0.0, 1.0), c10::Error);
  EXPECT_THROW(at::baddbmm(bad, a3, b3, 0.0, 1.0), c10::Error);
  EXPECT_THROW(at::addbmm(bad, a3, b3, 0.0, 1.0), c10::Error);
  EXPECT_THROW(at::bmm(a3, exact({3, 50, 40}, at::kBFloat16, 133)), c10::Error);  // batches
  EXPECT_THROW(at::mm(a, exact({40, 40}, at::kBFloat16, 134)), c10::Error);       // k
  // And takes what it should: beta 0 with a self that broadcasts (its NaN not propagated).
  const at::Tensor nan_self = at::full({40}, std::numeric_limits<float>::quiet_NaN(), a.options());
  EXPECT_FALSE(at::isnan(at::addmm(nan_self, a, b, 0.0, 1.0)).any().item<bool>());
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

// What the scope serves, decided from a CPU's flags, for every CPU family seen: the route where
// LibTorch multiplies a half dtype slowly, attention's own kernels wherever the kernel table has
// them (also where LibTorch's half matmuls are fast: its half attention is not).
TEST(CpuHalfDecision, EveryCpuFamilyByItsFlags) {
  using apex::amp::CpuHalfSupport;
  using apex::amp::detail::decide_cpu_half;
  CpuHalfSupport zen3;  // AVX2 only
  zen3.onednn = true;
  CpuHalfSupport skylake = zen3;  // AVX-512 without its bf16 instructions: oneDNN emulates
  skylake.avx512_core = true;
  CpuHalfSupport zen4 = skylake;  // AVX512-BF16, no AVX512-FP16 (Zen 4/5, Cooper Lake)
  zen4.avx512_bf16 = true;
  CpuHalfSupport spr = zen4;  // Sapphire Rapids: AVX512-FP16 and AMX
  spr.avx512_fp16 = true;
  spr.amx_bf16 = true;
  spr.amx_fp16 = true;
  struct Case {
    const char* name;
    CpuHalfSupport cpu;
    bool own_kernels;
    const char* fallback;
    const char* attention;
    bool route_bf16, route_fp16, attention_on, scope;
  };
  const Case cases[] = {
      {"Zen 3", zen3, true, nullptr, nullptr, true, true, true, true},
      {"Skylake-Ice Lake", skylake, true, nullptr, nullptr, true, true, true, true},
      {"Zen 4/5", zen4, true, nullptr, nullptr, false, true, true, true},
      // The case Python's scope missed: nothing for the route, attention's kernels still on.
      {"Sapphire Rapids", spr, true, nullptr, nullptr, false, false, true, true},
      {"Sapphire Rapids, FALLBACK=1", spr, true, "1", nullptr, true, true, true, true},
      {"Sapphire Rapids, ATTENTION=0", spr, true, nullptr, "0", false, false, false, false},
      {"Sapphire Rapids, no kernels", spr, false, nullptr, nullptr, false, false, false, false},
      {"Zen 3, FALLBACK=0", zen3, true, "0", nullptr, false, false, false, false},
      {"Zen 3, ATTENTION=0", zen3, true, nullptr, "0", true, true, false, true},
      {"no oneDNN", CpuHalfSupport{}, true, nullptr, nullptr, true, true, true, true},
  };
  for (const Case& c : cases) {
    const auto d = decide_cpu_half(c.cpu, c.own_kernels, c.fallback, c.attention);
    EXPECT_EQ(d.route_bf16, c.route_bf16) << c.name;
    EXPECT_EQ(d.route_fp16, c.route_fp16) << c.name;
    EXPECT_EQ(d.attention_bf16, c.attention_on) << c.name;
    EXPECT_EQ(d.attention_fp16, c.attention_on) << c.name;
    EXPECT_EQ(d.scope(), c.scope) << c.name;
  }
}

// On a CPU whose half matmuls are fast (forced here), the guard still turns on for attention.
TEST(CpuHalfDecision, GuardServesAttentionWithoutTheRoute) {
  apex::amp::detail::force_cpu_half_attention_only();
  const bool kernels = apex::amp::detail::cpu_half_attention_available(at::kBFloat16);
  {
    const CpuHalfFallbackGuard guard;
    EXPECT_EQ(apex::amp::cpu_half_fallback_active(), kernels);
    EXPECT_EQ(apex::amp::cpu_half_scope_available(), kernels);
    EXPECT_FALSE(apex::amp::cpu_half_fallback_available());
  }
  apex::amp::detail::force_cpu_half_fallback_available(std::nullopt);
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
