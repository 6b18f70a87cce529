// CUDA backend of the multi-tensor kernels declared in kernels/multi_tensor.h. Each operation is
// a functor run by the apply engine (multi_tensor_apply.cuh) on every chunk of its tensor lists;
// the math follows the header's comments, in fp32 registers whatever the storage dtype.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "kernels/cuda/multi_tensor_apply.cuh"
#include "kernels/multi_tensor.h"

namespace apex::kernels::cuda {
namespace {

using detail::Chunk;
using detail::Frame;
using detail::kBlockSize;
using detail::kILP;
using detail::kWarpSize;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

/// The AmpArgs skip: a non-finite gradient was found, so the optimizer changes nothing.
__device__ __forceinline__ bool skip_step(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

__device__ __forceinline__ float value_or(const float* p, float fallback) {
  return p != nullptr ? *p : fallback;
}

/// Loads the parameter the math works on: the fp32 master when present, else the model param.
template <typename TP>
__device__ __forceinline__ void load_param(float (&r)[kILP], const TP* p, const float* master,
                                           const Frame& f) {
  if (master != nullptr) {
    detail::load(r, master, f);
  } else {
    detail::load(r, p, f);
  }
}

/// Stores the updated parameter to the master (when present) and, rounded, to the model param.
template <typename TP>
__device__ __forceinline__ void store_param(TP* p, float* master, const float (&r)[kILP],
                                            const Frame& f) {
  if (master != nullptr) detail::store(master, r, f);
  detail::store(p, r, f);
}

double bias_correction(bool enabled, float beta, int64_t step) {
  if (!enabled) return 1.0;
  return 1.0 - std::pow(static_cast<double>(beta), static_cast<double>(step));
}

// ---------------------------------------------------------------------------------------------
// scale, axpby, check_finite
// ---------------------------------------------------------------------------------------------

template <typename TIn, typename TOut>
struct ScaleOp {
  float scale;
  float* found_inf;

  __device__ void operator()(const Chunk<2>& c) const {
    const TIn* in = c.ptr<const TIn>(0);
    TOut* out = c.ptr<TOut>(1);
    bool bad = false;
    const bool aligned = detail::is_aligned(in) && detail::is_aligned(out);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float r[kILP];
      detail::load(r, in, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        if (i < f.count && !isfinite(r[i])) bad = true;
        r[i] *= scale;
      }
      detail::store(out, r, f);
    });
    if (bad) *found_inf = 1.0f;
  }
};

template <typename TX, typename TY, typename TOut>
struct AxpbyOp {
  float a;
  float b;
  bool check_x;
  bool check_y;
  float* found_inf;

  __device__ void operator()(const Chunk<3>& c) const {
    const TX* x = c.ptr<const TX>(0);
    const TY* y = c.ptr<const TY>(1);
    TOut* out = c.ptr<TOut>(2);
    bool bad = false;
    const bool aligned = detail::is_aligned(x) && detail::is_aligned(y) && detail::is_aligned(out);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rx[kILP];
      float ry[kILP];
      detail::load(rx, x, f);
      detail::load(ry, y, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        if (i < f.count && ((check_x && !isfinite(rx[i])) || (check_y && !isfinite(ry[i])))) {
          bad = true;
        }
        rx[i] = a * rx[i] + b * ry[i];
      }
      detail::store(out, rx, f);
    });
    if (bad) *found_inf = 1.0f;
  }
};

template <typename T>
struct CheckFiniteOp {
  float* found_inf;

  __device__ void operator()(const Chunk<1>& c) const {
    const T* x = c.ptr<const T>(0);
    bool bad = false;
    detail::for_each_frame(c.n, detail::is_aligned(x), [&](const Frame& f) {
      float r[kILP];
      detail::load(r, x, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        if (i < f.count && !isfinite(r[i])) bad = true;
      }
    });
    if (bad) *found_inf = 1.0f;
  }
};

