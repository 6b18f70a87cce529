// 1-D convolutions of half CPU tensors as apex's own products (conv1d.h). With x the
// (zero-padded) input, w the weight, g the output's gradient, s the stride, d the dilation and K
// taps, per group:
//
//   out[n, :, t]  = sum over taps j of  w[:, :, j] x[n, :, s t + d j]       (terms: the taps)
//   gw[:, :, j]   = sum over samples n of  g[n] x[n, :, s t + d j]^T        (terms: the samples)
//   gx[n, :, u]   = sum over j with s t + d j = u of  w[:, :, j]^T g[n, :, t]
//
// Each is a product whose operands are strided views of the tensors (no im2col copy). The input's
// gradient is computed a residue of u modulo s at a time: the taps that reach u = r + s u' are
// those with d j = r (mod s), an arithmetic progression, and they read g at u' minus a step that
// falls by a constant from one tap to the next (g padded with zeros at both ends for the taps that
// reach past it). Every output element is one fp32 sum rounded once.
//
// A transposed convolution is the input gradient of the convolution with its channels swapped
// (spread, below); its own input gradient that convolution (correlate), and its weight's the same
// sums with the roles of input and output gradient swapped (weight_sums).

#include "amp/cpu_half/conv1d.h"

#include <ATen/ops/constant_pad_nd.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <limits>
#include <numeric>

#include "bridge/bridge.h"
#include "kernels/gemm.h"

