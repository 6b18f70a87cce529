// The multi-tensor kernels of one instruction set (compiled once per ISA, see isa.h): scale,
// axpby, the reductions and the optimizer updates on one chunk each, and the conversions the
// norm drivers use. The math loops are plain fp32 loops over restrict pointers that the compiler
// vectorizes for the target ISA; fp16/bf16 storage is converted tile by tile into L1-resident
// fp32 buffers, so one math loop serves every dtype.
#include <cstring>

#include "kernels/cpu/vec.h"

namespace apex::kernels::cpu {
namespace {

// Tile walker: for each tile, the parameter the math works on (the master when `master` names a
// present list, else list 0) as fp32, then written back to every list that holds it.
struct ParamTile {
  float buf[kTile];
  float* p = nullptr;
  void begin(const Span& s, int master, int64_t off, int64_t n) {
    if (master >= 0 && s.p[master] != nullptr) {
      p = static_cast<float*>(s.p[master]) + off;
    } else {
      p = load(s.t[0], at(s.p[0], s.t[0], off), buf, n);
    }
  }
  void end(const Span& s, int64_t off, int64_t n) const {
    store(s.t[0], p, at(s.p[0], s.t[0], off), n);
  }
};

inline float* fp32_list(const Span& s, int l, int64_t off) {
  return static_cast<float*>(s.p[l]) + off;
}

// ---- primitives -------------------------------------------------------------------------------

bool any_non_finite(const float* __restrict x, int64_t n) {
  int bad = 0;
  for (int64_t i = 0; i < n; ++i) bad |= !(__builtin_fabsf(x[i]) <= kFloatMax);
  return bad != 0;
}

bool scale_chunk(const Span& s, float scale) {
  float in_buf[kTile];
  float out_buf[kTile];
  bool bad = false;
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    const float* x = load(s.t[0], at(s.p[0], s.t[0], off), in_buf, n);
    bad |= any_non_finite(x, n);
    float* y = s.t[1] == DType::kFloat32 ? fp32_list(s, 1, off) : out_buf;
    for (int64_t i = 0; i < n; ++i) y[i] = x[i] * scale;
    store(s.t[1], y, at(s.p[1], s.t[1], off), n);
  }
  return bad;
}

bool axpby_chunk(const Span& s, float a, float b, int arg_to_check) {
  float x_buf[kTile];
  float y_buf[kTile];
  float out_buf[kTile];
  bool bad = false;
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    const float* x = load(s.t[0], at(s.p[0], s.t[0], off), x_buf, n);
    const float* y = load(s.t[1], at(s.p[1], s.t[1], off), y_buf, n);
    if (arg_to_check == -1 || arg_to_check == 0) bad |= any_non_finite(x, n);
    if (arg_to_check == -1 || arg_to_check == 1) bad |= any_non_finite(y, n);
    float* out = s.t[2] == DType::kFloat32 ? fp32_list(s, 2, off) : out_buf;
    for (int64_t i = 0; i < n; ++i) out[i] = a * x[i] + b * y[i];
    store(s.t[2], out, at(s.p[2], s.t[2], off), n);
  }
  return bad;
}

bool non_finite_chunk(const Span& s) {
  float buf[kTile];
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    if (any_non_finite(load(s.t[0], at(s.p[0], s.t[0], off), buf, n), n)) return true;
  }
  return false;
}

// Sixteen independent fp32 lanes per tile (vectorizable without reassociation flags), summed
// into a double per tile: accurate and independent of the thread count.
double lane_sumsq(const float* __restrict x, int64_t n, float mul) {
  float acc[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    for (int j = 0; j < 16; ++j) {
      const float v = x[i + j] * mul;
      acc[j] += v * v;
    }
  }
  for (; i < n; ++i) {
    const float v = x[i] * mul;
    acc[0] += v * v;
  }
  double total = 0.0;
  for (float a : acc) total += a;
  return total;
}

double sumsq_chunk(const Span& s, float mul) {
  float buf[kTile];
  double total = 0.0;
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    total += lane_sumsq(load(s.t[0], at(s.p[0], s.t[0], off), buf, n), n, mul);
  }
  return total;
}

// NaN is sticky: once a lane holds NaN no comparison replaces it.
float absmax_chunk(const Span& s, float mul) {
  float buf[kTile];
  float acc[16] = {};
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    const float* x = load(s.t[0], at(s.p[0], s.t[0], off), buf, n);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) {
      for (int j = 0; j < 16; ++j) {
        const float v = __builtin_fabsf(x[i + j] * mul);
        acc[j] = (v > acc[j] || v != v) ? v : acc[j];
      }
    }
    for (; i < n; ++i) {
      const float v = __builtin_fabsf(x[i] * mul);
      acc[0] = (v > acc[0] || v != v) ? v : acc[0];
    }
  }
  float m = 0.0f;
  for (float a : acc) {
    if (a != a) return a;
    m = a > m ? a : m;
  }
  return m;
}

