// apex-bench zero: the sharded optimizer (ZeRO-2, apex::parallel::DistributedFusedAdam) against
// DDP + FusedAdam in the same run, on a BERT-base-sized stack of linear layers (108M parameters):
//   memory: bf16 model with fp32 masters at W = 1, 2, 4, 8 ranks; optimizer + gradient bytes
//           per rank (exact, from the tensors) against the formula, and each rank's peak RSS;
//   large:  (only with --only large) a 517M-parameter model, W = 4, ZeRO-2 with
//           store_param_remainders, against what DDP would need and the machine's memory;
//   speed:  fp32 at W = 2 on loopback; step time, and bytes sent per step (the loopback
//           interface's counter, over both ranks) against the optimal (W-1)/W * 2 * model bytes;
//           the peers, in the same run: Python's FSDP2 (reshard_after_forward=False) and DDP +
//           ZeroRedundancyOptimizer on the same model (tools/bench/zero_peer.py).
// Ranks are copies of this program ("apex-bench zero-rank", hidden), one thread each.
#include <apex/amp/cpu_half.h>
#include <apex/optim/fused_adam.h>
#include <apex/parallel.h>
#include <apex/parallel/process_group.h>
#include <c10/util/Exception.h>
#include <sys/wait.h>
#include <torch/nn.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "bench_common.h"
#include "train/json.h"

namespace apex::bench {
namespace {

namespace fs = std::filesystem;
constexpr int64_t kHidden = 768;
constexpr int64_t kBlocks = 12;
constexpr int64_t kVocab = 30522;
constexpr int64_t kBatch = 4;

// 12 blocks of (4 x 768x768 "attention" projections, 768x3072, 3072x768) and a 768x30522 head:
// BERT-base's parameter count and shapes, without its attention math (not what is measured).
// The large model ("--only large"): the same stack at hidden size 1792, 517M parameters, which
// DDP cannot hold on 4 ranks of a 24 GiB machine (18 B/param each) and ZeRO-2 can.
constexpr int64_t kLargeHidden = 1792;
struct BertSized : torch::nn::Module {
  std::vector<torch::nn::Linear> layers;
  explicit BertSized(int64_t hidden = kHidden) {
    for (int64_t b = 0; b < kBlocks; ++b) {
      for (int k = 0; k < 4; ++k) add(hidden, hidden);
      add(hidden, 4 * hidden);
      add(4 * hidden, hidden);
    }
    add(hidden, kVocab);
  }
  void add(int64_t in, int64_t out) {
    std::string name = std::to_string(layers.size());
    name.insert(name.begin(), 'l');
    layers.push_back(register_module(name, torch::nn::Linear(in, out)));
  }
  at::Tensor forward(at::Tensor x) {
    for (size_t i = 0; i + 1 < layers.size(); ++i) {
      auto& l = layers[i];
      x = l->options.out_features() == l->options.in_features() ? x + at::tanh(l->forward(x))
                                                                : at::tanh(l->forward(x));
    }
    return layers.back()->forward(x);
  }
};

double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  }
  return 0;
}

int64_t loopback_tx() {
  std::ifstream in("/sys/class/net/lo/statistics/tx_bytes");
  int64_t v = 0;
  in >> v;
  return v;
}

