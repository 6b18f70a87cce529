#include "bench_common.h"

#include <ATen/Parallel.h>
#include <apex/io.h>
#include <apex/optim/multi_tensor.h>
#include <torch/cuda.h>
#include <torch/types.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <sstream>

namespace apex::bench {

std::vector<std::vector<double>> interleaved_runs(const Config& cfg,
                                                  const std::vector<std::function<void()>>& fns) {
  const bool cuda = cfg.device.is_cuda();
  for (int i = 0; i < cfg.warmup; ++i) {
    for (const auto& fn : fns) fn();
  }
  std::vector<std::vector<double>> t(fns.size());
  for (int i = 0; i < cfg.repeats; ++i) {
    for (size_t k = 0; k < fns.size(); ++k) {
      if (cuda) torch::cuda::synchronize();
      const auto start = std::chrono::steady_clock::now();
      fns[k]();
      if (cuda) torch::cuda::synchronize();
      t[k].push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
              .count());
    }
  }
  return t;
}

double median(std::vector<double> v) {
  TORCH_CHECK(!v.empty(), "apex-bench: the median of no runs");
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

std::vector<double> interleaved_ms(const Config& cfg,
                                   const std::vector<std::function<void()>>& fns) {
  std::vector<double> medians;
  for (auto& v : interleaved_runs(cfg, fns)) medians.push_back(median(v));
  return medians;
}

Row paired_row(const std::string& group, const std::string& name, double bytes, double limit_bytes,
               const std::vector<std::vector<double>>& runs) {
  const auto& ours = runs.at(0);
  const auto& peer = runs.at(1);
  std::vector<double> speedup;
  for (size_t i = 0; i < ours.size(); ++i) speedup.push_back(peer[i] / ours[i]);
  Row r{group, name, median(ours), median(peer), bytes, {}};
  r.extra["speedup"] = median(speedup);
  if (runs.size() > 2) {
    const auto& limit = runs[2];
    std::vector<double> of_limit;
    for (size_t i = 0; i < ours.size(); ++i) {
      of_limit.push_back((bytes / ours[i]) / (limit_bytes / limit[i]));
    }
    r.extra["stream_gbs"] = limit_bytes / (median(limit) * 1e6);
    r.extra["of_limit"] = median(of_limit);
  }
  return r;
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

__attribute__((target_clones("avx512f", "avx2", "default"))) void copy_stream(
    const float* __restrict a, float* __restrict c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) c[i] = 1.5f * a[i] + 0.25f;
}

__attribute__((target_clones("avx512f", "avx2", "default"))) void add_stream(
    const float* __restrict a, const float* __restrict b, float* __restrict c, int64_t n) {
  for (int64_t i = 0; i < n; ++i) c[i] = 1.5f * a[i] + b[i];
}

}  // namespace

FreshWriteStream::FreshWriteStream(const Config& cfg, int64_t bytes)
    : cfg_(cfg), n_(std::max<int64_t>(bytes / 4, 16)) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(cfg.device);
  a_ = torch::rand({n_}, opts);
  b_ = torch::rand({n_}, opts);
  c_ = torch::rand({n_}, opts);
}

void FreshWriteStream::copy() {
  if (cfg_.device.is_cuda()) {
    c_.copy_(a_);
    return;
  }
  const float* a = a_.data_ptr<float>();
  float* c = c_.data_ptr<float>();
  at::parallel_for(0, n_, 32768, [&](int64_t b, int64_t e) { copy_stream(a + b, c + b, e - b); });
}

void FreshWriteStream::add() {
  if (cfg_.device.is_cuda()) {
    at::add_out(c_, a_, b_);
    return;
  }
  const float* a = a_.data_ptr<float>();
  const float* bp = b_.data_ptr<float>();
  float* c = c_.data_ptr<float>();
  at::parallel_for(0, n_, 32768,
                   [&](int64_t b, int64_t e) { add_stream(a + b, bp + b, c + b, e - b); });
}

StreamLoop::StreamLoop(const Config& cfg, int64_t n) : cfg_(cfg), n_(n) {
  const auto opts = torch::TensorOptions().dtype(torch::kFloat).device(cfg.device);
  if (cfg.device.is_cuda()) {
    p_ = torch::rand({n * 4}, opts);
    g_ = torch::empty_like(p_);
    return;
  }
  p_ = torch::rand({n}, opts);
  g_ = torch::rand({n}, opts);
  m_ = torch::rand({n}, opts);
  v_ = torch::rand({n}, opts);
}

