// apex-bench half: the ops of amp's CPU half-precision route (apex/amp/cpu_half.h) in bf16 and
// fp16, inside a CpuHalfFallbackGuard (ours) against the same op on LibTorch's own half kernels
// (the peer) and in fp32 (what the route must not be slower than), in the same run. Shapes from
// the models apex-train trains. LibTorch's half path is a scalar loop on AVX2-only CPUs (tens of
// times slower): there it is timed on a few runs only, so that the area ends in bounded time.
#include <ATen/Parallel.h>
#include <apex/amp/cpu_half.h>
#include <apex/amp/utils.h>
#include <apex/io.h>
#include <malloc.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <sstream>

#include "bench_common.h"

namespace apex::bench {
namespace {

struct Case {
  const char* name;
  const char* what;
  std::vector<at::ScalarType> dtypes;
  double flops;  // of one run (0: elementwise)
  // One run in `dtype` on fresh-per-case inputs; returns something to keep alive.
  std::function<std::function<void()>(at::ScalarType)> make;
};

at::Tensor input(at::IntArrayRef sizes, at::ScalarType t, uint64_t seed, bool grad = false) {
  auto gen = at::detail::createCPUGenerator(seed);
  at::Tensor x = at::randn(sizes, gen).to(t);
  return grad ? x.requires_grad_() : x;
}

// One run: op() forward, then backward from g into fresh gradients of `leaves` (accumulating into
// the last run's would add an elementwise add of the dtype to every run).
std::function<void()> fwd_bwd(std::vector<at::Tensor> leaves, at::Tensor g,
                              std::function<at::Tensor()> op) {
  return [leaves = std::move(leaves), g = std::move(g), op = std::move(op)] {
    for (const at::Tensor& t : leaves) t.mutable_grad().reset();
    op().backward(g);
  };
}

std::vector<Case> cases() {
  const std::vector<at::ScalarType> both{at::kBFloat16, at::kHalf};
  const std::vector<at::ScalarType> bf16{at::kBFloat16};
  return {
      {"mm", "mm 2048x256 @ 256x1024", both, 2.0 * 2048 * 256 * 1024,
       [](at::ScalarType t) {
         const at::Tensor a = input({2048, 256}, t, 1);
         const at::Tensor b = input({256, 1024}, t, 2);
         return std::function<void()>([a, b] { at::mm(a, b); });
       }},
      {"linear", "linear 64x64x256 -> 1024, fwd+bwd", both, 3 * 2.0 * 4096 * 256 * 1024,
       [](at::ScalarType t) {
         const at::Tensor x = input({64, 64, 256}, t, 3, true);
         const at::Tensor w = input({1024, 256}, t, 4, true);
         const at::Tensor b = input({1024}, t, 5, true);
         return fwd_bwd({x, w, b}, input({64, 64, 1024}, t, 6),
                        [=] { return at::linear(x, w, b); });
       }},
      {"conv2d", "conv2d 3x3 32x64x32x32, fwd+bwd", both, 3 * 2.0 * 32 * 64 * 32 * 32 * 64 * 9,
       [](at::ScalarType t) {
         const at::Tensor x = input({32, 64, 32, 32}, t, 7, true);
         const at::Tensor w = input({64, 64, 3, 3}, t, 8, true);
         return fwd_bwd({x, w}, input({32, 64, 32, 32}, t, 9),
                        [=] { return at::conv2d(x, w, {}, 1, 1); });
       }},
      {"conv1d", "conv1d k3 s2 64x64x799 (wav2vec2), fwd+bwd", both,
       3 * 2.0 * 64 * 64 * 399 * 64 * 3,
       [](at::ScalarType t) {
         const at::Tensor x = input({64, 64, 799}, t, 10, true);
         const at::Tensor w = input({64, 64, 3}, t, 11, true);
         return fwd_bwd({x, w}, input({64, 64, 399}, t, 12),
                        [=] { return at::conv1d(x, w, {}, 2); });
       }},
      {"conv_t1d", "conv_transpose1d k4 s2 16x128x512, fwd+bwd", both,
       3 * 2.0 * 16 * 128 * 512 * 64 * 4,
       [](at::ScalarType t) {
         const at::Tensor x = input({16, 128, 512}, t, 75, true);
         const at::Tensor w = input({128, 64, 4}, t, 76, true);
         return fwd_bwd({x, w}, input({16, 64, 1024}, t, 77),
                        [=] { return at::conv_transpose1d(x, w, {}, 2, 1); });
       }},
      {"conv1x1", "conv2d 1x1 8x256x56x56 -> 64, fwd+bwd", both, 3 * 2.0 * 8 * 56 * 56 * 256 * 64,
       [](at::ScalarType t) {
         const at::Tensor x = input({8, 256, 56, 56}, t, 78, true);
         const at::Tensor w = input({64, 256, 1, 1}, t, 79, true);
         return fwd_bwd({x, w}, input({8, 64, 56, 56}, t, 80), [=] { return at::conv2d(x, w); });
       }},
      {"sdpa", "attention 64x4x64x64 (flash), fwd+bwd", both, 3 * 4.0 * 64 * 4 * 64 * 64 * 64,
       [](at::ScalarType t) {
         const at::Tensor q = input({64, 4, 64, 64}, t, 13, true);
         const at::Tensor k = input({64, 4, 64, 64}, t, 14, true);
         const at::Tensor v = input({64, 4, 64, 64}, t, 15, true);
         return fwd_bwd({q, k, v}, input({64, 4, 64, 64}, t, 16),
                        [=] { return at::scaled_dot_product_attention(q, k, v); });
       }},
      {"addbmm", "addbmm 16x256x256 @ 16x256x256 into 256x256", bf16, 2.0 * 16 * 256 * 256 * 256,
       [](at::ScalarType t) {
         const at::Tensor c = input({256, 256}, t, 34);
         const at::Tensor a = input({16, 256, 256}, t, 35);
         const at::Tensor b = input({16, 256, 256}, t, 36);
         return std::function<void()>([c, a, b] { at::addbmm(c, a, b); });
       }},
      {"mm_out", "mm 2048x256 @ 256x1024, out=", bf16, 2.0 * 2048 * 256 * 1024,
       [](at::ScalarType t) {
         const at::Tensor a = input({2048, 256}, t, 1);
         const at::Tensor b = input({256, 1024}, t, 2);
         at::Tensor out = at::empty({2048, 1024}, a.options());
         return std::function<void()>([a, b, out]() mutable { at::mm_out(out, a, b); });
       }},
      // fairseq's ConvTBC: one addmm_ per kernel tap into the output.
      {"conv_tbc", "conv_tbc k3 200x32x256 -> 256, fwd+bwd", bf16,
       3 * 2.0 * 200 * 32 * 256 * 256 * 3,
       [](at::ScalarType t) {
         const at::Tensor x = input({200, 32, 256}, t, 37, true);
         const at::Tensor w = input({3, 256, 256}, t, 38, true);
         const at::Tensor b = input({256}, t, 39, true);
         return fwd_bwd({x, w, b}, input({200, 32, 256}, t, 40),
                        [=] { return at::conv_tbc(x, w, b, 1); });
       }},
      {"addmv", "addmv 4096x1024 @ 1024 (one-sample linear)", bf16, 2.0 * 4096 * 1024,
       [](at::ScalarType t) {
         const at::Tensor s = input({4096}, t, 43);
         const at::Tensor m = input({4096, 1024}, t, 44);
         const at::Tensor v = input({1024}, t, 45);
         return std::function<void()>([s, m, v] { at::addmv(s, m, v); });
       }},
      {"rnn", "nn.RNN tanh 256 -> 256, 32 steps x 16, fwd+bwd", bf16,
       3 * 2.0 * 2 * 32 * 16 * 256 * 256,
       [](at::ScalarType t) {
         const at::Tensor x = input({32, 16, 256}, t, 46, true);
         const at::Tensor h = input({1, 16, 256}, t, 47);
         // Weights of the scale nn.RNN draws them at (1/16), so that tanh does not saturate.
         const std::vector<at::Tensor> p = {(input({256, 256}, t, 48) * 0.0625).requires_grad_(),
                                            (input({256, 256}, t, 49) * 0.0625).requires_grad_(),
                                            input({256}, t, 50, true), input({256}, t, 51, true)};
         return fwd_bwd({x, p[0], p[1], p[2], p[3]}, input({32, 16, 256}, t, 52), [=] {
           return std::get<0>(at::rnn_tanh(x, h, p, true, 1, 0.0, true, false, false));
         });
       }},
      // Small batches (control policies, recurrent cells stepped by hand): ten calls per run,
      // each product a few rows against a weight read whole.
      {"linear16", "linear 16x256 -> 1024 x10, fwd+bwd", both, 10 * 3 * 2.0 * 16 * 256 * 1024,
       [](at::ScalarType t) {
         const at::Tensor x = input({16, 256}, t, 53, true);
         const at::Tensor w = input({1024, 256}, t, 54, true);
         const at::Tensor b = input({1024}, t, 55, true);
         return fwd_bwd({x, w, b}, input({16, 1024}, t, 56), [=] {
           at::Tensor y = at::linear(x, w, b);
           for (int i = 1; i < 10; ++i) y = y + at::linear(x, w, b);
           return y;
         });
       }},
      {"linear1", "linear 1x256 -> 256 x100, no grad (batch 1)", both, 100 * 2.0 * 256 * 256,
       [](at::ScalarType t) {
         const at::Tensor x = input({1, 256}, t, 72);
         const at::Tensor w = input({256, 256}, t, 73);
         const at::Tensor b = input({256}, t, 74);
         return std::function<void()>([x, w, b] {
           const at::NoGradGuard no_grad;
           for (int i = 0; i < 100; ++i) at::linear(x, w, b);
         });
       }},
      {"lstm_cell", "LSTMCell 16x256 -> 256 x10 steps, fwd+bwd", both,
       10 * 3 * 2.0 * 16 * 512 * 1024,
       [](at::ScalarType t) {
         const at::Tensor x = input({10, 16, 256}, t, 57, true);
         const at::Tensor h = input({16, 256}, t, 58);
         const at::Tensor c = input({16, 256}, t, 59);
         const std::vector<at::Tensor> p = {(input({1024, 256}, t, 60) * 0.0625).requires_grad_(),
                                            (input({1024, 256}, t, 61) * 0.0625).requires_grad_(),
                                            input({1024}, t, 62, true), input({1024}, t, 63, true)};
         return fwd_bwd({x, p[0], p[1], p[2], p[3]}, input({16, 256}, t, 64), [=] {
           std::tuple<at::Tensor, at::Tensor> hc{h, c};
           for (int64_t s = 0; s < 10; ++s) {
             hc = at::lstm_cell(x[s], {std::get<0>(hc), std::get<1>(hc)}, p[0], p[1], p[2], p[3]);
           }
           return std::get<0>(hc);
         });
       }},
      {"gru_cell", "GRUCell 16x256 -> 256 x10 steps, fwd+bwd", both, 10 * 3 * 2.0 * 16 * 512 * 768,
       [](at::ScalarType t) {
         const at::Tensor x = input({10, 16, 256}, t, 65, true);
         const at::Tensor h = input({16, 256}, t, 66);
         const std::vector<at::Tensor> p = {(input({768, 256}, t, 67) * 0.0625).requires_grad_(),
                                            (input({768, 256}, t, 68) * 0.0625).requires_grad_(),
                                            input({768}, t, 69, true), input({768}, t, 70, true)};
         return fwd_bwd({x, p[0], p[1], p[2], p[3]}, input({16, 256}, t, 71), [=] {
           at::Tensor hs = h;
           for (int64_t s = 0; s < 10; ++s) hs = at::gru_cell(x[s], hs, p[0], p[1], p[2], p[3]);
           return hs;
         });
       }},
      // Not on the route: LibTorch's half kernels inside the scope too (ours = LibTorch's half,
      // a measure of this method's noise). Here for their "vs fp32": the ops of apex-train's
      // models between the products, whose half kernels may be slower than fp32 on a CPU.
      {"batch_norm", "batch_norm 64x32x32x32, fp32 params, fwd+bwd", bf16, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({64, 32, 32, 32}, t, 19, true);
         const at::Tensor w = input({32}, at::kFloat, 20, true);
         const at::Tensor b = input({32}, at::kFloat, 21, true);
         const at::Tensor mean = at::zeros({32});
         const at::Tensor var = at::ones({32});
         return fwd_bwd({x, w, b}, input({64, 32, 32, 32}, t, 22),
                        [=] { return at::batch_norm(x, w, b, mean, var, true, 0.1, 1e-5, false); });
       }},
      {"relu_add", "relu(x + y) 64x32x32x32 (residual), fwd+bwd", bf16, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({64, 32, 32, 32}, t, 23, true);
         const at::Tensor y = input({64, 32, 32, 32}, t, 24, true);
         return fwd_bwd({x, y}, input({64, 32, 32, 32}, t, 25), [=] { return at::relu(x + y); });
       }},
      {"mean", "mean over H, W of 64x64x16x16, fwd+bwd", bf16, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({64, 64, 16, 16}, t, 26, true);
         return fwd_bwd({x}, input({64, 64}, t, 27), [=] { return x.mean({2, 3}); });
       }},
      {"group_norm", "group_norm 64 groups of 64x64x799, fwd+bwd", bf16, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({64, 64, 799}, t, 28, true);
         const at::Tensor w = input({64}, t, 29, true);
         const at::Tensor b = input({64}, t, 30, true);
         return fwd_bwd({x, w, b}, input({64, 64, 799}, t, 31),
                        [=] { return at::group_norm(x, 64, w, b); });
       }},
      {"softmax", "softmax of 16384x64 rows, fwd+bwd", bf16, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({16384, 64}, t, 32, true);
         return fwd_bwd({x}, input({16384, 64}, t, 33), [=] { return at::softmax(x, -1); });
       }},
      {"silu", "silu 4096x1024, fwd+bwd", both, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({4096, 1024}, t, 41, true);
         return fwd_bwd({x}, input({4096, 1024}, t, 42), [=] { return at::silu(x); });
       }},
      {"gelu", "gelu 4096x1024, fwd+bwd", both, 0,
       [](at::ScalarType t) {
         const at::Tensor x = input({4096, 1024}, t, 17, true);
         return fwd_bwd({x}, input({4096, 1024}, t, 18), [=] { return at::gelu(x); });
       }},
  };
}