std::string read_text(const fs::path& p) {
  std::ifstream in(p);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

// Runs `world` ranks of `kind` and returns rank 0's JSON line.
std::string launch(const std::string& kind, const std::string& dtype, int world, int steps,
                   const fs::path& work) {
  const fs::path out = work / (kind + "-" + dtype + "-" + std::to_string(world) + ".json");
  const std::string port = std::to_string(apex::parallel::free_loopback_port("apex-bench zero"));
  std::vector<pid_t> pids;
  std::fflush(stdout);
  for (int r = 0; r < world; ++r) {
    const pid_t pid = fork();
    TORCH_CHECK(pid >= 0, "apex-bench zero: fork failed");
    if (pid == 0) {
      setenv("RANK", std::to_string(r).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
      setenv("MASTER_ADDR", "127.0.0.1", 1);
      setenv("MASTER_PORT", port.c_str(), 1);
      const std::string s = std::to_string(steps);
      execl("/proc/self/exe", "apex-bench", "zero-rank", kind.c_str(), dtype.c_str(), s.c_str(),
            out.c_str(), static_cast<char*>(nullptr));
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
  TORCH_CHECK(ok, "apex-bench zero: a rank of ", kind, " with ", world, " ranks failed");
  return read_text(out);
}

double num(const std::string& line, const char* key) {
  return apex::train::json::get_number(line, key);
}

}  // namespace

int run_zero_rank(int argc, char** argv) {
  TORCH_CHECK(argc == 6, "apex-bench zero-rank: internal use (kind dtype steps out)");
  std::string kind = argv[2];
  const at::ScalarType dtype = std::string(argv[3]) == "bf16" ? at::kBFloat16 : at::kFloat;
  const int steps = std::stoi(argv[4]);
  // "zero-large": the large model, bf16 from the start (no fp32 copy at construction), ZeRO-2
  // with store_param_remainders.
  const bool large = kind == "zero-large";
  if (large) kind = "zero";
  const int64_t hidden = large ? kLargeHidden : kHidden;
  at::set_num_threads(1);
  auto pg = apex::parallel::init_process_group(
      apex::parallel::ProcessGroupOptions().timeout(std::chrono::minutes(10)));
  torch::manual_seed(0);
  const caffe2::TypeMeta default_dtype = c10::get_default_dtype();
  if (large) c10::set_default_dtype(caffe2::TypeMeta::fromScalarType(dtype));
  auto model = std::make_shared<BertSized>(hidden);
  c10::set_default_dtype(default_dtype);
  model->to(dtype);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();
  std::unique_ptr<torch::optim::Optimizer> opt;
  apex::parallel::DistributedFusedAdam* dfa = nullptr;
  std::optional<apex::parallel::DistributedDataParallel<std::shared_ptr<BertSized>>> ddp;
  if (kind == "ddp") {
    ddp.emplace(model, apex::parallel::DistributedDataParallelOptions(), pg);
    opt = std::make_unique<apex::optim::FusedAdam>(
        model->parameters(), apex::optim::FusedAdamOptions(1e-4).master_weights(true));
  } else {
    auto o = apex::parallel::DistributedFusedAdamOptions(1e-4).reduce_scatter(
        kind == "zero-native" ? apex::parallel::ReduceScatter::kNative
                              : apex::parallel::ReduceScatter::kAllToAll);
    if (dtype != at::kFloat) o.grad_sync_dtype(dtype).param_sync_dtype(dtype);
    if (large) o.store_param_remainders(true);
    auto d = std::make_unique<apex::parallel::DistributedFusedAdam>(model->parameters(), o, pg);
    dfa = d.get();
    opt = std::move(d);
  }
  const at::Tensor x = at::randn({kBatch, hidden}).to(dtype);
  std::vector<double> ms;
  int64_t tx0 = 0;
  for (int s = 0; s < steps + 1; ++s) {
    pg.barrier();
    if (s == 1) tx0 = loopback_tx();
    const auto t0 = std::chrono::steady_clock::now();
    opt->zero_grad();
    {
      // bf16 products through amp's CPU half fallback (fp32 speed where LibTorch's are slow).
      const apex::amp::CpuHalfFallbackGuard half(large);
      const at::Tensor y = ddp ? (*ddp)->forward(x) : model->forward(x);
      y.to(at::kFloat).pow(2).mean().backward();
    }
    opt->step();
    ms.push_back(
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  pg.barrier();
  const int64_t tx = loopback_tx() - tx0;
  // Bytes of optimizer state and gradients this rank holds after a step.
  int64_t state = 0;
  int64_t grads = 0;
  if (dfa != nullptr) {
    const auto m = dfa->memory();
    state = m.state_bytes;
    grads = m.grad_shard_bytes;
  } else {
    const auto sd = static_cast<apex::optim::FusedAdam&>(*opt).python_state_dict();
    for (const auto& kv : sd.at("state").toGenericDict()) {
      for (const auto& e : kv.value().toGenericDict()) {
        const c10::IValue v = e.value();
        if (v.isTensor() && v.toTensor().dim() > 0) {
          state += v.toTensor().numel() * static_cast<int64_t>(v.toTensor().element_size());
        }
      }
    }
    // python_state_dict holds the moments; the fp32 masters live beside them.
    if (dtype != at::kFloat) state += 4 * params;
    // p.grad, and DDP's bucket copy of it.
    grads = 2 * params * static_cast<int64_t>(c10::elementSize(dtype));
  }
  ms.erase(ms.begin());  // the first step allocates the state
  if (pg.rank() == 0) {
    std::ofstream(argv[5]) << "{\"params\": " << params << ", \"state_bytes\": " << state
                           << ", \"grad_bytes\": " << grads
                           << ", \"peak_rss_mb\": " << peak_rss_mb()
                           << ", \"step_ms\": " << median(ms)
                           << ", \"loopback_bytes_per_step\": " << static_cast<double>(tx) / steps
                           << "}\n";
  }
  return 0;
}

int run_zero(const Config& cfg) {
  TORCH_CHECK(cfg.device.is_cpu(), "apex-bench zero runs on the CPU (Gloo)");
  const fs::path work = fs::temp_directory_path() / ("apex-bench-zero-" + std::to_string(getpid()));
  fs::create_directories(work);
  std::ofstream json;
  if (!cfg.json.empty()) json.open(cfg.json);
  json << "{\"area\": \"zero\", \"memory\": [";
  const bool memory = selected(cfg, "memory");
  const bool speed = selected(cfg, "speed");
  if (memory) {
    std::printf(
        "memory per rank, BERT-base-sized model (bf16 weights, fp32 masters, bf16 "
        "gradient and parameter sync), 1 thread per rank\n");
    std::printf("%-6s %5s %12s %12s %10s %10s %10s\n", "kind", "ranks", "state MiB", "grads MiB",
                "B/param", "formula", "peak MiB");
    bool first = true;
    for (const int w : {1, 2, 4, 8}) {
      for (const std::string kind : {"ddp", "zero"}) {
        const std::string r = launch(kind, "bf16", w, 3, work);
        const double p = num(r, "params");
        const double bpp = (num(r, "state_bytes") + num(r, "grad_bytes")) / p;
        // Bytes per parameter besides the bf16 weights: DDP 12 + 2 (grad) + 2 (bucket);
        // ZeRO-2 (12 + 2) / W.
        const double formula = kind == "ddp" ? 16.0 : 14.0 / w;
        std::printf("%-6s %5d %12.1f %12.1f %10.2f %10.2f %10.0f\n", kind.c_str(), w,
                    num(r, "state_bytes") / 1048576.0, num(r, "grad_bytes") / 1048576.0, bpp,
                    formula, num(r, "peak_rss_mb"));
        std::fflush(stdout);
        json << (first ? "" : ", ") << "{\"kind\": \"" << kind << "\", \"ranks\": " << w
             << ", \"bytes_per_param\": " << bpp << ", \"formula\": " << formula
             << ", \"result\": " << r.substr(0, r.find('\n')) << "}";
        first = false;
      }
    }
  }
  if (std::find(cfg.only.begin(), cfg.only.end(), "large") != cfg.only.end()) {
    // Only when asked (a few minutes; ~15 GiB): the model DDP cannot hold here.
    const int w = 4;
    const std::string r = launch("zero-large", "bf16", w, 2, work);
    const double p = num(r, "params");
    const double bpp = (num(r, "state_bytes") + num(r, "grad_bytes")) / p;
    const double ram = static_cast<double>(sysconf(_SC_PHYS_PAGES)) *
                       static_cast<double>(sysconf(_SC_PAGE_SIZE)) / 1073741824.0;
    std::printf(
        "\nlarge: %.0fM parameters, W = %d, bf16 weights with 16-bit remainders, bf16 sync: "
        "ZeRO-2 %.2f B/param of state and gradients (formula 12/W = %.2f), peak %.0f MiB per "
        "rank; DDP + FusedAdam would need %.1f GiB per rank (18 B/param with the weights), "
        "%.1f GiB for %d ranks, on a machine of %.1f GiB\n",
        p / 1e6, w, bpp, 12.0 / w, num(r, "peak_rss_mb"), 18.0 * p / 1073741824.0,
        18.0 * p * w / 1073741824.0, w, ram);
    std::fflush(stdout);
    json << (memory ? ", " : "") << "{\"kind\": \"zero-large\", \"ranks\": " << w
         << ", \"bytes_per_param\": " << bpp << ", \"formula\": " << 12.0 / w
         << ", \"ddp_gib_per_rank\": " << 18.0 * p / 1073741824.0 << ", \"machine_gib\": " << ram
         << ", \"result\": " << r.substr(0, r.find('\n')) << "}";
  }
  json << "], \"speed\": [";
  if (speed) {
    const int world = 2;
    const int steps = std::clamp(cfg.repeats, 3, 20);
    const int rounds = std::max(3, cfg.rounds);
    std::printf(
        "\nW = %d on loopback, fp32, per-rank batch %lld; each run the median of %d steps "
        "after one, %d rounds in rotating order (peers included), medians\n",
        world, static_cast<long long>(kBatch), steps, rounds);
    std::printf("%-30s %10s %10s %14s %10s\n", "run", "step ms", "vs DDP", "sent MB/step/rank",
                "vs optimal");
    // Every configuration once per round, the order rotated, so that the machine's drift (DDP's
    // own step moved 0.89-1.68 s between runs on a 2-core VM) hits them alike; the ratio is the
    // median of the per-round ratios.
    const std::vector<std::string> kinds = {"ddp", "zero", "zero-native", "peers"};
    std::map<std::string, std::vector<double>> ms;
    std::map<std::string, double> sent, optimal;
    std::vector<double> fsdp2, zero1;
    for (int r = 0; r < rounds; ++r) {
      for (size_t k = 0; k < kinds.size(); ++k) {
        const std::string& kind = kinds[(k + r) % kinds.size()];
        if (kind == "peers") {
          const std::string peer =
              run_peer(std::string(APEX_PYTHON) + " " + APEX_SOURCE_DIR +
                       "/tools/bench/zero_peer.py --world 2 --steps " + std::to_string(steps));
          fsdp2.push_back(num(peer, "fsdp2_step_ms"));
          zero1.push_back(num(peer, "zero1_step_ms"));
          continue;
        }
        const std::string out = launch(kind, "fp32", world, steps, work);
        ms[kind].push_back(num(out, "step_ms"));
        // The loopback counter holds both ranks' sends.
        sent[kind] = num(out, "loopback_bytes_per_step") / world;
        optimal[kind] = 2.0 * (world - 1) / world * 4.0 * num(out, "params");
      }
    }
    auto ratio_to_ddp = [&](const std::vector<double>& v) {
      std::vector<double> r;
      for (size_t i = 0; i < v.size(); ++i) r.push_back(ms["ddp"][i] / v[i]);
      return median(r);
    };
    bool first = true;
    for (const std::string kind : {"ddp", "zero", "zero-native"}) {
      const char* label = kind == "ddp"    ? "DDP + FusedAdam"
                          : kind == "zero" ? "ZeRO-2 (all-to-all)"
                                           : "ZeRO-2 (Gloo reduce-scatter)";
      const double m = median(ms[kind]);
      const double ratio = ratio_to_ddp(ms[kind]);
      std::printf("%-30s %10.1f %9.2fx %14.1f %9.2fx\n", label, m, ratio, sent[kind] / 1e6,
                  sent[kind] / optimal[kind]);
      json << (first ? "" : ", ") << "{\"kind\": \"" << kind << "\", \"step_ms\": " << m
           << ", \"vs_ddp\": " << ratio << ", \"sent_bytes_per_step_per_rank\": " << sent[kind]
           << ", \"optimal_bytes\": " << optimal[kind] << "}";
      first = false;
    }
    for (const auto& [label, v] :
         {std::pair<const char*, const std::vector<double>*>{"torch FSDP2 (no reshard)", &fsdp2},
          {"torch DDP + ZeroRedundancyOpt", &zero1}}) {
      std::printf("%-30s %10.1f %9.2fx   (Python peer)\n", label, median(*v), ratio_to_ddp(*v));
      json << ", {\"kind\": \"" << label << "\", \"step_ms\": " << median(*v)
           << ", \"vs_ddp\": " << ratio_to_ddp(*v) << "}";
    }
    std::fflush(stdout);
  }
  json << "]}\n";
  std::error_code ec;
  fs::remove_all(work, ec);
  if (!cfg.json.empty()) std::printf("results written to %s\n", cfg.json.c_str());
  return 0;
}

}  // namespace apex::bench
