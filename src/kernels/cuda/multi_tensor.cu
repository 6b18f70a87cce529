// CUDA backend of the multi-tensor kernels declared in kernels/multi_tensor.h. Each operation is
// a functor run by the apply engine (multi_tensor_apply.cuh) on every chunk of its tensor lists;
// the math follows the header's comments, in fp32 registers whatever the storage dtype.
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>

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

__device__ __forceinline__ float value_or(const float* p, float fallback) {
  return p != nullptr ? *p : fallback;
}

// ---------------------------------------------------------------------------------------------
// Element-wise ops: the lists a kernel reads and writes, and the frame loop over them
// ---------------------------------------------------------------------------------------------

/// A list the element-wise math reads (kRead, else its registers start at 0) and/or writes
/// (kWrite), stored as T (const T when only read).
template <typename T, bool kRead, bool kWrite>
struct ListIo {
  T* ptr;

  __device__ __forceinline__ bool aligned() const { return detail::is_aligned(ptr); }
  __device__ __forceinline__ void load(float (&r)[kILP], const Frame& f) const {
    if constexpr (kRead) detail::load(r, ptr, f);
  }
  __device__ __forceinline__ void store(const float (&r)[kILP], const Frame& f) const {
    if constexpr (kWrite) detail::store(ptr, r, f);
  }
};

template <typename T, int D>
__device__ __forceinline__ ListIo<const T, true, false> in(const Chunk<D>& c, int list) {
  return {c.template ptr<const T>(list)};
}
template <typename T, int D>
__device__ __forceinline__ ListIo<T, false, true> out(const Chunk<D>& c, int list) {
  return {c.template ptr<T>(list)};
}
template <typename T, int D>
__device__ __forceinline__ ListIo<T, true, true> in_out(const Chunk<D>& c, int list) {
  return {c.template ptr<T>(list)};
}

/// An optimizer's gradient list (1): read; stored back (what the math leaves in the lane: the
/// unscaled gradient) only when `write` (AmpArgs::unscale_grads), so that without it the kernel
/// moves exactly the bytes it did.
template <typename TG>
struct GradIo {
  TG* ptr;
  bool write;

  __device__ __forceinline__ bool aligned() const { return detail::is_aligned(ptr); }
  __device__ __forceinline__ void load(float (&r)[kILP], const Frame& f) const {
    detail::load(r, ptr, f);
  }
  __device__ __forceinline__ void store(const float (&r)[kILP], const Frame& f) const {
    if (write) detail::store(ptr, r, f);
  }
};
template <typename TG, int D>
__device__ __forceinline__ GradIo<TG> grad_io(const Chunk<D>& c, const AmpArgs& amp) {
  return {c.template ptr<TG>(1), amp.unscale_grads && amp.inv_scale != nullptr};
}

/// The parameter of an optimizer (list 0) and its optional fp32 master (list `master_list`): the
/// math reads the master when present, else the model param; with kWrite the result is stored
/// to the master (when present) and, rounded, to the model param.
template <typename TP, bool kWrite>
struct ParamIo {
  std::conditional_t<kWrite, TP, const TP>* p;
  std::conditional_t<kWrite, float, const float>* master;

  template <int D>
  __device__ __forceinline__ ParamIo(const Chunk<D>& c, int master_list)
      : p(c.template ptr<TP>(0)), master(c.template ptr<float>(master_list)) {}

  __device__ __forceinline__ bool aligned() const {
    return detail::is_aligned(p) && detail::is_aligned(master);
  }
  __device__ __forceinline__ void load(float (&r)[kILP], const Frame& f) const {
    if (master != nullptr) {
      detail::load(r, master, f);
    } else {
      detail::load(r, p, f);
    }
  }
  __device__ __forceinline__ void store(const float (&r)[kILP], const Frame& f) const {
    if constexpr (kWrite) {
      if (master != nullptr) detail::store(master, r, f);
      detail::store(p, r, f);
    }
  }
};

