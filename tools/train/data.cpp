// apex-train's datasets (data.h): what the formats share (data_files.h). Each format has its own
// file: data_synthetic.cpp, data_mnist.cpp, data_cifar.cpp, data_wav.cpp.
#include "data.h"

#include <ATen/ops/empty.h>
#include <apex/io.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <string>
#include <utility>

#include "data_files.h"

namespace apex::train {

int64_t Dataset::size() const { return inputs.defined() ? inputs.size(0) : 0; }

namespace data {

namespace fs = std::filesystem;

uint64_t stream_seed(uint64_t seed, uint64_t task, uint64_t split) {
  return splitmix64(splitmix64(seed) ^ splitmix64((task << 8) | split));
}

std::vector<int64_t> balanced_labels(int64_t n, int64_t classes, Rng& rng) {
  std::vector<int64_t> y(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) y[static_cast<size_t>(i)] = i % classes;
  for (int64_t i = n - 1; i > 0; --i) std::swap(y[static_cast<size_t>(i)], y[rng.below(i + 1)]);
  return y;
}

at::Tensor labels_tensor(const std::vector<int64_t>& y) {
  auto t = at::empty({static_cast<int64_t>(y.size())}, at::TensorOptions().dtype(at::kLong));
  std::copy(y.begin(), y.end(), t.data_ptr<int64_t>());
  return t;
}

void check_counts(const char* what, int64_t n_train, int64_t n_test, int64_t classes) {
  TORCH_CHECK(n_train >= classes, "apex-train: ", what, ": n_train ", n_train,
              ", expected at least ", classes, " (one sample per class)");
  TORCH_CHECK(n_test >= 0, "apex-train: ", what, ": n_test ", n_test, ", expected >= 0");
}

void normalize_channels(at::Tensor& train, at::Tensor& test) {
  const int64_t channels = train.size(1);
  const int64_t n = train.size(0);
  const int64_t inner = train.numel() / std::max<int64_t>(1, n * channels);
  std::vector<double> mean(static_cast<size_t>(channels)), scale(static_cast<size_t>(channels));
  const float* p = train.data_ptr<float>();
  for (int64_t c = 0; c < channels; ++c) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float* q = p + (i * channels + c) * inner;
      for (int64_t k = 0; k < inner; ++k) {
        s += q[k];
        s2 += static_cast<double>(q[k]) * q[k];
      }
    }
    const double count = static_cast<double>(std::max<int64_t>(1, n * inner));
    const double m = s / count;
    const double var = std::max(0.0, s2 / count - m * m);
    mean[static_cast<size_t>(c)] = m;
    // A constant channel stays constant (0) rather than dividing by zero.
    scale[static_cast<size_t>(c)] = var > 1e-12 ? 1.0 / std::sqrt(var) : 1.0;
  }
  for (at::Tensor* t : {&train, &test}) {
    float* d = t->data_ptr<float>();
    const int64_t m = t->size(0);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t c = 0; c < channels; ++c) {
        float* q = d + (i * channels + c) * inner;
        const auto mu = static_cast<float>(mean[static_cast<size_t>(c)]);
        const auto sc = static_cast<float>(scale[static_cast<size_t>(c)]);
        for (int64_t k = 0; k < inner; ++k) q[k] = (q[k] - mu) * sc;
      }
    }
  }
}

// Through the library's file helpers: regular files only (a FIFO or a device cannot hang a load),
// and writes atomic (a killed run leaves the old file or the new one, never half of one).
std::vector<uint8_t> read_bytes(const fs::path& path, const std::string& what) {
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    fs::path gz = path;
    gz += ".gz";
    TORCH_CHECK(!fs::exists(gz, ec), "apex-train: ", what, " ", path.string(), ": not found, but ",
                gz.string(), " is: gunzip it first (plain, uncompressed files only)");
    TORCH_CHECK(false, "apex-train: ", what, " ", path.string(), ": cannot open file");
  }
  std::string bytes;
  try {
    bytes = apex::read_file(path.string());
  } catch (const c10::Error& e) {
    TORCH_CHECK(false, "apex-train: ", what, " ", path.string(), ": ", e.what_without_backtrace());
  }
  return {bytes.begin(), bytes.end()};
}

void write_bytes(const fs::path& path, const std::vector<uint8_t>& bytes) {
  apex::write_file_atomic(
      path.string(), std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()));
}

std::vector<uint8_t> label_bytes(const at::Tensor& labels, int64_t n, const char* what) {
  TORCH_CHECK(labels.dim() == 1 && labels.size(0) == n, "apex-train: ", what, ": labels shape ",
              labels.sizes(), ", expected [", n, "]");
  auto l = labels.to(at::kLong).contiguous();
  std::vector<uint8_t> out(static_cast<size_t>(n));
  const int64_t* p = l.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] <= 255, "apex-train: ", what, ": label ", p[i], " at index ", i,
                ", expected 0..255");
    out[static_cast<size_t>(i)] = static_cast<uint8_t>(p[i]);
  }
  return out;
}

void put_be32(std::vector<uint8_t>& b, uint32_t v) {
  for (int s = 24; s >= 0; s -= 8) b.push_back(static_cast<uint8_t>(v >> s));
}
void put_le32(std::vector<uint8_t>& b, uint32_t v) {
  for (int s = 0; s < 32; s += 8) b.push_back(static_cast<uint8_t>(v >> s));
}
void put_le16(std::vector<uint8_t>& b, uint16_t v) {
  b.push_back(static_cast<uint8_t>(v));
  b.push_back(static_cast<uint8_t>(v >> 8));
}

}  // namespace data
}  // namespace apex::train
