// The CPU half fallback's matrix products (fallback.h): mm, bmm, addmm, baddbmm, addbmm and addmv
// of half CPU tensors (so linear, matmul, mv and conv_tbc) by the vector kernels (few rows or
// columns), apex's own product, or LibTorch's fp32 kernels on widened operands, the result rounded
// once; their out= and in-place forms generated from them; and `x += bias` of a half x and an fp32
// bias in one pass.
#include <ATen/ExpandUtils.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/add_cpu_dispatch.h>
#include <ATen/ops/addbmm_cpu_dispatch.h>
#include <ATen/ops/addmm_cpu_dispatch.h>
#include <ATen/ops/addmv_cpu_dispatch.h>
#include <ATen/ops/baddbmm_cpu_dispatch.h>
#include <ATen/ops/bmm_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm_cpu_dispatch.h>
#include <torch/library.h>

#include "amp/cpu_half/fallback.h"
#include "bridge/bridge.h"
#include "kernels/gemm.h"
#include "kernels/gemv.h"
#include "kernels/half_add.h"

#include <algorithm>
#include <array>
#include <optional>
#include <type_traits>
#include <vector>

namespace apex::amp::cpu_half {
namespace {

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

int64_t max_vectors() { return own_product() ? kMaxVectorsWithGemm : kMaxVectors; }

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
  if (!own_product() || a.dim() != dims || b.dim() != dims) return {};
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
  ++own_product_calls;
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

// The tensors among an op's arguments, for take().
struct Tensors {
  std::array<const at::Tensor*, 5> p{};
  size_t n = 0;
  template <typename T>
  void add(const T& x) {
    if constexpr (std::is_same_v<T, at::Tensor>) p[n++] = &x;
  }
};
template <typename... A>
Tensors tensors_of(const A&... a) {
  static_assert((0 + ... + int{std::is_same_v<A, at::Tensor>}) <= 5, "Tensors holds five");
  Tensors t;
  (t.add(a), ...);
  return t;
}
bool take_all(const Tensors& t) { return take({t.p.data(), t.n}); }

// The out= form of a functional op above: its result, written into `out` as LibTorch's kernels
// write theirs (resized where its shape differs, with LibTorch's warning if it held elements). An
// `out` of another dtype (not taken) goes to LibTorch's kernel, which refuses it.
template <auto Functional, auto LibTorchOut>
struct OutForm;
template <typename... A, at::Tensor (*Functional)(A...),
          at::Tensor& (*LibTorchOut)(A..., at::Tensor&)>
struct OutForm<Functional, LibTorchOut> {
  static at::Tensor& call(A... a, at::Tensor& out) {
    if (!take_all(tensors_of(a..., out))) return LibTorchOut(a..., out);
    const at::Tensor result = Functional(a...);
    at::native::resize_output(out, result.sizes());
    return out.copy_(result);
  }
};

// The in-place form: the functional op's result (computed before `self` is written, so `self` may
// alias an operand) copied into `self` where `Fits` says `self` has the result's shape; any other
// `self` goes to LibTorch's kernel, which refuses it with its own message.
template <auto Functional, auto LibTorchInplace, auto Fits>
struct InplaceForm;
template <typename... A, at::Tensor (*Functional)(const at::Tensor&, A...),
          at::Tensor& (*LibTorchInplace)(at::Tensor&, A...), bool (*Fits)(const at::Tensor&, A...)>
struct InplaceForm<Functional, LibTorchInplace, Fits> {
  static at::Tensor& call(at::Tensor& self, A... a) {
    if (!take_all(tensors_of(self, a...)) || !Fits(self, a...)) return LibTorchInplace(self, a...);
    return self.copy_(Functional(self, a...));
  }
};

// `self` of the shape a [.., rows, k] times b [.., k, cols] gives: [batch, rows, cols] where the
// batches stay (baddbmm), [rows, cols] otherwise.
bool has_product_shape(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                       bool batched_out) {
  const int64_t d = batched_out ? 3 : 2;
  if (a.dim() != b.dim() || a.dim() < 2 || self.dim() != d) return false;
  const int64_t rows = a.size(-2), cols = b.size(-1);
  return batched_out ? self.sizes() == at::IntArrayRef{a.size(0), rows, cols}
                     : self.sizes() == at::IntArrayRef{rows, cols};
}

template <int64_t Dims, bool BatchedOut>
bool product_fits(const at::Tensor& self, const at::Tensor& a, const at::Tensor& b,
                  const at::Scalar&, const at::Scalar&) {
  return a.dim() == Dims && has_product_shape(self, a, b, BatchedOut);
}

bool addmv_fits(const at::Tensor& self, const at::Tensor& mat, const at::Tensor&, const at::Scalar&,
                const at::Scalar&) {
  return mat.dim() == 2 && self.dim() == 1 && self.size(0) == mat.size(0);
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
  if (scope_depth == 0 || !is_half(self) || !self.device().is_cpu() || !other.defined() ||
      other.scalar_type() != at::kFloat || !other.device().is_cpu() || alpha.isComplex() ||
      !self.is_contiguous() || !other.is_contiguous() || self.is_alias_of(other) ||
      !is_trailing_vector(self, other) || !serves(self.scalar_type())) {
    return at::cpu::add_(self, other, alpha);
  }
  ++taken_calls;
  const int64_t n = other.numel();
  kernels::cpu::half_add_rows(self.mutable_data_ptr(), bridge::kernel_dtype(self, "add_"),
                              self.numel() / n, n, other.const_data_ptr<float>(),
                              static_cast<float>(alpha.toDouble()));
  return self;
}
}  // namespace

void register_products(torch::Library& cpu) {
  cpu.impl("mm", TORCH_FN(mm));
  cpu.impl("bmm", TORCH_FN(bmm));
  cpu.impl("addmm", TORCH_FN(addmm));
  cpu.impl("baddbmm", TORCH_FN(baddbmm));
  cpu.impl("addbmm", TORCH_FN(addbmm));
  cpu.impl("addmv", TORCH_FN(addmv));
  cpu.impl("mm.out", TORCH_FN((OutForm<&mm, &at::cpu::mm_outf>::call)));
  cpu.impl("bmm.out", TORCH_FN((OutForm<&bmm, &at::cpu::bmm_outf>::call)));
  cpu.impl("addmm.out", TORCH_FN((OutForm<&addmm, &at::cpu::addmm_outf>::call)));
  cpu.impl("baddbmm.out", TORCH_FN((OutForm<&baddbmm, &at::cpu::baddbmm_outf>::call)));
  cpu.impl("addbmm.out", TORCH_FN((OutForm<&addbmm, &at::cpu::addbmm_outf>::call)));
  cpu.impl("addmv.out", TORCH_FN((OutForm<&addmv, &at::cpu::addmv_outf>::call)));
  cpu.impl("addmm_",
           TORCH_FN((InplaceForm<&addmm, &at::cpu::addmm_, &product_fits<2, false>>::call)));
  cpu.impl("baddbmm_",
           TORCH_FN((InplaceForm<&baddbmm, &at::cpu::baddbmm_, &product_fits<3, true>>::call)));
  cpu.impl("addbmm_",
           TORCH_FN((InplaceForm<&addbmm, &at::cpu::addbmm_, &product_fits<3, false>>::call)));
  cpu.impl("addmv_", TORCH_FN((InplaceForm<&addmv, &at::cpu::addmv_, &addmv_fits>::call)));
  cpu.impl("add_.Tensor", TORCH_FN(add_));
}

}  // namespace apex::amp::cpu_half
