#include "train/cli.h"

#include <apex/amp/cpu_half.h>
#include <apex/amp/utils.h>
#include <apex/parallel/process_group.h>
#include <c10/util/Exception.h>

#include <ATen/Context.h>
#include <algorithm>
#include <cctype>
#include <cmath>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <set>
#include <sstream>

namespace apex::train {
namespace {

// Written as a plain decimal number: a digit or '-' first (strtoll/strtod also take leading
// spaces and '+', and strtod hexadecimal "0x1p-10"), no hexadecimal, infinity or NaN spelling.
bool plain_number(const std::string& v) {
  if (v.empty() ||
      !(std::isdigit(static_cast<unsigned char>(v[0])) || v[0] == '-' || v[0] == '.')) {
    return false;
  }
  for (char c : v) {
    if (!(std::isdigit(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == 'e' ||
          c == 'E' || c == '+')) {
      return false;
    }
  }
  return true;
}

// A whole decimal integer in [min, max]; anything else (overflow included: strtoll would clamp
// it) is refused with the range.
int64_t to_int(const std::string& flag, const std::string& v, int64_t min, int64_t max) {
  errno = 0;
  char* end = nullptr;
  const long long n = std::strtoll(v.c_str(), &end, 10);
  TORCH_CHECK(plain_number(v) && *end == '\0' && errno == 0 && n >= min && n <= max,
              "apex-train: ", flag, " expects an integer in [", min, ", ", max, "], got '", v, "'");
  return n;
}

// A finite number in [min, max].
double to_double(const std::string& flag, const std::string& v, double min, double max = 1e30) {
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  TORCH_CHECK(plain_number(v) && *end == '\0' && d >= min && d <= max && std::isfinite(d),
              "apex-train: ", flag, " expects a number in [", min, ", ", max, "], got '", v, "'");
  return d;
}

// The shortest "%.Ng" spelling of `d` that reads back as `d`.
std::string shortest_decimal(double d) {
  char buf[32];
  for (int digits = 1; digits <= 17; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, d);
    if (std::strtod(buf, nullptr) == d) break;
  }
  return buf;
}

// Upper bounds of the integer flags: far above any run this tool makes, low enough that no
// product of them (steps x batch x accumulation x ranks) overflows 64 bits and that a size is
// refused here, not by the allocator.
constexpr int64_t kMaxSteps = 1000000000;
constexpr int64_t kMaxBatch = 1 << 20;
constexpr int64_t kMaxSamples = 1 << 26;
constexpr int64_t kMaxWidth = 1 << 16;
constexpr int64_t kMaxDepth = 1024;

std::string one_of(const std::string& flag, const std::string& v,
                   const std::vector<std::string>& allowed) {
  if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return v;
  std::string list;
  for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
  TORCH_CHECK(false, "apex-train: ", flag, " must be one of ", list, "; got '", v, "'");
  return {};
}

const std::vector<std::string> kLevels = {"fp32", "O0", "O1", "O2", "O3"};
const std::vector<std::string> kOptimizers = {
    "fused-adam", "fused-lamb", "fused-sgd", "fused-novograd", "fused-adagrad", "adam", "sgd"};
const std::vector<std::string> kData = {"shapes", "tokens", "tones", "mnist", "cifar10", "wav"};

}  // namespace

// The --model, --width and --depth lines of --help, from the family table.
static std::string model_help() {
  std::string names;
  std::string widths;
  std::string depths;
  std::string width_values;
  std::string depth_values;
  std::string heads;
  // Appends `item` to `list` after `sep` (none before the first item).
  auto append = [](std::string& list, const char* sep, const std::string& item) {
    if (!list.empty()) list.append(sep);
    list.append(item);
  };
  for (const auto& f : model_families()) {
    append(names, " | ", f.name);
    if (widths.find(f.width_means) == std::string::npos) append(widths, " / ", f.width_means);
    if (depths.find(f.depth_means) == std::string::npos) append(depths, " / ", f.depth_means);
    append(width_values, "/", std::to_string(f.width));
    append(depth_values, "/", std::to_string(f.depth));
    if (f.heads > 0 && heads.empty()) heads = std::to_string(f.heads);
  }
  char buf[1024];
  std::snprintf(buf, sizeof(buf),
                "  --model NAME          %s (default transformer)\n"
                "  --width N             %s (family default: %s)\n"
                "  --depth N             %s (%s)\n"
                "  --heads N             attention heads (%s)\n",
                names.c_str(), widths.c_str(), width_values.c_str(), depths.c_str(),
                depth_values.c_str(), heads.c_str());
  return buf;
}

std::string usage() {
  return R"(usage: apex-train [options]
Trains a model with apex-cpp's mixed precision, one opt level or several side by side.
With no options: --model transformer --compare O0,O1,O2 on built-in token data (~2 min on 2 cores;
O0 alone, saying why, only where LibTorch multiplies bf16 matrices slowly, no AVX-512, and
APEX_CPU_HALF_FALLBACK=0 turns apex's fp32 route off).

model and data
)" + model_help() +
         R"(  --data NAME           shapes | tokens | tones (built-in, learnable, seeded) |
                        mnist | cifar10 | wav (files in --data-dir); default: the model's
  --data-dir DIR        MNIST IDX files, CIFAR-10 binary batches, or one folder per class of
                        16 kHz mono 16-bit WAV files
  --train-size N        built-in data: training samples (8192 shapes, 16384 tokens, 4096 tones)
  --test-size N         built-in data: held-out samples (1024, 2048, 512)
  --seq-len N           tokens per sequence (64)      --vocab N     vocabulary (64)
  --image-size N        shapes: image side (32)       --samples N   audio clip samples (4000)
training
  --opt-level L         fp32 (no apex) | O0 | O1 | O2 | O3 (default: compare O0,O1,O2)
  --compare L1,L2,..    train the same model from the same weights at each level, each in its own
                        process, and print a table (samples/s, speed-up, peak memory, loss,
                        held-out accuracy, skipped steps, loss scale)
  --rounds N            run the --compare levels N times, in rotating order, and report each
                        level's median samples/s and median speed-up over the rounds (1): on a
                        shared or virtual machine one round's ratios can drift by 10 %
  --half-dtype T        bf16 | fp16 (default bf16 on cpu, fp16 on cuda)
  --loss-scale S        dynamic | a positive number (default: the level's)
  --optimizer NAME      fused-adam | fused-lamb | fused-sgd | fused-novograd | fused-adagrad |
                        adam | sgd (LibTorch's AdamW / SGD) (default fused-adam)
  --batch-size N        samples per micro-batch (64)
  --accumulate N        micro-batches per optimizer step (1)
  --steps N             optimizer steps (default: the model's, about 1 minute per level)
  --epochs N            passes over the training split, instead of --steps
  --lr X                peak learning rate (1e-3)
  --warmup N            linear warm-up steps, then cosine decay to lr/10 (default steps/10)
  --weight-decay X      (0.01)
  --clip X              clip the gradient norm to X (off)
  --seed N              weights, data and order (0)
  --device D            cpu | cuda (cpu)
  --threads N           intra-op threads (LibTorch's default)
output
  --log-every N         steps per logged point (10)
  --metrics FILE        JSON lines: one per logged step, then a summary record per level
  --plot FILE.svg       the loss curves of every level on one chart
  --checkpoint DIR      save model, optimizer and amp state (atomically) at the end
  --checkpoint-every N  ... and every N steps
  --resume              continue from the checkpoint in --checkpoint DIR (bit-identically);
                        every file is checked against the checkpoint's manifest first, and
                        the run's settings against the checkpoint's (docs/reliability.md)
  --resume-from step-N  ... from that step folder of DIR instead of the one `latest` names
  --resume-with-changes resume although seed, data, batch, schedule, steps or ranks differ
  --stop-after N        stop after step N as if interrupted (checkpoint first): tests resume
  --no-progress         no progress bar or lines
distributed (Gloo over TCP; docs/distributed.md)
  --ddp                 train data-parallel in the group that torchrun's environment describes
                        (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): each rank its shard of every
                        batch (--batch-size is per rank), gradients averaged by DDP
  --nproc N             start N local ranks itself (on 127.0.0.1) and train with --ddp
  --sync-bn             resnet: BatchNorm statistics over every rank's batch (SyncBatchNorm)
  --zero                ZeRO-2 with --ddp/--nproc: Adam's state and the gradients sharded over
                        the ranks (DistributedFusedAdam; amp casts the model, a GradScaler for fp16)
  --zero-reduce-scatter M  auto (all-to-all on Gloo: (W-1)/W of the gradients), all-to-all, or
                        native (Gloo's own: an all-reduce, twice the bytes)
  --zero-message-cap-mb X  the largest message of a bucket's exchanges in MiB per peer (0: one
                        per bucket): on a slow link between hosts 0.125-0.25 keeps its queue
                        short (one large exchange both ways runs at ~60 % of the link)
  --bucket-cap-mb X     DDP's gradient bucket size in MiB, the first bucket's too, as Python
                        DDP's bucket_cap_mb (default 25, first bucket 1): small buckets let a
                        small model's all-reduce start while backward still runs
  --timeout S           seconds a rank waits for the others: to join the group (a missing or
                        unreachable rank) and in any one collective (a dead one) (300)
  --help
)";
}

Cli parse_cli(const std::vector<std::string>& args) {
  Cli cli;
  cli.args = args;
  TrainOptions& o = cli.train;
  bool level_set = false;
  bool half_set = false;
  bool bucket_set = false;
  bool timeout_set = false;
  bool zero_rs_set = false;
  bool zero_cap_set = false;
  static const std::set<std::string> kPerLevel = {"--compare", "--opt-level",  "--plot",
                                                  "--metrics", "--checkpoint", "--summary-out",
                                                  "--rounds"};
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& flag = args[i];
    if (flag == "--help" || flag == "-h") {
      cli.help = true;
      continue;
    }
    if (flag == "--resume" || flag == "--no-progress" || flag == "--ddp" || flag == "--sync-bn" ||
        flag == "--resume-with-changes" || flag == "--zero") {
      if (flag == "--resume") {
        o.resume = true;
      } else if (flag == "--resume-with-changes") {
        o.resume_with_changes = true;
      } else if (flag == "--ddp") {
        o.ddp = true;
      } else if (flag == "--sync-bn") {
        o.sync_bn = true;
      } else if (flag == "--zero") {
        o.zero = true;
      } else {
        o.progress = false;
      }
      cli.child_args.push_back(flag);
      continue;
    }
    TORCH_CHECK(flag.rfind("--", 0) == 0, "apex-train: unexpected argument '", flag,
                "' (see --help)");
    TORCH_CHECK(i + 1 < args.size(), "apex-train: ", flag, " needs a value");
    const std::string& v = args[++i];
    if (kPerLevel.count(flag) == 0) {
      cli.child_args.push_back(flag);
      cli.child_args.push_back(v);
    }
    if (flag == "--model") {
      o.model.family = one_of(flag, v, model_family_names());
    } else if (flag == "--width") {
      o.model.width = to_int(flag, v, 1, kMaxWidth);
    } else if (flag == "--depth") {
      o.model.depth = to_int(flag, v, 1, kMaxDepth);
    } else if (flag == "--heads") {
      o.model.heads = to_int(flag, v, 1, kMaxDepth);
    } else if (flag == "--data") {
      o.data = one_of(flag, v, kData);
    } else if (flag == "--data-dir") {
      o.data_dir = v;
    } else if (flag == "--train-size") {
      o.train_size = to_int(flag, v, 1, kMaxSamples);
    } else if (flag == "--test-size") {
      o.test_size = to_int(flag, v, 1, kMaxSamples);
    } else if (flag == "--seq-len") {
      o.seq_len = to_int(flag, v, 8, 1 << 16);
    } else if (flag == "--vocab") {
      o.vocab = to_int(flag, v, 8, 1 << 24);
    } else if (flag == "--image-size") {
      o.image_size = to_int(flag, v, 8, 4096);
    } else if (flag == "--samples") {
      o.samples = to_int(flag, v, 400, 1 << 24);
    } else if (flag == "--opt-level") {
      o.opt_level = one_of(flag, v, kLevels);
      level_set = true;
    } else if (flag == "--compare") {
      cli.compare.clear();
      size_t start = 0;
      while (start <= v.size()) {
        const size_t comma = v.find(',', start);
        const std::string level =
            v.substr(start, comma == std::string::npos ? comma : comma - start);
        cli.compare.push_back(one_of(flag, level, kLevels));
        if (comma == std::string::npos) break;
        start = comma + 1;
      }
      const std::set<std::string> unique(cli.compare.begin(), cli.compare.end());
      TORCH_CHECK(unique.size() == cli.compare.size(),
                  "apex-train: --compare lists a level twice: ", v);
    } else if (flag == "--half-dtype") {
      o.half_dtype = one_of(flag, v, {"bf16", "fp16"}) == "bf16" ? c10::kBFloat16 : c10::kHalf;
      half_set = true;
    } else if (flag == "--loss-scale") {
      // One spelling per value ("8", "8.0" and "8e0" alike): the checkpoint signature holds it.
      o.loss_scale = v == "dynamic" ? v : shortest_decimal(to_double(flag, v, 1e-30));
    } else if (flag == "--optimizer") {
      o.optimizer = one_of(flag, v, kOptimizers);
    } else if (flag == "--batch-size") {
      o.batch_size = to_int(flag, v, 1, kMaxBatch);
    } else if (flag == "--accumulate") {
      o.accumulate = to_int(flag, v, 1, kMaxBatch);
    } else if (flag == "--steps") {
      o.steps = to_int(flag, v, 1, kMaxSteps);
    } else if (flag == "--epochs") {
      o.epochs = to_int(flag, v, 1, 1000000);
    } else if (flag == "--lr") {
      o.lr = to_double(flag, v, 0.0, 1e6);
      TORCH_CHECK(o.lr > 0, "apex-train: --lr must be > 0, got '", v, "'");
    } else if (flag == "--warmup") {
      o.warmup = to_int(flag, v, 0, kMaxSteps);
    } else if (flag == "--weight-decay") {
      o.weight_decay = to_double(flag, v, 0.0, 1e6);
    } else if (flag == "--clip") {
      o.clip = to_double(flag, v, 0.0, 1e30);
    } else if (flag == "--seed") {
      o.seed = static_cast<uint64_t>(to_int(flag, v, 0, std::numeric_limits<int64_t>::max()));
    } else if (flag == "--device") {
      o.device = c10::Device(one_of(flag, v, {"cpu", "cuda"}));
    } else if (flag == "--threads") {
      o.threads = static_cast<int>(to_int(flag, v, 1, 1024));
    } else if (flag == "--log-every") {
      o.log_every = to_int(flag, v, 1, kMaxSteps);
    } else if (flag == "--metrics") {
      o.metrics = v;
    } else if (flag == "--plot") {
      cli.plot = v;
    } else if (flag == "--checkpoint") {
      o.checkpoint = v;
    } else if (flag == "--resume-from") {
      TORCH_CHECK(v.size() > 5 && v.rfind("step-", 0) == 0 &&
                      v.find_first_not_of("0123456789", 5) == std::string::npos,
                  "apex-train: --resume-from expects a folder name step-N of --checkpoint, got '",
                  v, "'");
      o.resume_from = v;
      o.resume = true;
    } else if (flag == "--checkpoint-every") {
      o.checkpoint_every = to_int(flag, v, 1, kMaxSteps);
    } else if (flag == "--stop-after") {
      o.stop_after = to_int(flag, v, 1, kMaxSteps);
    } else if (flag == "--summary-out") {
      cli.summary_out = v;
    } else if (flag == "--bucket-cap-mb") {
      o.bucket_cap_mb = to_double(flag, v, 1e-6, 1e6);
      bucket_set = true;
    } else if (flag == "--nproc") {
      cli.nproc = to_int(flag, v, 1, 64);
    } else if (flag == "--zero-reduce-scatter") {
      TORCH_CHECK(v == "auto" || v == "native" || v == "all-to-all", "apex-train: ", flag,
                  " expects auto, native or all-to-all, got '", v, "'");
      o.zero_reduce_scatter = v;
      zero_rs_set = true;
    } else if (flag == "--zero-message-cap-mb") {
      o.zero_message_cap_mb = to_double(flag, v, 0, 1e6);
      zero_cap_set = true;
    } else if (flag == "--timeout") {
      o.timeout_s = to_double(flag, v, 0.1, 86400.0 * 7);
      timeout_set = true;
    } else if (flag == "--rounds") {
      cli.rounds = to_int(flag, v, 1, 100);
    } else {
      TORCH_CHECK(false, "apex-train: unknown option '", flag, "' (see --help)");
    }
  }
  TORCH_CHECK(!(level_set && !cli.compare.empty()),
              "apex-train: give either --opt-level or --compare, not both");
  TORCH_CHECK(cli.rounds == 1 || !level_set,
              "apex-train: --rounds repeats a --compare; give --compare (or no level), not "
              "--opt-level");
  TORCH_CHECK(cli.rounds == 1 || (o.checkpoint.empty() && !o.resume),
              "apex-train: --rounds trains every level afresh each round; it takes no --checkpoint "
              "or --resume");
  if (!half_set && o.device.is_cuda()) o.half_dtype = c10::kHalf;
  TORCH_CHECK(!o.ddp || (level_set && cli.compare.empty()),
              "apex-train: --ddp trains one opt level: give --opt-level (to compare levels "
              "data-parallel, run apex-train --nproc N --compare ...)");
  if (!level_set && cli.compare.empty()) {
    cli.compare = {"O0", "O1", "O2"};
    // On a CPU where LibTorch multiplies the half dtype in a scalar loop, apex::amp computes
    // half matmuls through fp32 (apex/amp/cpu_half.h). Only with that turned off
    // (APEX_CPU_HALF_FALLBACK=0) would O1 and O2 take an hour where O0 takes minutes: the default
    // then runs O0 alone and says why. (Decided from cpuid, never from a timing: a busy machine
    // once made a timing misjudge.)
    if (o.device.is_cpu() && !cli.help) {
      if (apex::amp::cpu_half_matmul_kind(o.half_dtype) == apex::amp::CpuHalfMatmul::kScalar &&
          !apex::amp::cpu_half_fallback_available(o.half_dtype)) {
        cli.compare = {"O0"};
        std::ostringstream note;
        note << "apex-train: O1 and O2 left out of the default comparison: LibTorch multiplies "
             << (o.half_dtype == c10::kBFloat16 ? "bf16" : "fp16") << " matrices "
             << apex::amp::cpu_half_matmul_slow_reason(o.half_dtype)
             << ", and APEX_CPU_HALF_FALLBACK=0 turns off apex's fp32 route, so they would train "
                "tens of times slower than O0; --compare O0,O1,O2 runs them anyway";
        cli.note = note.str();
      }
    }
  }
  TORCH_CHECK(!o.resume || !o.checkpoint.empty(), "apex-train: --resume needs --checkpoint DIR");
  TORCH_CHECK(o.batch_size * o.accumulate <= kMaxBatch, "apex-train: --batch-size ", o.batch_size,
              " x --accumulate ", o.accumulate, " = ", o.batch_size * o.accumulate,
              " samples per step, more than ", kMaxBatch, " (lower one of them)");
  TORCH_CHECK(!timeout_set || o.ddp || cli.nproc > 0,
              "apex-train: --timeout needs --ddp (under torchrun) or --nproc N");
  TORCH_CHECK(!bucket_set || o.ddp || cli.nproc > 0,
              "apex-train: --bucket-cap-mb needs --ddp (under torchrun) or --nproc N");
  TORCH_CHECK(!o.sync_bn || o.ddp || cli.nproc > 0,
              "apex-train: --sync-bn needs --ddp (under torchrun) or --nproc N");
  TORCH_CHECK(!zero_rs_set || o.zero, "apex-train: --zero-reduce-scatter needs --zero");
  TORCH_CHECK(!zero_cap_set || o.zero, "apex-train: --zero-message-cap-mb needs --zero");
  TORCH_CHECK(!o.zero || o.ddp || cli.nproc > 0,
              "apex-train: --zero needs --ddp (under torchrun) or --nproc N");
  TORCH_CHECK(!o.zero || o.optimizer == "fused-adam" || o.optimizer == "adam",
              "apex-train: --zero shards Adam (apex::parallel::DistributedFusedAdam); --optimizer ",
              o.optimizer, " is not sharded (use fused-adam)");
  TORCH_CHECK(!(o.ddp && cli.nproc > 0),
              "apex-train: give either --ddp (under torchrun) or "
              "--nproc N (apex-train starts the ranks itself), not both");
  const char* launch = cli.nproc > 0 ? "--nproc" : "--ddp";
  TORCH_CHECK(!(o.ddp || cli.nproc > 0) || o.device.is_cpu() ||
                  apex::parallel::backend_available(apex::parallel::Backend::kNccl),
              "apex-train: ", launch, " on ", o.device,
              " needs the NCCL backend, which this build lacks (a CUDA build of LibTorch and "
              "nccl.h at configure time); use --device cpu (Gloo)");
  TORCH_CHECK(!(cli.nproc > 1 && o.device.is_cuda() && o.device.has_index()),
              "apex-train: --nproc ", cli.nproc, " with --device ", o.device,
              " would put every rank on one GPU; give --device cuda (rank r takes cuda:r)");
  if (o.ddp && o.device.is_cuda() && !o.device.has_index()) {
    // One GPU per rank, as torchrun's LOCAL_RANK numbers them on this node.
    const char* local = std::getenv("LOCAL_RANK");
    char* end = nullptr;
    const long index = local != nullptr ? std::strtol(local, &end, 10) : 0;
    TORCH_CHECK(local == nullptr || (end != local && *end == '\0' && index >= 0 && index < 1024),
                "apex-train: LOCAL_RANK must be an integer in [0, 1024), got '",
                local != nullptr ? local : "", "'");
    o.device = c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
  }
  TORCH_CHECK(o.steps == 0 || o.epochs == 0, "apex-train: give either --steps or --epochs");
  if (o.steps == 0 && o.epochs == 0) o.steps = model_family(o.model.family).default_steps;
  return cli;
}

}  // namespace apex::train
