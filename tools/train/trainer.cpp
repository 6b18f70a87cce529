#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <apex/amp/grad_scaler.h>
#include <apex/amp/initialize.h>
#include <apex/io.h>
#include <apex/optim.h>
#include <apex/parallel/distributed.h>
#include <apex/parallel/distributed_fused_adam.h>
#include <apex/parallel/distributed_sampler.h>
#include <apex/parallel/process_group.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <malloc.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include <unistd.h>

#include "train/checkpoint.h"
#include "train/data.h"
#include "train/json.h"
#include "train/optimizer_factory.h"
#include "train/progress.h"

namespace apex::train {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Warm-up (default: a tenth of the run), then cosine decay to lr / 10.
double lr_at(const TrainOptions& o, int64_t step, int64_t total) {
  const int64_t warmup = o.warmup >= 0 ? o.warmup : total / 10;
  if (warmup > 0 && step < warmup) {
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double t = std::min(1.0, static_cast<double>(step - warmup) / span);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * t)));
}

// Appends `text` to the metrics file and flushes it; a failed write (full disk, a removed
// folder) is an error, not a lost record.
void write_metrics(std::FILE* f, const std::string& text, const std::string& path) {
  if (text.empty()) return;
  TORCH_CHECK(std::fputs(text.c_str(), f) >= 0 && std::fflush(f) == 0, "apex-train: --metrics ",
              path, ": write failed: ", std::strerror(errno));
}

// Steps that must overflow in a row before a dynamic loss scale counts as stuck.
constexpr int64_t kStuckSteps = 20;

// The step records of `path` up to `step` (all levels), as text; "" when the file is absent.
std::string metrics_up_to(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line.find("\"summary\": true") != std::string::npos) continue;
    // A line cut short by a kill while it was written is dropped, not fatal.
    try {
      if (json::get_number(line, "step") <= static_cast<double>(step)) kept += line + "\n";
    } catch (const c10::Error&) {
    }
  }
  return kept;
}

struct Eval {
  double loss = 0;
  double accuracy = 0;
};

Eval evaluate(std::shared_ptr<Classifier>& model, apex::amp::Amp* amp, const Dataset& test,
              c10::Device device, int64_t batch) {
  const at::NoGradGuard no_grad;
  model->eval();
  double loss = 0;
  int64_t correct = 0;
  const int64_t n = test.size();
  for (int64_t i = 0; i < n; i += batch) {
    const int64_t e = std::min(n, i + batch);
    const at::Tensor x = test.inputs.slice(0, i, e).to(device);
    const at::Tensor y = test.labels.slice(0, i, e).to(device);
    const at::Tensor logits = (amp ? amp->forward(model, x) : model->forward(x)).to(at::kFloat);
    loss += at::cross_entropy_loss(logits, y, {}, at::Reduction::Sum).item<double>();
    correct += logits.argmax(1).eq(y).sum().item<int64_t>();
  }
  model->train();
  return {loss / static_cast<double>(std::max<int64_t>(n, 1)),
          static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(n, 1))};
}

}  // namespace

// glibc serves the activation-sized tensors of every step with mmap and unmaps them on free, so
// each step page-faults its outputs in again. A fixed threshold of 64 MiB and trimming only
// beyond 128 MiB keep freed memory for reuse (why these values: docs/perf-notes.md, "Thresholds
// in the code"). A user's own malloc settings (GLIBC_TUNABLES, MALLOC_*_) win.
static void keep_freed_memory() {
#ifdef __GLIBC__
  static const bool once = [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if ((tunables != nullptr && std::strstr(tunables, "malloc") != nullptr) ||
        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
        std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
      return false;
    }
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 128 << 20);
    return true;
  }();
  (void)once;
#endif
}