// ---------------------------------------------------------------------------------------------
// norm: one partial per chunk (sum of squares or NaN-aware max of |x|), then cleanup kernels
// ---------------------------------------------------------------------------------------------

template <NormType Type>
struct NormTraits;

template <>
struct NormTraits<NormType::kL2> {
  using Combine = detail::SumOp;
  __device__ static float accumulate(float acc, float v) { return acc + v * v; }
  __device__ static float finish(float acc) { return sqrtf(acc); }
};

template <>
struct NormTraits<NormType::kInf> {
  using Combine = detail::MaxNanOp;
  __device__ static float accumulate(float acc, float v) { return Combine{}(acc, fabsf(v)); }
  __device__ static float finish(float acc) { return acc; }
};

template <typename T, NormType Type>
struct NormOp {
  const float* inv_scale;
  float* partial;  ///< [number of chunks of the call]

  __device__ void operator()(const Chunk<1>& c) const {
    using Traits = NormTraits<Type>;
    const T* x = c.ptr<const T>(0);
    const float s = value_or(inv_scale, 1.0f);
    float acc[1] = {0.0f};
    detail::for_each_frame(c.n, detail::is_aligned(x), [&](const Frame& f) {
      float r[kILP];
      detail::load(r, x, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        if (i < f.count) acc[0] = Traits::accumulate(acc[0], r[i] * s);
      }
    });
    detail::block_reduce(acc, typename Traits::Combine{});
    if (threadIdx.x == 0) partial[c.ordinal] = acc[0];
  }
};

template <NormType Type>
__global__ void __launch_bounds__(kBlockSize)
    norm_total_kernel(const float* partial, int64_t count, float* total) {
  using Traits = NormTraits<Type>;
  const typename Traits::Combine combine;
  float acc[1] = {0.0f};
  for (int64_t i = threadIdx.x; i < count; i += kBlockSize) acc[0] = combine(acc[0], partial[i]);
  detail::block_reduce(acc, combine);
  if (threadIdx.x == 0) *total = Traits::finish(acc[0]);
}

inline constexpr int kNormTensorThreads = 256;  ///< one warp per tensor
inline constexpr int kNormTensorEntries = 240;

/// Tensor `tensor[e]` owns partials first[e] .. first[e] + count[e] - 1 (count 0 when empty).
struct NormTensorTable {
  int64_t first[kNormTensorEntries];
  int32_t count[kNormTensorEntries];
  int32_t tensor[kNormTensorEntries];
  int32_t entries;
};

template <NormType Type>
__global__ void __launch_bounds__(kNormTensorThreads)
    norm_per_tensor_kernel(const __grid_constant__ NormTensorTable table, const float* partial,
                           float* per_tensor) {
  using Traits = NormTraits<Type>;
  const typename Traits::Combine combine;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int e = static_cast<int>(blockIdx.x) * (kNormTensorThreads / kWarpSize) +
                static_cast<int>(threadIdx.x) / kWarpSize;
  if (e >= table.entries) return;  // whole warps leave together
  const float* src = partial + table.first[e];
  float acc = 0.0f;
  for (int i = lane; i < table.count[e]; i += kWarpSize) acc = combine(acc, src[i]);
  acc = detail::warp_reduce(acc, combine);
  if (lane == 0) per_tensor[table.tensor[e]] = Traits::finish(acc);
}

