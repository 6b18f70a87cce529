#pragma once

// apex-train's checkpoints and run settings (checkpoint.cpp): save, verify and resume step folders,
// and compare the ranks' settings.

#include <apex/amp/initialize.h>
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
void save_checkpoint(const TrainOptions& o, int64_t world, int64_t step, const std::string& run,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     apex::amp::Amp* amp);

/// Verifies and loads the checkpoint --resume names; returns the step to continue from and sets
/// `run` to the run's id.
int64_t load_checkpoint(const TrainOptions& o, int64_t world, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer, apex::amp::Amp* amp, std::string& run);

}  // namespace apex::train
