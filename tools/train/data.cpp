#include "data.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/randn.h>
#include <ATen/ops/zeros.h>
#include <apex/io.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <numbers>
#include <utility>

namespace apex::train {

namespace fs = std::filesystem;

int64_t Dataset::size() const { return inputs.defined() ? inputs.size(0) : 0; }

namespace {

// ---------------------------------------------------------------------------------------------
// Randomness: one at::Generator per split, never the global one.

uint64_t splitmix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ULL;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ULL;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBULL;
  return x ^ (x >> 31);
}

// Each (task, split) gets its own stream so that, e.g., the test split does not change with
// n_train.
uint64_t stream_seed(uint64_t seed, uint64_t task, uint64_t split) {
  return splitmix64(splitmix64(seed) ^ splitmix64((task << 8) | split));
}

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

/// Per-channel (x - mean) / std over [N, C, ...] float tensors, statistics from `train`.
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

// ---------------------------------------------------------------------------------------------
// Synthetic images

const std::vector<std::string>& image_class_names() {
  static const std::vector<std::string> names{
      "disc",          "ring",   "square",          "hollow_square",
      "triangle",      "cross",  "horizontal_bars", "vertical_bars",
      "diagonal_line", "checker"};
  return names;
}

/// Whether the pixel at offset (dx, dy) from the centre belongs to shape `cls` of radius r.
/// w is the half-width of strokes; `flip` mirrors the diagonal line.
bool in_shape(int64_t cls, double dx, double dy, double r, double w, bool flip) {
  const double d = std::sqrt(dx * dx + dy * dy);
  const double m = std::max(std::abs(dx), std::abs(dy));  // Chebyshev distance: squares
  switch (cls) {
    case 0:  // disc
      return d <= r;
    case 1:  // ring
      return d <= r && d >= r - 2 * w;
    case 2:  // filled square
      return m <= 0.85 * r;
    case 3:  // hollow square
      return m <= 0.85 * r && m >= 0.85 * r - 2 * w;
    case 4: {  // upward triangle: apex at -r, base at +0.7r with half-width r
      const double t = (dy + r) / (1.7 * r);
      return t >= 0 && t <= 1 && std::abs(dx) <= t * r;
    }
    case 5:  // plus-shaped cross
      return (std::abs(dx) <= w && std::abs(dy) <= r) || (std::abs(dy) <= w && std::abs(dx) <= r);
    case 6:
    case 7: {  // horizontal / vertical stripes inside the square
      const double p = std::max(3.0, 2 * r / 3);
      const double u = (cls == 6 ? dy : dx) + r;
      return m <= r && std::fmod(u, p) < p / 2;
    }
    case 8:  // one diagonal of the square, '\' or '/'
      return m <= r && std::abs(dx - (flip ? -dy : dy)) <= w * std::numbers::sqrt2;
    case 9: {  // checkerboard of 4x4 cells
      const double c = std::max(2.0, r / 2);
      const auto a = static_cast<int64_t>(std::floor((dx + r) / c));
      const auto b = static_cast<int64_t>(std::floor((dy + r) / c));
      return m <= r && (a + b) % 2 == 0;
    }
    default:
      return false;
  }
}

at::Tensor render_images(const std::vector<int64_t>& y, int64_t size, int64_t channels, Rng& rng) {
  const auto n = static_cast<int64_t>(y.size());
  // Noise first (one call), then shapes on top: x = background + noise + intensity * colour * mask.
  at::Tensor x = at::randn({n, channels, size, size}, rng.gen());
  float* d = x.data_ptr<float>();
  const double s = static_cast<double>(size);
  const int64_t plane = size * size;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t cls = y[static_cast<size_t>(i)];
    const double r = std::max(2.5, rng.uniform(0.18, 0.38) * s);
    const double cx = rng.uniform(r, s - r);
    const double cy = rng.uniform(r, s - r);
    const double w = std::max(1.0, 0.22 * r);
    const bool flip = rng.uniform() < 0.5;
    const double background = rng.uniform(0.0, 0.3);
    const double intensity = rng.uniform(0.5, 1.0);
    const double noise = rng.uniform(0.05, 0.2);
    std::array<double, 3> colour{1.0, 1.0, 1.0};
    if (channels == 3) {
      for (double& c : colour) c = rng.uniform(0.4, 1.0);
    }
    float* img = d + i * channels * plane;
    for (int64_t k = 0; k < channels * plane; ++k) {
      img[k] = static_cast<float>(background + noise * img[k]);
    }
    const auto y0 = std::max<int64_t>(0, static_cast<int64_t>(std::floor(cy - r - 1)));
    const auto y1 = std::min<int64_t>(size, static_cast<int64_t>(std::ceil(cy + r + 1)));
    const auto x0 = std::max<int64_t>(0, static_cast<int64_t>(std::floor(cx - r - 1)));
    const auto x1 = std::min<int64_t>(size, static_cast<int64_t>(std::ceil(cx + r + 1)));
    for (int64_t py = y0; py < y1; ++py) {
      for (int64_t px = x0; px < x1; ++px) {
        const double dx = static_cast<double>(px) + 0.5 - cx;
        const double dy = static_cast<double>(py) + 0.5 - cy;
        if (!in_shape(cls, dx, dy, r, w, flip)) continue;
        for (int64_t c = 0; c < channels; ++c) {
          img[c * plane + py * size + px] +=
              static_cast<float>(intensity * colour[static_cast<size_t>(c)]);
        }
      }
    }
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Synthetic tokens

constexpr int64_t kFirstFiller = 5;

at::Tensor make_token_rows(const std::vector<int64_t>& y, int64_t seq_len, int64_t vocab,
                           Rng& rng) {
  const auto n = static_cast<int64_t>(y.size());
  auto x = at::empty({n, seq_len}, at::TensorOptions().dtype(at::kLong));
  int64_t* d = x.data_ptr<int64_t>();
  const int64_t body = seq_len - 1;
  // The winning count m is at most this, so markers fill at most about half the sequence.
  const int64_t max_win = std::max<int64_t>(1, (body / 2 + 3) / 4);
  std::vector<int64_t> row(static_cast<size_t>(body));
  for (int64_t i = 0; i < n; ++i) {
    const int64_t label = y[static_cast<size_t>(i)];
    const int64_t m = 1 + rng.below(max_win);
    std::array<int64_t, kTokenClasses> counts{};
    for (int64_t c = 0; c < kTokenClasses; ++c) counts[c] = c == label ? m : rng.below(m);
    // Half the time one rival marker is a near-tie (m - 1), so counting must be exact.
    if (m > 1 && rng.uniform() < 0.5) {
      const int64_t rival = (label + 1 + rng.below(kTokenClasses - 1)) % kTokenClasses;
      counts[rival] = m - 1;
    }
    size_t k = 0;
    for (int64_t c = 0; c < kTokenClasses; ++c) {
      for (int64_t j = 0; j < counts[c]; ++j) row[k++] = c + 1;
    }
    while (k < row.size()) row[k++] = kFirstFiller + rng.below(vocab - kFirstFiller);
    for (int64_t j = body - 1; j > 0; --j) std::swap(row[j], row[rng.below(j + 1)]);
    int64_t* out = d + i * seq_len;
    out[0] = 0;  // [CLS]
    std::copy(row.begin(), row.end(), out + 1);
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Synthetic audio

const std::vector<std::string>& audio_class_names() {
  static const std::vector<std::string> names{"low_tone",      "high_tone", "rising_chirp",
                                              "falling_chirp", "two_tone",  "am_tone"};
  return names;
}

at::Tensor make_waves(const std::vector<int64_t>& y, int64_t samples, Rng& rng) {
  const auto n = static_cast<int64_t>(y.size());
  at::Tensor x = at::randn({n, 1, samples}, rng.gen());
  float* d = x.data_ptr<float>();
  constexpr double kTwoPi = 2 * std::numbers::pi;
  const double sr = kSampleRate;
  const double duration = static_cast<double>(samples) / sr;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t cls = y[static_cast<size_t>(i)];
    const double amplitude = rng.uniform(0.3, 0.7);
    const double noise = rng.uniform(0.01, 0.08);
    double phase = rng.uniform(0.0, kTwoPi);
    // Per-class parameters; f(t) is the instantaneous frequency, env(t) the amplitude envelope.
    double f0 = 0, ratio = 1, fa = 0, fb = 0, segment = 1, fm = 0, depth = 0, phase_m = 0;
    bool start_b = false;
    switch (cls) {
      case 0:
        f0 = rng.uniform(120, 350);
        break;
      case 1:
        f0 = rng.uniform(1500, 3500);
        break;
      case 2:  // exponential sweep up by 3..5x
        f0 = rng.uniform(250, 600);
        ratio = rng.uniform(3, 5);
        break;
      case 3:  // exponential sweep down by 3..5x
        f0 = rng.uniform(1000, 2500);
        ratio = 1 / rng.uniform(3, 5);
        break;
      case 4:  // alternation every 25..50 ms between fa and ~2 fa
        fa = rng.uniform(400, 700);
        fb = fa * rng.uniform(1.6, 2.2);
        segment = rng.uniform(0.025, 0.05) * sr;
        start_b = rng.uniform() < 0.5;
        break;
      default:  // 5: carrier 600..1200 Hz, amplitude-modulated at 10..25 Hz
        f0 = rng.uniform(600, 1200);
        fm = rng.uniform(10, 25);
        depth = rng.uniform(0.7, 1.0);
        phase_m = rng.uniform(0.0, kTwoPi);
        break;
    }
    float* w = d + i * samples;
    for (int64_t k = 0; k < samples; ++k) {
      const double t = static_cast<double>(k) / sr;
      double f = f0;
      double env = 1;
      if (cls == 2 || cls == 3) {
        f = f0 * std::pow(ratio, t / duration);
      } else if (cls == 4) {
        const bool b =
            ((static_cast<int64_t>(static_cast<double>(k) / segment) % 2) == 1) != start_b;
        f = b ? fb : fa;
      } else if (cls == 5) {
        env = 1 - depth * (0.5 + 0.5 * std::cos(kTwoPi * fm * t + phase_m));
      }
      const double v = amplitude * env * std::sin(phase) + noise * w[k];
      w[k] = static_cast<float>(std::clamp(v, -1.0, 1.0));
      phase = std::fmod(phase + kTwoPi * f / sr, kTwoPi);
    }
  }
  return x;
}

// ---------------------------------------------------------------------------------------------
// Files

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

uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | uint32_t{p[3]};
}
uint32_t le32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
uint16_t le16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

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

bool is_gzip(const std::vector<uint8_t>& b) {
  return b.size() >= 2 && b[0] == 0x1f && b[1] == 0x8b;
}

/// Labels as int64 [N] in [0, 255] (any integer dtype).
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

// MNIST ----------------------------------------------------------------------------------------

struct RawImages {
  int64_t n = 0, rows = 0, cols = 0;
  std::vector<uint8_t> bytes;  // whole file; pixels from offset 16
};

RawImages read_idx_images(const fs::path& path) {
  const std::string name = "apex-train: MNIST file " + path.string() + ": ";
  RawImages r;
  r.bytes = read_bytes(path, "MNIST file");
  const auto& b = r.bytes;
  TORCH_CHECK(!is_gzip(b), name, "is gzip-compressed; gunzip it first (plain IDX files only)");
  TORCH_CHECK(b.size() >= 16, name, "truncated header: ", b.size(), " bytes, expected at least 16");
  const uint32_t magic = be32(b.data());
  TORCH_CHECK(magic == 2051, name, "magic ", magic, ", expected 2051 (IDX images)");
  r.n = be32(b.data() + 4);
  r.rows = be32(b.data() + 8);
  r.cols = be32(b.data() + 12);
  TORCH_CHECK(r.rows >= 1 && r.rows <= 4096 && r.cols >= 1 && r.cols <= 4096, name, "image size ",
              r.rows, "x", r.cols, ", expected 1..4096 per side");
  TORCH_CHECK(r.n >= 1, name, "holds 0 images, expected at least 1");
  const auto expected = static_cast<uint64_t>(16 + r.n * r.rows * r.cols);
  TORCH_CHECK(b.size() >= expected, name, "truncated: ", b.size(), " bytes, expected ", expected,
              " (16 + ", r.n, " images x ", r.rows, "x", r.cols, ")");
  TORCH_CHECK(b.size() == expected, name, b.size(), " bytes, expected ", expected,
              " (trailing data after ", r.n, " images)");
  return r;
}

std::vector<uint8_t> read_idx_labels(const fs::path& path, int64_t expected_n,
                                     const fs::path& images_path) {
  const std::string name = "apex-train: MNIST file " + path.string() + ": ";
  auto b = read_bytes(path, "MNIST file");
  TORCH_CHECK(!is_gzip(b), name, "is gzip-compressed; gunzip it first (plain IDX files only)");
  TORCH_CHECK(b.size() >= 8, name, "truncated header: ", b.size(), " bytes, expected at least 8");
  const uint32_t magic = be32(b.data());
  TORCH_CHECK(magic == 2049, name, "magic ", magic, ", expected 2049 (IDX labels)");
  const int64_t n = be32(b.data() + 4);
  TORCH_CHECK(n == expected_n, name, n, " labels, but ", images_path.string(), " has ", expected_n,
              " images");
  const auto expected = static_cast<uint64_t>(8 + n);
  TORCH_CHECK(b.size() >= expected, name, "truncated: ", b.size(), " bytes, expected ", expected,
              " (8 + ", n, " labels)");
  TORCH_CHECK(b.size() == expected, name, b.size(), " bytes, expected ", expected,
              " (trailing data after ", n, " labels)");
  std::vector<uint8_t> labels(b.begin() + 8, b.end());
  for (size_t i = 0; i < labels.size(); ++i) {
    TORCH_CHECK(labels[i] < 10, name, "label ", int{labels[i]}, " at index ", i, ", expected 0..9");
  }
  return labels;
}

Dataset mnist_part(const fs::path& dir, const std::string& prefix) {
  const fs::path images_path = dir / (prefix + "-images-idx3-ubyte");
  const fs::path labels_path = dir / (prefix + "-labels-idx1-ubyte");
  RawImages img = read_idx_images(images_path);
  auto labels = read_idx_labels(labels_path, img.n, images_path);
  Dataset ds;
  ds.kind = "image";
  ds.num_classes = 10;
  for (int c = 0; c < 10; ++c) ds.class_names.push_back(std::to_string(c));
  ds.inputs = at::empty({img.n, 1, img.rows, img.cols});
  float* d = ds.inputs.data_ptr<float>();
  const uint8_t* p = img.bytes.data() + 16;
  for (int64_t k = 0; k < ds.inputs.numel(); ++k) d[k] = static_cast<float>(p[k]) / 255.0f;
  ds.labels = labels_tensor(std::vector<int64_t>(labels.begin(), labels.end()));
  return ds;
}

// CIFAR-10 -------------------------------------------------------------------------------------

constexpr int64_t kCifarPixels = 3 * 32 * 32;
constexpr int64_t kCifarRecord = 1 + kCifarPixels;

void append_cifar(const fs::path& path, std::vector<uint8_t>& pixels,
                  std::vector<int64_t>& labels) {
  const std::string name = "apex-train: CIFAR-10 file " + path.string() + ": ";
  auto b = read_bytes(path, "CIFAR-10 file");
  TORCH_CHECK(!is_gzip(b), name, "is gzip-compressed; extract it first (binary version only)");
  TORCH_CHECK(!b.empty() && b.size() % kCifarRecord == 0, name, b.size(),
              " bytes, expected a non-zero multiple of ", kCifarRecord,
              " (1 label byte + 3072 pixel bytes per image)");
  const size_t n = b.size() / kCifarRecord;
  for (size_t i = 0; i < n; ++i) {
    const uint8_t* rec = b.data() + i * kCifarRecord;
    TORCH_CHECK(rec[0] < 10, name, "label ", int{rec[0]}, " in record ", i, ", expected 0..9");
    labels.push_back(rec[0]);
    pixels.insert(pixels.end(), rec + 1, rec + kCifarRecord);
  }
}

Dataset cifar_dataset(const std::vector<uint8_t>& pixels, const std::vector<int64_t>& labels) {
  Dataset ds;
  ds.kind = "image";
  ds.num_classes = 10;
  ds.class_names = {"airplane", "automobile", "bird",  "cat",  "deer",
                    "dog",      "frog",       "horse", "ship", "truck"};
  const auto n = static_cast<int64_t>(labels.size());
  ds.inputs = at::empty({n, 3, 32, 32});
  float* d = ds.inputs.data_ptr<float>();
  for (size_t k = 0; k < pixels.size(); ++k) d[k] = static_cast<float>(pixels[k]) / 255.0f;
  ds.labels = labels_tensor(labels);
  return ds;
}

// WAV ------------------------------------------------------------------------------------------

std::string wav_format_name(uint16_t format) {
  switch (format) {
    case 1:
      return " (PCM)";
    case 3:
      return " (IEEE float)";
    case 6:
      return " (A-law)";
    case 7:
      return " (mu-law)";
    case 0xFFFE:
      return " (extensible)";
    default:
      return "";
  }
}

uint64_t fnv1a(const std::string& s, uint64_t seed) {
  uint64_t h = 0xcbf29ce484222325ULL ^ splitmix64(seed);
  for (unsigned char c : s) {
    h ^= c;
    h *= 0x100000001b3ULL;
  }
  return splitmix64(h);
}

bool has_wav_extension(const fs::path& p) {
  std::string ext = p.extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return ext == ".wav";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public API

namespace {

// Both splits of a synthetic task: balanced labels, then `make(labels, rng)` for the inputs; each
// split draws from its own stream of the seed (so the test split does not depend on n_train).
template <typename MakeInputs>
Split synthetic_split(const char* kind, int64_t classes, std::vector<std::string> names,
                      uint64_t seed, uint64_t task, int64_t n_train, int64_t n_test, int64_t vocab,
                      MakeInputs&& make) {
  Split s;
  for (int part = 0; part < 2; ++part) {
    Rng rng(stream_seed(seed, task, static_cast<uint64_t>(part)));
    Dataset& ds = part == 0 ? s.train : s.test;
    auto y = balanced_labels(part == 0 ? n_train : n_test, classes, rng);
    ds.kind = kind;
    ds.num_classes = classes;
    ds.vocab_size = vocab;
    ds.class_names = names;
    ds.inputs = make(y, rng);
    ds.labels = labels_tensor(y);
  }
  return s;
}

}  // namespace

Split synthetic_images(int64_t n_train, int64_t n_test, int64_t size, int64_t channels,
                       uint64_t seed) {
  check_counts("synthetic images", n_train, n_test, kImageClasses);
  TORCH_CHECK(size >= 8 && size <= 1024, "apex-train: synthetic images: size ", size,
              ", expected 8..1024");
  TORCH_CHECK(channels == 1 || channels == 3, "apex-train: synthetic images: channels ", channels,
              ", expected 1 or 3");
  Split s = synthetic_split("image", kImageClasses, image_class_names(), seed, 1, n_train, n_test,
                            0, [&](const std::vector<int64_t>& y, Rng& rng) {
                              return render_images(y, size, channels, rng);
                            });
  normalize_channels(s.train.inputs, s.test.inputs);
  return s;
}

Split synthetic_tokens(int64_t n_train, int64_t n_test, int64_t seq_len, int64_t vocab,
                       uint64_t seed) {
  check_counts("synthetic tokens", n_train, n_test, kTokenClasses);
  TORCH_CHECK(seq_len >= 8, "apex-train: synthetic tokens: seq_len ", seq_len,
              ", expected at least 8");
  TORCH_CHECK(vocab >= 8, "apex-train: synthetic tokens: vocab ", vocab,
              ", expected at least 8 (0 = [CLS], 1..4 markers, fillers >= 5)");
  return synthetic_split("tokens", kTokenClasses, {"marker_1", "marker_2", "marker_3", "marker_4"},
                         seed, 2, n_train, n_test, vocab,
                         [&](const std::vector<int64_t>& y, Rng& rng) {
                           return make_token_rows(y, seq_len, vocab, rng);
                         });
}

Split synthetic_audio(int64_t n_train, int64_t n_test, int64_t samples, uint64_t seed) {
  check_counts("synthetic audio", n_train, n_test, kAudioClasses);
  TORCH_CHECK(samples >= 400, "apex-train: synthetic audio: samples ", samples,
              ", expected at least 400 (25 ms at 16 kHz)");
  return synthetic_split(
      "audio", kAudioClasses, audio_class_names(), seed, 3, n_train, n_test, 0,
      [&](const std::vector<int64_t>& y, Rng& rng) { return make_waves(y, samples, rng); });
}

Split load_mnist(const std::string& dir) {
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir, ec), "apex-train: MNIST folder ", dir, ": not a directory");
  Split s;
  s.train = mnist_part(dir, "train");
  s.test = mnist_part(dir, "t10k");
  TORCH_CHECK(s.train.inputs.size(2) == s.test.inputs.size(2) &&
                  s.train.inputs.size(3) == s.test.inputs.size(3),
              "apex-train: MNIST folder ", dir, ": train images are ", s.train.inputs.size(2), "x",
              s.train.inputs.size(3), " but test images are ", s.test.inputs.size(2), "x",
              s.test.inputs.size(3));
  normalize_channels(s.train.inputs, s.test.inputs);
  return s;
}

Split load_cifar10(const std::string& dir) {
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(dir, ec), "apex-train: CIFAR-10 folder ", dir, ": not a directory");
  fs::path root = dir;
  // The archive extracts to cifar-10-batches-bin/; accept its parent too.
  if (!fs::exists(root / "test_batch.bin", ec) &&
      fs::exists(root / "cifar-10-batches-bin" / "test_batch.bin", ec)) {
    root /= "cifar-10-batches-bin";
  }
  std::vector<uint8_t> pixels;
  std::vector<int64_t> labels;
  for (int b = 1; b <= 5; ++b) {
    const fs::path p = root / ("data_batch_" + std::to_string(b) + ".bin");
    if (fs::exists(p, ec)) append_cifar(p, pixels, labels);
  }
  TORCH_CHECK(!labels.empty(), "apex-train: CIFAR-10 folder ", root.string(),
              ": no data_batch_1.bin .. data_batch_5.bin found (binary version expected)");
  Split s;
  s.train = cifar_dataset(pixels, labels);
  pixels.clear();
  labels.clear();
  append_cifar(root / "test_batch.bin", pixels, labels);
  s.test = cifar_dataset(pixels, labels);
  normalize_channels(s.train.inputs, s.test.inputs);
  return s;
}

