// CPU backend of SyncBatchNorm's per-channel pieces (kernels/batch_norm.h): blocks of values are
// widened to fp32 (the ISA table's vector conversions), summed in fp64, and merged (Chan) in a
// fixed order. Two walks over [outer, channels, inner]: channel by channel when each channel's
// runs are long (NC* input), and blocks of rows with one fp32 accumulator per channel when they
// are short (channels-last and [N, C] input).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernels/batch_norm.h"
#include "kernels/cpu/isa.h"
#include "kernels/cpu/parallel.h"

namespace apex::kernels::cpu {
namespace {

// Values widened to fp32 at a time (the block stays in L1).
constexpr int64_t kBlock = 2048;
// Sums are fp64, in this many independent lanes: a random-sign sum such as sum dy * (x - mean)
// cancels to far less than its terms, and fp32 accumulation (without the reassociation that
// -ffast-math would allow) left 1e-4 relative errors in dx where ATen's own CPU kernel, which
// accumulates in double, has none. The lanes keep the adds from waiting on one another.
constexpr int kLanes = 4;

// sum over j in [0, n) of f(j), in fp64 lanes combined in a fixed order.
template <typename F>
double lane_sum(int64_t n, F f) {
  double acc[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    for (int k = 0; k < kLanes; ++k) acc[k] += static_cast<double>(f(j + k));
  }
  for (int k = 0; j < n; ++j, ++k) acc[k] += static_cast<double>(f(j));
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}
// Channel runs at least this long are walked channel by channel.
constexpr int64_t kLongRun = 64;
// Blocks of rows are merged in this fixed number of groups at most (the order of the fp64
// merge, and so the result, does not depend on the thread count).
constexpr int64_t kMaxGroups = 64;

const MultiTensorKernels& table() { return *cpu_kernels().multi_tensor; }

// n values at src (stored as t) as fp32: src itself when it is fp32, else widened into buf.
const float* widen(const void* src, DType t, int64_t offset, int64_t n, float* buf) {
  const auto* base = static_cast<const char*>(src) + offset * dtype_size(t);
  if (t == DType::kFloat32) return reinterpret_cast<const float*>(base);
  table().to_float(base, t, buf, n);
  return buf;
}

// Chan's merge of (n_b, mean_b, m2_b) into (n, mean, m2).
inline void merge(double& n, double& mean, double& m2, double nb, double mb, double m2b) {
  if (nb <= 0) return;
  const double total = n + nb;
  const double delta = mb - mean;
  mean += delta * nb / total;
  m2 += m2b + delta * delta * n * nb / total;
  n = total;
}

int64_t channel_grain(int64_t per_channel) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, per_channel));
}

// Rows (of channels * inner values) per fp32 block of the short-run walk.
int64_t rows_per_block(const BatchNormShape& s) {
  return std::max<int64_t>(1, kBlock / std::max<int64_t>(1, s.channels * s.inner));
}

}  // namespace