namespace apex::amp::cpu_half {
namespace {

const uint16_t* bits(const at::Tensor& t) {
  return static_cast<const uint16_t*>(t.const_data_ptr());
}
uint16_t* bits_mut(at::Tensor& t) { return static_cast<uint16_t*>(t.mutable_data_ptr()); }

at::Tensor padded(const at::Tensor& x, int64_t left, int64_t right) {
  return left > 0 || right > 0 ? at::constant_pad_nd(x, {left, right}) : x;
}

// The product's output: out [N, C, L] from channel c0 and step t0 on, every `step`-th step.
void set_output(kernels::cpu::HalfGemm& g, at::Tensor& out, int64_t c0, int64_t t0, int64_t step) {
  g.c = bits_mut(out) + c0 * out.stride(1) + t0 * out.stride(2);
  g.c_b = out.stride(0);
  g.c_m = out.stride(1);
  g.c_n = step * out.stride(2);
}

// The bias from channel c0 on, added to every step (if defined).
void add_bias(kernels::cpu::HalfGemm& g, const at::Tensor& bias, int64_t c0) {
  if (!bias.defined()) return;
  g.s = bits(bias) + c0 * bias.stride(0);
  g.s_m = bias.stride(0);
  g.beta = 1.0f;
}

}  // namespace

std::optional<Conv1dShape> conv1d_shape(const at::Tensor& input, const at::Tensor& weight,
                                        const at::Tensor& bias, c10::SymIntArrayRef stride,
                                        c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                        bool transposed, c10::SymIntArrayRef output_padding,
                                        const c10::SymInt& groups) {
  if (input.dim() != 3 || weight.dim() != 3 || stride.size() != 1 || padding.size() != 1 ||
      dilation.size() != 1 || output_padding.size() != 1) {
    return std::nullopt;
  }
  const std::optional<int64_t> st = stride[0].maybe_as_int(), p = padding[0].maybe_as_int(),
                               d = dilation[0].maybe_as_int(), g = groups.maybe_as_int(),
                               op = output_padding[0].maybe_as_int();
  if (!st || !p || !d || !g || !op || *st < 1 || *p < 0 || *d < 1 || *g < 1) return std::nullopt;
  constexpr int64_t kBig = int64_t{1} << 30;  // sizes past this: LibTorch's own path
  const int64_t n = input.size(0), c = input.size(1), l = input.size(2), k = weight.size(2);
  if (n <= 0 || c <= 0 || l <= 0 || k <= 0 || c % *g != 0 || *st > kBig || *p > kBig || *d > kBig ||
      l > kBig || k > kBig) {
    return std::nullopt;
  }
  const int64_t dil = k == 1 ? 1 : *d;  // one tap: the dilation is never used
  const int64_t span = dil * (k - 1) + 1;
  Conv1dShape s{n, 0, 0, 0, k, *st, *p, dil, *g, 0, transposed};
  if (!transposed) {
    // input [N, C, L], weight [O, C / groups, K]: the product's columns are the output's steps.
    if (*op != 0 || weight.size(1) != c / *g || weight.size(0) % *g != 0) return std::nullopt;
    s.c_in = c;
    s.length = l;
    s.c_out = weight.size(0);
    if (l + 2 * *p < span) return std::nullopt;
    s.out_length = (l + 2 * *p - span) / *st + 1;
  } else {
    // input [N, C, L], weight [C, O / groups, K]: the convolution whose input gradient this is,
    // with O input channels, an input of the output's length and L steps out.
    if (weight.size(0) != c || *op < 0 || *op >= std::max(*st, *d)) return std::nullopt;
    s.c_in = weight.size(1) * *g;
    s.c_out = c;
    s.length = (l - 1) * *st - 2 * *p + span + *op;
    s.out_length = l;
    if (s.length <= 0) return std::nullopt;
  }
  const int64_t out_channels = transposed ? s.c_in : s.c_out;
  if (bias.defined() && (bias.dim() != 1 || bias.size(0) != out_channels)) return std::nullopt;
  // Rows to fill: 16+ channels per group on the product's m side, 8+ (or one, as k) on its k
  // side; 16+ steps out of the convolution (in the transposed case, its input's length).
  const int64_t og = s.c_out / *g, cg = s.c_in / *g;
  if (og < 16 || (cg < 8 && !(cg == 1 && !transposed)) || s.out_length < 16) return std::nullopt;
  return s;
}

namespace {

// The convolution of s on x [N, c_in, length]: [N, c_out, out_length], plus the bias if defined.
at::Tensor correlate(const Conv1dShape& s, const at::Tensor& input, const at::Tensor& weight,
                     const at::Tensor& bias) {
  const at::Tensor x = padded(input, s.padding, s.padding);
  at::Tensor out = at::empty({s.n, s.c_out, s.out_length}, input.options());
  const int64_t cg = s.c_in / s.groups, og = s.c_out / s.groups;
  for (int64_t gi = 0; gi < s.groups; ++gi) {
    kernels::cpu::HalfGemm g;
    g.t = bridge::kernel_dtype(input, "conv1d");
    g.batch = s.n;
    g.m = og;
    g.n = s.out_length;
    g.a = bits(weight) + gi * og * weight.stride(0);
    g.a_m = weight.stride(0);
    g.b = bits(x) + gi * cg * x.stride(1);
    g.b_b = x.stride(0);
    g.b_n = s.stride * x.stride(2);
    if (cg == 1) {  // one input channel: the taps are k
      g.k = s.taps;
      g.a_k = weight.stride(2);
      g.b_k = s.dilation * x.stride(2);
    } else {
      g.k = cg;
      g.terms = s.taps;
      g.a_k = weight.stride(1);
      g.a_t = weight.stride(2);
      g.b_k = x.stride(1);
      g.b_t = s.dilation * x.stride(2);
    }
    set_output(g, out, gi * og, 0, 1);
    add_bias(g, bias, gi * og);
    kernels::cpu::half_gemm(g);
  }
  return out;
}

// Its transpose on y [N, c_out, out_length] (the input's gradient for y the output's):
// [N, c_in, length], plus the bias if defined.
at::Tensor spread(const Conv1dShape& s, const at::Tensor& grad, const at::Tensor& weight,
                  const at::Tensor& bias) {
  at::Tensor gx = at::empty({s.n, s.c_in, s.length}, grad.options());
  const int64_t cg = s.c_in / s.groups, og = s.c_out / s.groups;
  // Tap j reads g at u' - o_j, o_j = floor(d j / s) <= lead; u' runs up to ceil(lp / s).
  const int64_t lead = s.dilation * (s.taps - 1) / s.stride;
  const int64_t lp = s.length + 2 * s.padding;
  const int64_t tail = std::max<int64_t>(0, (lp + s.stride - 1) / s.stride - s.out_length);
  const at::Tensor gp = padded(grad, lead, tail);
  // Taps reaching one residue: j, j + step, ...; their o_j falls by o_step from one to the next.
  const int64_t step = s.stride / std::gcd(s.stride, s.dilation);
  const int64_t o_step = s.dilation * step / s.stride;
  for (int64_t r = 0; r < s.stride; ++r) {
    // The input's positions u = r + s u' in [padding, padding + length).
    const int64_t u0 = s.padding > r ? (s.padding - r + s.stride - 1) / s.stride : 0;
    const int64_t last = s.padding + s.length - 1 - r;
    if (last < 0) continue;
    const int64_t cols = last / s.stride - u0 + 1;
    if (cols <= 0) continue;
    const int64_t first = r + s.stride * u0 - s.padding;  // in gx
    int64_t j0 = 0;
    while (j0 < s.taps && s.dilation * j0 % s.stride != r) ++j0;
    if (j0 == s.taps) {  // no tap lands here: zero, or the bias
      at::Tensor part = gx.slice(2, first, first + s.stride * (cols - 1) + 1, s.stride);
      bias.defined() ? part.copy_(bias.view({1, -1, 1}).expand_as(part)) : part.zero_();
      continue;
    }
    const int64_t count = (s.taps - 1 - j0) / step + 1;
    const int64_t o0 = (s.dilation * j0 - r) / s.stride;
    for (int64_t gi = 0; gi < s.groups; ++gi) {
      kernels::cpu::HalfGemm g;
      g.t = bridge::kernel_dtype(grad, "conv1d");
      g.batch = s.n;
      g.terms = count;
      g.m = cg;
      g.k = og;
      g.n = cols;
      g.a = bits(weight) + gi * og * weight.stride(0) + j0 * weight.stride(2);
      g.a_m = weight.stride(1);
      g.a_k = weight.stride(0);
      g.a_t = step * weight.stride(2);
      g.b = bits(gp) + gi * og * gp.stride(1) + (u0 - o0 + lead) * gp.stride(2);
      g.b_b = gp.stride(0);
      g.b_k = gp.stride(1);
      g.b_n = gp.stride(2);
      g.b_t = -o_step * gp.stride(2);
      set_output(g, gx, gi * cg, first, s.stride);
      add_bias(g, bias, gi * cg);
      kernels::cpu::half_gemm(g);
    }
  }
  return gx;
}

// The weight's gradient for y [N, c_out, out_length] the output's gradient and x [N, c_in,
// length] the input: [c_out, c_in / groups, K] (weight's layout for a convolution; a transposed
// one's weight [c_out, c_in / groups, K] alike, with the roles of its input and output swapped).
at::Tensor weight_sums(const Conv1dShape& s, const at::Tensor& grad, const at::Tensor& input,
                       const at::Tensor& weight) {
  const int64_t cg = s.c_in / s.groups, og = s.c_out / s.groups;
  at::Tensor gw = at::empty({s.c_out, cg, s.taps}, weight.options());
  const at::Tensor x = padded(input, s.padding, s.padding);
  for (int64_t gi = 0; gi < s.groups; ++gi) {
    kernels::cpu::HalfGemm g;
    g.t = bridge::kernel_dtype(input, "conv1d");
    g.terms = s.n;
    g.m = og;
    g.k = s.out_length;
    g.a = bits(grad) + gi * og * grad.stride(1);
    g.a_m = grad.stride(1);
    g.a_k = grad.stride(2);
    g.a_t = grad.stride(0);
    g.b = bits(x) + gi * cg * x.stride(1);
    g.b_k = s.stride * x.stride(2);
    g.b_t = x.stride(0);
    g.c = bits_mut(gw) + gi * og * gw.stride(0);
    g.c_m = gw.stride(0);
    if (cg == 1) {  // one input channel: the taps are the columns
      g.n = s.taps;
      g.b_n = s.dilation * x.stride(2);
      g.c_n = gw.stride(2);
    } else {  // a batch per tap
      g.batch = s.taps;
      g.n = cg;
      g.b_n = x.stride(1);
      g.b_b = s.dilation * x.stride(2);
      g.c_n = gw.stride(1);
      g.c_b = gw.stride(2);
    }
    kernels::cpu::half_gemm(g);
  }
  return gw;
}

}  // namespace

at::Tensor conv1d_rounded(const Conv1dShape& s, const at::Tensor& input, const at::Tensor& weight,
                          const at::Tensor& bias) {
  return s.transposed ? spread(s, input, weight, bias) : correlate(s, input, weight, bias);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> conv1d_backward_rounded(
    const Conv1dShape& s, const at::Tensor& grad_output, const at::Tensor& input,
    const at::Tensor& weight, std::array<bool, 3> mask) {
  const int64_t c = s.transposed ? s.c_in : s.c_out;
  const int64_t l = s.transposed ? s.length : s.out_length;
  TORCH_CHECK(grad_output.dim() == 3 && grad_output.size(0) == s.n && grad_output.size(1) == c &&
                  grad_output.size(2) == l,
              "apex conv1d backward: expected a gradient of sizes [", s.n, ", ", c, ", ", l,
              "], got ", grad_output.sizes());
  at::Tensor gx, gw, gb;
  if (s.transposed) {  // the input's gradient is the convolution; the weight's, roles swapped
    if (mask[0]) gx = correlate(s, grad_output, weight, at::Tensor());
    if (mask[1]) gw = weight_sums(s, input, grad_output, weight);
  } else {
    if (mask[0]) gx = spread(s, grad_output, weight, at::Tensor());
    if (mask[1]) gw = weight_sums(s, grad_output, input, weight);
  }
  if (mask[2]) gb = at::sum(grad_output, {0, 2}, false, at::kFloat).to(grad_output.scalar_type());
  return {gx, gw, gb};
}

}  // namespace apex::amp::cpu_half
