// The CPU half-precision fallback (apex/amp/cpu_half.h): CPU-key kernels for the matrix-product
// ops, convolution, flash attention, GELU and SiLU (and AutogradCPU ones for the recurrent layers),
// registered once on first use, that compute through fp32 (or apex's own half kernels) while a
// guard is active in the calling thread and otherwise call LibTorch's own kernel (at::cpu::*, the
// kernel the dispatcher had) unchanged.
#include <ATen/ExpandUtils.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_cpu_dispatch.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_cpu_dispatch.h>
#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/addbmm_cpu_dispatch.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/addmv_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/convolution_backward_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/convolution_compositeexplicitautograd_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/gelu_backward_cpu_dispatch.h>
#include <ATen/ops/gelu_cpu_dispatch.h>
#include <ATen/ops/gru.h>
#include <ATen/ops/gru_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/lstm_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <ATen/ops/rnn_relu.h>
#include <ATen/ops/rnn_relu_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/rnn_tanh.h>
#include <ATen/ops/rnn_tanh_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/silu_backward_cpu_dispatch.h>
#include <ATen/ops/silu_cpu_dispatch.h>
#include <apex/amp/cpu_half.h>
#include <apex/amp/utils.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "amp/cpu_half_conv1d.h"
#include "amp/quiet_registration.h"
#include "bridge/bridge.h"
#include "common/environment.h"
#include "kernels/activation.h"
#include "kernels/attention.h"
#include "kernels/gemm.h"
#include "kernels/gemv.h"
#include "kernels/half_add.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <optional>

