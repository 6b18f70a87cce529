// apex-train's synthetic tasks (data.h): shapes to classify in images, markers in token rows,
// waveforms in audio, each split drawn from its own stream of the seed.
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

#include "data_files.h"

namespace apex::train {

namespace fs = std::filesystem;
using namespace data;

namespace {

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

}  // namespace apex::train
