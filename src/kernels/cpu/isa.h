// The interface of the per-ISA CPU kernels. multi_tensor_kernels.cpp, norm_kernels.cpp,
// lookup_kernels.cpp, gemv_kernels.cpp and gemm_kernels.cpp are compiled once per instruction set
// (the list: cmake/ApexCpuIsa.cmake,
// generated into kernels/cpu/isa_list.h), each filling its table by name; their helpers (vec.h)
// live in a namespace per ISA and their kernels at internal linkage, so no function compiled for a
// wider ISA can reach a narrower table through the linker; isa_select.cpp picks the table. The
// drivers (multi_tensor_cpu.cpp, norm_cpu.cpp, batch_norm_cpu.cpp, gemv_cpu.cpp, gemm_cpu.cpp,
// attention_cpu.cpp, activation_cpu.cpp) split the work and call these functions on one chunk,
// range of rows or block each; pointers are already offset to the chunk's first element.
#pragma once

#include "kernels/cpu/isa_list.h"
#include "kernels/multi_tensor.h"
#include "kernels/norm.h"

namespace apex::kernels::cpu {

/// One chunk of one tensor across the lists of a call.
struct Span {
  void* p[kMaxLists] = {};
  DType t[kMaxLists] = {};
  int64_t n = 0;
};

struct AdamChunk {
  float inv, l2, decay, beta1, one_minus_beta1, beta2, one_minus_beta2, bc2_sqrt, eps, step_size;
  float unscale;  ///< != 0: g_in * unscale is written back into the gradients
};
struct SgdChunk {
  float inv, wd_before, wd_after, momentum, one_minus_dampening, lr;
  bool nesterov, first_run, has_momentum;
  float unscale;  ///< != 0: g_in * unscale is written back into the gradients
};
struct AdagradChunk {
  float inv, l2, decay, lr, eps;
  float unscale;  ///< != 0: g_in * unscale is written back into the gradients
};
struct LambChunk {
  float g_mul, l2, wd_update, beta1, beta3, beta2, one_minus_beta2, bc1, bc2, eps;
  float unscale;  ///< != 0: g_in * unscale is written back into the gradients
};
struct NovoGradChunk {
  float inv, beta1, beta3, bc1, wd, lr, denom;
  bool reg_inside_moment;
  float unscale;  ///< != 0: g_in * unscale is written back into the gradients
};

/// Distance in floats between the per-row scratch regions of the norm kernels: the row rounded up
/// to whole cache lines plus three lines, so that every region starts on a line (a vector load
/// that straddles two lines costs two), and never a multiple of 16 lines, so that equal offsets
/// in any two of the (at most five) regions do not share their low 12 address bits (loads after
/// stores to such addresses stall on 4K aliasing): k * lines is a multiple of 64 for some k <= 4
/// only when lines is a multiple of 16.
inline int64_t norm_scratch_stride(int64_t cols) {
  int64_t lines = (cols + 15) / 16 + 3;
  if (lines % 16 == 0) ++lines;
  return lines * 16;
}

/// A block of rows of the norm backward: rows [begin, end), with fp32 dw/db partials over groups
/// of rows summed into the block's fp64 sums.
struct NormBackwardBlock {
  int64_t begin = 0;
  int64_t end = 0;
  const float* w = nullptr;   ///< fp32 [cols]: ones when the norm has none
  const float* wd = nullptr;  ///< from the output only: w clamped to |w| >= eps (the divisor)
  const float* b = nullptr;   ///< fp32 [cols], from the output only (zeros if no bias); else null
  float* scratch = nullptr;   ///< 5 regions of norm_scratch_stride(cols) floats, then 1024 more
  double* dw_sum = nullptr;   ///< fp64 [cols]: the block's first group stores, later ones add;
                              ///< null: dw not wanted (db_sum: db)
  double* db_sum = nullptr;
};

/// axpby's arg_to_check for no finiteness check (apex's are -1: both, 0: x, 1: y).
constexpr int kAxpbyCheckNone = 2;

/// The multi-tensor kernels of one instruction set, each on one chunk (multi_tensor_kernels.cpp).
struct MultiTensorKernels {
  bool (*scale)(const Span&, float s);
  bool (*axpby)(const Span&, float a, float b, int arg_to_check);
  bool (*non_finite)(const Span&);
  double (*sumsq)(const Span&, float mul);
  float (*absmax)(const Span&, float mul);
  void (*adam)(const Span&, const AdamChunk&);
  void (*sgd)(const Span&, const SgdChunk&);
  void (*adagrad)(const Span&, const AdagradChunk&);
  void (*lamb_stage1)(const Span&, const LambChunk&, double* u_sumsq, double* p_sumsq);
  void (*lamb_stage2)(const Span&, const LambChunk&, float ratio);
  void (*novograd)(const Span&, const NovoGradChunk&);
  /// n values of src (stored as t) as fp32 into dst.
  void (*to_float)(const void* src, DType t, float* dst, int64_t n);
  /// n fp32 values of src into dst, stored as t (rounded to nearest even).
  void (*from_float)(const float* src, DType t, void* dst, int64_t n);
};

/// The LayerNorm/RMSNorm row kernels of one instruction set (norm_kernels.cpp).
struct NormKernels {
  /// Rows [begin, end) of a LayerNorm/RMSNorm forward (see NormForwardArgs). w, b: [cols] or
  /// null, stored as `wb`: fp32 (copies, or the parameters in place), or bf16 (the parameters in
  /// place; only with bf16 x and y). scratch: 2 regions of norm_scratch_stride(cols) floats.
  void (*forward_rows)(const NormForwardArgs& a, int64_t begin, int64_t end, const void* w,
                       const void* b, DType wb, float* scratch);
  /// A block of rows of the backward (see NormBackwardArgs, NormBackwardBlock).
  void (*backward_block)(const NormBackwardArgs& a, const NormBackwardBlock& block);
  /// The norms read bf16 rows 16 elements at a time by interleaving them with zeros (AVX2): bf16
  /// parameters of a bf16 forward are then read in place whatever the size, since widening them
  /// costs one instruction per register instead of two.
  bool bf16_unpacked;
};

/// Unary functions of bf16/fp16 elements by table lookup, of one instruction set
/// (lookup_kernels.cpp; the tables: activation_cpu.cpp).
struct LookupKernels {
  /// y[i] = table[x[i]] for n 16-bit elements; the table has 65536 + 1 entries (the gathers read
  /// 32 bits at a time: the last entry is padding).
  void (*map16)(const uint16_t* x, uint16_t* y, int64_t n, const uint16_t* table);
  /// dx[i] = g[i] * table[x[i]] in fp32, rounded to nearest even in t (bf16 or fp16).
  void (*scale16)(const uint16_t* g, const uint16_t* x, uint16_t* dx, int64_t n, const float* table,
                  DType t);
};

/// Rows per block of column-major work (GemvKernels::axpy_cols) in the driver's split: a multiple
/// of every ISA's lanes, so that which rows a kernel takes in vector lanes does not depend on the
/// split; small, so that a 256-row matrix still gives both threads work.
constexpr int64_t kGemvRowBlock = 64;

/// Products of a bf16/fp16 matrix and nv (1 to 4) fp32 vectors with fp32 sums, the matrix widened
/// in registers (gemv_kernels.cpp; the driver: gemv_cpu.cpp). m points at row 0 of the rows done,
/// vector i at v + i * ldv, its results at y + i * ldy.
struct GemvKernels {
  /// y_i[r] = sum over l < k of m[r * ld + l] * v_i[l], for r < rows (each row contiguous).
  void (*dot_rows)(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v,
                   int64_t ldv, int nv, float* y, int64_t ldy, DType t);
  /// y_i[r] = sum over l < k of m[l * ld + r] * v_i[l], for r < rows (each column contiguous).
  void (*axpy_cols)(const uint16_t* m, int64_t ld, int64_t rows, int64_t k, const float* v,
                    int64_t ldv, int nv, float* y, int64_t ldy, DType t);
};

/// The register tile and blocking of the half-precision matrix products (gemm_kernels.cpp; the
/// driver: gemm_cpu.cpp): 6 rows x GemmKernels::nr columns of fp32 sums per tile (16 on AVX2, 32
/// on AVX-512), k in blocks of 256 (a panel of B, 16-32 KiB, stays in L1), 72 rows of A per
/// block (72 KiB, in L2).
constexpr int64_t kGemmMr = 6;
constexpr int64_t kGemmKc = 256;
constexpr int64_t kGemmMc = 72;

struct GemmKernels {
  int64_t nr;  ///< columns per tile and per panel of B
  /// Rows [0, mc) of A over k [0, kc) (element (i, l) at a[i * sm + l * sk], stored as t) into
  /// panels of kGemmMr rows: out[(i / Mr) * kc * Mr + l * Mr + i % Mr], zero for rows past mc.
  /// rows_avail (>= mc): rows that exist from a (the kernels may read, not use, rows past mc).
  /// May store up to 8 floats past the last panel.
  void (*pack_a)(const uint16_t* a, int64_t sm, int64_t sk, int64_t mc, int64_t rows_avail,
                 int64_t kc, float* out, DType t);
  /// Columns [0, nc) of B over k [0, kc) (element (l, j) at b[l * sk + j * sn]) into panels of
  /// nr columns likewise, zero past nc. Both packs may read (not use) the element between two
  /// they use where a stride is 2 (the next one exists: a column below cols_avail, or l < kc).
  void (*pack_b)(const uint16_t* b, int64_t sk, int64_t sn, int64_t nc, int64_t cols_avail,
                 int64_t kc, float* out, DType t);
  /// c[i * ldc + j] = (c[i * ldc + j] if accumulate) + sum over l < kc of A[i, l] B[l, j], for i
  /// below mc rounded up to kGemmMr and j < ncp (a multiple of nr), from packed panels.
  void (*multiply)(const float* a, const float* b, int64_t mc, int64_t ncp, int64_t kc, float* c,
                   int64_t ldc, bool accumulate);
  /// x[j] = exp(x[j] * scale - shift[j]) for j < n (attention's softmax, kernels/attention.h):
  /// within ~2 fp32 units of the exact value; 0 where the argument is below -87.3 (-inf: a
  /// masked score), exp(88.3) where it is above that (not infinity: the softmax's arguments are
  /// at most ~0), NaN where it is NaN.
  void (*exp_shifted)(float* x, const float* shift, int64_t n, float scale);
};

/// Every kernel table of one instruction set.
struct CpuKernels {
  const char* isa;  ///< its name, as APEX_CPU_ISA takes it
  const MultiTensorKernels* multi_tensor;
  const NormKernels* norm;
  const LookupKernels* lookup;
  const GemvKernels* gemv;
  const GemmKernels* gemm;
};

/// The kernels of the widest instruction set this CPU has (APEX_CPU_ISA may force a narrower
/// one), chosen on first use (isa_select.cpp).
const CpuKernels& cpu_kernels();

// One getter per table and ISA, defined by the per-ISA objects (the list: isa_list.h).
#define APEX_DECLARE_ISA_TABLES(name, runs)                \
  const MultiTensorKernels& multi_tensor_kernels_##name(); \
  const NormKernels& norm_kernels_##name();                \
  const LookupKernels& lookup_kernels_##name();            \
  const GemvKernels& gemv_kernels_##name();                \
  const GemmKernels& gemm_kernels_##name();
APEX_FOR_EACH_CPU_ISA(APEX_DECLARE_ISA_TABLES)
#undef APEX_DECLARE_ISA_TABLES

}  // namespace apex::kernels::cpu
