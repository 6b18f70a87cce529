#pragma once

// apex-bench helpers: timing (median of repeats), the machine's streaming limit, a result table
// and its JSON form. The tool uses apex-cpp's public headers only.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace apex::bench {

struct Config {
  c10::Device device = c10::kCPU;
  int warmup = 2;
  int repeats = 10;
  int threads = 0;  // 0: LibTorch's default
  std::string json = "apex-bench.json";
  std::vector<std::string> only;  // model / case filter, empty = all
};

/// Medians (ms) of several functions over cfg.repeats runs after cfg.warmup runs (on CUDA the
/// device is synchronized around each run), measured in alternation (run 1 of each, then run 2
/// of each, ...), so that all of them see the same machine state. This matters on shared machines,
/// whose memory bandwidth was seen to drift by 1.5x between runs a minute apart.
std::vector<double> interleaved_ms(const Config& cfg,
                                   const std::vector<std::function<void()>>& fns);

/// One table row: our time, the peer's, bytes moved by ours.
struct Row {
  std::string group;  // e.g. "resnet50"
  std::string name;   // e.g. "FusedAdam vs torch::optim::AdamW"
  double ours_ms = 0;
  double peer_ms = 0;
  double bytes = 0;                     // bytes our step moves
  std::map<std::string, double> extra;  // more numbers for the JSON record
};

/// The machine's streaming limit: a vectorized in-place loop with the traffic shape of fp32 Adam
/// (read 4 arrays, write 3 of them back) over `n` elements per array, 28*n bytes per run; on CUDA
/// a device-to-device copy of 16*n bytes (read + write counted, 32*n bytes per run).
struct StreamLoop {
  StreamLoop(const Config& cfg, int64_t n);
  void operator()();
  double bytes() const;

 private:
  Config cfg_;
  int64_t n_;
  at::Tensor p_, g_, m_, v_;
};

/// Prints the table and writes the JSON file: {"area", "device", "threads", "cpu_isa",
/// "rows": [...]}. Each row's limit is its extra["stream_gbs"], measured alongside it.
void report(const Config& cfg, const std::string& area, const std::vector<Row>& rows);

/// True when `name` passes cfg.only.
bool selected(const Config& cfg, const std::string& name);

int run_optim(const Config& cfg);
int run_norm(const Config& cfg);
int run_train(const Config& cfg);

}  // namespace apex::bench