template <class Math, std::size_t... K, class... Lists>
__device__ __forceinline__ void run_frame(const Frame& f, Math& math, std::index_sequence<K...>,
                                          const Lists&... lists) {
  float r[sizeof...(Lists)][kILP] = {};
  (lists.load(r[K], f), ...);
#pragma unroll
  for (int i = 0; i < kILP; ++i) math(i < f.count, r[K][i]...);
  (lists.store(r[K], f), ...);
}

/// For each frame of this thread in a chunk of n elements: loads every list, calls
/// math(live, x...) on each of the kILP lanes with x the lane's value of each list (by reference;
/// live is false for lanes past the end of the chunk, which are computed but not stored), then
/// stores the lists that are written. Vector accesses are used when every list is aligned.
template <class Math, class... Lists>
__device__ __forceinline__ void for_each_element(int n, Math&& math, const Lists&... lists) {
  const bool aligned = (lists.aligned() && ...);
  detail::for_each_frame(n, aligned, [&](const Frame& f) {
    run_frame(f, math, std::index_sequence_for<Lists...>{}, lists...);
  });
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
    bool bad = false;
    for_each_element(
        c.n,
        [&](bool live, float& x, float& y) {
          if (live && !isfinite(x)) bad = true;
          y = x * scale;
        },
        in<TIn>(c, 0), out<TOut>(c, 1));
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
    bool bad = false;
    for_each_element(
        c.n,
        [&](bool live, float& x, float& y, float& o) {
          if (live && ((check_x && !isfinite(x)) || (check_y && !isfinite(y)))) bad = true;
          o = a * x + b * y;
        },
        in<TX>(c, 0), in<TY>(c, 1), out<TOut>(c, 2));
    if (bad) *found_inf = 1.0f;
  }
};

template <typename T>
struct CheckFiniteOp {
  float* found_inf;

  __device__ void operator()(const Chunk<1>& c) const {
    bool bad = false;
    for_each_element(
        c.n,
        [&](bool live, float& x) {
          if (live && !isfinite(x)) bad = true;
        },
        in<T>(c, 0));
    if (bad) *found_inf = 1.0f;
  }
};

// ---------------------------------------------------------------------------------------------
// norm: one partial// norm: one partial per chunk (sum of squares or NaN-aware max of |x|), then
// cleanup kernels
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
    const float s = value_or(inv_scale, 1.0f);
    float acc[1] = {0.0f};
    for_each_element(
        c.n,
        [&](bool live, float& x) {
          if (live) acc[0] = Traits::accumulate(acc[0], x * s);
        },
        in<T>(c, 0));
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
// Optimizers: each op holds its Args (and values derived from them on the host), leaves
// everything unchanged when AmpArgs::found_inf is set, and runs its per-element math over
// ParamIo (list 0 and the master) and its gradient and state lists.
// ---------------------------------------------------------------------------------------------

/// Whether a non-finite gradient was found: the step changes nothing.
__device__ __forceinline__ bool overflow(const AmpArgs& amp) {
  return amp.found_inf != nullptr && *amp.found_inf != 0.0f;
}

/// The AmpArgs skip: on overflow the optimizer changes nothing, but for unscaling the gradients
/// when asked (as GradScaler's unscale_ would have).
template <typename TG, int D>
__device__ __forceinline__ bool skip_step(const AmpArgs& amp, const Chunk<D>& c) {
  if (!overflow(amp)) return false;
  const GradIo<TG> g = grad_io<TG>(c, amp);
  if (g.write) {
    const float inv = *amp.inv_scale;
    for_each_element(
        c.n, [&](bool, float& x) { x = x * inv; }, g);
  }
  return true;
}

/// From args.lr and args.step, computed on the host in double like the CPU backend; the kernel
/// recomputes them in fp32 in capturable mode.
struct AdamHost {
  float bc1;  ///< from args.step, used when step_ptr is null
  float bc2;
  float step_size;  ///< lr / bc1
  float bc2_sqrt;
  float decay;  ///< 1 - lr*wd
};

template <typename TP, typename TG>
struct AdamOp {
  AdamArgs s;
  AdamHost h;