namespace apex::amp {
namespace {

thread_local int active_depth = 0;
thread_local uint64_t route_calls = 0;  // calls the route took in this thread (tests)
thread_local uint64_t gemm_calls = 0;   // of them, apex's own product (tests)
std::atomic<int> forced{-1};  // -1: decide; 0 nothing, 1 everything, 2 attention only (tests)

using apex::detail::env_is;

bool is_half(const at::Tensor& t) {
  return t.defined() && (t.scalar_type() == at::kBFloat16 || t.scalar_type() == at::kHalf);
}

// Inside a scope, the one half dtype of the defined tensors, all on the CPU; nullopt otherwise.
std::optional<at::ScalarType> scoped_half_dtype(c10::ArrayRef<const at::Tensor*> ts) {
  if (active_depth == 0) return std::nullopt;
  std::optional<at::ScalarType> dtype;
  for (const at::Tensor* t : ts) {
    if (!t->defined()) continue;
    if (!is_half(*t) || !t->device().is_cpu()) return std::nullopt;
    if (dtype && *dtype != t->scalar_type()) return std::nullopt;
    dtype = t->scalar_type();
  }
  return dtype;
}

// Every tensor defined, on the CPU, of one half dtype the fallback serves: the calls it takes.
bool take(c10::ArrayRef<const at::Tensor*> ts) {
  const std::optional<at::ScalarType> dtype = scoped_half_dtype(ts);
  if (!dtype.has_value() || !cpu_half_fallback_available(*dtype)) return false;
  ++route_calls;
  return true;
}

at::Tensor wide(const at::Tensor& t) { return t.defined() ? t.to(at::kFloat) : t; }

// Products the vector kernels do not take: apex's own product (kernels/gemm.h), which widens the
// operands as it packs them and rounds the result as it stores it, where the CPU's kernel table
// has it (AVX2 and wider); APEX_CPU_HALF_GEMM=0 widens both operands for LibTorch's fp32 product
// instead (to compare). Why: docs/perf-notes.md, "Thresholds in the code".
bool own_gemm() {
  static const bool on = kernels::cpu::half_gemm_available() && !env_is("APEX_CPU_HALF_GEMM", "0");
  return on;
}

// Products with at most this many rows or columns (small-batch `linear`) read the other operand
// in place (kernels/gemv.h) rather than widen all of it for a few vectors; a matrix under
// kMinMatrixForVectors elements takes them for at most kMaxVectorsSmallMatrix vectors; where
// apex's own product runs it takes over from kMaxVectorsWithGemm + 1 rows. The measurements that
// set the four cutoffs: docs/perf-notes.md, "Thresholds in the code".
constexpr int64_t kMaxVectors = 64;
constexpr int64_t kMaxVectorsWithGemm = 32;
constexpr int64_t kMaxVectorsSmallMatrix = 16;
constexpr int64_t kMinMatrixForVectors = int64_t{1} << 16;

// How the vector kernels take a product of 2-D a [m, k] and b [k, n] with at most kMaxVectors rows
// or columns: the larger operand read in place as a matrix M, the few rows of a (or columns of b)
// as the vectors. Few rows: C = (b^T a^T)^T, M = b^T [n, k], the vectors a's rows, the result C.
// Few columns: M = a [m, k], the vectors b's columns, the result C^T.
struct VectorPlan {
  at::Tensor mat, vecs;
  int64_t rows = 0, k = 0, ld = 0;
  bool k_contiguous = false, rows_few = false;
};

int64_t max_vectors() { return own_gemm() ? kMaxVectorsWithGemm : kMaxVectors; }

// Empty for larger products, or where M is strided in both dimensions (the caller widens then).
std::optional<VectorPlan> vector_plan(const at::Tensor& a, const at::Tensor& b) {
  if (a.dim() != 2 || b.dim() != 2 || a.size(1) != b.size(0)) return std::nullopt;
  const int64_t m = a.size(0), k = a.size(1), n = b.size(1);
  if (std::min(m, n) > max_vectors() || m == 0 || n == 0 || k == 0) return std::nullopt;
  VectorPlan p;
  p.rows_few = m <= n;
  p.mat = p.rows_few ? b.t() : a;
  p.vecs = p.rows_few ? a : b.t();
  p.rows = p.mat.size(0);
  p.k = k;
  if (p.vecs.size(0) > kMaxVectorsSmallMatrix && p.rows * k < kMinMatrixForVectors) {
    return std::nullopt;
  }
  p.k_contiguous = p.mat.stride(1) == 1 || k == 1;
  if (!p.k_contiguous && p.mat.stride(0) != 1 && p.rows > 1) return std::nullopt;
  p.ld = p.k_contiguous ? p.mat.stride(0) : p.mat.stride(1);
  return p;
}

// The fp32 product by the vector kernels, as planned. Widening all of M for a few vectors cost 2-5x
// the fp32 product.
at::Tensor vector_product(const VectorPlan& p) {
  const at::Tensor v = p.vecs.to(at::kFloat, false, false, at::MemoryFormat::Contiguous);
  at::Tensor y = at::empty({p.vecs.size(0), p.rows}, p.mat.options().dtype(at::kFloat));
  kernels::cpu::half_gemv(p.mat.const_data_ptr(), bridge::kernel_dtype(p.mat, "mm"), p.rows, p.k,
                          p.k_contiguous, p.ld, v.const_data_ptr<float>(), p.vecs.size(0),
                          y.mutable_data_ptr<float>());
  return p.rows_few ? y : y.t();
}

// The half result of the planned product (+ bias, the half row added in fp32 before the one
// rounding: addmm's beta = alpha = 1 with a 1-D self) where the kernels' result is already in the
// output's layout (few rows, or one column): widening, sum and rounding inside the kernels'
// driver, the output's allocation the only ATen call (the others cost ~2 us, as much as a small
// product). Undefined otherwise.
at::Tensor vector_product_rounded(const VectorPlan& p, const at::Tensor* bias) {
  const int64_t nv = p.vecs.size(0);
  if (!(p.rows_few || nv == 1)) return {};
  if (bias != nullptr && !(bias->dim() == 1 && bias->size(0) == p.rows && bias->is_contiguous())) {
    return {};
  }
  at::Tensor out = p.rows_few ? at::empty({nv, p.rows}, p.mat.options())
                              : at::empty({p.rows, nv}, p.mat.options());
  kernels::cpu::half_gemv_rounded(
      p.mat.const_data_ptr(), bridge::kernel_dtype(p.mat, "mm"), p.rows, p.k, p.k_contiguous, p.ld,
      p.vecs.const_data_ptr(), p.vecs.stride(0), p.vecs.stride(1), nv,
      bias != nullptr ? bias->const_data_ptr() : nullptr, out.mutable_data_ptr());
  return out;
}

// beta * self + alpha * (a b) by the own product, operands of `dims` dimensions (2: mm, addmm;
// 3: the batched ops) and one half dtype, self null or expandable to the result (whatever beta,
// as LibTorch checks it), as a new contiguous half tensor; undefined where it does not apply:
// the caller then widens, or LibTorch refuses what it refuses.
at::Tensor gemm_rounded(int64_t dims, const at::Tensor& a, const at::Tensor& b,
                        const at::Tensor* self, const at::Scalar& beta, const at::Scalar& alpha,
                        bool sum_batches = false) {
  if (!own_gemm() || a.dim() != dims || b.dim() != dims) return {};
  if (beta.isComplex() || alpha.isComplex()) return {};
  const bool batched = dims == 3;
  const bool batched_out = batched && !sum_batches;
  const int64_t m = a.size(-2), k = a.size(-1), n = b.size(-1);
  const int64_t batch = batched ? a.size(0) : 1;
  if (b.size(-2) != k || (batched && b.size(0) != batch) || m == 0 || n == 0 || k == 0 ||
      batch == 0) {
    return {};
  }
  const std::vector<int64_t> sizes =
      batched_out ? std::vector<int64_t>{batch, m, n} : std::vector<int64_t>{m, n};
  if (self != nullptr && !at::is_expandable_to(self->sizes(), sizes)) return {};
  at::Tensor s;
  const float beta_f = static_cast<float>(beta.toDouble());
  if (self != nullptr && beta_f != 0.0f) s = self->expand(sizes);
  at::Tensor out = at::empty(sizes, a.options());
  kernels::cpu::HalfGemm g;
  g.t = bridge::kernel_dtype(a, "mm");
  // addbmm: the batches are the terms of one output's sum.
  (sum_batches ? g.terms : g.batch) = batch;
  g.m = m;
  g.n = n;
  g.k = k;
  const auto strides = [](const at::Tensor& x, int64_t& sb, int64_t& s0, int64_t& s1) {
    sb = x.dim() == 3 ? x.stride(0) : 0;
    s0 = x.stride(-2);
    s1 = x.stride(-1);
  };
  g.a = a.const_data_ptr();
  strides(a, sum_batches ? g.a_t : g.a_b, g.a_m, g.a_k);
  g.b = b.const_data_ptr();
  strides(b, sum_batches ? g.b_t : g.b_b, g.b_k, g.b_n);
  g.c = out.mutable_data_ptr();
  strides(out, g.c_b, g.c_m, g.c_n);
  if (s.defined()) {
    g.s = s.const_data_ptr();
    strides(s, g.s_b, g.s_m, g.s_n);
  }
  g.alpha = static_cast<float>(alpha.toDouble());
  g.beta = beta_f;
  kernels::cpu::half_gemm(g);
  ++gemm_calls;
  return out;
}

// The fp32 result in the half dtype, row-major as LibTorch's kernels return it.
at::Tensor rounded(const at::Tensor& y, at::ScalarType t) {
  return y.to(t, false, false, at::MemoryFormat::Contiguous);
}

// beta * self + alpha * product (fp32, from vector_product) in fp32, as the fp32 kernels compute it
// (self ignored where beta is 0, widened as it is read), rounded to t.
at::Tensor scaled_sum_rounded(at::Tensor product, const at::Tensor& self, const at::Scalar& beta,
                              const at::Scalar& alpha, at::ScalarType t) {
  if (alpha.toDouble() != 1) product.mul_(alpha);
  if (beta.toDouble() != 0) product.add_(self, beta);
  return rounded(product, t);
}

at::Tensor mm(const at::Tensor& a, const at::Tensor& b) {
  if (!take({&a, &b})) return at::cpu::mm(a, b);
  if (const std::optional<VectorPlan> p = vector_plan(a, b)) {
    if (at::Tensor y = vector_product_rounded(*p, nullptr); y.defined()) return y;
    return rounded(vector_product(*p), a.scalar_type());
  }
  if (at::Tensor y = gemm_rounded(2, a, b, nullptr, 0, 1); y.defined()) return y;
  return at::cpu::mm(wide(a), wide(b)).to(a.scalar_type());
}

at::Tensor bmm(const at::Tensor& a, const at::Tensor& b) {
  if (!take({&a, &b})) return at::cpu::bmm(a, b);
  if (at::Tensor y = gemm_rounded(3, a, b, nullptr, 0, 1); y.defined()) return y;
  return at::cpu::bmm(wide(a), wide(b)).to(a.scalar_type());
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &a, &b})) return at::cpu::addmm(self, a, b, beta, alpha);
  if (a.dim() == 2 && b.dim() == 2 && !beta.isComplex() && !alpha.isComplex() &&
      at::is_expandable_to(self.sizes(), {a.size(0), b.size(1)})) {
    if (const std::optional<VectorPlan> p = vector_plan(a, b)) {
      if (beta.toDouble() == 1 && alpha.toDouble() == 1 && self.dim() == 1) {
        if (at::Tensor y = vector_product_rounded(*p, &self); y.defined()) return y;
      }
      return scaled_sum_rounded(vector_product(*p), self, beta, alpha, a.scalar_type());
    }
  }
  if (at::Tensor y = gemm_rounded(2, a, b, &self, beta, alpha); y.defined()) return y;
  return at::cpu::addmm(wide(self), wide(a), wide(b), beta, alpha).to(a.scalar_type());
}