const char* dtype_name(at::ScalarType t) {
  return t == at::kBFloat16 ? "bf16" : t == at::kHalf ? "fp16" : "fp32";
}

struct Result {
  std::string name, what, dtype;
  double ours_ms, torch_half_ms, fp32_ms, flops;
  int torch_half_runs;
};

}  // namespace

int run_half(const Config& cfg) {
  TORCH_CHECK(cfg.device.is_cpu(),
              "half: the route is for CPU tensors; expected --device cpu, got ", cfg.device.str());
  std::string names;
  bool any = cfg.only.empty();
  for (const Case& c : cases()) {
    names += std::string(names.empty() ? "" : ", ") + c.name;
    any = any || selected(cfg, c.name);
  }
  TORCH_CHECK(any, "half: --only names no case; expected one of ", names);
  // Freed memory stays in the heap (as in apex-bench norm): otherwise whichever side runs after
  // the fp32 case page-faults fresh outputs in, and the order of the sides decides the ratios.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
  for (const at::ScalarType t : {at::kBFloat16, at::kHalf}) {
    std::printf("apex-bench half: LibTorch's %s matmuls are %s on this CPU; the fp32 route %s\n",
                t == at::kBFloat16 ? "bf16" : "fp16",
                apex::amp::cpu_half_matmul_kind(t) == apex::amp::CpuHalfMatmul::kFast ? "fast"
                : apex::amp::cpu_half_matmul_kind(t) == apex::amp::CpuHalfMatmul::kEmulated
                    ? "emulated (below fp32's speed)"
                    : "slow",
                apex::amp::cpu_half_fallback_available(t)
                    ? "takes them in the scope"
                    : "leaves them to LibTorch (ours = LibTorch's half kernels)");
  }
  std::vector<Result> results;
  for (const Case& c : cases()) {
    if (!selected(cfg, c.name)) continue;
    for (const at::ScalarType t : c.dtypes) {
      // Each side on its own tensors (the same values): none finds the others' in the caches.
      const auto run_ours = c.make(t);
      const auto run = c.make(t);
      const auto run32 = c.make(at::kFloat);
      const std::function<void()> ours = [&run_ours] {
        const apex::amp::CpuHalfFallbackGuard on;
        run_ours();
      };
      // LibTorch's half kernels are timed in the same rounds as ours and fp32 unless they are
      // slow (one run over 5x ours): then on as many runs as fit in about 20x ours' total time
      // (at least 1, at most --repeats), after ours and fp32.
      const auto once = [](const std::function<void()>& f) {
        const auto start = std::chrono::steady_clock::now();
        f();
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
            .count();
      };
      once(ours);
      once(run);
      const double ours_first = once(ours);
      const double half_first = once(run);
      double ours_ms, fp32_ms;
      std::vector<double> half_runs;
      if (half_first <= 5 * ours_first) {
        const auto runs = interleaved_runs(cfg, {ours, run, run32});
        ours_ms = median(runs[0]);
        half_runs = runs[1];
        fp32_ms = median(runs[2]);
      } else {
        const auto runs = interleaved_runs(cfg, {ours, run32});
        ours_ms = median(runs[0]);
        fp32_ms = median(runs[1]);
        Config few = cfg;
        few.warmup = 0;
        few.repeats = static_cast<int>(
            std::clamp<double>(20.0 * ours_ms * cfg.repeats / half_first - 1, 0, cfg.repeats - 1));
        half_runs = {half_first};
        if (few.repeats > 0) {
          const auto more = interleaved_runs(few, {run});
          half_runs.insert(half_runs.end(), more[0].begin(), more[0].end());
        }
      }
      results.push_back({c.name, c.what, dtype_name(t), ours_ms, median(half_runs), fp32_ms,
                         c.flops, static_cast<int>(half_runs.size())});
    }
  }
  std::printf("\napex-bench half  device=cpu threads=%d\n", at::get_num_threads());
  std::printf("%-7s %-44s %9s %12s %9s %9s %8s %9s\n", "dtype", "case", "ours ms", "torch half",
              "fp32 ms", "vs half", "vs fp32", "GFLOP/s");
  for (const auto& r : results) {
    std::printf("%-7s %-44s %9.3f %9.3f (%d) %9.3f %8.2fx %7.2fx", r.dtype.c_str(), r.what.c_str(),
                r.ours_ms, r.torch_half_ms, r.torch_half_runs, r.fp32_ms,
                r.torch_half_ms / r.ours_ms, r.fp32_ms / r.ours_ms);
    if (r.flops > 0) {
      std::printf(" %9.1f\n", r.flops / (r.ours_ms * 1e6));
    } else {
      std::printf(" %9s\n", "-");
    }
  }
  std::printf(
      "(torch half: LibTorch's own half kernels, runs in parentheses; vs fp32 >= 1: the\n"
      " half op is at least as fast as the same op in fp32)\n");
  if (!cfg.json.empty()) {
    std::ostringstream out;
    out << "{\"area\": \"half\", \"threads\": " << at::get_num_threads() << ", \"route_bf16\": "
        << (apex::amp::cpu_half_fallback_available(at::kBFloat16) ? "true" : "false")
        << ", \"route_fp16\": "
        << (apex::amp::cpu_half_fallback_available(at::kHalf) ? "true" : "false")
        << ", \"rows\": [";
    for (size_t i = 0; i < results.size(); ++i) {
      const auto& r = results[i];
      out << (i ? ", " : "") << "{\"case\": \"" << r.name << "\", \"dtype\": \"" << r.dtype
          << "\", \"ours_ms\": " << r.ours_ms << ", \"torch_half_ms\": " << r.torch_half_ms
          << ", \"torch_half_runs\": " << r.torch_half_runs << ", \"fp32_ms\": " << r.fp32_ms
          << ", \"vs_half\": " << r.torch_half_ms / r.ours_ms
          << ", \"vs_fp32\": " << r.fp32_ms / r.ours_ms << ", \"flops\": " << r.flops << "}";
    }
    out << "]}\n";
    apex::write_file_atomic(cfg.json, out.str());
    std::printf("results written to %s\n", cfg.json.c_str());
  }
  return 0;
}

}  // namespace apex::bench