void batch_norm_stats(const BatchNormStatsArgs& a) {
  const BatchNormShape& s = a.shape;
  const int64_t C = s.channels;
  for (int64_t c = 0; c < C; ++c) a.mean[c] = a.m2[c] = 0.0;
  if (s.outer <= 0 || s.inner <= 0 || C <= 0) return;
  if (s.inner >= kLongRun) {
    parallel_for(0, C, channel_grain(s.outer * s.inner), [&](int64_t c0, int64_t c1) {
      std::vector<float> buf(kBlock);
      for (int64_t c = c0; c < c1; ++c) {
        double n = 0, mean = 0, m2 = 0;
        for (int64_t o = 0; o < s.outer; ++o) {
          const int64_t run = (o * C + c) * s.inner;
          for (int64_t i = 0; i < s.inner; i += kBlock) {
            const int64_t len = std::min(kBlock, s.inner - i);
            const float* x = widen(a.x, a.dtype, run + i, len, buf.data());
            const double mb =
                lane_sum(len, [&](int64_t j) { return x[j]; }) / static_cast<double>(len);
            const double sq = lane_sum(len, [&](int64_t j) {
              const double d = static_cast<double>(x[j]) - mb;
              return d * d;
            });
            merge(n, mean, m2, static_cast<double>(len), mb, sq);
          }
        }
        a.mean[c] = mean;
        a.m2[c] = m2;
      }
    });
    return;
  }
  // Short runs: blocks of whole rows, one fp32 accumulator per channel.
  const int64_t rows = rows_per_block(s);
  const int64_t blocks = (s.outer + rows - 1) / rows;
  const int64_t groups = std::min(blocks, kMaxGroups);
  std::vector<double> gn(groups * C, 0.0), gmean(groups * C, 0.0), gm2(groups * C, 0.0);
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> buf(rows * C * s.inner);
    std::vector<double> sum(C), sq(C);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b0 = blocks * g / groups, b1 = blocks * (g + 1) / groups;
      for (int64_t b = b0; b < b1; ++b) {
        const int64_t r0 = b * rows, nr = std::min(rows, s.outer - r0);
        const float* x = widen(a.x, a.dtype, r0 * C * s.inner, nr * C * s.inner, buf.data());
        std::fill(sum.begin(), sum.end(), 0.0);
        std::fill(sq.begin(), sq.end(), 0.0);
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t i = 0; i < s.inner; ++i) {
            const float* row = x + r * C * s.inner + i;
            for (int64_t c = 0; c < C; ++c) sum[c] += row[c * s.inner];
          }
        }
        const double count = static_cast<double>(nr * s.inner);
        for (int64_t c = 0; c < C; ++c) sum[c] /= count;  // now the block's mean
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t i = 0; i < s.inner; ++i) {
            const float* row = x + r * C * s.inner + i;
            for (int64_t c = 0; c < C; ++c) {
              const double d = static_cast<double>(row[c * s.inner]) - sum[c];
              sq[c] += d * d;
            }
          }
        }
        for (int64_t c = 0; c < C; ++c) {
          merge(gn[g * C + c], gmean[g * C + c], gm2[g * C + c], count, sum[c], sq[c]);
        }
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    double n = 0, mean = 0, m2 = 0;
    for (int64_t g = 0; g < groups; ++g) {
      merge(n, mean, m2, gn[g * C + c], gmean[g * C + c], gm2[g * C + c]);
    }
    a.mean[c] = mean;
    a.m2[c] = m2;
  }
}

void batch_norm_elemt(const BatchNormElemtArgs& a) {
  const BatchNormShape& s = a.shape;
  const int64_t C = s.channels;
  if (s.outer <= 0 || s.inner <= 0 || C <= 0) return;
  const int64_t osize = dtype_size(a.out_dtype);
  // out[j] = a * (u[j] - m) + b * v[j] + k over n values of one channel (or per-channel vectors).
  if (s.inner >= kLongRun) {
    const int64_t runs = s.outer * C;
    parallel_for(0, runs, channel_grain(s.inner), [&](int64_t r0, int64_t r1) {
      std::vector<float> ub(kBlock), vb(kBlock), ob(kBlock);
      for (int64_t r = r0; r < r1; ++r) {
        const int64_t c = r % C;
        const float ca = a.a[c], cm = a.m[c], ck = a.k[c];
        const float cb = a.v != nullptr ? a.b[c] : 0.0f;
        for (int64_t i = 0; i < s.inner; i += kBlock) {
          const int64_t off = r * s.inner + i, len = std::min(kBlock, s.inner - i);
          const float* u = widen(a.u, a.u_dtype, off, len, ub.data());
          float* out = a.out_dtype == DType::kFloat32
                           ? reinterpret_cast<float*>(static_cast<char*>(a.out) + off * osize)
                           : ob.data();
          if (a.v != nullptr) {
            const float* v = widen(a.v, a.v_dtype, off, len, vb.data());
            for (int64_t j = 0; j < len; ++j) out[j] = ca * (u[j] - cm) + cb * v[j] + ck;
          } else {
            for (int64_t j = 0; j < len; ++j) out[j] = ca * (u[j] - cm) + ck;
          }
          if (a.out_dtype != DType::kFloat32) {
            table().from_float(out, a.out_dtype, static_cast<char*>(a.out) + off * osize, len);
          }
        }
      }
    });
    return;
  }
  const int64_t rows = rows_per_block(s);
  const int64_t blocks = (s.outer + rows - 1) / rows;
  const int64_t row_len = C * s.inner;
  parallel_for(0, blocks, std::max<int64_t>(1, 8), [&](int64_t b0, int64_t b1) {
    const int64_t cap = rows * row_len;
    std::vector<float> ub(cap), vb(cap), ob(cap);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t r0 = b * rows, nr = std::min(rows, s.outer - r0);
      const int64_t off = r0 * row_len, len = nr * row_len;
      const float* u = widen(a.u, a.u_dtype, off, len, ub.data());
      const float* v = a.v != nullptr ? widen(a.v, a.v_dtype, off, len, vb.data()) : nullptr;
      float* out = a.out_dtype == DType::kFloat32
                       ? reinterpret_cast<float*>(static_cast<char*>(a.out) + off * osize)
                       : ob.data();
      for (int64_t r = 0; r < nr; ++r) {
        for (int64_t i = 0; i < s.inner; ++i) {
          const int64_t base = r * row_len + i;
          if (v != nullptr) {
            for (int64_t c = 0; c < C; ++c) {
              const int64_t j = base + c * s.inner;
              out[j] = a.a[c] * (u[j] - a.m[c]) + a.b[c] * v[j] + a.k[c];
            }
          } else {
            for (int64_t c = 0; c < C; ++c) {
              const int64_t j = base + c * s.inner;
              out[j] = a.a[c] * (u[j] - a.m[c]) + a.k[c];
            }
          }
        }
      }
      if (a.out_dtype != DType::kFloat32) {
        table().from_float(out, a.out_dtype, static_cast<char*>(a.out) + off * osize, len);
      }
    }
  });
}