  __device__ void operator()(const Chunk<5>& c) const {
    if (skip_step<TG>(s.amp, c)) return;
    float step_size = h.step_size;
    float bc2_sqrt = h.bc2_sqrt;
    float decay = h.decay;
    if (s.lr_ptr != nullptr || s.step_ptr != nullptr) {  // capturable: read lr and step here
      const float lr = value_or(s.lr_ptr, s.lr);
      float bc1 = h.bc1;
      float bc2 = h.bc2;
      if (s.step_ptr != nullptr && s.bias_correction) {
        const float step = *s.step_ptr;
        bc1 = 1.0f - powf(s.beta1, step);
        bc2 = 1.0f - powf(s.beta2, step);
      }
      step_size = lr / bc1;
      bc2_sqrt = sqrtf(bc2);
      decay = 1.0f - lr * s.weight_decay;
    }
    const float g_scale = value_or(s.amp.inv_scale, 1.0f);
    for_each_element(
        c.n,
        [&](bool, float& p, float& g, float& m, float& v) {
          float gi = g * g_scale;
          g = gi;  // stored back only under unscale_grads
          float pi = p;
          if (s.weight_decay != 0.0f) {
            if (s.adam_w_mode) {
              pi = pi * decay;
            } else {
              gi = gi + s.weight_decay * pi;
            }
          }
          m = s.beta1 * m + (1.0f - s.beta1) * gi;
          v = s.beta2 * v + (1.0f - s.beta2) * gi * gi;
          // torch's addcdiv order: p - step_size * (m / denom)
          p = pi - step_size * (m / (sqrtf(v) / bc2_sqrt + s.eps));
        },
        ParamIo<TP, true>(c, 4), grad_io<TG>(c, s.amp), in_out<float>(c, 2), in_out<float>(c, 3));
  }
};

template <typename TP, typename TG>
struct SgdOp {
  SgdArgs s;

  __device__ void operator()(const Chunk<4>& c) const {
    if (skip_step<TG>(s.amp, c)) return;
    const float g_scale = value_or(s.amp.inv_scale, 1.0f);
    const bool use_momentum = s.momentum != 0.0f;  // the buffer list is present then
    const GradIo<TG> grad = grad_io<TG>(c, s.amp);
    // A frame loop of its own: through for_each_element the conditional buffer load made the
    // compiler emit different code for this op, so this loop keeps SGD's generated math as it was.
    const ParamIo<TP, true> param(c, 3);
    const TG* g = c.ptr<const TG>(1);
    float* buf = c.ptr<float>(2);
    const bool aligned = param.aligned() && detail::is_aligned(g) && detail::is_aligned(buf);
    detail::for_each_frame(c.n, aligned, [&](const Frame& f) {
      float rp[kILP];
      float rg[kILP];
      float rb[kILP] = {};
      param.load(rp, f);
      detail::load(rg, g, f);
      if (use_momentum && !s.first_run) detail::load(rb, buf, f);
#pragma unroll
      for (int i = 0; i < kILP; ++i) {
        float gi = rg[i] * g_scale;
        rg[i] = gi;  // stored back only under unscale_grads
        const float pi = rp[i];
        if (s.weight_decay != 0.0f && !s.wd_after_momentum) gi = gi + s.weight_decay * pi;
        if (use_momentum) {
          rb[i] = s.first_run ? gi : s.momentum * rb[i] + (1.0f - s.dampening) * gi;
          gi = s.nesterov ? gi + s.momentum * rb[i] : rb[i];
        }
        if (s.weight_decay != 0.0f && s.wd_after_momentum) gi = gi + s.weight_decay * pi;
        rp[i] = pi - s.lr * gi;
      }
      param.store(rp, f);
      if (use_momentum) detail::store(buf, rb, f);
      grad.store(rg, f);
    });
  }
};

template <typename TP, typename TG>
struct AdagradOp {
  AdagradArgs s;
  float decay;  ///< 1 - lr*wd in w mode (computed in double on the host), else 1