at::Tensor baddbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &a, &b})) return at::cpu::baddbmm(self, a, b, beta, alpha);
  if (at::Tensor y = gemm_rounded(3, a, b, &self, beta, alpha); y.defined()) return y;
  return at::cpu::baddbmm(wide(self), wide(a), wide(b), beta, alpha).to(a.scalar_type());
}

at::Tensor addbmm(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                  const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &a, &b})) return at::cpu::addbmm(self, a, b, beta, alpha);
  if (at::Tensor y = gemm_rounded(3, a, b, &self, beta, alpha, true); y.defined()) return y;
  return at::cpu::addbmm(wide(self), wide(a), wide(b), beta, alpha).to(a.scalar_type());
}

// Matrix-vector products (mv, and matmul or linear of a 1-D input, reach them as addmv.out): the
// matrix read in place by the vector kernels, as a one-column mm.
at::Tensor addmv(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &mat, &vec})) return at::cpu::addmv(self, mat, vec, beta, alpha);
  if (mat.dim() == 2 && vec.dim() == 1 && !beta.isComplex() && !alpha.isComplex() &&
      at::is_expandable_to(self.sizes(), {mat.size(0)})) {
    if (const std::optional<VectorPlan> p = vector_plan(mat, vec.unsqueeze(1))) {
      if (beta.toDouble() == 1 && alpha.toDouble() == 1 && self.dim() == 1) {
        if (at::Tensor y = vector_product_rounded(*p, &self); y.defined()) {
          return y.view({mat.size(0)});
        }
      }
      return scaled_sum_rounded(vector_product(*p).squeeze(1), self, beta, alpha,
                                mat.scalar_type());
    }
  }
  return at::cpu::addmv(wide(self), wide(mat), wide(vec), beta, alpha).to(mat.scalar_type());
}

// out= variants: the functional route's result (`amp::` so that the at:: op of the same name
// is not found through the arguments), written into `out` as LibTorch's kernels write
// theirs (resized where its shape differs, with LibTorch's warning if it held elements). An `out`
// of another dtype goes to LibTorch's kernel, which refuses it.
at::Tensor& write_out(at::Tensor& out, const at::Tensor& result) {
  at::native::resize_output(out, result.sizes());
  return out.copy_(result);
}

at::Tensor& mm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (!take({&a, &b, &out})) return at::cpu::mm_outf(a, b, out);
  return write_out(out, amp::mm(a, b));
}

at::Tensor& bmm_out(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  if (!take({&a, &b, &out})) return at::cpu::bmm_outf(a, b, out);
  return write_out(out, amp::bmm(a, b));
}

at::Tensor& addmm_out(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  if (!take({&self, &a, &b, &out})) return at::cpu::addmm_outf(self, a, b, beta, alpha, out);
  return write_out(out, amp::addmm(self, a, b, beta, alpha));
}

at::Tensor& baddbmm_out(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                        const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  if (!take({&self, &a, &b, &out})) return at::cpu::baddbmm_outf(self, a, b, beta, alpha, out);
  return write_out(out, amp::baddbmm(self, a, b, beta, alpha));
}

at::Tensor& addbmm_out(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                       const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  if (!take({&self, &a, &b, &out})) return at::cpu::addbmm_outf(self, a, b, beta, alpha, out);
  return write_out(out, amp::addbmm(self, a, b, beta, alpha));
}

at::Tensor& addmv_out(const at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                      const at::Scalar& beta, const at::Scalar& alpha, at::Tensor& out) {
  if (!take({&self, &mat, &vec, &out}))
    return at::cpu::addmv_outf(self, mat, vec, beta, alpha, out);
  return write_out(out, amp::addmv(self, mat, vec, beta, alpha));
}

// In place: the functional route's result (computed before `self` is written, so `self` may
// alias an operand) copied into `self` where that is the result's shape; any other `self` goes
// to LibTorch's kernel, which refuses it with its own message.
bool has_product_shape(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                       bool batched_out) {
  const int64_t d = batched_out ? 3 : 2;
  if (a.dim() != b.dim() || a.dim() < 2 || self.dim() != d) return false;
  const int64_t rows = a.size(-2), cols = b.size(-1);
  return batched_out ? self.sizes() == at::IntArrayRef{a.size(0), rows, cols}
                     : self.sizes() == at::IntArrayRef{rows, cols};
}

at::Tensor& addmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &a, &b}) || a.dim() != 2 || !has_product_shape(self, a, b, false)) {
    return at::cpu::addmm_(self, a, b, beta, alpha);
  }
  return self.copy_(amp::addmm(self, a, b, beta, alpha));
}

at::Tensor& baddbmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                     const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &a, &b}) || a.dim() != 3 || !has_product_shape(self, a, b, true)) {
    return at::cpu::baddbmm_(self, a, b, beta, alpha);
  }
  return self.copy_(amp::baddbmm(self, a, b, beta, alpha));
}

at::Tensor& addbmm_(at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                    const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &a, &b}) || a.dim() != 3 || !has_product_shape(self, a, b, false)) {
    return at::cpu::addbmm_(self, a, b, beta, alpha);
  }
  return self.copy_(amp::addbmm(self, a, b, beta, alpha));
}