// ---- optimizers -------------------------------------------------------------------------------

// Gradient tile `g` (fp32 values of list 1 at `off`) written back as g * unscale.
void write_unscaled(const Span& s, const float* g, int64_t off, int64_t n, float unscale) {
  if (s.t[1] == DType::kFloat32) {  // `g` is the gradient's own memory: in place
    float* __restrict gp = fp32_list(s, 1, off);
    for (int64_t i = 0; i < n; ++i) gp[i] *= unscale;
    return;
  }
  float u_buf[kTile];
  float* __restrict u = u_buf;
  for (int64_t i = 0; i < n; ++i) u[i] = g[i] * unscale;
  store(s.t[1], u, at(s.p[1], s.t[1], off), n);
}

// The walk every optimizer shares: per tile, the parameter as fp32 (the master when present),
// the gradient as fp32 (when `with_grad`), fn(p, g, offset, n), then the parameter written back.
// With `unscale` != 0 the tile's gradient, still in L1, is written back as g * unscale after the
// math read it (GradScaler's contract: gradients unscaled after the step), so the math and its
// results are the same either way.
template <class Fn>
void for_each_param_tile(const Span& s, int master, bool with_grad, const Fn& fn,
                         float unscale = 0.0f) {
  ParamTile pt;
  float g_buf[kTile];
  for (int64_t off = 0; off < s.n; off += kTile) {
    const int64_t n = s.n - off < kTile ? s.n - off : kTile;
    pt.begin(s, master, off, n);
    const float* g = with_grad ? load(s.t[1], at(s.p[1], s.t[1], off), g_buf, n) : nullptr;
    fn(pt.p, g, off, n);
    pt.end(s, off, n);
    if (with_grad && unscale != 0.0f) write_unscaled(s, g, off, n, unscale);
  }
}

void adam_math(float* __restrict p, const float* __restrict g, float* __restrict m,
               float* __restrict v, int64_t n, const AdamChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float gi = g[i] * a.inv + a.l2 * pi;
    const float mi = m[i] * a.beta1 + a.one_minus_beta1 * gi;
    const float vi = v[i] * a.beta2 + a.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    const float denom = __builtin_sqrtf(vi) * (1.0f / a.bc2_sqrt) + a.eps;
    p[i] = pi * a.decay - a.step_size * (mi / denom);
  }
}

void adam_chunk(const Span& s, const AdamChunk& a) {
  for_each_param_tile(
      s, 4, true,
      [&](float* p, const float* g, int64_t off, int64_t n) {
        adam_math(p, g, fp32_list(s, 2, off), fp32_list(s, 3, off), n, a);
      },
      a.unscale);
}

// The common case (momentum buffer already seeded) in one loop: g, buf and p are each touched
// once per element.
template <bool kNesterov>
void sgd_momentum_math(float* __restrict p, const float* __restrict g, float* __restrict buf,
                       int64_t n, const SgdChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float gi = g[i] * a.inv + a.wd_before * pi;
    const float b = a.momentum * buf[i] + a.one_minus_dampening * gi;
    buf[i] = b;
    const float d = kNesterov ? gi + a.momentum * b : b;
    p[i] = pi - a.lr * (d + a.wd_after * pi);
  }
}

// No momentum, or the first step, which seeds the buffer with the gradient.
void sgd_plain_math(float* __restrict p, const float* __restrict g, float* __restrict buf,
                    int64_t n, const SgdChunk& a) {
  float d_buf[kTile];
  float* __restrict d = d_buf;
  for (int64_t i = 0; i < n; ++i) d[i] = g[i] * a.inv + a.wd_before * p[i];
  if (a.has_momentum) {
    for (int64_t i = 0; i < n; ++i) buf[i] = d[i];
    if (a.nesterov) {
      for (int64_t i = 0; i < n; ++i) d[i] = d[i] + a.momentum * buf[i];
    }
  }
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - a.lr * (d[i] + a.wd_after * p[i]);
}

void sgd_chunk(const Span& s, const SgdChunk& a) {
  for_each_param_tile(
      s, 3, true,
      [&](float* p, const float* g, int64_t off, int64_t n) {
        float* buf = a.has_momentum ? fp32_list(s, 2, off) : nullptr;
        if (!a.has_momentum || a.first_run) {
          sgd_plain_math(p, g, buf, n, a);
        } else if (a.nesterov) {
          sgd_momentum_math<true>(p, g, buf, n, a);
        } else {
          sgd_momentum_math<false>(p, g, buf, n, a);
        }
      },
      a.unscale);
}