template <NormType Type>
void norm_typed(const TensorLists& lists, const NormArgs& args, cudaStream_t stream) {
  constexpr const char* kName = "apex::kernels::cuda::norm";
  int64_t chunks = 0;
  for (int64_t t = 0; t < lists.num_tensors; ++t) chunks += detail::chunks_of(lists.numel[t]);
  if (chunks == 0) {  // every tensor is empty: all norms are 0
    detail::check_cuda(kName, cudaMemsetAsync(args.total, 0, sizeof(float), stream));
    if (args.per_tensor != nullptr) {
      const auto bytes = static_cast<std::size_t>(lists.num_tensors) * sizeof(float);
      detail::check_cuda(kName, cudaMemsetAsync(args.per_tensor, 0, bytes, stream));
    }
    return;
  }

  const detail::StreamBuffer partial(kName, static_cast<std::size_t>(chunks) * sizeof(float),
                                     stream);
  detail::dispatch_dtype(kName, lists.dtype[0], [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::apply<1>(kName, lists, NormOp<T, Type>{args.inv_scale, partial.as<float>()}, stream);
  });
  detail::launch("apex::kernels::cuda::norm_total", norm_total_kernel<Type>, 1, kBlockSize, stream,
                 partial.as<const float>(), chunks, args.total);

  if (args.per_tensor == nullptr) return;
  constexpr int kWarpsPerBlock = kNormTensorThreads / kWarpSize;
  NormTensorTable table = {};
  int64_t first = 0;
  for (int64_t t = 0; t < lists.num_tensors; ++t) {
    const int64_t count = detail::chunks_of(lists.numel[t]);
    table.first[table.entries] = first;
    table.count[table.entries] = static_cast<int32_t>(count);
    table.tensor[table.entries] = static_cast<int32_t>(t);
    ++table.entries;
    first += count;
    if (table.entries == kNormTensorEntries || t == lists.num_tensors - 1) {
      const auto blocks =
          static_cast<unsigned>((table.entries + kWarpsPerBlock - 1) / kWarpsPerBlock);
      detail::launch("apex::kernels::cuda::norm_per_tensor", norm_per_tensor_kernel<Type>, blocks,
                     kNormTensorThreads, stream, table, partial.as<const float>(), args.per_tensor);
      table.entries = 0;
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Adam
// ---------------------------------------------------------------------------------------------

struct AdamScalars {
  float lr;
  float beta1;
  float beta2;
  float eps;
  float weight_decay;
  float bc1;  ///< from args.step, used when step_ptr is null
  float bc2;
  // From args.lr and args.step, computed on the host in double like the CPU backend; the kernel
  // recomputes them in fp32 in capturable mode.
  float step_size;  ///< lr / bc1
  float bc2_sqrt;
  float decay;  ///< 1 - lr*wd
  bool adam_w_mode;
  bool bias_correction;
  const float* lr_ptr;
  const float* step_ptr;
  const float* inv_scale;
  const float* found_inf;
};

template <typename TP, typename TG>
struct AdamOp {
  AdamScalars s;

  __device__ void operator()(const Chunk<5>& c) const {
    if (skip_step(s.found_inf)) return;
    float step_size = s.step_size;
    float bc2_sqrt = s.bc2_sqrt;
    float decay = s.decay;
    if (s.lr_ptr != nullptr || s.step_ptr != nullptr) {  // capturable: read lr and step here
      const float lr = value_or(s.lr_ptr, s.lr);
      float bc1 = s.bc1;
      float bc2 = s.bc2;
      if (s.step_ptr != nullptr && s.bias_correction) {
        const float step = *s.step_ptr;
        bc1 = 1.0f - powf(s.beta1, step);
        bc2 = 1.0f - powf(s.beta2, step);
      }
      step_size = lr / bc1;
      bc2_sqrt = sqrtf(bc2);
      decay = 1.0f - lr * s.weight_decay;
    }
    const float g_scale = value_or(s.inv_scale, 1.0f);

    TP* p = c.ptr<TP>(0);
    const TG* g = c.ptr<const TG>(1);
    float* m = c.ptr<float>(2);
    float* v = c.ptr<float>(3);
    float* master = c.ptr<float>(4);
    const bool aligned = detail::is_aligned(p) && detail::is_aligned(g) && detail::is_aligned(m) &&
                         detail::is_aligned(v) && detail::is_aligned(master);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rg[kILP];
      float rm[kILP];
      float rv[kILP];
      load_param(rp, p, master, f);
      detail::load(rg, g, f);
      detail::load(rm, m, f);
      detail::load(rv, v, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        float gi = rg[i] * g_scale;
        float pi = rp[i];
        if (s.weight_decay != 0.0f) {
          if (s.adam_w_mode) {
            pi = pi * decay;
          } else {
            gi = gi + s.weight_decay * pi;
          }
        }
        rm[i] = s.beta1 * rm[i] + (1.0f - s.beta1) * gi;
        rv[i] = s.beta2 * rv[i] + (1.0f - s.beta2) * gi * gi;
        // torch's addcdiv order: p - step_size * (m / denom)
        rp[i] = pi - step_size * (rm[i] / (sqrtf(rv[i]) / bc2_sqrt + s.eps));
      }
      store_param(p, master, rp, f);
      detail::store(m, rm, f);
      detail::store(v, rv, f);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// SGD
// ---------------------------------------------------------------------------------------------

struct SgdScalars {
  float lr;
  float momentum;
  float dampening;
  float weight_decay;
  bool nesterov;
  bool wd_after_momentum;
  bool first_run;
  const float* inv_scale;
  const float* found_inf;
};

template <typename TP, typename TG>
struct SgdOp {
  SgdScalars s;

  __device__ void operator()(const Chunk<4>& c) const {
    if (skip_step(s.found_inf)) return;
    const float g_scale = value_or(s.inv_scale, 1.0f);
    const bool use_momentum = s.momentum != 0.0f;  // the buffer list is present then

    TP* p = c.ptr<TP>(0);
    const TG* g = c.ptr<const TG>(1);
    float* buf = c.ptr<float>(2);
    float* master = c.ptr<float>(3);
    const bool aligned = detail::is_aligned(p) && detail::is_aligned(g) &&
                         detail::is_aligned(buf) && detail::is_aligned(master);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rg[kILP];
      float rb[kILP] = {};
      load_param(rp, p, master, f);
      detail::load(rg, g, f);
      if (use_momentum && !s.first_run) detail::load(rb, buf, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        float gi = rg[i] * g_scale;
        const float pi = rp[i];
        if (s.weight_decay != 0.0f && !s.wd_after_momentum) gi = gi + s.weight_decay * pi;
        if (use_momentum) {
          rb[i] = s.first_run ? gi : s.momentum * rb[i] + (1.0f - s.dampening) * gi;
          gi = s.nesterov ? gi + s.momentum * rb[i] : rb[i];
        }
        if (s.weight_decay != 0.0f && s.wd_after_momentum) gi = gi + s.weight_decay * pi;
        rp[i] = pi - s.lr * gi;
      }
      store_param(p, master, rp, f);
      if (use_momentum) detail::store(buf, rb, f);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// Adagrad
// ---------------------------------------------------------------------------------------------

struct AdagradScalars {
  float lr;
  float eps;
  float weight_decay;
  float decay;  ///< 1 - lr*wd in w mode (computed in double on the host), else 1
  bool adagrad_w_mode;
  const float* inv_scale;
  const float* found_inf;
};

template <typename TP, typename TG>
struct AdagradOp {
  AdagradScalars s;

  __device__ void operator()(const Chunk<4>& c) const {
    if (skip_step(s.found_inf)) return;
    const float g_scale = value_or(s.inv_scale, 1.0f);

    TP* p = c.ptr<TP>(0);
    const TG* g = c.ptr<const TG>(1);
    float* h = c.ptr<float>(2);
    float* master = c.ptr<float>(3);
    const bool aligned = detail::is_aligned(p) && detail::is_aligned(g) && detail::is_aligned(h) &&
                         detail::is_aligned(master);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rg[kILP];
      float rh[kILP];
      load_param(rp, p, master, f);
      detail::load(rg, g, f);
      detail::load(rh, h, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        float gi = rg[i] * g_scale;
        const float pi = rp[i];
        if (!s.adagrad_w_mode && s.weight_decay != 0.0f) gi = gi + s.weight_decay * pi;
        rh[i] = rh[i] + gi * gi;
        // w mode: p -= lr*wd*p folded into p*(1 - lr*wd)
        rp[i] = pi * s.decay - s.lr * (gi / (sqrtf(rh[i]) + s.eps));
      }
      store_param(p, master, rp, f);
      detail::store(h, rh, f);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// LAMB
// ---------------------------------------------------------------------------------------------

struct LambScalars {
  float lr;
  float beta1;
  float beta2;
  float beta3;
  float eps;
  float weight_decay;
  float bc1;
  float bc2;
  float max_grad_norm;
  bool adam_w_mode;
  bool use_nvlamb;
  const float* global_grad_norm;
  float* u_sumsq;
  float* p_sumsq;
  const float* inv_scale;
  const float* found_inf;
};

/// u = (m/bc1) / (sqrt(v/bc2) + eps) [+ wd*p]. Every operation is explicitly rounded so that the
/// compiler cannot contract it differently in the two stages: stage 2 recomputes exactly the u
/// whose squares stage 1 summed.
__device__ __forceinline__ float lamb_update(float m, float v, float p, const LambScalars& s) {
  float u = __fdiv_rn(__fdiv_rn(m, s.bc1), __fadd_rn(__fsqrt_rn(__fdiv_rn(v, s.bc2)), s.eps));
  if (s.adam_w_mode && s.weight_decay != 0.0f) u = __fadd_rn(u, __fmul_rn(s.weight_decay, p));
  return u;
}

template <typename TP, typename TG>
struct LambStage1Op {
  LambScalars s;

  __device__ void operator()(const Chunk<5>& c) const {
    if (skip_step(s.found_inf)) return;
    float clip = 1.0f;
    if (s.max_grad_norm > 0.0f && s.global_grad_norm != nullptr) {
      const float gnorm = *s.global_grad_norm;
      if (gnorm > s.max_grad_norm) clip = gnorm / s.max_grad_norm;
    }
    const float g_mul = value_or(s.inv_scale, 1.0f) / clip;

    const TP* p = c.ptr<const TP>(0);
    const TG* g = c.ptr<const TG>(1);
    float* m = c.ptr<float>(2);
    float* v = c.ptr<float>(3);
    const float* master = c.ptr<const float>(4);
    const bool aligned = detail::is_aligned(p) && detail::is_aligned(g) && detail::is_aligned(m) &&
                         detail::is_aligned(v) && detail::is_aligned(master);
    float sums[2] = {0.0f, 0.0f};  // u*u, p*p
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rg[kILP];
      float rm[kILP];
      float rv[kILP];
      load_param(rp, p, master, f);
      detail::load(rg, g, f);
      detail::load(rm, m, f);
      detail::load(rv, v, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        float gi = rg[i] * g_mul;
        if (!s.adam_w_mode && s.weight_decay != 0.0f) gi = gi + s.weight_decay * rp[i];
        rm[i] = s.beta1 * rm[i] + s.beta3 * gi;
        rv[i] = s.beta2 * rv[i] + (1.0f - s.beta2) * gi * gi;
        if (i < f.count) {
          const float u = lamb_update(rm[i], rv[i], rp[i], s);
          sums[0] += u * u;
          sums[1] += rp[i] * rp[i];
        }
      }
      detail::store(m, rm, f);
      detail::store(v, rv, f);
    });
    detail::block_reduce(sums, detail::SumOp{});
    if (threadIdx.x == 0) {
      atomicAdd(s.u_sumsq + c.tensor, sums[0]);
      atomicAdd(s.p_sumsq + c.tensor, sums[1]);
    }
  }
};

template <typename TP>
struct LambStage2Op {
  LambScalars s;

  __device__ void operator()(const Chunk<5>& c) const {
    if (skip_step(s.found_inf)) return;
    const float p_norm = sqrtf(s.p_sumsq[c.tensor]);
    const float u_norm = sqrtf(s.u_sumsq[c.tensor]);
    const bool adapt = (s.use_nvlamb || s.weight_decay != 0.0f) && p_norm != 0.0f && u_norm != 0.0f;
    const float ratio = adapt ? s.lr * (p_norm / u_norm) : s.lr;

    TP* p = c.ptr<TP>(0);  // list 1 (the gradients) is not read
    const float* m = c.ptr<const float>(2);
    const float* v = c.ptr<const float>(3);
    float* master = c.ptr<float>(4);
    const bool aligned = detail::is_aligned(p) && detail::is_aligned(m) && detail::is_aligned(v) &&
                         detail::is_aligned(master);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rm[kILP];
      float rv[kILP];
      load_param(rp, p, master, f);
      detail::load(rm, m, f);
      detail::load(rv, v, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) rp[i] = rp[i] - ratio * lamb_update(rm[i], rv[i], rp[i], s);
      store_param(p, master, rp, f);
    });
  }
};

// ---------------------------------------------------------------------------------------------
// NovoGrad
// ---------------------------------------------------------------------------------------------

struct NovoGradScalars {
  float lr;
  float beta1;
  float beta3;
  float eps;
  float weight_decay;
  float bc1;
  float bc2;
  bool reg_inside_moment;
  const float* v;
  const float* inv_scale;
  const float* found_inf;
};

template <typename TP, typename TG>
struct NovoGradOp {
  NovoGradScalars s;

  __device__ void operator()(const Chunk<4>& c) const {
    if (skip_step(s.found_inf)) return;
    const float d = s.v[c.tensor] / s.bc2 + s.eps;
    const float g_scale = value_or(s.inv_scale, 1.0f);

    TP* p = c.ptr<TP>(0);
    const TG* g = c.ptr<const TG>(1);
    float* m = c.ptr<float>(2);
    float* master = c.ptr<float>(3);
    const bool aligned = detail::is_aligned(p) && detail::is_aligned(g) && detail::is_aligned(m) &&
                         detail::is_aligned(master);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rg[kILP];
      float rm[kILP];
      load_param(rp, p, master, f);
      detail::load(rg, g, f);
      detail::load(rm, m, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        float gi = rg[i] * g_scale;
        const float pi = rp[i];
        if (s.reg_inside_moment) {
          gi = gi / d;
          if (s.weight_decay != 0.0f) gi = gi + s.weight_decay * pi;
          rm[i] = s.beta1 * rm[i] + s.beta3 * gi;
          rp[i] = pi - s.lr * (rm[i] / s.bc1);
        } else {
          rm[i] = s.beta1 * rm[i] + s.beta3 * gi;
          float update = (rm[i] / s.bc1) / d;
          if (s.weight_decay != 0.0f) update = update + s.weight_decay * pi;
          rp[i] = pi - s.lr * update;
        }
      }
      store_param(p, master, rp, f);
      detail::store(m, rm, f);
    });
  }
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

void scale(const TensorLists& lists, const ScaleArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::scale";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 2, {0, 1}, {});
  if (args.found_inf == nullptr) detail::fail(kName, "found_inf is required");
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tin, auto tout) {
    using TIn = typename decltype(tin)::type;
    using TOut = typename decltype(tout)::type;
    detail::apply<2>(kName, lists, ScaleOp<TIn, TOut>{args.scale, args.found_inf},
                     as_stream(stream));
  });
}

void axpby(const TensorLists& lists, const AxpbyArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::axpby";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 3, {0, 1, 2}, {});
  if (args.found_inf == nullptr) detail::fail(kName, "found_inf is required");
  if (args.arg_to_check < -1 || args.arg_to_check > 1) {
    detail::fail(kName,
                 "arg_to_check must be -1, 0 or 1, got " + std::to_string(args.arg_to_check));
  }
  const bool check_x = args.arg_to_check != 1;
  const bool check_y = args.arg_to_check != 0;
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tx, auto ty) {
    detail::dispatch_dtype(kName, lists.dtype[2], [&](auto tout) {
      using TX = typename decltype(tx)::type;
      using TY = typename decltype(ty)::type;
      using TOut = typename decltype(tout)::type;
      const AxpbyOp<TX, TY, TOut> op{args.a, args.b, check_x, check_y, args.found_inf};
      detail::apply<3>(kName, lists, op, as_stream(stream));
    });
  });
}

