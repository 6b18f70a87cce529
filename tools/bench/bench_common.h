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

/// Median wall time of `fn` in milliseconds over cfg.repeats runs after cfg.warmup runs. On
/// CUDA the device is synchronized around each run.
double median_ms(const Config& cfg, const std::function<void()>& fn);

/// One table row: our time, the peer's, bytes moved by ours.
struct Row {
  std::string group;  // e.g. "resnet50"
  std::string name;   // e.g. "FusedAdam vs torch::optim::AdamW"
  double ours_ms = 0;
  double peer_ms = 0;
  double bytes = 0;                     // bytes our step moves
  std::map<std::string, double> extra;  // more numbers for the JSON record
};

/// Measured streaming bandwidth (GB/s) of a vectorized in-place loop with the traffic shape of
/// fp32 Adam (read 4 arrays, write 3 of them back) over `n` elements per array; on CUDA a
/// device-to-device copy of n*4*4 bytes (read + write counted).
double streaming_limit_gbs(const Config& cfg, int64_t n);

/// Prints the table and writes the JSON file: {"area", "device", "threads", "isa",
/// "stream_gbs", "rows": [...]}.
void report(const Config& cfg, const std::string& area, double stream_gbs,
            const std::vector<Row>& rows);

/// True when `name` passes cfg.only.
bool selected(const Config& cfg, const std::string& name);

int run_optim(const Config& cfg);

}  // namespace apex::bench
