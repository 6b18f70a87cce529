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
  int rounds = 1;                 ///< train: the levels this many times, in rotating order
  int threads = 0;                // 0: LibTorch's default
  std::string json;               ///< --json FILE; empty: no JSON written
  std::vector<std::string> only;  // model / case filter, empty = all
};

/// Medians (ms) of several functions over cfg.repeats runs after cfg.warmup runs (on CUDA the
/// device is synchronized around each run), measured in alternation (run 1 of each, then run 2
/// of each, ...), so that all of them see the same machine state. This matters on shared machines,
/// whose memory bandwidth was seen to drift by 1.5x between runs a minute apart.
std::vector<double> interleaved_ms(const Config& cfg,
                                   const std::vector<std::function<void()>>& fns);

/// The same measurement, every run kept: runs[k][i] is function k's time (ms) in round i.
std::vector<std::vector<double>> interleaved_runs(const Config& cfg,
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

/// The streaming limit for a norm's traffic: its output is a fresh array whose lines the CPU reads
/// before writing them (write-allocate), as in STREAM's Copy and Add, so the limit loops have that
/// shape (the in-place StreamLoop above would credit the norm with traffic it cannot avoid).
/// copy(): read one array, write another (a norm forward); add(): read two, write a third (a norm
/// backward). `bytes` per array; the rates count each array once, read or written.
struct FreshWriteStream {
  FreshWriteStream(const Config& cfg, int64_t bytes);
  void copy();
  void add();
  double copy_bytes() const { return 2.0 * static_cast<double>(n_) * 4.0; }
  double add_bytes() const { return 3.0 * static_cast<double>(n_) * 4.0; }

 private:
  Config cfg_;
  int64_t n_;  // fp32 elements per array
  at::Tensor a_, b_, c_;
};

/// The median of `v` (the upper one of an even count); `v` must not be empty.
double median(std::vector<double> v);

/// A row from interleaved runs of {ours, peer, limit loop} (or {ours, peer}: no limit). Besides
/// the medians it records paired statistics, taken round by round and then their median:
/// extra["speedup"] (peer / ours) and extra["of_limit"] (our GB/s over the limit's in the same
/// round). Pairing cancels most of
/// the bandwidth drift of a shared machine, which moves whole rounds together.
Row paired_row(const std::string& group, const std::string& name, double bytes, double limit_bytes,
               const std::vector<std::vector<double>>& runs);

/// Prints the table and writes the JSON file: {"area", "device", "threads", "cpu_isa",
/// "rows": [...]}. Each row's limit is its extra["stream_gbs"], measured alongside it; the speed-up
/// and the fraction of the limit are the paired ones where the row has them.
void report(const Config& cfg, const std::string& area, const std::vector<Row>& rows);

/// True when `name` passes cfg.only.
bool selected(const Config& cfg, const std::string& name);

/// Runs a peer's command line (a Python script) and returns what it printed; throws c10::Error
/// with the command and its output when it fails.
std::string run_peer(const std::string& command);

int run_optim(const Config& cfg);
int run_norm(const Config& cfg);
int run_train(const Config& cfg);
int run_ddp(const Config& cfg);
int run_half(const Config& cfg);
/// A rank of run_ddp: `apex-bench ddp-rank MODEL STEPS ddp|plain OUT` (internal).
int run_ddp_rank(int argc, char** argv);

/// ZeRO-2 (DistributedFusedAdam) against DDP + FusedAdam: memory per rank, step time, bytes.
int run_zero(const Config& cfg);
/// A rank of run_zero: `apex-bench zero-rank KIND DTYPE STEPS OUT` (internal).
int run_zero_rank(int argc, char** argv);

}  // namespace apex::bench