void adagrad_math(float* __restrict p, const float* __restrict g, float* __restrict h, int64_t n,
                  const AdagradChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float pi = p[i];
    const float gi = g[i] * a.inv + a.l2 * pi;
    const float hi = h[i] + gi * gi;
    h[i] = hi;
    p[i] = pi * a.decay - a.lr * (gi / (__builtin_sqrtf(hi) + a.eps));
  }
}

void adagrad_chunk(const Span& s, const AdagradChunk& a) {
  for_each_param_tile(
      s, 3, true,
      [&](float* p, const float* g, int64_t off, int64_t n) {
        adagrad_math(p, g, fp32_list(s, 2, off), n, a);
      },
      a.unscale);
}

inline float lamb_update(float m, float v, float p, const LambChunk& a) {
  return (m / a.bc1) / (__builtin_sqrtf(v / a.bc2) + a.eps) + a.wd_update * p;
}

void lamb_stage1_math(const float* __restrict p, const float* __restrict g, float* __restrict m,
                      float* __restrict v, float* __restrict u, int64_t n, const LambChunk& a) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i] * a.g_mul + a.l2 * p[i];
    const float mi = a.beta1 * m[i] + a.beta3 * gi;
    const float vi = a.beta2 * v[i] + a.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    u[i] = lamb_update(mi, vi, p[i], a);
  }
}

void lamb_stage1_chunk(const Span& s, const LambChunk& a, double* u_sumsq, double* p_sumsq) {
  double u_total = 0.0;
  double p_total = 0.0;
  for_each_param_tile(
      s, 4, true,
      [&](float* p, const float* g, int64_t off, int64_t n) {
        float u[kTile];
        lamb_stage1_math(p, g, fp32_list(s, 2, off), fp32_list(s, 3, off), u, n, a);
        u_total += lane_sumsq(u, n, 1.0f);
        p_total += lane_sumsq(p, n, 1.0f);
      },
      a.unscale);
  *u_sumsq = u_total;
  *p_sumsq = p_total;
}

void lamb_stage2_math(float* __restrict p, const float* __restrict m, const float* __restrict v,
                      int64_t n, const LambChunk& a, float ratio) {
  for (int64_t i = 0; i < n; ++i) p[i] = p[i] - ratio * lamb_update(m[i], v[i], p[i], a);
}

void lamb_stage2_chunk(const Span& s, const LambChunk& a, float ratio) {
  for_each_param_tile(s, 4, false, [&](float* p, const float*, int64_t off, int64_t n) {
    lamb_stage2_math(p, fp32_list(s, 2, off), fp32_list(s, 3, off), n, a, ratio);
  });
}

void novograd_math(float* __restrict p, const float* __restrict g, float* __restrict m, int64_t n,
                   const NovoGradChunk& a) {
  if (a.reg_inside_moment) {
    for (int64_t i = 0; i < n; ++i) {
      const float gi = (g[i] * a.inv) / a.denom + a.wd * p[i];
      const float mi = a.beta1 * m[i] + a.beta3 * gi;
      m[i] = mi;
      p[i] = p[i] - a.lr * (mi / a.bc1);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      const float mi = a.beta1 * m[i] + a.beta3 * (g[i] * a.inv);
      m[i] = mi;
      p[i] = p[i] - a.lr * ((mi / a.bc1) / a.denom + a.wd * p[i]);
    }
  }
}

void novograd_chunk(const Span& s, const NovoGradChunk& a) {
  for_each_param_tile(
      s, 3, true,
      [&](float* p, const float* g, int64_t off, int64_t n) {
        novograd_math(p, g, fp32_list(s, 2, off), n, a);
      },
      a.unscale);
}

void from_float_values(const float* src, DType t, void* dst, int64_t n) { store(t, src, dst, n); }

void to_float_values(const void* src, DType t, float* dst, int64_t n) {
  const float* p = load(t, const_cast<void*>(src), dst, n);
  if (p != dst) std::memcpy(dst, p, static_cast<size_t>(n) * sizeof(float));
}

}  // namespace

const MultiTensorKernels& APEX_CAT(multi_tensor_kernels_, APEX_CPU_ISA)() {
  static constexpr MultiTensorKernels kTable = {
      .scale = scale_chunk,
      .axpby = axpby_chunk,
      .non_finite = non_finite_chunk,
      .sumsq = sumsq_chunk,
      .absmax = absmax_chunk,
      .adam = adam_chunk,
      .sgd = sgd_chunk,
      .adagrad = adagrad_chunk,
      .lamb_stage1 = lamb_stage1_chunk,
      .lamb_stage2 = lamb_stage2_chunk,
      .novograd = novograd_chunk,
      .to_float = to_float_values,
      .from_float = from_float_values,
  };
  return kTable;
}

}  // namespace apex::kernels::cpu
