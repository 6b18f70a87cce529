// What apex-train's data formats share (data.cpp): one random stream per split, balanced labels,
// channel normalization, and files through the library's helpers (regular files only, atomic
// writes) with their byte orders. The formats: data_synthetic.cpp, data_mnist.cpp,
// data_cifar.cpp, data_wav.cpp.
#pragma once

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace apex::train::data {

/// SplitMix64's finalizer: a well-mixed 64-bit value of x.
inline uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

/// Each (task, split) gets its own stream so that, e.g., the test split does not change with
/// n_train.
uint64_t stream_seed(uint64_t seed, uint64_t task, uint64_t split);

/// Draws from one at::Generator of its own, never the global one.
class Rng {
 public:
  explicit Rng(uint64_t seed)
      : gen_(at::detail::createCPUGenerator(seed)), impl_(gen_.get<at::CPUGeneratorImpl>()) {}
  /// Uniform in [0, 1).
  double uniform() { return static_cast<double>(impl_->random64() >> 11) * 0x1.0p-53; }
  double uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }
  /// Uniform integer in [0, n).
  int64_t below(int64_t n) {
    return static_cast<int64_t>(impl_->random64() % static_cast<uint64_t>(n));
  }
  at::Generator& gen() { return gen_; }

 private:
  at::Generator gen_;
  at::CPUGeneratorImpl* impl_;
};

/// n labels with every class n / classes (± 1) times, in random order.
std::vector<int64_t> balanced_labels(int64_t n, int64_t classes, Rng& rng);
at::Tensor labels_tensor(const std::vector<int64_t>& y);
void check_counts(const char* what, int64_t n_train, int64_t n_test, int64_t classes);
/// Per-channel (x - mean) / std over [N, C, ...] float tensors, statistics from `train`.
void normalize_channels(at::Tensor& train, at::Tensor& test);

/// A regular file's bytes (a missing one whose .gz exists says to gunzip it); errors name `what`.
std::vector<uint8_t> read_bytes(const std::filesystem::path& path, const std::string& what);
/// Written atomically (a killed run leaves the old file or the new one, never half of one).
void write_bytes(const std::filesystem::path& path, const std::vector<uint8_t>& bytes);
/// Labels as bytes [N] in [0, 255] (any integer dtype).
std::vector<uint8_t> label_bytes(const at::Tensor& labels, int64_t n, const char* what);

inline uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}
inline uint32_t le32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
inline uint16_t le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

void put_be32(std::vector<uint8_t>& b, uint32_t v);
void put_le32(std::vector<uint8_t>& b, uint32_t v);
void put_le16(std::vector<uint8_t>& b, uint16_t v);

inline bool is_gzip(const std::vector<uint8_t>& b) {
  return b.size() >= 2 && b[0] == 0x1f && b[1] == 0x8b;
}

}  // namespace apex::train::data
