// What a run needs before it trains (trainer.h): its data, the checks that fail before any work
// (device, memory, output paths), the epoch sampler shared by every rank, the step count.
#include <apex/io.h>
#include <apex/parallel/distributed_sampler.h>
#include <c10/util/Exception.h>

#include <ATen/Context.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <unistd.h>

#include "train/data.h"
#include "train/trainer.h"

namespace apex::train {
namespace fs = std::filesystem;

at::Tensor EpochSampler::indices(int64_t first, int64_t count) {
  std::vector<at::Tensor> parts;
  while (count > 0) {
    const int64_t epoch = first / n_;
    if (epoch != epoch_) {
      // The epoch's order is the public sampler's (one replica: the whole permutation, Python's
      // DistributedSampler order for seed + epoch); the ranks' shards are cut from it below as
      // global micro-batches, so that R ranks see exactly one process's batches.
      const auto order =
          apex::parallel::DistributedSampler(
              static_cast<size_t>(n_),
              apex::parallel::DistributedSamplerOptions().num_replicas(1).rank(0).seed(seed_))
              .indices(epoch);
      perm_ = at::empty({n_}, at::TensorOptions().dtype(at::kLong));
      int64_t* p = perm_.data_ptr<int64_t>();
      for (int64_t i = 0; i < n_; ++i) p[i] = static_cast<int64_t>(order[static_cast<size_t>(i)]);
      epoch_ = epoch;
    }
    const int64_t off = first % n_;
    const int64_t take = std::min(count, n_ - off);
    parts.push_back(perm_.slice(0, off, off + take));
    first += take;
    count -= take;
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

at::Tensor EpochSampler::shard(int64_t micro_batch, int64_t batch, int64_t world, int64_t rank) {
  return indices(micro_batch * batch * world + rank * batch, batch);
}

int64_t total_steps(const TrainOptions& o, int64_t train_size, int64_t world) {
  if (o.steps > 0) return o.steps;
  const int64_t per_step = o.batch_size * o.accumulate * world;
  return std::max<int64_t>(1, std::max<int64_t>(o.epochs, 1) * train_size / per_step);
}

Split load_data(const TrainOptions& o) {
  const std::string name = o.data.empty() ? model_family(o.model.family).default_data : o.data;
  const bool file_based = name == "mnist" || name == "cifar10" || name == "wav";
  TORCH_CHECK(!file_based || !o.data_dir.empty(), "apex-train: --data ", name,
              " needs --data-dir DIR");
  const uint64_t seed = o.seed + 12345;
  if (name == "shapes") {
    return synthetic_images(o.train_size > 0 ? o.train_size : 8192,
                            o.test_size > 0 ? o.test_size : 1024, o.image_size, 1, seed);
  }
  if (name == "tokens") {
    return synthetic_tokens(o.train_size > 0 ? o.train_size : 16384,
                            o.test_size > 0 ? o.test_size : 2048, o.seq_len, o.vocab, seed);
  }
  if (name == "tones") {
    return synthetic_audio(o.train_size > 0 ? o.train_size : 4096,
                           o.test_size > 0 ? o.test_size : 512, o.samples, seed);
  }
  if (name == "mnist") return load_mnist(o.data_dir);
  if (name == "cifar10") return load_cifar10(o.data_dir);
  TORCH_CHECK(name == "wav", "apex-train: unknown --data '", name,
              "' (expected shapes, tokens, tones, mnist, cifar10 or wav)");
  return load_wav_folder(o.data_dir, o.samples, 0.2, o.seed);
}

double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  }
  return 0.0;
}

void check_device(const TrainOptions& o) {
  TORCH_CHECK(!o.device.is_cuda() || at::hasCUDA(),
              "apex-train: --device cuda, but this LibTorch is a CPU-only build (or sees no "
              "GPU): install a CUDA build of torch and rebuild (scripts/setup with "
              "APEX_TORCH_SPEC), or use --device cpu");
}

void check_fits(const TrainOptions& o) {
  const ModelConfig c = resolved(o.model);
  const double params = model_family(c.family).min_parameters(c);
  // fp32 weights, gradients and two optimizer moments at least.
  const double bytes = params * 16.0;
  const double memory =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  TORCH_CHECK(memory <= 0 || bytes <= memory, "apex-train: --model ", c.family, " --width ",
              c.width, " --depth ", c.depth, " would have at least ", params,
              " parameters, which with their gradients and optimizer state need at least ",
              bytes / (1 << 30), " GiB; this machine has ", memory / (1 << 30),
              " GiB (lower --width or --depth)");

  // The built-in data sets are generated in memory: samples times their size.
  const std::string data = o.data.empty() ? model_family(c.family).default_data : o.data;
  double per_sample = 0;
  double samples = 0;
  if (data == "shapes") {
    per_sample = 4.0 * static_cast<double>(o.image_size) * static_cast<double>(o.image_size);
    samples = (o.train_size > 0 ? o.train_size : 8192) + (o.test_size > 0 ? o.test_size : 1024);
  } else if (data == "tokens") {
    per_sample = 8.0 * static_cast<double>(o.seq_len);
    samples = (o.train_size > 0 ? o.train_size : 16384) + (o.test_size > 0 ? o.test_size : 2048);
  } else if (data == "tones") {
    per_sample = 4.0 * static_cast<double>(o.samples);
    samples = (o.train_size > 0 ? o.train_size : 4096) + (o.test_size > 0 ? o.test_size : 512);
  }
  const double data_bytes = per_sample * samples;
  TORCH_CHECK(memory <= 0 || data_bytes <= memory, "apex-train: the built-in ", data, " data (",
              samples, " samples of ", per_sample, " bytes) needs ", data_bytes / (1 << 30),
              " GiB; this machine has ", memory / (1 << 30),
              " GiB (lower --train-size, --test-size or the sample size)");
}

void check_outputs(const TrainOptions& o) {
  if (!o.metrics.empty()) apex::check_writable(o.metrics, "apex-train: --metrics");
  if (!o.checkpoint.empty()) {
    std::error_code ec;
    fs::create_directories(o.checkpoint, ec);
    TORCH_CHECK(!ec, "apex-train: --checkpoint ", o.checkpoint, ": cannot create it (",
                ec.message(), ")");
    TORCH_CHECK(fs::is_directory(o.checkpoint, ec), "apex-train: --checkpoint ", o.checkpoint,
                " is not a folder");
    apex::check_writable((fs::path(o.checkpoint) / "latest").string(), "apex-train: --checkpoint");
    // A new run would replace the checkpoint there at its first save, without a word.
    TORCH_CHECK(o.resume || !fs::exists(fs::path(o.checkpoint) / "latest", ec),
                "apex-train: --checkpoint ", o.checkpoint,
                " already holds a run's checkpoint; pass --resume to continue it, or another "
                "folder (or remove that one) to start a new run");
  }
}

}  // namespace apex::train