at::Tensor& addmv_(at::Tensor& self, const at::Tensor& mat, const at::Tensor& vec,
                   const at::Scalar& beta, const at::Scalar& alpha) {
  if (!take({&self, &mat, &vec}) || mat.dim() != 2 || self.dim() != 1 ||
      self.size(0) != mat.size(0)) {
    return at::cpu::addmv_(self, mat, vec, beta, alpha);
  }
  return self.copy_(amp::addmv(self, mat, vec, beta, alpha));
}

// `x += bias` with x half and the bias fp32: LibTorch's C++ Linear adds its bias this way on an
// N-d input (matmul, then in place), and at O1 autocast leaves the product half and the bias
// fp32. LibTorch then widens all of x into a temporary, adds, and rounds the temporary back
// into x; here one pass (kernels/half_add.h), the same fp32 sums rounded once. Taken for a
// contiguous x and a contiguous fp32 `other` of x's trailing sizes (leading ones dropped), at
// least 1-D (a 0-dim fp32 tensor does not promote a half x: LibTorch rounds it first).
bool is_trailing_vector(const at::Tensor& self, const at::Tensor& other) {
  if (other.dim() == 0 || other.dim() > self.dim() || other.numel() == 0) return false;
  at::IntArrayRef o = other.sizes();
  while (o.size() > 1 && o.front() == 1) o = o.slice(1);
  return self.sizes().slice(self.dim() - o.size()) == o;
}

at::Tensor& add_(at::Tensor& self, const at::Tensor& other, const at::Scalar& alpha) {
  if (active_depth == 0 || !is_half(self) || !self.device().is_cpu() || !other.defined() ||
      other.scalar_type() != at::kFloat || !other.device().is_cpu() || alpha.isComplex() ||
      !self.is_contiguous() || !other.is_contiguous() || self.is_alias_of(other) ||
      !is_trailing_vector(self, other) || !cpu_half_fallback_available(self.scalar_type())) {
    return at::cpu::add_(self, other, alpha);
  }
  ++route_calls;
  const int64_t n = other.numel();
  kernels::cpu::half_add_rows(self.mutable_data_ptr(), bridge::kernel_dtype(self, "add_"),
                              self.numel() / n, n, other.const_data_ptr<float>(),
                              static_cast<float>(alpha.toDouble()));
  return self;
}

// Convolutions: 1-D ones with enough channels through apex's own product (cpu_half_conv1d.h;
// wav2vec 2.0's feature encoder and positional convolution), the others widened around LibTorch's
// fp32 kernels (oneDNN's).
//
// A 1x1 2-D convolution with stride 1 and no padding (a bottleneck's, a pointwise one) on an
// NCHW input whose height and width are one run of memory is that 1-D convolution of kernel 1
// over H * W steps: its input and weight as 3-D views (channels-last inputs keep LibTorch's
// path, whose output is channels-last too).
struct Pointwise {
  at::Tensor input, weight;
  detail::Conv1dShape shape;
};

std::optional<Pointwise> pointwise(const at::Tensor& input, const at::Tensor& weight,
                                   const at::Tensor& bias, c10::SymIntArrayRef stride,
                                   c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation,
                                   bool transposed, c10::SymIntArrayRef output_padding,
                                   const c10::SymInt& groups) {
  // (conv2d passes one value for both dimensions as it was given; LibTorch expands it later.)
  const auto all = [](c10::SymIntArrayRef v, int64_t x) {
    return (v.size() == 1 || v.size() == 2) &&
           std::all_of(v.begin(), v.end(), [x](const c10::SymInt& e) { return e == x; });
  };
  if (transposed || input.dim() != 4 || weight.dim() != 4 || weight.size(2) != 1 ||
      weight.size(3) != 1 || !all(stride, 1) || !all(padding, 0) || dilation.empty() ||
      dilation.size() > 2 || !all(output_padding, 0) ||
      input.suggest_memory_format() != at::MemoryFormat::Contiguous ||
      input.stride(2) != input.size(3) * input.stride(3)) {
    return std::nullopt;
  }
  Pointwise p{input.view({input.size(0), input.size(1), input.size(2) * input.size(3)}),
              weight.view({weight.size(0), weight.size(1), 1}),
              {}};
  const c10::SymInt one(1), zero(0);
  const auto shape = detail::conv1d_shape(p.input, p.weight, bias, {&one, 1}, {&zero, 1}, {&one, 1},
                                          false, {&zero, 1}, groups);
  if (!shape) return std::nullopt;
  p.shape = *shape;
  return p;
}

at::Tensor convolution(const at::Tensor& input, const at::Tensor& weight,
                       const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                       c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, bool transposed,
                       c10::SymIntArrayRef output_padding, c10::SymInt groups) {
  const at::Tensor b = bias.value_or(at::Tensor());
  if (!take({&input, &weight, &b})) {
    return at::compositeexplicitautograd::convolution_symint(
        input, weight, bias, stride, padding, dilation, transposed, output_padding, groups);
  }
  if (own_gemm()) {
    if (const auto s = detail::conv1d_shape(input, weight, b, stride, padding, dilation, transposed,
                                            output_padding, groups)) {
      ++gemm_calls;
      return detail::conv1d_rounded(*s, input, weight, b);
    }
    if (const auto p = pointwise(input, weight, b, stride, padding, dilation, transposed,
                                 output_padding, groups)) {
      ++gemm_calls;
      return detail::conv1d_rounded(p->shape, p->input, p->weight, b)
          .view({input.size(0), weight.size(0), input.size(2), input.size(3)});
    }
  }
  const std::optional<at::Tensor> wb = b.defined() ? std::optional<at::Tensor>(wide(b)) : bias;
  return at::compositeexplicitautograd::convolution_symint(wide(input), wide(weight), wb, stride,
                                                           padding, dilation, transposed,
                                                           output_padding, groups)
      .to(input.scalar_type());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    at::OptionalSymIntArrayRef bias_sizes, c10::SymIntArrayRef stride, c10::SymIntArrayRef padding,
    c10::SymIntArrayRef dilation, bool transposed, c10::SymIntArrayRef output_padding,
    c10::SymInt groups, std::array<bool, 3> output_mask) {
  if (!take({&grad_output, &input, &weight})) {
    return at::compositeexplicitautograd::convolution_backward_symint(
        grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed,
        output_padding, groups, output_mask);
  }
  if (own_gemm()) {
    if (const auto s = detail::conv1d_shape(input, weight, at::Tensor(), stride, padding, dilation,
                                            transposed, output_padding, groups)) {
      ++gemm_calls;
      return detail::conv1d_backward_rounded(*s, grad_output, input, weight, output_mask);
    }
    if (const auto p = pointwise(input, weight, at::Tensor(), stride, padding, dilation, transposed,
                                 output_padding, groups);
        p && grad_output.dim() == 4) {
      ++gemm_calls;
      auto [gi, gw, gb] = detail::conv1d_backward_rounded(
          p->shape, grad_output.reshape({grad_output.size(0), grad_output.size(1), -1}), p->input,
          p->weight, output_mask);
      return {gi.defined() ? gi.view(input.sizes()) : gi,
              gw.defined() ? gw.view(weight.sizes()) : gw, gb};
    }
  }
  auto [gi, gw, gb] = at::compositeexplicitautograd::convolution_backward_symint(
      wide(grad_output), wide(input), wide(weight), bias_sizes, stride, padding, dilation,
      transposed, output_padding, groups, output_mask);
  const auto t = input.scalar_type();
  return {gi.defined() ? gi.to(t) : gi, gw.defined() ? gw.to(t) : gw, gb.defined() ? gb.to(t) : gb};
}

