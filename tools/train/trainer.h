#pragma once

// apex-train's training run: one model at one opt level, from options to a summary. The CLI
// (cli.h) fills TrainOptions; --compare runs one of these per level, each in its own process.

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "train/models.h"

namespace apex::train {

struct Split;

struct TrainOptions {
  ModelConfig model;
  std::string data;        ///< shapes | tokens | tones | mnist | cifar10 | wav ("" = the model's)
  std::string data_dir;    ///< for mnist, cifar10, wav
  int64_t train_size = 0;  ///< synthetic samples (0 = default)
  int64_t test_size = 0;
  int64_t seq_len = 64;
  int64_t vocab = 64;
  int64_t image_size = 32;
  int64_t samples = 4000;        ///< audio clip length
  std::string opt_level = "O1";  ///< "fp32" (no apex at all) or O0..O3
  c10::ScalarType half_dtype = c10::kBFloat16;
  std::string loss_scale;  ///< "" (the level's default), "dynamic" or a number
  std::string optimizer = "fused-adam";
  int64_t batch_size = 64;
  int64_t steps = 0;   ///< optimizer steps (0: from epochs)
  int64_t epochs = 0;  ///< passes over the train split (used when steps == 0)
  double lr = 1e-3;
  int64_t warmup = -1;  ///< linear warm-up steps, then cosine decay to lr/10 (-1: total/10)
  double weight_decay = 0.01;
  uint64_t seed = 0;
  c10::Device device = c10::kCPU;
  int threads = 0;
  int64_t accumulate = 1;  ///< micro-batches per optimizer step
  /// Steps before the throughput clock starts (Summary::samples_per_s), as the benchmarks' Python
  /// peers time after a warm-up: the first steps pay one-time costs (allocations, oneDNN
  /// primitives, DDP's bucket rebuild). At least one step is always timed.
  int64_t untimed_steps = 0;
  double clip = 0.0;  ///< max gradient norm (0: off)
  int64_t log_every = 10;
  std::string metrics;           ///< JSON-lines file
  std::string checkpoint;        ///< directory
  int64_t checkpoint_every = 0;  ///< steps (0: only at the end)
  bool resume = false;
  std::string resume_from;  ///< a step-N folder of --checkpoint ("" = the one `latest` names)
  bool resume_with_changes = false;  ///< resume although run-changing settings differ
  int64_t stop_after = 0;  ///< stop (with a checkpoint) after this step, as if interrupted (tests)
  bool progress = true;    ///< progress bar on a terminal, lines otherwise
  bool ddp = false;        ///< data-parallel in the environment's process group (torchrun's)
  bool sync_bn = false;    ///< resnet: SyncBatchNorm instead of BatchNorm (needs ddp)
  /// ZeRO-2: apex::parallel::DistributedFusedAdam shards the optimizer state and gradients over
  /// the ranks (needs ddp, Adam, fp32/O0/O1).
  bool zero = false;
  std::string zero_reduce_scatter = "auto";  ///< auto, all-to-all or native
  /// ZeRO-2: the largest message of a bucket's exchanges in MiB per peer (0: none).
  double zero_message_cap_mb = 0;
  /// DDP's bucket size in MiB, the first bucket's too, as Python DDP's bucket_cap_mb (0: the
  /// defaults, 25 MiB and a first bucket of 1 MiB).
  double bucket_cap_mb = 0;
  /// Seconds a rank waits to join the group and in any one collective before it fails.
  double timeout_s = 300;
};

/// One logged step.
struct StepRecord {
  int64_t step = 0;
  double loss = 0;
  double loss_scale = 1;
  double lr = 0;
  double samples_per_s = 0;
  double elapsed_s = 0;
};

struct Summary {
  std::string level;
  std::string model;
  int64_t steps = 0;
  int64_t samples = 0;
  double train_seconds = 0;
  double samples_per_s = 0;
  double final_loss = 0;  ///< mean train loss over the last logged window
  double test_loss = 0;
  double test_accuracy = 0;
  int64_t skipped_steps = 0;
  double loss_scale = 1;
  double peak_rss_mb = 0;  ///< the process's high-water mark (VmHWM)
  /// Bytes of optimizer state (and, with --zero, the gradient shard) this rank holds.
  double optimizer_state_mb = 0;
  int64_t rank = 0;        ///< this process's rank (only rank 0's summary is complete)
  int64_t world_size = 1;  ///< ranks that trained (samples and samples/s are summed over them)
  /// DDP runs: c10d's Logger averages (its sampled iterations) of rank 0's backward compute, its
  /// all-reduce time, and how much of that ran while backward was still computing; ms.
  double ddp_backward_compute_ms = 0;
  double ddp_backward_comm_ms = 0;
  double ddp_overlap_ms = 0;
  /// DDP runs: gradient buckets at the end (rebuilt in arrival order at the second forward, so a
  /// one-step run reports the initial single bucket).
  int64_t ddp_buckets = 0;
  std::vector<StepRecord> curve;
};

/// The sample order: a fresh permutation of the train split per epoch, apex::parallel's
/// DistributedSampler's for the seed and the epoch number only (a resumed run sees the same
/// batches), read as one stream across epochs and cut into global micro-batches.
class EpochSampler {
 public:
  EpochSampler(int64_t n, uint64_t seed) : n_(n), seed_(seed) {}
  /// Sample indices at positions [first, first + count) of the epochs' concatenated orders.
  at::Tensor indices(int64_t first, int64_t count);
  /// Rank `rank`'s slice of global micro-batch `micro_batch` (of batch x world positions): the
  /// ranks' shards are disjoint, and over an epoch every sample is seen once.
  at::Tensor shard(int64_t micro_batch, int64_t batch, int64_t world, int64_t rank);

