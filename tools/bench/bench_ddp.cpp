// apex-bench ddp: data-parallel training on this machine's cores. apex-train's transformer and
// resnet in fp32, each rank one thread and the same per-rank batch (weak scaling): one process
// without DDP, one with a DDP of one (the wrapper's cost), and `ranks` of them over Gloo; the
// peer, in the same run, is Python's torch.nn.parallel.DistributedDataParallel on the same model
// (tools/bench/ddp_peer.py). The machine's limit is N plain single-rank jobs run side by side
// (they share its memory and caches as the ranks do). Ranks are copies of this program
// ("apex-bench ddp-rank", hidden).
#include <c10/util/Exception.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <apex/parallel/process_group.h>
#include "bench_common.h"
#include "train/cli.h"
#include "train/data.h"
#include "train/json.h"
#include "train/trainer.h"

namespace apex::bench {
namespace {

namespace fs = std::filesystem;

// Untimed steps before every timed run, ours and the peer's alike.
constexpr int64_t kWarmup = 3;

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// apex-train's run of `model` in `world` ranks (0: no DDP), rank 0's summary. With `independent`
// > 0: that many plain processes at once, no DDP (the machine's limit for weak scaling: what
// `independent` single-rank jobs achieve side by side); their samples/s summed.
apex::train::Summary apex_run(const std::string& model, double bucket_mb, int world, int64_t steps,
                              const fs::path& work, int independent = 0) {
  const fs::path out = work / ("apex-" + model + "-" + std::to_string(world) + ".json");
  const int ranks = independent > 0 ? independent : std::max(1, world);
  const std::string port = std::to_string(apex::parallel::free_loopback_port("apex-bench ddp"));
  std::vector<pid_t> pids;
  std::fflush(stdout);
  for (int r = 0; r < ranks; ++r) {
    const pid_t pid = fork();
    TORCH_CHECK(pid >= 0, "apex-bench ddp: fork failed");
    if (pid == 0) {
      if (world > 0) {
        setenv("RANK", std::to_string(r).c_str(), 1);
        setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
        setenv("MASTER_ADDR", "127.0.0.1", 1);
        setenv("MASTER_PORT", port.c_str(), 1);
      }
      const std::string s = std::to_string(steps);
      const std::string b = std::to_string(bucket_mb);
      const std::string o = independent > 0 ? out.string() + "." + std::to_string(r) : out.string();
      execl("/proc/self/exe", "apex-bench", "ddp-rank", model.c_str(), s.c_str(),
            world > 0 ? "ddp" : "plain", b.c_str(), o.c_str(), static_cast<char*>(nullptr));
      _exit(127);
    }
    pids.push_back(pid);
  }
  bool ok = true;
  for (const pid_t p : pids) {
    int status = 0;
    waitpid(p, &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  TORCH_CHECK(ok, "apex-bench ddp: a rank of the ", model, " run with ", world, " ranks failed");
  if (independent == 0) return apex::train::summary_from_json(read_text(out));
  apex::train::Summary sum;
  for (int r = 0; r < independent; ++r) {
    sum.samples_per_s +=
        apex::train::summary_from_json(read_text(out.string() + "." + std::to_string(r)))
            .samples_per_s;
  }
  return sum;
}

double python_run(const std::string& model, double bucket_mb, int world, int64_t steps) {
  const std::string cmd = std::string(APEX_PYTHON) + " " + APEX_SOURCE_DIR +
                          "/tools/bench/ddp_peer.py --model " + model + " --world " +
                          std::to_string(world) + " --steps " + std::to_string(steps) +
                          " --warmup " + std::to_string(kWarmup) + " --threads 1" +
                          (bucket_mb > 0 ? " --bucket-cap-mb " + std::to_string(bucket_mb) : "");
  return apex::train::json::get_number(run_peer(cmd), "samples_per_s");
}

}  // namespace

int run_ddp_rank(int argc, char** argv) {
  TORCH_CHECK(argc == 7, "apex-bench ddp-rank: internal use (model steps ddp|plain bucket_mb out)");
  const std::string model = argv[2];
  // kWarmup untimed steps first, as the Python peer's (ddp_peer.py --warmup).
  const std::string total = std::to_string(std::stoll(argv[3]) + kWarmup);
  apex::train::Cli cli = apex::train::parse_cli(
      {"--model", model, "--opt-level", "fp32", "--no-progress", "--threads", "1", "--steps", total,
       "--log-every", total, "--optimizer", "fused-adam"});
  cli.train.ddp = std::string(argv[4]) == "ddp";
  cli.train.untimed_steps = kWarmup;
  cli.train.bucket_cap_mb = std::stod(argv[5]);
  const auto data = apex::train::load_data(cli.train);
  const auto s = apex::train::train(cli.train, data);
  if (s.rank == 0) {
    std::ofstream(argv[6]) << apex::train::to_json(s) << "\n";
  }
  return 0;
}

int run_ddp(const Config& cfg) {
  TORCH_CHECK(cfg.device.is_cpu(), "apex-bench ddp runs on the CPU (Gloo)");
  const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  const int world = static_cast<int>(std::min<long>(cores, 8));
  TORCH_CHECK(world >= 2, "apex-bench ddp needs at least 2 cores, this machine has ", cores);
  const fs::path work = fs::temp_directory_path() / ("apex-bench-ddp-" + std::to_string(getpid()));
  fs::create_directories(work);
  std::ofstream json;  // written only with --json (an unopened stream ignores the writes)
  if (!cfg.json.empty()) json.open(cfg.json);
  json << "{\"area\": \"ddp\", \"ranks\": " << world << ", \"threads_per_rank\": 1, \"rows\": [";
  bool first = true;
  std::printf(
      "%d ranks x 1 thread against 1 x 1, fp32, per-rank batch 64 (weak scaling); medians of %d "
      "rounds, %lld untimed steps first\n",
      world, std::clamp(cfg.repeats, 1, 5), static_cast<long long>(kWarmup));
  std::printf("%-14s %8s %8s %9s %8s %8s %7s %8s %8s %7s %8s %8s %7s %6s\n", "model", "1x1",
              "Nx1 indep", "ddp1", "ddp1 cost", "ddpN", "effic.", "vs limit", "comm ms", "hidden",
              "py 1x1", "py ddpN", "py eff", "vs py");
  // The resnet twice: its 0.3 MB of gradients fill one default bucket, which can only start when
  // backward ends; with 0.1 MiB buckets (--bucket-cap-mb 0.1, the peer's bucket_cap_mb alike) the
  // all-reduce of the last layers runs while the first ones still compute.
  struct Row {
    std::string model;
    double bucket_mb;  // 0: DDP's defaults
  };
  // The runs without DDP do not depend on the buckets: the second resnet row reuses the first's.
  struct NoDdp {
    std::vector<double> plain, side, py_plain;
  };
  std::map<std::string, NoDdp> no_ddp;
  for (const Row& row : {Row{"transformer", 0}, Row{"resnet", 0}, Row{"resnet", 0.1}}) {
    const std::string& model = row.model;
    if (!selected(cfg, model)) continue;
    const std::string label = row.bucket_mb > 0 ? model + "/0.1MiB" : model;
    const int64_t steps = model == "transformer" ? 16 : 30;
    // Rounds of every configuration in turn (drift on a shared VM hits them alike), medians.
    const int rounds = std::clamp(cfg.repeats, 1, 5);
    const bool reuse = no_ddp.count(model) > 0;
    NoDdp& base = no_ddp[model];
    std::vector<double>&v_plain = base.plain, &v_side = base.side, &v_py_plain = base.py_plain;
    std::vector<double> v_one, v_py;
    std::vector<apex::train::Summary> v_many;
    for (int round = 0; round < rounds; ++round) {
      const double b = row.bucket_mb;
      if (!reuse) {
        v_plain.push_back(apex_run(model, b, 0, steps, work).samples_per_s);
        v_side.push_back(apex_run(model, b, 0, steps, work, world).samples_per_s);
      }
      v_one.push_back(apex_run(model, b, 1, steps, work).samples_per_s);
      v_many.push_back(apex_run(model, b, world, steps, work));
      if (!reuse) v_py_plain.push_back(python_run(model, b, 0, steps));
      v_py.push_back(python_run(model, b, world, steps));
    }
    const double plain = median(v_plain);
    const double side_by_side = median(v_side);
    const double one = median(v_one);
    // The median round of the DDP runs, with that round's Logger timings.
    std::sort(v_many.begin(), v_many.end(),
              [](const auto& a, const auto& b) { return a.samples_per_s < b.samples_per_s; });
    const apex::train::Summary many = v_many[v_many.size() / 2];
    const double py_plain = median(v_py_plain);
    const double py = median(v_py);
    const double efficiency = many.samples_per_s / (world * plain);
    const double vs_limit = many.samples_per_s / side_by_side;
    const double py_efficiency = py / (world * py_plain);
    const double cost = 1.0 - one / plain;
    const double hidden =
        many.ddp_backward_comm_ms > 0 ? many.ddp_overlap_ms / many.ddp_backward_comm_ms : 0.0;
    std::printf(
        "%-14s %8.1f %8.1f %8.1f %7.1f%% %8.1f %6.1f%% %7.1f%% %8.1f %6.1f%% %8.1f %8.1f %6.1f%% "
        "%5.2fx\n",
        label.c_str(), plain, side_by_side, one, 100 * cost, many.samples_per_s, 100 * efficiency,
        100 * vs_limit, many.ddp_backward_comm_ms, 100 * hidden, py_plain, py, 100 * py_efficiency,
        many.samples_per_s / py);
    std::fflush(stdout);
    json << (first ? "" : ", ") << "{\"model\": \"" << model << "\", \"label\": \"" << label
         << "\", \"bucket_cap_mb\": " << row.bucket_mb << ", \"plain_samples_per_s\": " << plain
         << ", \"ddp1_samples_per_s\": " << one << ", \"ddp_samples_per_s\": " << many.samples_per_s
         << ", \"independent_samples_per_s\": " << side_by_side
         << ", \"weak_scaling_efficiency\": " << efficiency << ", \"vs_limit\": " << vs_limit
         << ", \"ddp1_cost\": " << cost << ", \"peer_plain_samples_per_s\": " << py_plain
         << ", \"peer_weak_scaling_efficiency\": " << py_efficiency
         << ", \"backward_compute_ms\": " << many.ddp_backward_compute_ms
         << ", \"backward_comm_ms\": " << many.ddp_backward_comm_ms
         << ", \"overlap_ms\": " << many.ddp_overlap_ms << ", \"hidden_share\": " << hidden
         << ", \"peer_ddp_samples_per_s\": " << py << ", \"steps\": " << steps
         << ", \"rounds\": " << rounds << "}";
    first = false;
  }
  json << "]}\n";
  std::error_code ec;
  fs::remove_all(work, ec);
  if (!cfg.json.empty()) std::printf("results written to %s\n", cfg.json.c_str());
  return 0;
}

}  // namespace apex::bench
