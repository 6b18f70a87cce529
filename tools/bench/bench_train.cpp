// apex-bench train: end-to-end training throughput of apex-train's transformer and resnet defaults
// at O0/O1/O2, against the same models in Python PyTorch (tools/bench/train_peer.py: autocast +
// GradScaler + AdamW(fused=True)) timed in the same run on the same threads.
#include <ATen/Parallel.h>
#include <apex/amp/utils.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "bench_common.h"
#include "train/cli.h"
#include "train/data.h"
#include "train/json.h"
#include "train/report.h"

namespace apex::bench {
namespace {

struct Peer {
  double fp32 = 0;
  double autocast = 0;
};

double python_run(const std::string& model, const std::string& mode, int64_t steps, int threads,
                  int64_t warmup = 5) {
  const std::string cmd = std::string(APEX_PYTHON) + " " + APEX_SOURCE_DIR +
                          "/tools/bench/train_peer.py --model " + model + " --mode " + mode +
                          " --steps " + std::to_string(steps) + " --warmup " +
                          std::to_string(warmup) + " --threads " + std::to_string(threads);
  return apex::train::json::get_number(run_peer(cmd), "samples_per_s");
}

}  // namespace

int run_train(const Config& cfg) {
  TORCH_CHECK(cfg.device.is_cpu(),
              "apex-bench train runs on the CPU (the Python peer is CPU-only)");
  const int threads = at::get_num_threads();
  struct Case {
    std::string model;
    std::vector<std::string> extra;
  };
  std::vector<Case> cases = {{"transformer", {}}, {"resnet", {}}};
  std::ofstream json;  // written only with --json (an unopened stream ignores the writes)
  if (!cfg.json.empty()) json.open(cfg.json);
  json << "{\"area\": \"train\", \"threads\": " << threads << ", \"rows\": [";
  bool first_row = true;
  std::printf("%-12s %-6s %11s %9s %9s %10s %10s %9s\n", "model", "level", "samples/s", "vs O0",
              "test acc", "py fp32", "py autocast", "vs py ac");
  for (const auto& c : cases) {
    if (!selected(cfg, c.model)) continue;
    std::vector<std::string> args = {"--model", c.model, "--no-progress", "--threads",
                                     std::to_string(threads)};
    const apex::train::Cli cli = apex::train::parse_cli(args);
    const auto data = apex::train::load_data(cli.train);
    // The Python peer first: the same model, batch and threads; steps after a warm-up.
    Peer peer;
    const int64_t peer_steps = std::max<int64_t>(20, cfg.repeats * 4);
    peer.fp32 = python_run(c.model, "fp32", peer_steps, threads);
    // Where LibTorch's half matmuls are a scalar loop (cpuid), Python's autocast runs tens of
    // times slower than fp32: a few steps measure it in bounded time.
    const bool slow_half =
        apex::amp::cpu_half_matmul_kind(c10::kBFloat16) == apex::amp::CpuHalfMatmul::kScalar;
    if (slow_half) {
      std::printf(
          "(%s: Python autocast timed on 3 steps after 1: LibTorch's bf16 matmuls are a "
          "scalar loop on this CPU)\n",
          c.model.c_str());
    }
    peer.autocast = slow_half ? python_run(c.model, "autocast", 3, threads, 1)
                              : python_run(c.model, "autocast", peer_steps, threads);
    // The levels in rounds (a single pass on a virtual machine drifted by up to 10 % between
    // levels): medians.
    const std::vector<std::string> levels = {"O0", "O1", "O2"};
    std::vector<double> accuracy(levels.size());
    std::vector<int64_t> steps(levels.size());
    const apex::train::Rounds rounds = apex::train::run_in_rounds(
        levels.size(), cfg.rounds,
        [&](size_t i) {
          apex::train::TrainOptions o = cli.train;
          o.opt_level = levels[i];
          o.untimed_steps = 5;  // as the peer's --warmup
          const auto s = apex::train::train(o, data);
          accuracy[i] = s.test_accuracy;
          steps[i] = s.steps;
          return s.samples_per_s;
        },
        [&](int64_t r, const apex::train::Rounds& so_far) {
          if (cfg.rounds == 1) return;
          std::printf("%-12s round %lld/%d: O0 %.1f, O1 %.1f (%.2fx), O2 %.1f (%.2fx)\n",
                      c.model.c_str(), static_cast<long long>(r + 1), cfg.rounds,
                      so_far.rate[0].back(), so_far.rate[1].back(), so_far.ratio[1].back(),
                      so_far.rate[2].back(), so_far.ratio[2].back());
          std::fflush(stdout);
        });
    for (size_t i = 0; i < levels.size(); ++i) {
      const double samples = rounds.median_rate(i);
      const double speedup = rounds.median_ratio(i);
      std::printf("%-12s %-6s %11.1f %8.2fx %8.1f%% %10.1f %10.1f %8.2fx\n", c.model.c_str(),
                  levels[i].c_str(), samples, speedup, 100 * accuracy[i], peer.fp32, peer.autocast,
                  samples / peer.autocast);
      std::fflush(stdout);
      json << (first_row ? "" : ", ") << "{\"model\": \"" << c.model << "\", \"level\": \""
           << levels[i] << "\", \"samples_per_s\": " << samples
           << ", \"speedup_vs_o0\": " << speedup << ", \"rounds\": " << cfg.rounds
           << ", \"test_accuracy\": " << accuracy[i] << ", \"steps\": " << steps[i]
           << ", \"peer_fp32_samples_per_s\": " << peer.fp32
           << ", \"peer_autocast_samples_per_s\": " << peer.autocast << "}";
      first_row = false;
    }
  }
  json << "]}\n";
  if (!cfg.json.empty()) std::printf("results written to %s\n", cfg.json.c_str());
  return 0;
}

}  // namespace apex::bench