void norm(const TensorLists& lists, const NormArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::norm";
  if (lists.num_tensors == 0) {  // the norm of no tensors is 0, as in the CPU backend
    if (args.total != nullptr) {
      detail::check_cuda(kName, cudaMemsetAsync(args.total, 0, sizeof(float), as_stream(stream)));
    }
    return;
  }
  detail::check_lists(kName, lists, 1, {0}, {});
  if (args.total == nullptr) detail::fail(kName, "total is required");
  switch (args.type) {
    case NormType::kL2:
      norm_typed<NormType::kL2>(lists, args, as_stream(stream));
      return;
    case NormType::kInf:
      norm_typed<NormType::kInf>(lists, args, as_stream(stream));
      return;
  }
  detail::fail(kName, "unknown norm type " + std::to_string(static_cast<int>(args.type)));
}

void check_finite(const TensorLists& lists, float* found_inf, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::check_finite";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 1, {0}, {});
  if (found_inf == nullptr) detail::fail(kName, "found_inf is required");
  detail::dispatch_dtype(kName, lists.dtype[0], [&](auto tag) {
    using T = typename decltype(tag)::type;
    detail::apply<1>(kName, lists, CheckFiniteOp<T>{found_inf}, as_stream(stream));
  });
}

void adam(const TensorLists& lists, const AdamArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::adam";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 5, {0, 1, 2, 3}, {2, 3, 4});
  AdamScalars s = {};
  s.lr = args.lr;
  s.beta1 = args.beta1;
  s.beta2 = args.beta2;
  s.eps = args.eps;
  s.weight_decay = args.weight_decay;
  const double bc1 = bias_correction(args.bias_correction, args.beta1, args.step);
  const double bc2 = bias_correction(args.bias_correction, args.beta2, args.step);
  s.bc1 = static_cast<float>(bc1);
  s.bc2 = static_cast<float>(bc2);
  s.step_size = static_cast<float>(args.lr / bc1);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.decay = static_cast<float>(1.0 - static_cast<double>(args.lr) * args.weight_decay);
  s.adam_w_mode = args.adam_w_mode;
  s.bias_correction = args.bias_correction;
  s.lr_ptr = args.lr_ptr;
  s.step_ptr = args.step_ptr;
  s.inv_scale = args.amp.inv_scale;
  s.found_inf = args.amp.found_inf;
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tp, auto tg) {
    using TP = typename decltype(tp)::type;
    using TG = typename decltype(tg)::type;
    detail::apply<5>(kName, lists, AdamOp<TP, TG>{s}, as_stream(stream));
  });
}

