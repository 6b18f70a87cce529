#pragma once

// apex-train's checkpoints and run settings (checkpoint.cpp): save, verify and resume step folders,
// and compare the ranks' settings.

#include <apex/amp/grad_scaler.h>
#include <apex/amp/initialize.h>
#include <apex/parallel/distributed_fused_adam.h>
#include <apex/parallel/process_group.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <string>

#include "train/trainer.h"

namespace apex::train {

/// Every rank's settings, compared right after the group forms: a difference is one error on
/// every rank naming the flags and the ranks' values.
void check_same_settings(const TrainOptions& o, const apex::parallel::ProcessGroup& pg);

/// A new run's id (16 hex digits), recorded in its checkpoints.
std::string new_run_id();

/// Writes step folder `step` of --checkpoint (atomically, manifest last) and names it latest.
/// With --zero, `shards` is the folder save_zero_shards wrote: it becomes the checkpoint's
/// "zero" folder in place of optimizer.pt.
void save_checkpoint(const TrainOptions& o, int64_t world, int64_t step, const std::string& run,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     apex::amp::Amp* amp, const std::string& shards = "",
                     const apex::amp::GradScaler* scaler = nullptr);

/// --zero: every rank writes its optimizer shard for step `step` into a staging folder of
/// --checkpoint (every rank must call it); returns the folder.
std::string save_zero_shards(const TrainOptions& o, int64_t step,
                             apex::parallel::DistributedFusedAdam& optimizer);

/// Verifies and loads the checkpoint --resume names; returns the step to continue from and sets
/// `run` to the run's id.
int64_t load_checkpoint(const TrainOptions& o, int64_t world, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer, apex::amp::Amp* amp, std::string& run,
                        apex::amp::GradScaler* scaler = nullptr);

}  // namespace apex::train