std::vector<float> read_wav(const std::string& path) {
  const std::string name = "apex-train: " + path + ": ";
  std::ifstream in(path, std::ios::binary);
  TORCH_CHECK(in, name, "cannot open file");
  std::vector<uint8_t> b((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  TORCH_CHECK(b.size() >= 12 && std::equal(b.begin(), b.begin() + 4, "RIFF") &&
                  std::equal(b.begin() + 8, b.begin() + 12, "WAVE"),
              name, "not a RIFF/WAVE file");
  bool have_fmt = false;
  size_t pos = 12;
  while (pos + 8 <= b.size()) {
    const std::string id(b.begin() + static_cast<std::ptrdiff_t>(pos),
                         b.begin() + static_cast<std::ptrdiff_t>(pos + 4));
    const uint64_t len = le32(b.data() + pos + 4);
    const size_t body = pos + 8;
    const uint64_t avail = b.size() - body;
    if (id == "fmt ") {
      TORCH_CHECK(len >= 16 && avail >= len, name, "fmt chunk of ", len, " bytes (", avail,
                  " present), expected at least 16");
      const uint8_t* f = b.data() + body;
      uint16_t format = le16(f);
      const uint16_t channels = le16(f + 2);
      const uint32_t rate = le32(f + 4);
      const uint16_t bits = le16(f + 14);
      // WAVE_FORMAT_EXTENSIBLE: the real format is the first two bytes of the sub-format GUID.
      if (format == 0xFFFE && len >= 40) format = le16(f + 24);
      TORCH_CHECK(format == 1, name, "audio format ", format, wav_format_name(format),
                  ", expected 1 (PCM)");
      TORCH_CHECK(channels == 1, name, channels, " channels, expected mono (1)");
      TORCH_CHECK(rate == static_cast<uint32_t>(kSampleRate), name, "sample rate ", rate,
                  " Hz, expected ", kSampleRate);
      TORCH_CHECK(bits == 16, name, bits, " bits per sample, expected 16");
      have_fmt = true;
    } else if (id == "data") {
      TORCH_CHECK(have_fmt, name, "data chunk before the fmt chunk");
      TORCH_CHECK(len <= avail, name, "truncated data chunk: header says ", len, " bytes, only ",
                  avail, " present");
      TORCH_CHECK(len % 2 == 0, name, "data chunk of ", len,
                  " bytes is not a whole number of 16-bit samples");
      std::vector<float> out(static_cast<size_t>(len / 2));
      const uint8_t* p = b.data() + body;
      for (size_t i = 0; i < out.size(); ++i) {
        out[i] = static_cast<float>(static_cast<int16_t>(le16(p + 2 * i))) / 32768.0f;
      }
      return out;
    }
    // Unknown chunks (LIST, fact, ...) are skipped; chunks are padded to an even size.
    TORCH_CHECK(len <= avail, name, "truncated '", id, "' chunk: header says ", len,
                " bytes, only ", avail, " present");
    pos = body + static_cast<size_t>(len) + (len % 2);
  }
  TORCH_CHECK(have_fmt, name, "no fmt chunk");
  TORCH_CHECK(false, name, "no data chunk");
}

Split load_wav_folder(const std::string& dir, int64_t samples, double test_fraction,
                      uint64_t seed) {
  const std::string name = "apex-train: WAV folder " + dir + ": ";
  TORCH_CHECK(samples >= 1, name, "samples ", samples, ", expected >= 1");
  TORCH_CHECK(test_fraction >= 0 && test_fraction < 1, name, "test fraction ", test_fraction,
              ", expected in [0, 1)");
  std::error_code ec;
  TORCH_CHECK(fs::exists(dir, ec), name, "not found");
  TORCH_CHECK(fs::is_directory(dir, ec), name, "not a directory");
  std::vector<std::string> classes;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string n = e.path().filename().string();
    if (e.is_directory() && !n.empty() && n[0] != '.' && n[0] != '_') classes.push_back(n);
  }
  std::sort(classes.begin(), classes.end());
  TORCH_CHECK(!classes.empty(), name,
              "no class sub-folders (expected one sub-folder of 16 kHz .wav files per class)");
  TORCH_CHECK(classes.size() >= 2, name, "only one class sub-folder ('", classes[0],
              "'), expected at least 2");

  struct Clip {
    fs::path path;
    int64_t label;
  };
  std::vector<Clip> train, test;
  for (size_t c = 0; c < classes.size(); ++c) {
    const fs::path cdir = fs::path(dir) / classes[c];
    std::vector<std::string> files;
    for (const auto& e : fs::directory_iterator(cdir)) {
      if (e.is_regular_file() && has_wav_extension(e.path())) {
        files.push_back(e.path().filename().string());
      }
    }
    std::sort(files.begin(), files.end());
    TORCH_CHECK(!files.empty(), name, "class '", classes[c], "' (", cdir.string(),
                ") has no .wav files");
    const auto n = static_cast<int64_t>(files.size());
    const int64_t n_test =
        std::min<int64_t>(n - 1, std::llround(test_fraction * static_cast<double>(n)));
    // Rank the files by a seeded hash of their name: the first n_test go to test.
    std::vector<std::pair<uint64_t, size_t>> order;
    for (size_t i = 0; i < files.size(); ++i) {
      order.emplace_back(fnv1a(classes[c] + "/" + files[i], seed), i);
    }
    std::sort(order.begin(), order.end());
    std::vector<bool> is_test(files.size(), false);
    for (int64_t k = 0; k < n_test; ++k) is_test[order[static_cast<size_t>(k)].second] = true;
    for (size_t i = 0; i < files.size(); ++i) {
      (is_test[i] ? test : train).push_back({cdir / files[i], static_cast<int64_t>(c)});
    }
  }

  auto build = [&](const std::vector<Clip>& clips) {
    Dataset ds;
    ds.kind = "audio";
    ds.num_classes = static_cast<int64_t>(classes.size());
    ds.class_names = classes;
    ds.inputs = at::zeros({static_cast<int64_t>(clips.size()), 1, samples});
    float* d = ds.inputs.data_ptr<float>();
    std::vector<int64_t> y;
    for (size_t i = 0; i < clips.size(); ++i) {
      const auto wave = read_wav(clips[i].path.string());
      const size_t m = std::min(wave.size(), static_cast<size_t>(samples));
      std::copy(wave.begin(), wave.begin() + static_cast<std::ptrdiff_t>(m),
                d + static_cast<int64_t>(i) * samples);
      y.push_back(clips[i].label);
    }
    ds.labels = labels_tensor(y);
    return ds;
  };
  Split s;
  s.train = build(train);
  s.test = build(test);
  return s;
}

void write_wav(const std::string& path, const std::vector<float>& samples, int sample_rate) {
  TORCH_CHECK(sample_rate > 0, "apex-train: ", path, ": sample rate ", sample_rate,
              ", expected > 0");
  const auto data_bytes = static_cast<uint32_t>(samples.size() * 2);
  std::vector<uint8_t> b;
  b.reserve(44 + data_bytes);
  b.insert(b.end(), {'R', 'I', 'F', 'F'});
  put_le32(b, 36 + data_bytes);
  b.insert(b.end(), {'W', 'A', 'V', 'E', 'f', 'm', 't', ' '});
  put_le32(b, 16);
  put_le16(b, 1);  // PCM
  put_le16(b, 1);  // mono
  put_le32(b, static_cast<uint32_t>(sample_rate));
  put_le32(b, static_cast<uint32_t>(sample_rate) * 2);  // byte rate
  put_le16(b, 2);                                       // block align
  put_le16(b, 16);                                      // bits per sample
  b.insert(b.end(), {'d', 'a', 't', 'a'});
  put_le32(b, data_bytes);
  for (float v : samples) {
    const auto q = static_cast<int16_t>(std::lround(std::clamp(v, -1.0f, 1.0f) * 32767.0f));
    put_le16(b, static_cast<uint16_t>(q));
  }
  write_bytes(path, b);
}

void write_mnist(const std::string& dir, const at::Tensor& train_images_u8,
                 const at::Tensor& train_labels, const at::Tensor& test_images_u8,
                 const at::Tensor& test_labels) {
  const std::pair<const char*, std::pair<const at::Tensor*, const at::Tensor*>> parts[] = {
      {"train", {&train_images_u8, &train_labels}}, {"t10k", {&test_images_u8, &test_labels}}};
  for (const auto& [prefix, tensors] : parts) {
    const at::Tensor& images = *tensors.first;
    TORCH_CHECK(images.scalar_type() == at::kByte && images.dim() == 3,
                "apex-train: write_mnist: images must be uint8 [N, rows, cols], got ",
                images.scalar_type(), " ", images.sizes());
    const int64_t n = images.size(0);
    std::vector<uint8_t> b;
    put_be32(b, 2051);
    put_be32(b, static_cast<uint32_t>(n));
    put_be32(b, static_cast<uint32_t>(images.size(1)));
    put_be32(b, static_cast<uint32_t>(images.size(2)));
    auto px = images.contiguous();
    b.insert(b.end(), px.data_ptr<uint8_t>(), px.data_ptr<uint8_t>() + px.numel());
    write_bytes(fs::path(dir) / (std::string(prefix) + "-images-idx3-ubyte"), b);

    auto labels = label_bytes(*tensors.second, n, "write_mnist");
    b.clear();
    put_be32(b, 2049);
    put_be32(b, static_cast<uint32_t>(n));
    b.insert(b.end(), labels.begin(), labels.end());
    write_bytes(fs::path(dir) / (std::string(prefix) + "-labels-idx1-ubyte"), b);
  }
}

void write_cifar10(const std::string& dir, const at::Tensor& train_images_u8,
                   const at::Tensor& train_labels, const at::Tensor& test_images_u8,
                   const at::Tensor& test_labels) {
  const std::pair<const char*, std::pair<const at::Tensor*, const at::Tensor*>> parts[] = {
      {"data_batch_1.bin", {&train_images_u8, &train_labels}},
      {"test_batch.bin", {&test_images_u8, &test_labels}}};
  for (const auto& [file, tensors] : parts) {
    const at::Tensor& images = *tensors.first;
    TORCH_CHECK(images.scalar_type() == at::kByte && images.dim() == 4 && images.size(1) == 3 &&
                    images.size(2) == 32 && images.size(3) == 32,
                "apex-train: write_cifar10: images must be uint8 [N, 3, 32, 32], got ",
                images.scalar_type(), " ", images.sizes());
    const int64_t n = images.size(0);
    auto labels = label_bytes(*tensors.second, n, "write_cifar10");
    auto px = images.contiguous();
    const uint8_t* p = px.data_ptr<uint8_t>();
    std::vector<uint8_t> b;
    b.reserve(static_cast<size_t>(n * kCifarRecord));
    for (int64_t i = 0; i < n; ++i) {
      b.push_back(labels[static_cast<size_t>(i)]);
      b.insert(b.end(), p + i * kCifarPixels, p + (i + 1) * kCifarPixels);
    }
    write_bytes(fs::path(dir) / file, b);
  }
}

}  // namespace apex::train
