#include "bench_common.h"

#include <ATen/Parallel.h>
#include <apex/optim/multi_tensor.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>

namespace apex::bench {

double median_ms(const Config& cfg, const std::function<void()>& fn) {
  const bool cuda = cfg.device.is_cuda();
  for (int i = 0; i < cfg.warmup; ++i) fn();
  std::vector<double> t;
  for (int i = 0; i < cfg.repeats; ++i) {
    if (cuda) torch::cuda::synchronize();
    const auto start = std::chrono::steady_clock::now();
    fn();
    if (cuda) torch::cuda::synchronize();
    t.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
                    .count());
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

namespace {

// Adam's traffic with trivial math: 4 streams read, 3 written in place. Compiled for the widest
// vector unit the CPU has (function multi-versioning).
__attribute__((target_clones("avx512f", "avx2", "default"))) void stream7(float* __restrict p,
                                                                          const float* __restrict g,
                                                                          float* __restrict m,
                                                                          float* __restrict v,
                                                                          int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float gi = g[i];
    m[i] = 0.9f * m[i] + gi;
    v[i] = 0.99f * v[i] + gi;
    p[i] = p[i] - 1e-3f * m[i];
  }
}

}  // namespace

double streaming_limit_gbs(const Config& cfg, int64_t n) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(cfg.device);
  if (cfg.device.is_cuda()) {
    auto src = torch::rand({n * 4}, opts);
    auto dst = torch::empty_like(src);
    const double ms = median_ms(cfg, [&] { dst.copy_(src); });
    return 2.0 * static_cast<double>(n) * 16.0 / (ms * 1e6);
  }
  auto p = torch::rand({n}, opts);
  auto g = torch::rand({n}, opts);
  auto m = torch::rand({n}, opts);
  auto v = torch::rand({n}, opts);
  float* pp = p.data_ptr<float>();
  const float* gp = g.data_ptr<float>();
  float* mp = m.data_ptr<float>();
  float* vp = v.data_ptr<float>();
  const double ms = median_ms(cfg, [&] {
    at::parallel_for(0, n, 32768,
                     [&](int64_t b, int64_t e) { stream7(pp + b, gp + b, mp + b, vp + b, e - b); });
  });
  return 28.0 * static_cast<double>(n) / (ms * 1e6);
}

bool selected(const Config& cfg, const std::string& name) {
  return cfg.only.empty() || std::find(cfg.only.begin(), cfg.only.end(), name) != cfg.only.end();
}

void report(const Config& cfg, const std::string& area, double stream_gbs,
            const std::vector<Row>& rows) {
  const int threads = at::get_num_threads();
  std::printf("\napex-bench %s  device=%s threads=%d cpu_isa=%s  streaming limit %.1f GB/s\n",
              area.c_str(), cfg.device.str().c_str(), threads, apex::optim::cpu_kernel_isa(),
              stream_gbs);
  std::printf("%-10s %-44s %10s %10s %8s %9s %8s\n", "model", "case", "ours ms", "peer ms",
              "speedup", "GB/s", "of limit");
  for (const auto& r : rows) {
    const double gbs = r.bytes / (r.ours_ms * 1e6);
    std::printf("%-10s %-44s %10.2f %10.2f %7.2fx %9.1f %7.0f%%\n", r.group.c_str(), r.name.c_str(),
                r.ours_ms, r.peer_ms, r.peer_ms / r.ours_ms, gbs, 100.0 * gbs / stream_gbs);
  }
  std::ofstream out(cfg.json);
  out << "{\"area\": \"" << area << "\", \"device\": \"" << cfg.device.str()
      << "\", \"threads\": " << threads << ", \"cpu_isa\": \"" << apex::optim::cpu_kernel_isa()
      << "\", \"stream_gbs\": " << stream_gbs << ", \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    out << (i ? ", " : "") << "{\"model\": \"" << r.group << "\", \"case\": \"" << r.name
        << "\", \"ours_ms\": " << r.ours_ms << ", \"peer_ms\": " << r.peer_ms
        << ", \"speedup\": " << r.peer_ms / r.ours_ms << ", \"bytes\": " << r.bytes
        << ", \"gbs\": " << r.bytes / (r.ours_ms * 1e6)
        << ", \"fraction_of_limit\": " << r.bytes / (r.ours_ms * 1e6) / stream_gbs;
    for (const auto& [k, v] : r.extra) out << ", \"" << k << "\": " << v;
    out << "}";
  }
  out << "]}\n";
  std::printf("results written to %s\n", cfg.json.c_str());
}

}  // namespace apex::bench