void sgd(const TensorLists& lists, const SgdArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::sgd";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 4, {0, 1}, {2, 3});
  if (args.momentum != 0.0f && lists.ptrs[2] == nullptr) {
    detail::fail(kName, "list 2 (momentum buffer) is required when momentum != 0");
  }
  SgdScalars s = {};
  s.lr = args.lr;
  s.momentum = args.momentum;
  s.dampening = args.dampening;
  s.weight_decay = args.weight_decay;
  s.nesterov = args.nesterov;
  s.wd_after_momentum = args.wd_after_momentum;
  s.first_run = args.first_run;
  s.inv_scale = args.amp.inv_scale;
  s.found_inf = args.amp.found_inf;
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tp, auto tg) {
    using TP = typename decltype(tp)::type;
    using TG = typename decltype(tg)::type;
    detail::apply<4>(kName, lists, SgdOp<TP, TG>{s}, as_stream(stream));
  });
}

void adagrad(const TensorLists& lists, const AdagradArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::adagrad";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 4, {0, 1, 2}, {2, 3});
  AdagradScalars s = {};
  s.lr = args.lr;
  s.eps = args.eps;
  s.weight_decay = args.weight_decay;
  s.decay = args.adagrad_w_mode
                ? static_cast<float>(1.0 - static_cast<double>(args.lr) * args.weight_decay)
                : 1.0f;
  s.adagrad_w_mode = args.adagrad_w_mode;
  s.inv_scale = args.amp.inv_scale;
  s.found_inf = args.amp.found_inf;
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tp, auto tg) {
    using TP = typename decltype(tp)::type;
    using TG = typename decltype(tg)::type;
    detail::apply<4>(kName, lists, AdagradOp<TP, TG>{s}, as_stream(stream));
  });
}

