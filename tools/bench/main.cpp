// apex-bench <area> [options]: benchmarks of apex-cpp against its LibTorch peers.
#include <ATen/Parallel.h>
#include <apex/io.h>
#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "bench_common.h"

namespace {

/// The benchmark areas: a new area is one row (and its run_ function in bench_common.h).
struct Area {
  const char* name;
  const char* help;
  int (*run)(const apex::bench::Config&);
};
const Area kAreas[] = {
    {"optim", "FusedAdam, FusedSGD, FusedLAMB on ResNet-50 / BERT-base parameter lists",
     apex::bench::run_optim},
    {"norm", "FusedLayerNorm / FusedRMSNorm against at::layer_norm / the composite expression",
     apex::bench::run_norm},
    {"train", "apex-train's transformer and resnet at O0/O1/O2 against the same models in PyTorch",
     apex::bench::run_train},
    {"ddp", "data-parallel weak scaling on this machine's cores (Gloo) against Python's DDP",
     apex::bench::run_ddp},
    {"zero",
     "ZeRO-2 (DistributedFusedAdam) against DDP + FusedAdam: memory per rank (W = 1, 2, 4, 8), "
     "step time and bytes at W = 2, Python FSDP2 / ZeroRedundancyOptimizer as peers",
     apex::bench::run_zero},
    {"half",
     "amp's CPU half route and the ops between (bf16/fp16) against LibTorch's half and fp32",
     apex::bench::run_half},
};

void usage(std::FILE* out) {
  std::fprintf(out, "usage: apex-bench <area> [options]\nareas:\n");
  for (const Area& a : kAreas) std::fprintf(out, "  %-9s %s\n", a.name, a.help);
  std::fprintf(
      out,
      "options:\n"
      "  --device cpu|cuda   where to run (default cpu)\n"
      "  --threads N         intra-op threads (default: LibTorch's)\n"
      "  --repeats N         timed runs per case, the median is reported (default 10)\n"
      "  --warmup N          untimed runs first (default 2)\n"
      "  --rounds N          train, zero: every configuration N times, in rotating order (zero:\n"
      "                      at least 3); medians of samples/s\n"
      "                      and of the per-round ratios to O0 (default 1)\n"
      "  --only NAME         only this model (optim: resnet50, bert; train: transformer, resnet),\n"
      "                      part (zero: memory, speed; large: a 517M-parameter model\n"
      "                      only ZeRO-2 fits here, not run by default),\n"
      "                      shape (norm: 4096x1024) or op (half: mm, linear, conv2d, conv1d,\n"
      "                      conv_t1d, conv1x1, sdpa, addbmm, mm_out, conv_tbc, addmv, rnn, "
      "linear16, linear1,\n"
      "                      lstm_cell, gru_cell, batch_norm, relu_add, mean, group_norm,\n"
      "                      softmax, silu, gelu); repeatable\n"
      "  --json FILE         also write the results as JSON to FILE (default: none)\n");
}

// A whole decimal integer in [min, max]; anything else (overflow included) exits with a message.
int parse_int(const std::string& flag, const char* v, int min, int max) {
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v, &end, 10);
  if (errno == ERANGE || end == v || *end != '\0' || n < min || n > max) {
    std::fprintf(stderr, "apex-bench: %s expects a whole number in [%d, %d], got '%s'\n",
                 flag.c_str(), min, max, v);
    std::exit(2);
  }
  return static_cast<int>(n);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  const std::string area = argv[1];
  if (area == "ddp-rank" || area == "zero-rank") {  // a rank of `apex-bench ddp`/`zero`
    try {
      return area == "ddp-rank" ? apex::bench::run_ddp_rank(argc, argv)
                                : apex::bench::run_zero_rank(argc, argv);
    } catch (const c10::Error& e) {
      std::fprintf(stderr, "apex-bench: %s\n", e.what_without_backtrace());
      return 1;
    }
  }
  apex::bench::Config cfg;
  for (int i = 2; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "apex-bench: %s needs a value\n", flag.c_str());
      return 2;
    }
    const char* value = argv[++i];
    if (flag == "--device") {
      if (std::strcmp(value, "cpu") != 0 && std::strcmp(value, "cuda") != 0) {
        std::fprintf(stderr, "apex-bench: --device must be cpu or cuda, got '%s'\n", value);
        return 2;
      }
      cfg.device = c10::Device(value);
    } else if (flag == "--threads") {
      cfg.threads = parse_int(flag, value, 1, 4096);
    } else if (flag == "--repeats") {
      cfg.repeats = parse_int(flag, value, 1, 100000);
    } else if (flag == "--rounds") {
      cfg.rounds = parse_int(flag, value, 1, 100);
    } else if (flag == "--warmup") {
      cfg.warmup = parse_int(flag, value, 0, 100000);
    } else if (flag == "--only") {
      cfg.only.emplace_back(value);
    } else if (flag == "--json") {
      cfg.json = value;
    } else {
      std::fprintf(stderr, "apex-bench: unknown option '%s' (see --help)\n", flag.c_str());
      return 2;
    }
  }
  if (cfg.threads > 0) at::set_num_threads(cfg.threads);
  try {
    for (const Area& a : kAreas) {
      if (area != a.name) continue;
      // A bad output path fails now, not after minutes of measuring.
      if (!cfg.json.empty()) apex::check_writable(cfg.json, "--json");
      return a.run(cfg);
    }
    std::fprintf(stderr, "apex-bench: unknown area '%s' (see --help)\n", area.c_str());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "apex-bench: %s\n", e.what_without_backtrace());
    return 1;
  }
}
