#include <apex/parallel/distributed_sampler.h>
#include <apex/parallel/process_group.h>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/ops/randperm.h>
#include <c10/util/Exception.h>
#include <torch/serialize/archive.h>

#include "parallel/env.h"

#include <algorithm>
#include <string>

namespace apex::parallel {
namespace {

// $name as a whole number in [lo, hi] (torchrun's RANK / WORLD_SIZE), or `fallback` when unset.
int64_t env_int(const char* name, int64_t fallback, int64_t lo, int64_t hi) {
  const auto v = detail::env(name);
  return v ? detail::parse_int(*v, "DistributedSampler", name, lo, hi) : fallback;
}

}  // namespace

DistributedSampler::DistributedSampler(size_t dataset_size, DistributedSamplerOptions options)
    : size_(dataset_size), options_(options) {
  const ProcessGroup group = default_process_group();
  if (options.num_replicas()) {
    num_replicas_ = *options.num_replicas();
  } else if (group.valid()) {
    num_replicas_ = group.size();
  } else {
    num_replicas_ = env_int("WORLD_SIZE", 1, 1, detail::kMaxWorld);
  }
  if (options.rank()) {
    rank_ = *options.rank();
  } else if (group.valid() && !options.num_replicas()) {
    rank_ = group.rank();
  } else {
    rank_ = env_int("RANK", 0, 0, detail::kMaxWorld - 1);
  }
  TORCH_CHECK(num_replicas_ >= 1, "DistributedSampler: num_replicas must be >= 1, got ",
              num_replicas_);
  TORCH_CHECK(rank_ >= 0 && rank_ < num_replicas_, "DistributedSampler: rank must be in [0, ",
              num_replicas_ - 1, "] for ", num_replicas_, " replica(s), got ", rank_);
}

size_t DistributedSampler::num_samples() const {
  const auto n = static_cast<int64_t>(size_);
  const int64_t r = num_replicas_;
  // torch: ceil((n - R) / R) samples each when dropping the uneven tail, else ceil(n / R).
  if (options_.drop_last() && n % r != 0) return static_cast<size_t>(std::max<int64_t>(0, n / r));
  return static_cast<size_t>((n + r - 1) / r);
}

std::vector<size_t> DistributedSampler::indices(int64_t epoch) const {
  TORCH_CHECK(epoch >= 0, "DistributedSampler: epoch must be >= 0, got ", epoch);
  std::vector<size_t> order(size_);
  if (options_.shuffle() && size_ > 0) {
    auto gen =
        at::make_generator<at::CPUGeneratorImpl>(options_.seed() + static_cast<uint64_t>(epoch));
    const at::Tensor perm = at::randperm(static_cast<int64_t>(size_), gen);
    const int64_t* p = perm.const_data_ptr<int64_t>();
    for (size_t i = 0; i < size_; ++i) order[i] = static_cast<size_t>(p[i]);
  } else {
    for (size_t i = 0; i < size_; ++i) order[i] = i;
  }
  const size_t total = num_samples() * static_cast<size_t>(num_replicas_);
  if (order.size() < total && !order.empty()) {
    // Padding repeats the order from its start (as often as needed for tiny datasets).
    const size_t n = order.size();
    for (size_t i = n; i < total; ++i) order.push_back(order[(i - n) % n]);
  }
  order.resize(total);
  std::vector<size_t> mine;
  mine.reserve(num_samples());
  for (size_t i = static_cast<size_t>(rank_); i < total; i += static_cast<size_t>(num_replicas_)) {
    mine.push_back(order[i]);
  }
  return mine;
}

void DistributedSampler::reset(std::optional<size_t> new_size) {
  if (new_size) size_ = *new_size;
  epoch_ = next_epoch_.value_or(epoch_ + 1);
  next_epoch_.reset();
  current_ = indices(epoch_);
  position_ = 0;
}

std::optional<std::vector<size_t>> DistributedSampler::next(size_t batch_size) {
  TORCH_CHECK(epoch_ >= 0,
              "DistributedSampler::next: call reset() first (LibTorch's DataLoader "
              "does at the start of each pass)");
  if (position_ >= current_.size()) return std::nullopt;
  const size_t end = std::min(current_.size(), position_ + batch_size);
  std::vector<size_t> batch(current_.begin() + static_cast<std::ptrdiff_t>(position_),
                            current_.begin() + static_cast<std::ptrdiff_t>(end));
  position_ = end;
  return batch;
}

void DistributedSampler::set_epoch(int64_t epoch) {
  TORCH_CHECK(epoch >= 0, "DistributedSampler::set_epoch: epoch must be >= 0, got ", epoch);
  next_epoch_ = epoch;
}

void DistributedSampler::save(torch::serialize::OutputArchive& archive) const {
  archive.write("epoch", at::tensor(epoch_), /*is_buffer=*/true);
  archive.write("position", at::tensor(static_cast<int64_t>(position_)), /*is_buffer=*/true);
}

void DistributedSampler::load(torch::serialize::InputArchive& archive) {
  at::Tensor epoch = at::empty({}, at::kLong);
  at::Tensor position = at::empty({}, at::kLong);
  archive.read("epoch", epoch, /*is_buffer=*/true);
  archive.read("position", position, /*is_buffer=*/true);
  const int64_t e = epoch.item<int64_t>();
  const int64_t p = position.item<int64_t>();
  TORCH_CHECK(e >= -1, "DistributedSampler::load: epoch ", e, " is negative");
  std::vector<size_t> current = e >= 0 ? indices(e) : std::vector<size_t>();
  TORCH_CHECK(p >= 0 && static_cast<size_t>(p) <= current.size(),
              "DistributedSampler::load: ", "position ", p, " is outside this rank's ",
              current.size(), " samples of epoch ", e);
  epoch_ = e;
  current_ = std::move(current);
  position_ = static_cast<size_t>(p);
  next_epoch_.reset();
}

}  // namespace apex::parallel