// A mask the route takes: none, a boolean one, or a floating one in the query's half dtype
// (LibTorch refuses a floating mask of another dtype; an fp32 one goes to LibTorch's kernel).
bool mask_taken(const at::Tensor& m, const at::Tensor& q) {
  return !m.defined() || !m.is_floating_point() || m.scalar_type() == q.scalar_type();
}

// A floating mask widened to fp32 without materialising its broadcast dimensions: the stored
// values are widened, then expanded again (LibTorch's kernel reads zero strides).
at::Tensor wide_mask(const at::Tensor& m) {
  at::Tensor compact = m;
  for (int64_t d = 0; d < m.dim(); ++d) {
    if (m.stride(d) == 0 && m.size(d) > 1) compact = compact.narrow(d, 0, 1);
  }
  return wide(compact).expand(m.sizes());
}

// Attention through apex's own kernels (kernels/attention.h): no dropout, one head of K and V per
// head of Q, one head size (LibTorch's flash attention refuses others), sequences and heads up to
// kAttentionMaxLength (all keys' scores held at once), an additive mask in the query's dtype of 2
// or 4 dimensions that broadcasts to [B, H, Lq, Lk] (or none). Otherwise widened for LibTorch's
// fp32 flash attention (in the route), or LibTorch's half kernel (beyond it).
bool own_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& mask, double dropout_p) {
  using kernels::cpu::kAttentionMaxLength;
  if (dropout_p != 0.0 || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
    return false;
  }
  const auto fits = [](int64_t n) { return n >= 1 && n <= kAttentionMaxLength; };
  const bool shapes = q.size(0) >= 1 && q.size(1) >= 1 && k.size(0) == q.size(0) &&
                      v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1) &&
                      k.size(3) == q.size(3) && v.size(3) == q.size(3) && v.size(2) == k.size(2) &&
                      fits(q.size(2)) && fits(k.size(2)) && fits(q.size(3)) && fits(v.size(3));
  if (!shapes || !mask.defined()) return shapes;
  return mask.scalar_type() == q.scalar_type() && (mask.dim() == 2 || mask.dim() == 4) &&
         at::is_expandable_to(mask.sizes(), {q.size(0), q.size(1), q.size(2), k.size(2)});
}

// The mask as [B, H, Lq, Lk] with zero strides where it broadcasts.
at::Tensor mask_4d(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  const at::Tensor m = mask.dim() == 2 ? mask.unsqueeze(0).unsqueeze(0) : mask;
  return m.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
}

kernels::cpu::HalfView half_view(const at::Tensor& x) {
  return {x.const_data_ptr(), x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}
kernels::cpu::HalfOut half_out(at::Tensor& x) {
  return {x.mutable_data_ptr(), x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}

kernels::cpu::HalfAttention attention_of(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& mask4,
                                         bool is_causal, std::optional<double> scale) {
  kernels::cpu::HalfAttention a;
  a.t = bridge::kernel_dtype(q, "scaled_dot_product_attention");
  a.batch = q.size(0);
  a.heads = q.size(1);
  a.lq = q.size(2);
  a.lk = k.size(2);
  a.d = q.size(3);
  a.dv = v.size(3);
  a.q = half_view(q);
  a.k = half_view(k);
  a.v = half_view(v);
  if (mask4.defined()) a.mask = half_view(mask4);
  // LibTorch's default: 1 / sqrt(head size), in double, then fp32.
  a.scale =
      static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(a.d)));
  a.causal = is_causal;
  return a;
}

// Attention's own kernels serve a dtype wherever the route does, and also where LibTorch's half
// matmuls are fast but its half attention is not (AVX512-BF16 and AMX CPUs: ~0.4x its fp32
// kernel up to a few hundred tokens; docs/amp.md): the kernels exist (AVX2 and wider) and
// neither APEX_CPU_HALF_FALLBACK=0 nor APEX_CPU_HALF_ATTENTION=0 is set.
// The decision in force, from decide_cpu_half: this process's (cpuid and the environment, read
// once), or a test's (forced): 0 nothing, 1 everything, 2 as a CPU whose half matmuls are fast.
detail::CpuHalfDecision decision() {
  static const std::optional<std::string> fallback = apex::detail::env("APEX_CPU_HALF_FALLBACK");
  static const std::optional<std::string> attention = apex::detail::env("APEX_CPU_HALF_ATTENTION");
  static const bool own_kernels = own_gemm() && kernels::cpu::half_attention_available();
  const char* attention_env = attention ? attention->c_str() : nullptr;
  static const detail::CpuHalfDecision natural = detail::decide_cpu_half(
      cpu_half_support(), own_kernels, fallback ? fallback->c_str() : nullptr, attention_env);
  switch (forced.load()) {
    case 0:
      return {};
    case 1:
      return detail::decide_cpu_half(cpu_half_support(), own_kernels, "1", attention_env);
    case 2: {
      CpuHalfSupport fast;
      fast.onednn = fast.avx512_core = fast.avx512_bf16 = fast.avx512_fp16 = true;
      return detail::decide_cpu_half(fast, own_kernels, nullptr, attention_env);
    }
    default:
      return natural;
  }
}