 private:
  int64_t n_;
  uint64_t seed_;
  int64_t epoch_ = -1;
  at::Tensor perm_;
};

/// Optimizer steps of a run over a train split of `train_size` samples (--steps, or --epochs),
/// `world` ranks each taking their batch per step.
int64_t total_steps(const TrainOptions& options, int64_t train_size, int64_t world = 1);

/// Refuses a device this LibTorch cannot serve, saying what to install or pass.
void check_device(const TrainOptions& options);

/// Loads (or generates) the data the options name; errors are one-line c10::Errors.
Split load_data(const TrainOptions& options);

/// Checks, before any training, that every output of `o` (--metrics, --checkpoint) can be
/// written: a bad path fails now, not after the training.
void check_outputs(const TrainOptions& o);
/// The one live writer of a checkpoint folder: an exclusive lock on DIR/.lock (flock: the kernel
/// drops it when the holder dies, even by SIGKILL, so a dead writer leaves nothing behind that
/// blocks a resume). Construction fails with a c10::Error naming the folder and the holder's pid
/// when another live process holds it. `probe`: take and release at once (a launcher that only
/// checks before starting the process that writes).
class CheckpointLock {
 public:
  CheckpointLock() = default;
  explicit CheckpointLock(const std::string& dir, bool probe = false);
  ~CheckpointLock();
  CheckpointLock(CheckpointLock&& other) noexcept;
  CheckpointLock& operator=(CheckpointLock&& other) noexcept;
  CheckpointLock(const CheckpointLock&) = delete;
  CheckpointLock& operator=(const CheckpointLock&) = delete;

 private:
  int fd_ = -1;
  std::string path_;
};

/// Refuses sizes whose parameters (with gradients and optimizer state) cannot fit in this
/// machine's memory, before anything is allocated.
void check_fits(const TrainOptions& o);

/// Trains and evaluates. Writes metrics / checkpoints as the options say. Throws c10::Error with
/// a one-line message on bad input or divergence.
Summary train(const TrainOptions& options, const Split& data);

/// Summary as one JSON object (the metrics file's last line), and back.
std::string to_json(const Summary& s);
Summary summary_from_json(const std::string& line);

/// Peak resident set of this process in MiB (VmHWM from /proc/self/status).
double peak_rss_mb();

}  // namespace apex::train