  __device__ void operator()(const Chunk<4>& c) const {
    if (skip_step<TG>(s.amp, c)) return;
    const float g_scale = value_or(s.amp.inv_scale, 1.0f);
    for_each_element(
        c.n,
        [&](bool, float& p, float& g, float& h) {
          float gi = g * g_scale;
          g = gi;  // stored back only under unscale_grads
          const float pi = p;
          if (!s.adagrad_w_mode && s.weight_decay != 0.0f) gi = gi + s.weight_decay * pi;
          h = h + gi * gi;
          // w mode: p -= lr*wd*p folded into p*(1 - lr*wd)
          p = pi * decay - s.lr * (gi / (sqrtf(h) + s.eps));
        },
        ParamIo<TP, true>(c, 3), grad_io<TG>(c, s.amp), in_out<float>(c, 2));
  }
};

/// LAMB's u = (m/bc1) / (sqrt(v/bc2) + eps) [+ wd*p]. Every operation is explicitly rounded so
/// that the compiler cannot contract it differently in the two stages: stage 2 recomputes
/// exactly the u whose squares stage 1 summed.
__device__ __forceinline__ float lamb_update(float m, float v, float p, const LambArgs& s) {
  float u = __fdiv_rn(__fdiv_rn(m, s.bias_correction1),
                      __fadd_rn(__fsqrt_rn(__fdiv_rn(v, s.bias_correction2)), s.eps));
  if (s.adam_w_mode && s.weight_decay != 0.0f) u = __fadd_rn(u, __fmul_rn(s.weight_decay, p));
  return u;
}

template <typename TP, typename TG>
struct LambStage1Op {
  LambArgs s;

  __device__ void operator()(const Chunk<5>& c) const {
    if (skip_step<TG>(s.amp, c)) return;
    float clip = 1.0f;
    if (s.max_grad_norm > 0.0f && s.global_grad_norm != nullptr) {
      const float gnorm = *s.global_grad_norm;
      if (gnorm > s.max_grad_norm) clip = gnorm / s.max_grad_norm;
    }
    const float inv = value_or(s.amp.inv_scale, 1.0f);
    const float g_mul = inv / clip;
    float sums[2] = {0.0f, 0.0f};  // u*u, p*p
    for_each_element(
        c.n,
        [&](bool live, float& p, float& g, float& m, float& v) {
          float gi = g * g_mul;
          g = g * inv;  // unscaled, not clipped; stored back only under unscale_grads
          if (!s.adam_w_mode && s.weight_decay != 0.0f) gi = gi + s.weight_decay * p;
          m = s.beta1 * m + s.beta3 * gi;
          v = s.beta2 * v + (1.0f - s.beta2) * gi * gi;
          if (live) {
            const float u = lamb_update(m, v, p, s);
            sums[0] += u * u;
            sums[1] += p * p;
          }
        },
        ParamIo<TP, false>(c, 4), grad_io<TG>(c, s.amp), in_out<float>(c, 2), in_out<float>(c, 3));
    detail::block_reduce(sums, detail::SumOp{});
    if (threadIdx.x == 0) {
      atomicAdd(s.u_sumsq + c.tensor, sums[0]);
      atomicAdd(s.p_sumsq + c.tensor, sums[1]);
    }
  }
};

template <typename TP>
struct LambStage2Op {
  LambArgs s;

  __device__ void operator()(const Chunk<5>& c) const {
    if (overflow(s.amp)) return;  // (stage 1 unscaled the gradients, skipped or not)
    const float p_norm = sqrtf(s.p_sumsq[c.tensor]);
    const float u_norm = sqrtf(s.u_sumsq[c.tensor]);
    const bool adapt = (s.use_nvlamb || s.weight_decay != 0.0f) && p_norm != 0.0f && u_norm != 0.0f;
    const float ratio = adapt ? s.lr * (p_norm / u_norm) : s.lr;
    // list 1 (the gradients) is not read
    for_each_element(
        c.n, [&](bool, float& p, float& m, float& v) { p = p - ratio * lamb_update(m, v, p, s); },
        ParamIo<TP, true>(c, 4), in<float>(c, 2), in<float>(c, 3));
  }
};

template <typename TP, typename TG>
struct NovoGradOp {
  NovoGradArgs s;