bool attention_available(at::ScalarType dtype) {
  const detail::CpuHalfDecision d = decision();
  return dtype == at::kBFloat16 ? d.attention_bf16 : d.attention_fp16;
}

// In a scope, inputs of one half dtype that attention's own kernels serve and can take.
bool take_own_attention(c10::ArrayRef<const at::Tensor*> ts, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double dropout_p) {
  const std::optional<at::ScalarType> dtype = scoped_half_dtype(ts);
  if (!dtype.has_value() || !attention_available(*dtype) ||
      !own_attention(q, k, v, mask, dropout_p)) {
    return false;
  }
  ++route_calls;
  ++gemm_calls;
  return true;
}

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, double dropout_p,
                                                   bool is_causal,
                                                   const std::optional<at::Tensor>& attn_mask,
                                                   std::optional<double> scale) {
  const at::Tensor m = attn_mask.value_or(at::Tensor());
  if (take_own_attention({&q, &k, &v}, q, k, v, m, dropout_p)) {
    const at::Tensor m4 = m.defined() ? mask_4d(m, q, k) : m;
    // The layouts LibTorch's kernel gives: the output like the query, lse [B, L, H] transposed.
    at::Tensor out = q.size(3) == v.size(3)
                         ? at::empty_like(q, at::MemoryFormat::Preserve)
                         : at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
    at::Tensor lse =
        at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat)).transpose(1, 2);
    kernels::cpu::half_attention_forward(attention_of(q, k, v, m4, is_causal, scale), half_out(out),
                                         lse.mutable_data_ptr<float>(), lse.stride(0),
                                         lse.stride(1), lse.stride(2));
    return {out, lse};
  }
  if (!take({&q, &k, &v}) || !mask_taken(m, q)) {
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                attn_mask, scale);
  }
  const std::optional<at::Tensor> wm =
      m.defined() && m.is_floating_point() ? std::optional<at::Tensor>(wide_mask(m)) : attn_mask;
  auto [out, lse] = at::cpu::_scaled_dot_product_flash_attention_for_cpu(
      wide(q), wide(k), wide(v), dropout_p, is_causal, wm, scale);
  return {out.to(q.scalar_type()), lse};  // logsumexp is fp32 for half inputs too
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& logsumexp, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  const at::Tensor m = attn_mask.value_or(at::Tensor());
  if (grad_out.sizes() == out.sizes() && out.dim() == 4 && q.dim() == 4 && v.dim() == 4 &&
      out.sizes() == at::IntArrayRef{q.size(0), q.size(1), q.size(2), v.size(3)} &&
      logsumexp.scalar_type() == at::kFloat && logsumexp.dim() == 3 &&
      logsumexp.sizes() == q.sizes().slice(0, 3) &&
      take_own_attention({&grad_out, &q, &k, &v, &out}, q, k, v, m, dropout_p)) {
    const at::Tensor m4 = m.defined() ? mask_4d(m, q, k) : m;
    // LibTorch's layout for the gradients, whatever the inputs': [B, L, H, D] seen transposed.
    const auto blhd = [](const at::Tensor& x) {
      return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
    };
    at::Tensor gq = blhd(q), gk = blhd(k), gv = blhd(v);
    kernels::cpu::half_attention_backward(
        attention_of(q, k, v, m4, is_causal, scale), half_view(grad_out), half_view(out),
        logsumexp.const_data_ptr<float>(), logsumexp.stride(0), logsumexp.stride(1),
        logsumexp.stride(2), half_out(gq), half_out(gk), half_out(gv));
    return {gq, gk, gv};
  }
  if (!take({&grad_out, &q, &k, &v, &out}) || !mask_taken(m, q)) {
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask, scale);
  }
  const std::optional<at::Tensor> wm =
      m.defined() && m.is_floating_point() ? std::optional<at::Tensor>(wide_mask(m)) : attn_mask;
  auto [gq, gk, gv] = at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
      wide(grad_out), wide(q), wide(k), wide(v), wide(out), logsumexp, dropout_p, is_causal, wm,
      scale);
  const auto t = q.scalar_type();
  return {gq.to(t), gk.to(t), gv.to(t)};
}

// GELU: LibTorch's bf16/fp16 kernel on AVX2 takes 1.6-1.8x the time of its fp32 one (which is
// oneDNN's), forward and backward; ours (kernels/activation.h) widens in registers and is more
// accurate. Dense tensors of any layout (the output takes the input's strides); others, and
// approximate modes LibTorch refuses, go to LibTorch's kernel.
std::optional<bool> gelu_tanh(c10::string_view approximate) {
  if (approximate == "none") return false;
  if (approximate == "tanh") return true;
  return std::nullopt;
}

// The table kernels' backward reads the gradient and the input element by element alike: a
// dense input and a gradient of its sizes and strides.
bool dense_alike(const at::Tensor& grad, const at::Tensor& x) {
  return x.is_non_overlapping_and_dense() && grad.sizes() == x.sizes() &&
         grad.strides() == x.strides();
}

at::Tensor gelu(const at::Tensor& x, c10::string_view approximate) {
  const auto tanh = gelu_tanh(approximate);
  if (!take({&x}) || !tanh || !x.is_non_overlapping_and_dense()) {
    return at::cpu::gelu(x, approximate);
  }
  at::Tensor y = at::empty_like(x);
  kernels::cpu::gelu(x.const_data_ptr(), y.mutable_data_ptr(), bridge::kernel_dtype(x, "gelu"),
                     x.numel(), *tanh);
  return y;
}

at::Tensor gelu_backward(const at::Tensor& grad, const at::Tensor& x,
                         c10::string_view approximate) {
  const auto tanh = gelu_tanh(approximate);
  if (!take({&grad, &x}) || !tanh || !dense_alike(grad, x)) {
    return at::cpu::gelu_backward(grad, x, approximate);
  }
  at::Tensor dx = at::empty_like(x);
  kernels::cpu::gelu_backward(grad.const_data_ptr(), x.const_data_ptr(), dx.mutable_data_ptr(),
                              bridge::kernel_dtype(x, "gelu"), x.numel(), *tanh);
  return dx;
}