void StreamLoop::operator()() {
  if (cfg_.device.is_cuda()) {
    g_.copy_(p_);
    return;
  }
  float* pp = p_.data_ptr<float>();
  const float* gp = g_.data_ptr<float>();
  float* mp = m_.data_ptr<float>();
  float* vp = v_.data_ptr<float>();
  at::parallel_for(0, n_, 32768,
                   [&](int64_t b, int64_t e) { stream7(pp + b, gp + b, mp + b, vp + b, e - b); });
}

double StreamLoop::bytes() const {
  return cfg_.device.is_cuda() ? 32.0 * static_cast<double>(n_) : 28.0 * static_cast<double>(n_);
}

bool selected(const Config& cfg, const std::string& name) {
  return cfg.only.empty() || std::find(cfg.only.begin(), cfg.only.end(), name) != cfg.only.end();
}

std::string run_peer(const std::string& command) {
  FILE* p = popen(command.c_str(), "r");
  TORCH_CHECK(p != nullptr, "apex-bench: cannot run ", command);
  std::string out;
  char buf[512];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  TORCH_CHECK(pclose(p) == 0, "apex-bench: the Python peer failed: ", command, "\n", out);
  return out;
}

void report(const Config& cfg, const std::string& area, const std::vector<Row>& rows) {
  const int threads = at::get_num_threads();
  std::printf("\napex-bench %s  device=%s threads=%d cpu_isa=%s\n", area.c_str(),
              cfg.device.str().c_str(), threads, apex::optim::cpu_kernel_isa());
  std::printf("%-16s %-44s %9s %9s %8s %8s %8s %7s\n", "model", "case", "ours ms", "peer ms",
              "speedup", "GB/s", "limit", "of lim");
  for (const auto& r : rows) {
    const double gbs = r.bytes / (r.ours_ms * 1e6);
    const double limit = r.extra.count("stream_gbs") ? r.extra.at("stream_gbs") : 0.0;
    const double speedup = r.extra.count("speedup") ? r.extra.at("speedup") : r.peer_ms / r.ours_ms;
    const double of_limit = r.extra.count("of_limit") ? r.extra.at("of_limit")
                            : limit > 0               ? gbs / limit
                                                      : 0.0;
    if (limit > 0) {
      std::printf("%-16s %-44s %9.2f %9.2f %7.2fx %8.1f %8.1f %6.0f%%\n", r.group.c_str(),
                  r.name.c_str(), r.ours_ms, r.peer_ms, speedup, gbs, limit, 100.0 * of_limit);
    } else {  // no limit measured (data in cache): times in microseconds
      std::printf("%-16s %-44s %8.1fu %8.1fu %7.2fx %8.1f %8s %7s\n", r.group.c_str(),
                  r.name.c_str(), r.ours_ms * 1e3, r.peer_ms * 1e3, speedup, gbs, "-", "-");
    }
  }
  if (cfg.json.empty()) return;  // JSON only where --json asks for it
  std::ostringstream out;
  out << "{\"area\": \"" << area << "\", \"device\": \"" << cfg.device.str()
      << "\", \"threads\": " << threads << ", \"cpu_isa\": \"" << apex::optim::cpu_kernel_isa()
      << "\", \"repeats\": " << cfg.repeats << ", \"rows\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    const auto& r = rows[i];
    const double gbs = r.bytes / (r.ours_ms * 1e6);
    out << (i ? ", " : "") << "{\"model\": \"" << r.group << "\", \"case\": \"" << r.name
        << "\", \"ours_ms\": " << r.ours_ms << ", \"peer_ms\": " << r.peer_ms
        << ", \"ratio_of_medians\": " << r.peer_ms / r.ours_ms << ", \"bytes\": " << r.bytes
        << ", \"gbs\": " << gbs;
    // "speedup" is the paired one where the row has it, else the ratio of the medians.
    if (r.extra.count("speedup") == 0) out << ", \"speedup\": " << r.peer_ms / r.ours_ms;
    for (const auto& [k, v] : r.extra) out << ", \"" << k << "\": " << v;
    out << "}";
  }
  out << "]}\n";
  apex::write_file_atomic(cfg.json, out.str());
  std::printf("results written to %s\n", cfg.json.c_str());
}

}  // namespace apex::bench