namespace {

LambScalars lamb_scalars(const LambArgs& args) {
  LambScalars s = {};
  s.lr = args.lr;
  s.beta1 = args.beta1;
  s.beta2 = args.beta2;
  s.beta3 = args.beta3;
  s.eps = args.eps;
  s.weight_decay = args.weight_decay;
  s.bc1 = args.bias_correction1;
  s.bc2 = args.bias_correction2;
  s.max_grad_norm = args.max_grad_norm;
  s.adam_w_mode = args.adam_w_mode;
  s.use_nvlamb = args.use_nvlamb;
  s.global_grad_norm = args.global_grad_norm;
  s.u_sumsq = args.u_sumsq;
  s.p_sumsq = args.p_sumsq;
  s.inv_scale = args.amp.inv_scale;
  s.found_inf = args.amp.found_inf;
  return s;
}

void check_lamb_sums(const char* name, const LambArgs& args) {
  if (args.u_sumsq == nullptr || args.p_sumsq == nullptr) {
    detail::fail(name, "u_sumsq and p_sumsq are required");
  }
}

}  // namespace

void lamb_stage1(const TensorLists& lists, const LambArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::lamb_stage1";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 5, {0, 1, 2, 3}, {2, 3, 4});
  check_lamb_sums(kName, args);
  if (args.max_grad_norm > 0.0f && args.global_grad_norm == nullptr) {
    detail::fail(kName, "global_grad_norm is required when max_grad_norm > 0");
  }
  const LambScalars s = lamb_scalars(args);
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tp, auto tg) {
    using TP = typename decltype(tp)::type;
    using TG = typename decltype(tg)::type;
    detail::apply<5>(kName, lists, LambStage1Op<TP, TG>{s}, as_stream(stream));
  });
}

