// Kernel interface of an fp32 vector added into every row of a bf16/fp16 tensor in place, in one
// pass: used by amp's CPU half fallback (amp/cpu_half/) for `out += bias` of LibTorch's C++
// Linear on an N-d input at O1 (a half product, an fp32 bias), which LibTorch computes by widening
// all of `out` into a temporary, adding, and rounding the temporary back.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cpu {

/// x[r * n + i] = x[r * n + i] + alpha * v[i] for r < rows and i < n, computed in fp32 and
/// rounded to nearest even in t (bf16 or fp16); x contiguous, stored as t; v fp32. Parallel on
/// ATen's thread pool; each element independent of the split.
void half_add_rows(void* x, DType t, int64_t rows, int64_t n, const float* v, float alpha);

}  // namespace apex::kernels::cpu