// SiLU likewise (LibTorch's bf16 kernel on AVX2: 1.5-1.6x its fp32 time); in place too, which
// nn.SiLU(inplace=true) calls.
at::Tensor silu(const at::Tensor& x) {
  if (!take({&x}) || !x.is_non_overlapping_and_dense()) return at::cpu::silu(x);
  at::Tensor y = at::empty_like(x);
  kernels::cpu::silu(x.const_data_ptr(), y.mutable_data_ptr(), bridge::kernel_dtype(x, "silu"),
                     x.numel());
  return y;
}

at::Tensor& silu_(at::Tensor& x) {
  if (!take({&x}) || !x.is_non_overlapping_and_dense()) return at::cpu::silu_(x);
  kernels::cpu::silu(x.const_data_ptr(), x.mutable_data_ptr(), bridge::kernel_dtype(x, "silu"),
                     x.numel());
  return x;
}

at::Tensor silu_backward(const at::Tensor& grad, const at::Tensor& x) {
  if (!take({&grad, &x}) || !dense_alike(grad, x)) return at::cpu::silu_backward(grad, x);
  at::Tensor dx = at::empty_like(x);
  kernels::cpu::silu_backward(grad.const_data_ptr(), x.const_data_ptr(), dx.mutable_data_ptr(),
                              bridge::kernel_dtype(x, "silu"), x.numel());
  return dx;
}

// LSTM, GRU and the plain RNNs: in a half dtype LibTorch runs them step by step, a few small ops
// per step (8-27x the fp32 time under the AVX2 emulation, docs/benchmarks.md), where fp32 runs
// oneDNN's fused LSTM or MKL's products over the whole sequence. The whole layer stack is run in
// fp32 on the widened input, state and weights and its outputs rounded once. Registered for
// AutogradCPU (and CPU, for inference mode), above autograd, so that the widenings are part of the
// graph: gradients reach the half weights through them. Elsewhere the op's own composite
// implementation.
bool take_all(const at::Tensor& input, at::TensorList a, at::TensorList b) {
  std::vector<const at::Tensor*> ts{&input};
  for (const at::Tensor& t : a) ts.push_back(&t);
  for (const at::Tensor& t : b) ts.push_back(&t);
  return take(ts);
}

std::vector<at::Tensor> wide_all(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(wide(t));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm(const at::Tensor& input, at::TensorList hx,
                                                    at::TensorList params, bool has_biases,
                                                    int64_t num_layers, double dropout, bool train,
                                                    bool bidirectional, bool batch_first) {
  if (!take_all(input, hx, params)) {
    return at::compositeimplicitautograd::lstm(input, hx, params, has_biases, num_layers, dropout,
                                               train, bidirectional, batch_first);
  }
  auto [out, h, c] = at::lstm(wide(input), wide_all(hx), wide_all(params), has_biases, num_layers,
                              dropout, train, bidirectional, batch_first);
  const auto t = input.scalar_type();
  return {out.to(t), h.to(t), c.to(t)};
}

// GRU and the plain RNNs (tanh, relu): one hidden state.
using HiddenRnn = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&,
                                                         at::TensorList, bool, int64_t, double,
                                                         bool, bool, bool);
template <HiddenRnn Op, HiddenRnn Composite>
std::tuple<at::Tensor, at::Tensor> hidden_rnn(const at::Tensor& input, const at::Tensor& hx,
                                              at::TensorList params, bool has_biases,
                                              int64_t num_layers, double dropout, bool train,
                                              bool bidirectional, bool batch_first) {
  if (!take_all(input, hx, params)) {
    return Composite(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first);
  }
  auto [out, h] = Op(wide(input), wide(hx), wide_all(params), has_biases, num_layers, dropout,
                     train, bidirectional, batch_first);
  const auto t = input.scalar_type();
  return {out.to(t), h.to(t)};
}

// Packed sequences: batch_sizes (int64) passed as it is.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_packed(
    const at::Tensor& data, const at::Tensor& batch_sizes, at::TensorList hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional) {
  if (!take_all(data, hx, params)) {
    return at::compositeimplicitautograd::lstm(data, batch_sizes, hx, params, has_biases,
                                               num_layers, dropout, train, bidirectional);
  }
  auto [out, h, c] = at::lstm(wide(data), batch_sizes, wide_all(hx), wide_all(params), has_biases,
                              num_layers, dropout, train, bidirectional);
  const auto t = data.scalar_type();
  return {out.to(t), h.to(t), c.to(t)};
}

using PackedHiddenRnn = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, at::TensorList,
                                                               bool, int64_t, double, bool, bool);
template <PackedHiddenRnn Op, PackedHiddenRnn Composite>
std::tuple<at::Tensor, at::Tensor> packed_hidden_rnn(const at::Tensor& data,
                                                     const at::Tensor& batch_sizes,
                                                     const at::Tensor& hx, at::TensorList params,
                                                     bool has_biases, int64_t num_layers,
                                                     double dropout, bool train,
                                                     bool bidirectional) {
  if (!take_all(data, hx, params)) {
    return Composite(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                     bidirectional);
  }
  auto [out, h] = Op(wide(data), batch_sizes, wide(hx), wide_all(params), has_biases, num_layers,
                     dropout, train, bidirectional);
  const auto t = data.scalar_type();
  return {out.to(t), h.to(t)};
}

using detail::QuietRegistration;

// A library of CPU kernels for aten's ops, registered quietly (see above). It lives as long as
// the process: the kernels check the thread's guard depth themselves.
torch::Library* cpu_library(const char* file, uint32_t line) {
  return new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, file, line);
}