  __device__ void operator()(const Chunk<4>& c) const {
    if (skip_step<TG>(s.amp, c)) return;
    const float d = s.v[c.tensor] / s.bias_correction2 + s.eps;
    const float g_scale = value_or(s.amp.inv_scale, 1.0f);
    for_each_element(
        c.n,
        [&](bool, float& p, float& g, float& m) {
          float gi = g * g_scale;
          g = gi;  // stored back only under unscale_grads
          const float pi = p;
          if (s.reg_inside_moment) {
            gi = gi / d;
            if (s.weight_decay != 0.0f) gi = gi + s.weight_decay * pi;
            m = s.beta1 * m + s.beta3 * gi;
            p = pi - s.lr * (m / s.bias_correction1);
          } else {
            m = s.beta1 * m + s.beta3 * gi;
            float update = (m / s.bias_correction1) / d;
            if (s.weight_decay != 0.0f) update = update + s.weight_decay * pi;
            p = pi - s.lr * update;
          }
        },
        ParamIo<TP, true>(c, 3), grad_io<TG>(c, s.amp), in_out<float>(c, 2));
  }
};

/// Runs Op<TP, TG>{fields...} on lists 0..Depth-1, TP and TG the storage types of lists 0 and 1.
template <template <typename, typename> class Op, int Depth, typename... Fields>
void apply_pg(const char* name, const TensorLists& lists, void* stream, const Fields&... fields) {
  detail::dispatch_dtypes(name, lists.dtype[0], lists.dtype[1], [&](auto tp, auto tg) {
    using TP = typename decltype(tp)::type;
    using TG = typename decltype(tg)::type;
    detail::apply<Depth>(name, lists, Op<TP, TG>{fields...}, as_stream(stream));
  });
}

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
  const double bc1 = bias_correction(args.bias_correction, args.beta1, args.step);
  const double bc2 = bias_correction(args.bias_correction, args.beta2, args.step);
  AdamHost h = {};
  h.bc1 = static_cast<float>(bc1);
  h.bc2 = static_cast<float>(bc2);
  h.step_size = static_cast<float>(args.lr / bc1);
  h.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  h.decay = static_cast<float>(1.0 - static_cast<double>(args.lr) * args.weight_decay);
  apply_pg<AdamOp, 5>(kName, lists, stream, args, h);
}

void sgd(const TensorLists& lists, const SgdArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::sgd";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 4, {0, 1}, {2, 3});
  if (args.momentum != 0.0f && lists.ptrs[2] == nullptr) {
    detail::fail(kName, "list 2 (momentum buffer) is required when momentum != 0");
  }
  apply_pg<SgdOp, 4>(kName, lists, stream, args);
}

void adagrad(const TensorLists& lists, const AdagradArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::adagrad";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 4, {0, 1, 2}, {2, 3});
  const float decay =
      args.adagrad_w_mode
          ? static_cast<float>(1.0 - static_cast<double>(args.lr) * args.weight_decay)
          : 1.0f;
  apply_pg<AdagradOp, 4>(kName, lists, stream, args, decay);
}

namespace {

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
  apply_pg<LambStage1Op, 5>(kName, lists, stream, args);
}

void lamb_stage2(const TensorLists& lists, const LambArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::lamb_stage2";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 5, {0, 2, 3}, {2, 3, 4});
  check_lamb_sums(kName, args);
  detail::dispatch_dtype(kName, lists.dtype[0], [&](auto tp) {
    using TP = typename decltype(tp)::type;
    detail::apply<5>(kName, lists, LambStage2Op<TP>{args}, as_stream(stream));
  });
}

void novograd(const TensorLists& lists, const NovoGradArgs& args, void* stream) {
  constexpr const char* kName = "apex::kernels::cuda::novograd";
  if (lists.num_tensors == 0) return;
  detail::check_lists(kName, lists, 4, {0, 1, 2}, {2, 3});
  if (args.v == nullptr) detail::fail(kName, "v is required");
  apply_pg<NovoGradOp, 4>(kName, lists, stream, args);
}

}  // namespace apex::kernels::cuda