void batch_norm_backward_reduce(const BatchNormBackwardReduceArgs& a) {
  const BatchNormShape& s = a.shape;
  const int64_t C = s.channels;
  for (int64_t c = 0; c < C; ++c) a.sum_dy[c] = a.sum_dy_xmu[c] = 0.0;
  if (s.outer <= 0 || s.inner <= 0 || C <= 0) return;
  if (s.inner >= kLongRun) {
    parallel_for(0, C, channel_grain(s.outer * s.inner), [&](int64_t c0, int64_t c1) {
      std::vector<float> xb(kBlock), gb(kBlock);
      for (int64_t c = c0; c < c1; ++c) {
        double sd = 0, sdx = 0;
        const double m = a.mean[c];
        for (int64_t o = 0; o < s.outer; ++o) {
          const int64_t run = (o * C + c) * s.inner;
          for (int64_t i = 0; i < s.inner; i += kBlock) {
            const int64_t len = std::min(kBlock, s.inner - i);
            const float* x = widen(a.x, a.x_dtype, run + i, len, xb.data());
            const float* g = widen(a.dy, a.dy_dtype, run + i, len, gb.data());
            sd += lane_sum(len, [&](int64_t j) { return g[j]; });
            sdx += lane_sum(len, [&](int64_t j) {
              return static_cast<double>(g[j]) * (static_cast<double>(x[j]) - m);
            });
          }
        }
        a.sum_dy[c] = sd;
        a.sum_dy_xmu[c] = sdx;
      }
    });
    return;
  }
  const int64_t rows = rows_per_block(s);
  const int64_t blocks = (s.outer + rows - 1) / rows;
  const int64_t groups = std::min(blocks, kMaxGroups);
  const int64_t row_len = C * s.inner;
  std::vector<double> gs(groups * C, 0.0), gsx(groups * C, 0.0);
  parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    std::vector<float> xb(rows * row_len), gb(rows * row_len);
    std::vector<double> bs(C), bsx(C);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t k0 = blocks * g / groups, k1 = blocks * (g + 1) / groups;
      for (int64_t b = k0; b < k1; ++b) {
        const int64_t r0 = b * rows, nr = std::min(rows, s.outer - r0);
        const float* x = widen(a.x, a.x_dtype, r0 * row_len, nr * row_len, xb.data());
        const float* dy = widen(a.dy, a.dy_dtype, r0 * row_len, nr * row_len, gb.data());
        std::fill(bs.begin(), bs.end(), 0.0);
        std::fill(bsx.begin(), bsx.end(), 0.0);
        for (int64_t r = 0; r < nr; ++r) {
          for (int64_t i = 0; i < s.inner; ++i) {
            const int64_t base = r * row_len + i;
            for (int64_t c = 0; c < C; ++c) {
              const int64_t j = base + c * s.inner;
              bs[c] += dy[j];
              bsx[c] += static_cast<double>(dy[j]) * (static_cast<double>(x[j]) - a.mean[c]);
            }
          }
        }
        for (int64_t c = 0; c < C; ++c) {
          gs[g * C + c] += bs[c];
          gsx[g * C + c] += bsx[c];
        }
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    double sd = 0, sdx = 0;
    for (int64_t g = 0; g < groups; ++g) {
      sd += gs[g * C + c];
      sdx += gsx[g * C + c];
    }
    a.sum_dy[c] = sd;
    a.sum_dy_xmu[c] = sdx;
  }
}

}  // namespace apex::kernels::cpu