Summary train(const TrainOptions& o, const Split& data) {
  keep_freed_memory();
  check_device(o);
  check_fits(o);
  check_outputs(o);
  TORCH_CHECK(o.batch_size > 0, "apex-train: --batch-size must be > 0, got ", o.batch_size);
  TORCH_CHECK(o.accumulate > 0, "apex-train: --accumulate must be > 0, got ", o.accumulate);
  TORCH_CHECK(data.train.size() > 0 && data.test.size() > 0,
              "apex-train: the data has an empty train or test split");
  if (o.threads > 0) at::set_num_threads(o.threads);
  TORCH_CHECK(!o.zero || o.loss_scale.empty(),
              "apex-train: --loss-scale does not apply to --zero, whose fp16 levels use a dynamic "
              "GradScaler");
  const bool plain = o.opt_level == "fp32";
  // Data-parallel: every rank trains on its shard of each global batch of batch_size * world.
  std::optional<apex::parallel::ProcessGroup> pg;
  if (o.ddp && o.device.is_cuda()) {
    // This rank's GPU as the current device: NCCL's barrier and any unplaced CUDA work go there,
    // not to GPU 0.
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(o.device);
  }
  if (o.ddp) {
    const auto ms = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.timeout_s * 1000)));
    pg = apex::parallel::init_process_group(
        apex::parallel::ProcessGroupOptions().device(o.device).timeout(ms));
    check_same_settings(o, *pg);
  }
  // One live writer per checkpoint folder (rank 0 writes; every rank learns whether it may).
  CheckpointLock lock;
  if (!o.checkpoint.empty()) {
    std::string refused;
    if (!pg || pg->rank() == 0) {
      try {
        lock = CheckpointLock(o.checkpoint);
      } catch (const c10::Error& e) {
        if (!pg) throw;
        refused = e.what_without_backtrace();
      }
    }
    if (pg) {
      const std::vector<std::string> all = pg->all_gather_string(refused);
      TORCH_CHECK(all[0].empty(), all[0]);
    }
  }
  const int64_t rank = pg ? pg->rank() : 0;
  const int64_t world = pg ? pg->size() : 1;
  const int64_t per_step = o.batch_size * o.accumulate * world;
  int64_t total = total_steps(o, data.train.size(), world);

  ModelConfig mc = o.model;
  mc.sync_bn = o.sync_bn;
  std::shared_ptr<Classifier> model = make_model(mc, data.train, o.seed);
  model->to(o.device);
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  if (!o.zero) optimizer = make_optimizer(o, model->parameters());
  // With --zero amp only casts the model and runs its forward (O1: autocast; O2/O3: the half
  // model); the sharded optimizer keeps the fp32 masters (at O3 too) and a GradScaler scales
  // fp16 losses.
  std::optional<apex::amp::Amp> amp;
  if (!plain) {
    apex::amp::Options ao(apex::amp::parse_opt_level(o.opt_level));
    ao.half_dtype(o.half_dtype).verbosity(0);
    if (!o.loss_scale.empty()) ao.loss_scale(apex::amp::LossScale::parse(o.loss_scale));
    std::vector<torch::optim::Optimizer*> managed;
    if (!o.zero) managed.push_back(optimizer.get());
    amp.emplace(apex::amp::initialize({model}, managed, ao));
  }
  apex::parallel::DistributedFusedAdam* zero = nullptr;
  std::optional<apex::amp::GradScaler> scaler;
  if (o.zero) {
    auto dfa = std::make_unique<apex::parallel::DistributedFusedAdam>(
        model->parameters(),
        apex::parallel::DistributedFusedAdamOptions(o.lr)
            .weight_decay(o.weight_decay)
            .bucket_cap_mb(o.bucket_cap_mb > 0 ? o.bucket_cap_mb : 100.0)
            .message_cap_mb(o.zero_message_cap_mb)
            .reduce_scatter(
                o.zero_reduce_scatter == "native"       ? apex::parallel::ReduceScatter::kNative
                : o.zero_reduce_scatter == "all-to-all" ? apex::parallel::ReduceScatter::kAllToAll
                                                        : apex::parallel::ReduceScatter::kAuto),
        *pg);
    zero = dfa.get();
    optimizer = std::move(dfa);
    if (!plain && o.opt_level != "O0" && o.half_dtype == at::kHalf) {
      scaler.emplace(apex::amp::GradScalerOptions().device(o.device.type()));
    }
  }
  // The handle that manages the optimizer (scale_loss, step); with --zero only its forward.
  apex::amp::Amp* ampp = amp && !o.zero ? &*amp : nullptr;
  apex::amp::Amp* amp_forward = amp ? &*amp : nullptr;
  int64_t start = 0;
  std::string run_id = new_run_id();
  if (o.resume) {
    start =
        load_checkpoint(o, world, *model, *optimizer, ampp, run_id, scaler ? &*scaler : nullptr);
  }
  TORCH_CHECK(o.stop_after == 0 || o.stop_after > start, "apex-train: --stop-after ", o.stop_after,
              " is not after the resumed checkpoint's step ", start);
  // After initialize (DDP reduces the gradients of the parameters as amp cast them).
  using Ddp = apex::parallel::DistributedDataParallel<std::shared_ptr<Classifier>>;
  std::optional<Ddp> ddp;
  if (pg && !o.zero) {
    apex::parallel::DistributedDataParallelOptions ddp_options;
    if (o.bucket_cap_mb > 0)
      ddp_options.bucket_cap_mb(o.bucket_cap_mb).first_bucket_mb(o.bucket_cap_mb);
    ddp.emplace(model, ddp_options, *pg);
  }
  const auto forward = [&](const at::Tensor& x) {
    if (ddp) return ampp ? ampp->forward(*ddp, x) : (*ddp)->forward(x);
    return amp_forward ? amp_forward->forward(model, x) : model->forward(x);
  };
  TORCH_CHECK(start < total, "apex-train: --resume: the checkpoint is at step ", start,
              " and this run has ", total,
              " steps: nothing left to train (raise --steps, with --resume-with-changes)");

  Summary s;
  s.level = o.opt_level;
  s.model = describe(o.model, *model);
  EpochSampler sampler(data.train.size(), o.seed);
  std::FILE* metrics = nullptr;
  if (!o.metrics.empty() && rank == 0) {
    // A resumed run keeps the records up to its checkpoint and drops the rest (steps logged after
    // the checkpoint, and the interrupted run's summary), so the file reads as one run.
    const std::string kept = o.resume ? metrics_up_to(o.metrics, start) : std::string();
    apex::check_writable(o.metrics, "apex-train: --metrics");
    // The kept records replace the file in one step (a kill while rewriting them in place would
    // lose the history), then this run appends.
    apex::write_file_atomic(o.metrics, kept);
    metrics = std::fopen(o.metrics.c_str(), "a");
    TORCH_CHECK(metrics != nullptr, "apex-train: cannot write --metrics ", o.metrics, ": ",
                std::strerror(errno));
  }
  Progress progress(o.opt_level, start, total, o.progress && rank == 0);
  const auto t0 = Clock::now();
  double train_seconds = 0;
  double timed_seconds = 0;  // from step start + untimed on (samples_per_s)
  int64_t timed_steps = 0;
  const int64_t untimed = std::clamp<int64_t>(o.untimed_steps, 0, total - start - 1);
  // The window's loss stays on the device until it is logged: no host sync per micro-batch.
  at::Tensor window_loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(o.device));
  int64_t window_steps = 0;
  int64_t skipped_before = ampp ? ampp->skipped_steps() : 0;
  int64_t skipped_in_a_row = 0;
  double last_logged_time = 0;
  const bool dynamic = ampp != nullptr && ampp->loss_scaler().dynamic();
  try {
    for (int64_t step = start; step < total; ++step) {
      const auto step_t0 = Clock::now();
      const double lr = lr_at(o, step, total);
      for (auto& g : optimizer->param_groups()) g.options().set_lr(lr);
      if (ampp) {
        ampp->zero_grad();
      } else {
        optimizer->zero_grad();
      }
      for (int64_t micro = 0; micro < o.accumulate; ++micro) {
        // This rank's slice of the micro-batch's global sample positions.
        const at::Tensor idx =
            sampler.shard(step * o.accumulate + micro, o.batch_size, world, rank);
        const at::Tensor x = data.train.inputs.index_select(0, idx).to(o.device);
        const at::Tensor y = data.train.labels.index_select(0, idx).to(o.device);
        // Micro-batches before the last only accumulate: DDP reduces once per step.
        std::optional<apex::parallel::NoSyncGuard> no_sync;
        if (ddp && micro + 1 < o.accumulate) no_sync.emplace(*ddp);
        std::optional<apex::parallel::DistributedFusedAdam::NoSync> zero_no_sync;
        if (zero != nullptr && micro + 1 < o.accumulate) zero_no_sync.emplace(*zero);
        const at::Tensor logits = forward(x);
        at::Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat), y);
        window_loss += loss.detach() / static_cast<double>(o.accumulate);
        if (o.accumulate > 1) loss = loss / static_cast<double>(o.accumulate);
        if (ampp) {
          ampp->scale_loss(loss, 0,
                           apex::amp::ScaleLossOptions().delay_unscale(micro + 1 < o.accumulate))
              .backward();
        } else if (scaler) {
          scaler->scale(loss).backward();
        } else {
          loss.backward();
        }
      }
      if (o.clip > 0 && zero != nullptr) {
        if (scaler) scaler->unscale_(*zero);
        zero->clip_grad_norm(o.clip);
      } else if (o.clip > 0) {
        apex::optim::clip_grad_norm_(ampp ? ampp->master_params() : model->parameters(), o.clip);
      }
      if (ampp) {
        ampp->step();
      } else if (scaler) {
        scaler->step(*zero);
        scaler->update();
      } else {
        optimizer->step();
      }
      ++window_steps;
      const double step_seconds = seconds_since(step_t0);
      train_seconds += step_seconds;
      if (step - start >= untimed) {
        timed_seconds += step_seconds;
        ++timed_steps;
      }
      if (ampp != nullptr) {
        const int64_t skipped = ampp->skipped_steps();
        skipped_in_a_row = skipped > skipped_before ? skipped_in_a_row + 1 : 0;
        skipped_before = skipped;
        // From the default 2^16 the scale is below 0.1 after 20 halvings: it is at its floor.
        TORCH_CHECK(
            skipped_in_a_row < kStuckSteps, "apex-train: ", kStuckSteps,
            " steps in a row overflowed (loss scale ", ampp->loss_scale(), ") at ", o.opt_level,
            ": the loss scale is stuck at its floor and training has diverged; lower --lr (", o.lr,
            ") or use bf16");
      }
      const bool interrupted = o.stop_after > 0 && step + 1 == o.stop_after;
      const bool last = step + 1 == total || interrupted;
      if ((step + 1) % o.log_every == 0 || last) {
        StepRecord r;
        r.step = step + 1;
        if (pg) {
          at::Tensor all = window_loss.to(at::kDouble);
          pg->all_reduce_(all);  // the mean over ranks: the loss of the global batch
          window_loss.copy_(all / static_cast<double>(world));
        }
        r.loss = window_loss.item<double>() / static_cast<double>(window_steps);
        r.loss_scale = ampp ? ampp->loss_scale() : scaler ? scaler->get_scale() : 1.0;
        r.lr = lr;
        r.elapsed_s = seconds_since(t0);
        r.samples_per_s = static_cast<double>(window_steps * per_step) /
                          std::max(1e-9, train_seconds - last_logged_time);
        last_logged_time = train_seconds;
        // Without dynamic loss scaling nothing skips a bad step: a non-finite loss is final.
        TORCH_CHECK(std::isfinite(r.loss) || dynamic, "apex-train: the loss became ", r.loss,
                    " by step ", r.step, " at ", o.opt_level,
                    " (no dynamic loss scaling): training diverged; lower --lr (", o.lr, ")");
        s.curve.push_back(r);
        if (rank == 0) progress.update(r);
        if (metrics != nullptr) {
          write_metrics(metrics, json::step_record(o.opt_level, r) + "\n", o.metrics);
        }
        s.final_loss = r.loss;
        window_loss.zero_();
        window_steps = 0;
      }
      if (!o.checkpoint.empty() &&
          (last || (o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0))) {
        // Never save weights a non-finite loss may have spoiled (between logged steps too), and
        // decide it alike on every rank (a rank that stopped alone would leave the others
        // waiting at the barrier below).
        double finite = std::isfinite(window_loss.item<double>()) ? 1.0 : 0.0;
        if (pg) {
          // On the training device: an NCCL group reduces CPU tensors only where Gloo is built.
          at::Tensor all = at::full({1}, finite, at::TensorOptions(at::kDouble).device(o.device));
          pg->all_reduce_(all);
          finite = all.item<double>() == static_cast<double>(world) ? 1.0 : 0.0;
        }
        TORCH_CHECK(dynamic || finite == 1.0, "apex-train: the loss became non-finite before step ",
                    step + 1, " at ", o.opt_level,
                    ": training diverged (no checkpoint written); lower --lr (", o.lr, ")");
        // Rank 0 writes (every rank holds the same state); the others wait for it.
        std::string shards;
        if (zero != nullptr) shards = save_zero_shards(o, step + 1, *zero);
        if (rank == 0) {
          save_checkpoint(o, world, step + 1, run_id, *model, *optimizer, ampp, shards,
                          scaler ? &*scaler : nullptr);
        }
        if (pg) pg->barrier();
      }
      if (interrupted) {
        total = step + 1;
        break;
      }
    }
  } catch (...) {
    progress.finish();
    if (metrics != nullptr) std::fclose(metrics);
    throw;
  }
  progress.finish();
  // Rank 0 evaluates (every rank holds the same weights); the summary is its.
  const Eval e = rank == 0 ? evaluate(model, amp_forward, data.test, o.device, 256) : Eval{};
  s.rank = rank;
  s.world_size = world;
  if (ddp) {
    const auto t = (*ddp)->engine().timings();
    s.ddp_backward_compute_ms = static_cast<double>(t.backward_compute_ns) / 1e6;
    s.ddp_backward_comm_ms = static_cast<double>(t.backward_comm_ns) / 1e6;
    s.ddp_overlap_ms = static_cast<double>(t.backward_compute_comm_overlap_ns) / 1e6;
    s.ddp_buckets = static_cast<int64_t>((*ddp)->engine().bucket_indices().size());
  }
  s.steps = total - start;
  s.samples = s.steps * per_step;
  s.train_seconds = train_seconds;
  s.samples_per_s = static_cast<double>(timed_steps * per_step) / std::max(1e-9, timed_seconds);
  s.test_loss = e.loss;
  s.test_accuracy = e.accuracy;
  s.skipped_steps = ampp ? ampp->skipped_steps() : 0;
  s.loss_scale = ampp ? ampp->loss_scale() : scaler ? scaler->get_scale() : 1.0;
  s.peak_rss_mb = peak_rss_mb();
  if (zero != nullptr) {
    const auto mem = zero->memory();
    s.optimizer_state_mb = static_cast<double>(mem.state_bytes + mem.grad_shard_bytes) / 1048576.0;
    if (rank == 0) {
      std::printf(
          "apex-train: --zero: %.2f MiB of Adam state and %.2f MiB of gradients per rank "
          "(%lld parameters, %lld ranks; %.2f B per parameter)\n",
          static_cast<double>(mem.state_bytes) / 1048576.0,
          static_cast<double>(mem.grad_shard_bytes) / 1048576.0, static_cast<long long>(mem.params),
          static_cast<long long>(world),
          static_cast<double>(mem.state_bytes + mem.grad_shard_bytes) /
              static_cast<double>(std::max<int64_t>(1, mem.params)));
    }
  }
  if (metrics != nullptr) {
    std::FILE* f = std::exchange(metrics, nullptr);
    const bool written = std::fputs((to_json(s) + "\n").c_str(), f) >= 0;
    const int err = errno;
    TORCH_CHECK(std::fclose(f) == 0 && written, "apex-train: --metrics ", o.metrics,
                ": write failed: ", std::strerror(written ? errno : err));
  }
  return s;
}

}  // namespace apex::train
