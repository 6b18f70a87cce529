#pragma once
// A sampler that gives each rank of a data-parallel job its own disjoint share of a dataset,
// reshuffled every epoch: Python's torch.utils.data.DistributedSampler, for LibTorch's
// DataLoader and for loops that draw indices themselves.

#include <torch/arg.h>
#include <torch/data/samplers/base.h>

#include <cstddef>
#include <cstdint>
#include <optional>
#include <vector>

namespace torch::serialize {
class OutputArchive;
class InputArchive;
}  // namespace torch::serialize

namespace apex::parallel {

/// Options of DistributedSampler, with torch's names and defaults.
struct DistributedSamplerOptions {
  /// Ranks sharing the dataset, and this one. Unset: the default process group's (after
  /// init_process_group), else $WORLD_SIZE / $RANK (torchrun's), else 1 / 0.
  TORCH_ARG(std::optional<int64_t>, num_replicas) = std::nullopt;
  TORCH_ARG(std::optional<int64_t>, rank) = std::nullopt;
  /// A fresh permutation each epoch, drawn from seed + epoch (the same on every rank).
  TORCH_ARG(bool, shuffle) = true;
  TORCH_ARG(uint64_t, seed) = 0;
  /// false: the epoch's order is padded by repeating its first indices so that every rank gets
  /// ceil(n / ranks) samples; true: the tail that does not divide evenly is dropped.
  TORCH_ARG(bool, drop_last) = false;
};

/// Rank r's indices of an epoch are positions r, r + R, r + 2R, ... of the epoch's order (a
/// permutation of 0..n-1 from seed + epoch, padded or cut to a multiple of R ranks), so the
/// ranks' shares are disjoint and together cover every sample once per epoch; the order equals
/// Python's DistributedSampler with the same seed and epoch (torch.randperm on a generator
/// seeded with seed + epoch).
///
/// Unlike LibTorch's DistributedRandomSampler, each reset() (LibTorch's DataLoader calls it at
/// the start of every pass) moves on to the next epoch, so the order changes without set_epoch;
/// set_epoch(e) makes the next reset() start epoch e (a resumed run).
///
///   apex::parallel::DistributedSampler sampler(dataset.size().value());
///   auto loader = torch::data::make_data_loader(dataset, sampler, batch_size);
///   for (int epoch = 0; epoch < epochs; ++epoch) for (auto& batch : *loader) { ... }
class DistributedSampler : public torch::data::samplers::Sampler<std::vector<size_t>> {
 public:
  explicit DistributedSampler(size_t dataset_size, DistributedSamplerOptions options = {});

  /// Starts the next epoch (the one set_epoch named, else the one after the last); `new_size`
  /// changes the dataset's size.
  void reset(std::optional<size_t> new_size = std::nullopt) override;
  /// The next up to `batch_size` of this rank's indices of the epoch; nullopt at its end.
  std::optional<std::vector<size_t>> next(size_t batch_size) override;
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

  /// The next reset() starts epoch `epoch` (>= 0).
  void set_epoch(int64_t epoch);
  /// The epoch in progress (-1 before the first reset()).
  int64_t epoch() const { return epoch_; }
  /// This rank's indices of `epoch`, in order.
  std::vector<size_t> indices(int64_t epoch) const;
  /// Samples per rank per epoch.
  size_t num_samples() const;
  int64_t num_replicas() const { return num_replicas_; }
  int64_t rank() const { return rank_; }

 private:
  size_t size_;
  DistributedSamplerOptions options_;
  int64_t num_replicas_;
  int64_t rank_;
  int64_t epoch_ = -1;
  std::optional<int64_t> next_epoch_;
  std::vector<size_t> current_;
  size_t position_ = 0;
};

}  // namespace apex::parallel