void register_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    QuietRegistration quiet;
    const c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    static auto* lib = cpu_library(__FILE__, __LINE__);
    lib->impl("mm", TORCH_FN(mm));
    lib->impl("bmm", TORCH_FN(bmm));
    lib->impl("addmm", TORCH_FN(addmm));
    lib->impl("baddbmm", TORCH_FN(baddbmm));
    lib->impl("addbmm", TORCH_FN(addbmm));
    lib->impl("addmv", TORCH_FN(addmv));
    lib->impl("mm.out", TORCH_FN(mm_out));
    lib->impl("bmm.out", TORCH_FN(bmm_out));
    lib->impl("addmm.out", TORCH_FN(addmm_out));
    lib->impl("baddbmm.out", TORCH_FN(baddbmm_out));
    lib->impl("addbmm.out", TORCH_FN(addbmm_out));
    lib->impl("addmv.out", TORCH_FN(addmv_out));
    lib->impl("addmm_", TORCH_FN(addmm_));
    lib->impl("baddbmm_", TORCH_FN(baddbmm_));
    lib->impl("addbmm_", TORCH_FN(addbmm_));
    lib->impl("addmv_", TORCH_FN(addmv_));
    lib->impl("add_.Tensor", TORCH_FN(add_));
    lib->impl("convolution", TORCH_FN(convolution));
    lib->impl("convolution_backward", TORCH_FN(convolution_backward));
    lib->impl("gelu", TORCH_FN(gelu));
    lib->impl("gelu_backward", TORCH_FN(gelu_backward));
    lib->impl("silu", TORCH_FN(silu));
    lib->impl("silu_", TORCH_FN(silu_));
    lib->impl("silu_backward", TORCH_FN(silu_backward));
    static auto* autograd = new torch::Library(torch::Library::IMPL, "aten",
                                               c10::DispatchKey::AutogradCPU, __FILE__, __LINE__);
    for (torch::Library* l : {lib, autograd}) {
      l->impl("lstm.input", TORCH_FN(lstm));
      l->impl("lstm.data", TORCH_FN(lstm_packed));
      l->impl("gru.input", TORCH_FN((hidden_rnn<at::gru, at::compositeimplicitautograd::gru>)));
      l->impl("gru.data",
              TORCH_FN((packed_hidden_rnn<at::gru, at::compositeimplicitautograd::gru>)));
      l->impl("rnn_tanh.input",
              TORCH_FN((hidden_rnn<at::rnn_tanh, at::compositeimplicitautograd::rnn_tanh>)));
      l->impl("rnn_tanh.data",
              TORCH_FN((packed_hidden_rnn<at::rnn_tanh, at::compositeimplicitautograd::rnn_tanh>)));
      l->impl("rnn_relu.input",
              TORCH_FN((hidden_rnn<at::rnn_relu, at::compositeimplicitautograd::rnn_relu>)));
      l->impl("rnn_relu.data",
              TORCH_FN((packed_hidden_rnn<at::rnn_relu, at::compositeimplicitautograd::rnn_relu>)));
    }
  });
}

// Attention's kernels, on their own: where only they are in use (LibTorch's half matmuls fast),
// nothing else is registered.
void register_attention_kernels() {
  static std::once_flag once;
  std::call_once(once, [] {
    QuietRegistration quiet;
    const c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    static auto* lib = cpu_library(__FILE__, __LINE__);
    lib->impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_attention));
    lib->impl("_scaled_dot_product_flash_attention_for_cpu_backward",
              TORCH_FN(flash_attention_backward));
  });
}

bool attention_available_any() {
  return attention_available(at::kBFloat16) || attention_available(at::kHalf);
}

// What the scope serves, in the dispatcher.
void register_what_is_available() {
  if (cpu_half_fallback_available()) register_kernels();
  if (cpu_half_fallback_available() || attention_available_any()) register_attention_kernels();
}

}  // namespace

bool cpu_half_fallback_available(c10::ScalarType dtype) {
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf,
              "apex::amp::cpu_half_fallback_available: expected Half or BFloat16, got ", dtype);
  const detail::CpuHalfDecision d = decision();
  return dtype == at::kBFloat16 ? d.route_bf16 : d.route_fp16;
}

bool cpu_half_scope_available() {
  return cpu_half_fallback_available() || attention_available_any();
}

bool cpu_half_fallback_available() {
  return cpu_half_fallback_available(at::kBFloat16) || cpu_half_fallback_available(at::kHalf);
}

bool cpu_half_fallback_active() { return active_depth > 0; }

void prepare_cpu_half_fallback() { register_what_is_available(); }

CpuHalfFallbackGuard::CpuHalfFallbackGuard(bool enabled)
    : counted_(enabled && cpu_half_scope_available()) {
  if (!counted_) return;
  register_what_is_available();
  ++active_depth;
}

CpuHalfFallbackGuard::~CpuHalfFallbackGuard() {
  if (counted_) --active_depth;
}

namespace detail {
void force_cpu_half_fallback_available(std::optional<bool> value) {
  forced.store(value.has_value() ? (*value ? 1 : 0) : -1);
}

void force_cpu_half_attention_only() { forced.store(2); }

// Per dtype: a CPU can be fast in one and slow in the other (AVX512-BF16 without AVX512-FP16, as
// AMD Zen 4/5 and Intel Cooper Lake: bf16 through oneDNN, fp16 in a scalar loop). Intel's
// AVX-512 servers before them (Skylake to Ice Lake) take both: oneDNN's bf16 emulation there is
// slower than fp32 (utils.h, CpuHalfMatmul::kEmulated). APEX_CPU_HALF_FALLBACK "0" turns
// everything off, "1" the route on even where LibTorch's half path is fast (to compare or
// profile it there). Attention's own kernels serve wherever the route does, and also where
// LibTorch's half matmuls are fast (its half attention is not), unless APEX_CPU_HALF_ATTENTION
// is "0" or the kernel table lacks them.
CpuHalfDecision decide_cpu_half(const CpuHalfSupport& support, bool own_kernels,
                                const char* fallback_env, const char* attention_env) {
  const auto is = [](const char* v, const char* want) {
    return v != nullptr && std::strcmp(v, want) == 0;
  };
  CpuHalfDecision d;
  if (is(fallback_env, "0")) return d;
  const bool all = is(fallback_env, "1");
  d.route_bf16 = all || !cpu_half_matmul_is_fast(at::kBFloat16, support);
  d.route_fp16 = all || !cpu_half_matmul_is_fast(at::kHalf, support);
  const bool attention = own_kernels && !is(attention_env, "0");
  d.attention_bf16 = attention;
  d.attention_fp16 = attention;
  return d;
}

uint64_t cpu_half_route_calls() { return route_calls; }
bool cpu_half_own_gemm() { return own_gemm(); }
uint64_t cpu_half_gemm_calls() { return gemm_calls; }
bool cpu_half_attention_available(c10::ScalarType dtype) { return attention_available(dtype); }
}  // namespace detail

}  // namespace apex::amp
