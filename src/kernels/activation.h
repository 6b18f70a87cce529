// Kernel interface of the activations of bf16 and fp16 CPU tensors: GELU and SiLU forward and
// backward over contiguous buffers, by table lookup. Used by amp's CPU half fallback
// (amp/cpu_half/), where LibTorch's bf16/fp16 GELU on AVX2 takes 1.5-1.7x the time of its fp32
// one.
//
// Every bf16 or fp16 element is one of 65536 bit patterns, so GELU of it is read from a table
// built once per process (per dtype and form) in fp64: the forward is correctly rounded (LibTorch
// computes 1 + erf(x / sqrt 2) in fp32, which cancels for x < -3: its bf16 results there are off
// by up to 1.3e4 units in the last place); the backward multiplies the gradient by gelu'(x)
// rounded to fp32 and rounds the fp32 product to the dtype: within one unit in the last place,
// except where gelu'(x) is an fp32 subnormal (bf16 x below about -13) and the gradient is large
// (LibTorch computes those in fp32 too). NaN in,
// NaN out; gelu(+inf) = +inf, gelu(-inf) = NaN and gelu'(+-inf) = NaN, as x Phi(x) evaluates
// there and as LibTorch's does.
#pragma once

#include <cstdint>

#include "kernels/multi_tensor.h"

namespace apex::kernels::cpu {

/// y[i] = gelu(x[i]) for n elements stored as t (bf16 or fp16): x Phi(x), or with tanh
/// 0.5 x (1 + tanh(sqrt(2 / pi) (x + 0.044715 x^3))). x and y may be the same buffer. Parallel
/// on ATen's thread pool.
void gelu(const void* x, void* y, DType t, int64_t n, bool tanh);

/// dx[i] = g[i] * gelu'(x[i]).
void gelu_backward(const void* g, const void* x, void* dx, DType t, int64_t n, bool tanh);

/// y[i] = silu(x[i]) = x sigma(x), correctly rounded from fp64 like gelu (LibTorch's bf16 SiLU on
/// AVX2 takes 1.5-1.6x its fp32 time); silu(-inf) is NaN, as LibTorch's.
void silu(const void* x, void* y, DType t, int64_t n);

/// dx[i] = g[i] * silu'(x[i]).
void silu_backward(const void* g, const void* x, void* dx, DType t, int64_t n);

}  // namespace apex::kernels::cpu