void lamb_stage2(const TensorLists& lists, const LambArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::lamb_stage2";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 5, {0, 2, 3}, {2, 3, 4});
  check_lamb_sums(kName, args);
  const LambScalars s = lamb_scalars(args);
  detail::dispatch_dtype(kName, lists.dtype[0], [&](auto tp) {
    using TP = typename decltype(tp)::type;
    detail::apply<5>(kName, lists, LambStage2Op<TP>{s}, as_stream(stream));
  });
}

void novograd(const TensorLists& lists, const NovoGradArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::novograd";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 4, {0, 1, 2}, {2, 3});
  if (args.v == nullptr) detail::fail(kName, "v is required");
  NovoGradScalars s = {};
  s.lr = args.lr;
  s.beta1 = args.beta1;
  s.beta3 = args.beta3;
  s.eps = args.eps;
  s.weight_decay = args.weight_decay;
  s.bc1 = args.bias_correction1;
  s.bc2 = args.bias_correction2;
  s.reg_inside_moment = args.reg_inside_moment;
  s.v = args.v;
  s.inv_scale = args.amp.inv_scale;
  s.found_inf = args.amp.found_inf;
  detail::dispatch_dtypes(kName, lists.dtype[0], lists.dtype[1], [&](auto tp, auto tg) {
    using TP = typename decltype(tp)::type;
    using TG = typename decltype(tg)::type;
    detail::apply<4>(kName, lists, NovoGradOp<TP, TG>{s}, as_stream(stream));
  });
}

}  // namespace apex::kernels::cuda
