// apex-train's data layer: synthetic generators (shapes, balance, determinism, label rules) and the
// MNIST / CIFAR-10 / WAV-folder readers (round trips through the writers, and every rejection path
// with its message).

#include "train/data.h"

#include "common/test_util.h"

#include <gtest/gtest.h>

#include <unistd.h>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;
using apex::test::throws_with;
using namespace apex::train;

// ---------------------------------------------------------------------------------------------
// Helpers

using DataFiles = apex::test::TempDirTest;

std::vector<uint8_t> read_all(const std::string& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_all(const std::string& p, const std::vector<uint8_t>& b) {
  std::ofstream out(p, std::ios::binary | std::ios::trunc);
  out.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

/// Every class occurs, and each n / classes (+- 1) times.
void expect_balanced(const at::Tensor& labels, int64_t classes) {
  ASSERT_EQ(labels.scalar_type(), at::kLong);
  ASSERT_GE(labels.min().item<int64_t>(), 0);
  ASSERT_LT(labels.max().item<int64_t>(), classes);
  auto counts = torch::bincount(labels, {}, classes);
  const int64_t n = labels.numel();
  EXPECT_GE(counts.min().item<int64_t>(), n / classes) << counts;
  EXPECT_LE(counts.max().item<int64_t>(), (n + classes - 1) / classes) << counts;
}

void expect_same(const Split& a, const Split& b) {
  EXPECT_TRUE(torch::equal(a.train.inputs, b.train.inputs));
  EXPECT_TRUE(torch::equal(a.train.labels, b.train.labels));
  EXPECT_TRUE(torch::equal(a.test.inputs, b.test.inputs));
  EXPECT_TRUE(torch::equal(a.test.labels, b.test.labels));
}

// ---------------------------------------------------------------------------------------------
// Synthetic images

TEST(SyntheticImages, ShapesDtypesBalanceAndNormalization) {
  for (int64_t channels : {1, 3}) {
    auto s = synthetic_images(500, 120, 32, channels, 7);
    for (const Dataset* ds : {&s.train, &s.test}) {
      EXPECT_EQ(ds->kind, "image");
      EXPECT_EQ(ds->num_classes, 10);
      EXPECT_EQ(ds->class_names.size(), 10u);
      EXPECT_EQ(ds->inputs.scalar_type(), at::kFloat);
      EXPECT_TRUE(ds->inputs.isfinite().all().item<bool>());
      expect_balanced(ds->labels, 10);
    }
    EXPECT_EQ(s.train.inputs.sizes(), (std::vector<int64_t>{500, channels, 32, 32}));
    EXPECT_EQ(s.test.inputs.sizes(), (std::vector<int64_t>{120, channels, 32, 32}));
    EXPECT_EQ(s.train.size(), 500);
    EXPECT_EQ(s.test.size(), 120);
    // Train statistics are exactly normalized per channel; test ones approximately.
    auto mean = s.train.inputs.mean({0, 2, 3});
    auto std = s.train.inputs.std({0, 2, 3}, /*unbiased=*/false);
    EXPECT_TRUE(torch::allclose(mean, torch::zeros_like(mean), 0, 1e-4)) << mean;
    EXPECT_TRUE(torch::allclose(std, torch::ones_like(std), 0, 1e-3)) << std;
    auto test_mean = s.test.inputs.mean({0, 2, 3});
    EXPECT_LT(test_mean.abs().max().item<double>(), 0.25) << test_mean;
  }
}

TEST(SyntheticImages, ShapesAreVisible) {
  // Each class draws its shape brighter than the background: the brightest pixels of an image
  // stand well above its median (which is background).
  auto s = synthetic_images(50, 0, 32, 1, 3);
  auto flat = s.train.inputs.flatten(1);
  auto top = std::get<0>(flat.topk(8, 1)).mean(1);
  auto median = std::get<0>(flat.median(1));
  EXPECT_GT((top - median).min().item<double>(), 1.0);
}

TEST(SyntheticImages, Deterministic) {
  expect_same(synthetic_images(60, 20, 16, 1, 42), synthetic_images(60, 20, 16, 1, 42));
  auto a = synthetic_images(60, 20, 16, 1, 42);
  auto b = synthetic_images(60, 20, 16, 1, 43);
  EXPECT_FALSE(torch::equal(a.train.inputs, b.train.inputs));
  EXPECT_FALSE(torch::equal(a.test.inputs, b.test.inputs));
  // The test split's raw content does not depend on n_train (only its normalization does).
  auto c = synthetic_images(90, 20, 16, 1, 42);
  EXPECT_TRUE(torch::equal(a.test.labels, c.test.labels));
}

TEST(SyntheticImages, RejectsBadArguments) {
  EXPECT_TRUE(throws_with([] { synthetic_images(100, 10, 32, 2, 0); },
                          "apex-train: synthetic images: channels 2, expected 1 or 3"));
  EXPECT_TRUE(throws_with([] { synthetic_images(100, 10, 4, 1, 0); }, "size 4, expected 8..1024"));
  EXPECT_TRUE(
      throws_with([] { synthetic_images(5, 10, 32, 1, 0); }, "n_train 5, expected at least 10"));
  EXPECT_TRUE(throws_with([] { synthetic_images(10, -1, 32, 1, 0); }, "n_test -1, expected >= 0"));
}

// ---------------------------------------------------------------------------------------------
// Synthetic tokens

TEST(SyntheticTokens, LabelIsTheStrictlyMostFrequentMarker) {
  const int64_t n = 400, t = 48, vocab = 64;
  auto s = synthetic_tokens(n, 100, t, vocab, 5);
  EXPECT_EQ(s.train.kind, "tokens");
  EXPECT_EQ(s.train.vocab_size, vocab);
  EXPECT_EQ(s.train.num_classes, 4);
  EXPECT_EQ(s.train.inputs.scalar_type(), at::kLong);
  EXPECT_EQ(s.train.inputs.sizes(), (std::vector<int64_t>{n, t}));
  EXPECT_EQ(s.test.inputs.sizes(), (std::vector<int64_t>{100, t}));
  int64_t near_ties = 0, several_markers = 0;
  for (const Dataset* ds : {&s.train, &s.test}) {
    expect_balanced(ds->labels, 4);
    const auto& x = ds->inputs;
    EXPECT_GE(x.min().item<int64_t>(), 0);
    EXPECT_LT(x.max().item<int64_t>(), vocab);
    // [CLS] at position 0 and nowhere else.
    EXPECT_TRUE(x.select(1, 0).eq(0).all().item<bool>());
    EXPECT_TRUE(x.slice(1, 1).ne(0).all().item<bool>());
    auto xa = x.accessor<int64_t, 2>();
    auto ya = ds->labels.accessor<int64_t, 1>();
    for (int64_t i = 0; i < x.size(0); ++i) {
      int64_t counts[5] = {0, 0, 0, 0, 0};
      for (int64_t j = 1; j < t; ++j) {
        if (xa[i][j] <= 4) ++counts[xa[i][j]];
      }
      const int64_t win = counts[ya[i] + 1];
      int64_t runner_up = 0, kinds = 0;
      for (int64_t m = 1; m <= 4; ++m) {
        if (counts[m] > 0) ++kinds;
        if (m != ya[i] + 1) runner_up = std::max(runner_up, counts[m]);
      }
      ASSERT_GT(win, runner_up) << "sample " << i << " label " << ya[i];
      near_ties += win - runner_up == 1 && runner_up > 0;
      several_markers += kinds >= 3;
    }
  }
  // Not trivial: many samples hold several marker kinds, and many are decided by one occurrence.
  EXPECT_GT(near_ties, 100);
  EXPECT_GT(several_markers, 200);
}

TEST(SyntheticTokens, DeterministicAndRejectsBadArguments) {
  expect_same(synthetic_tokens(40, 12, 16, 10, 1), synthetic_tokens(40, 12, 16, 10, 1));
  EXPECT_FALSE(torch::equal(synthetic_tokens(40, 12, 16, 10, 1).train.inputs,
                            synthetic_tokens(40, 12, 16, 10, 2).train.inputs));
  // The smallest allowed task still follows the rule (fillers only 5..7).
  auto s = synthetic_tokens(8, 4, 8, 8, 0);
  EXPECT_LT(s.train.inputs.max().item<int64_t>(), 8);
  EXPECT_TRUE(throws_with([] { synthetic_tokens(40, 10, 16, 7, 0); },
                          "apex-train: synthetic tokens: vocab 7, expected at least 8"));
  EXPECT_TRUE(
      throws_with([] { synthetic_tokens(40, 10, 4, 16, 0); }, "seq_len 4, expected at least 8"));
  EXPECT_TRUE(
      throws_with([] { synthetic_tokens(3, 10, 16, 16, 0); }, "n_train 3, expected at least 4"));
}

// ---------------------------------------------------------------------------------------------
// Synthetic audio

/// Zero crossings per second in samples [from, to) of one waveform after a 4-tap moving average
/// (which keeps tones up to 3.5 kHz but stops the noise from adding crossings near zero): about
/// twice the dominant frequency.
double crossing_rate(const at::Tensor& wave, int64_t from, int64_t to) {
  auto w = wave.flatten().slice(0, from, to);
  const int64_t n = w.numel() - 3;
  auto smooth = w.slice(0, 0, n) + w.slice(0, 1, n + 1) + w.slice(0, 2, n + 2) + w.slice(0, 3);
  auto sign = smooth.gt(0);
  const double crossings = sign.slice(0, 1).ne(sign.slice(0, 0, -1)).sum().item<double>();
  return crossings * 16000.0 / static_cast<double>(n);
}

TEST(SyntheticAudio, ShapesRangeBalanceAndClassCharacter) {
  const int64_t len = 4000;
  auto s = synthetic_audio(300, 60, len, 11);
  for (const Dataset* ds : {&s.train, &s.test}) {
    EXPECT_EQ(ds->kind, "audio");
    EXPECT_EQ(ds->num_classes, 6);
    EXPECT_EQ(ds->class_names.size(), 6u);
    EXPECT_EQ(ds->inputs.scalar_type(), at::kFloat);
    EXPECT_EQ(ds->inputs.size(1), 1);
    EXPECT_EQ(ds->inputs.size(2), len);
    EXPECT_LE(ds->inputs.abs().max().item<float>(), 1.0f);
    EXPECT_GT(ds->inputs.abs().max().item<float>(), 0.3f);
    expect_balanced(ds->labels, 6);
  }
  // Class character (margins checked on 3000 clips): low tones (<= 350 Hz) cross zero less often
  // than high tones (>= 1500 Hz); rising chirps end at least 2x higher than they start, falling
  // chirps the reverse.
  auto ya = s.train.labels.accessor<int64_t, 1>();
  for (int64_t i = 0; i < s.train.size(); ++i) {
    const auto w = s.train.inputs[i];
    const double first = crossing_rate(w, 0, len / 4);
    const double last = crossing_rate(w, 3 * len / 4, len);
    switch (ya[i]) {
      case 0:
        EXPECT_LT(crossing_rate(w, 0, len), 1000) << i;
        break;
      case 1:
        EXPECT_GT(crossing_rate(w, 0, len), 2400) << i;
        break;
      case 2:
        EXPECT_GT(last, first * 1.6) << i;
        break;
      case 3:
        EXPECT_LT(last * 1.6, first) << i;
        break;
      default:
        break;
    }
  }
}

TEST(SyntheticAudio, DeterministicAndRejectsBadArguments) {
  expect_same(synthetic_audio(12, 6, 800, 3), synthetic_audio(12, 6, 800, 3));
  EXPECT_FALSE(torch::equal(synthetic_audio(12, 6, 800, 3).train.inputs,
                            synthetic_audio(12, 6, 800, 4).train.inputs));
  EXPECT_TRUE(throws_with([] { synthetic_audio(12, 6, 100, 0); },
                          "apex-train: synthetic audio: samples 100, expected at least 400"));
  EXPECT_TRUE(throws_with([] { synthetic_audio(5, 6, 800, 0); }, "n_train 5, expected at least 6"));
}

// ---------------------------------------------------------------------------------------------
// MNIST

struct RawImages {
  at::Tensor train_x, train_y, test_x, test_y;
};

RawImages random_u8(int64_t n_train, int64_t n_test, std::vector<int64_t> image_shape) {
  auto gen = at::detail::createCPUGenerator(99);
  auto shape = [&](int64_t n) {
    std::vector<int64_t> s{n};
    s.insert(s.end(), image_shape.begin(), image_shape.end());
    return s;
  };
  auto u8 = at::TensorOptions().dtype(at::kByte);
  RawImages r;
  r.train_x = at::randint(256, shape(n_train), gen, u8);
  r.test_x = at::randint(256, shape(n_test), gen, u8);
  r.train_y = torch::arange(n_train) % 10;
  r.test_y = (torch::arange(n_test) * 3) % 10;
  return r;
}

/// (raw / 255 - mean) / std with per-channel statistics of `train_raw` ([N, C, ...] uint8).
at::Tensor expected_normalized(const at::Tensor& raw, const at::Tensor& train_raw) {
  auto t = train_raw.to(at::kDouble) / 255;
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < t.dim(); ++d) dims.push_back(d);
  auto mean = t.mean(dims, true);
  auto std = t.std(dims, /*unbiased=*/false, true);
  return ((raw.to(at::kDouble) / 255 - mean) / std).to(at::kFloat);
}

TEST_F(DataFiles, MnistRoundTrip) {
  auto r = random_u8(23, 7, {28, 28});
  write_mnist(dir_.string(), r.train_x, r.train_y, r.test_x, r.test_y);
  auto s = load_mnist(dir_.string());
  EXPECT_EQ(s.train.kind, "image");
  EXPECT_EQ(s.train.num_classes, 10);
  EXPECT_EQ(s.train.inputs.sizes(), (std::vector<int64_t>{23, 1, 28, 28}));
  EXPECT_EQ(s.test.inputs.sizes(), (std::vector<int64_t>{7, 1, 28, 28}));
  EXPECT_TRUE(torch::equal(s.train.labels, r.train_y));
  EXPECT_TRUE(torch::equal(s.test.labels, r.test_y));
  // Pixels keep their order; both splits are normalized with the train statistics.
  auto train_raw = r.train_x.unsqueeze(1);
  EXPECT_TRUE(apex::test::all_close(s.train.inputs, expected_normalized(train_raw, train_raw),
                                    {1e-5, 1e-5}));
  EXPECT_TRUE(apex::test::all_close(
      s.test.inputs, expected_normalized(r.test_x.unsqueeze(1), train_raw), {1e-5, 1e-5}));
}

TEST_F(DataFiles, MnistRejectsCorruptFiles) {
  auto r = random_u8(12, 5, {28, 28});
  write_mnist(dir_.string(), r.train_x, r.train_y, r.test_x, r.test_y);
  const std::string images = path("train-images-idx3-ubyte");
  const std::string labels = path("t10k-labels-idx1-ubyte");
  const auto good_images = read_all(images);
  const auto good_labels = read_all(labels);
  const std::string dir = dir_.string();
  auto load = [&] { load_mnist(dir); };

  auto bad = good_images;
  bad[2] = 0x04;  // 0x0403 = 1027
  write_all(images, bad);
  EXPECT_TRUE(throws_with(
      load, "apex-train: MNIST file " + images + ": magic 1027, expected 2051 (IDX images)"));

  bad = good_images;
  bad.pop_back();
  write_all(images, bad);
  EXPECT_TRUE(throws_with(load, images + ": truncated: 9423 bytes, expected 9424"));

  bad = good_images;
  bad.push_back(0);
  write_all(images, bad);
  EXPECT_TRUE(throws_with(load, "9425 bytes, expected 9424 (trailing data after 12 images)"));

  bad.assign(good_images.begin(), good_images.begin() + 10);
  write_all(images, bad);
  EXPECT_TRUE(throws_with(load, "truncated header: 10 bytes, expected at least 16"));

  write_all(images, {0x1f, 0x8b, 8, 0, 0, 0});
  EXPECT_TRUE(throws_with(load, "is gzip-compressed; gunzip it first (plain IDX files only)"));
  write_all(images, good_images);

  bad = good_labels;
  bad[8 + 3] = 10;
  write_all(labels, bad);
  EXPECT_TRUE(throws_with(load, labels + ": label 10 at index 3, expected 0..9"));

  bad = good_labels;
  bad[7] = 4;  // 4 labels for 5 images
  write_all(labels, bad);
  EXPECT_TRUE(
      throws_with(load, "4 labels, but " + path("t10k-images-idx3-ubyte") + " has 5 images"));

  bad = good_labels;
  bad[3] = 0x03;  // the images' magic in a labels file
  write_all(labels, bad);
  EXPECT_TRUE(throws_with(load, "magic 2051, expected 2049 (IDX labels)"));

  fs::remove(labels);
  EXPECT_TRUE(throws_with(load, "apex-train: MNIST file " + labels + ": cannot open file"));
  write_all(labels + ".gz", good_labels);
  EXPECT_TRUE(throws_with(load, labels + ".gz is: gunzip it first"));
  EXPECT_TRUE(throws_with([&] { load_mnist(path("nope")); },
                          "apex-train: MNIST folder " + path("nope") + ": not a directory"));
}

// ---------------------------------------------------------------------------------------------
// CIFAR-10

TEST_F(DataFiles, Cifar10RoundTrip) {
  auto r = random_u8(14, 6, {3, 32, 32});
  write_cifar10(dir_.string(), r.train_x, r.train_y, r.test_x, r.test_y);
  auto s = load_cifar10(dir_.string());
  EXPECT_EQ(s.train.inputs.sizes(), (std::vector<int64_t>{14, 3, 32, 32}));
  EXPECT_EQ(s.test.inputs.sizes(), (std::vector<int64_t>{6, 3, 32, 32}));
  EXPECT_EQ(s.train.class_names.at(0), "airplane");
  EXPECT_EQ(s.train.class_names.at(9), "truck");
  EXPECT_TRUE(torch::equal(s.train.labels, r.train_y));
  EXPECT_TRUE(torch::equal(s.test.labels, r.test_y));
  EXPECT_TRUE(apex::test::all_close(s.train.inputs, expected_normalized(r.train_x, r.train_x),
                                    {1e-5, 1e-5}));
  EXPECT_TRUE(
      apex::test::all_close(s.test.inputs, expected_normalized(r.test_x, r.train_x), {1e-5, 1e-5}));

  // Every data_batch_k.bin present counts, in order k = 1..5.
  fs::copy_file(path("data_batch_1.bin"), path("data_batch_4.bin"));
  auto twice = load_cifar10(dir_.string());
  EXPECT_EQ(twice.train.size(), 28);
  EXPECT_TRUE(torch::equal(twice.train.labels, torch::cat({r.train_y, r.train_y})));

  // The archive's own sub-folder is found from its parent.
  const fs::path sub = dir_ / "cifar-10-batches-bin";
  fs::create_directory(sub);
  for (const char* f : {"data_batch_1.bin", "test_batch.bin"}) {
    fs::rename(dir_ / f, sub / f);
  }
  fs::remove(path("data_batch_4.bin"));
  EXPECT_EQ(load_cifar10(dir_.string()).train.size(), 14);
}

TEST_F(DataFiles, Cifar10RejectsCorruptFiles) {
  auto r = random_u8(4, 3, {3, 32, 32});
  write_cifar10(dir_.string(), r.train_x, r.train_y, r.test_x, r.test_y);
  const std::string batch = path("data_batch_1.bin");
  const auto good = read_all(batch);
  const std::string dir = dir_.string();
  auto load = [&] { load_cifar10(dir); };

  auto bad = good;
  bad.resize(good.size() - 100);
  write_all(batch, bad);
  EXPECT_TRUE(throws_with(load, "apex-train: CIFAR-10 file " + batch +
                                    ": 12192 bytes, expected a non-zero multiple of 3073"));

  bad = good;
  bad[2 * 3073] = 10;
  write_all(batch, bad);
  EXPECT_TRUE(throws_with(load, batch + ": label 10 in record 2, expected 0..9"));

  write_all(batch, {});
  EXPECT_TRUE(throws_with(load, "0 bytes, expected a non-zero multiple of 3073"));

  fs::remove(batch);
  EXPECT_TRUE(throws_with(load, "no data_batch_1.bin .. data_batch_5.bin found"));
  write_all(batch, good);
  fs::remove(path("test_batch.bin"));
  EXPECT_TRUE(throws_with(load, "CIFAR-10 file " + path("test_batch.bin") + ": cannot open file"));
}

// ---------------------------------------------------------------------------------------------
// WAV folders

std::vector<float> tone(double freq, int64_t n, double amp = 0.5) {
  std::vector<float> w(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    w[static_cast<size_t>(i)] = static_cast<float>(
        amp * std::sin(2 * std::numbers::pi * freq * static_cast<double>(i) / 16000.0));
  }
  return w;
}

void put16(std::vector<uint8_t>& b, int v) {
  b.push_back(static_cast<uint8_t>(v & 0xff));
  b.push_back(static_cast<uint8_t>((v >> 8) & 0xff));
}
void put32(std::vector<uint8_t>& b, uint32_t v) {
  put16(b, static_cast<int>(v & 0xffff));
  put16(b, static_cast<int>(v >> 16));
}

/// A hand-built WAV: fmt fields as given, an optional LIST chunk, `data_bytes` of data (declared
/// size `declared`, or the real size when negative).
std::vector<uint8_t> wav_bytes(int format, int channels, int rate, int bits, size_t data_bytes,
                               bool list_chunk = false, int64_t declared = -1) {
  std::vector<uint8_t> b{'R', 'I', 'F', 'F', 0, 0, 0, 0, 'W', 'A', 'V', 'E', 'f', 'm', 't', ' '};
  put32(b, 16);
  put16(b, format);
  put16(b, channels);
  put32(b, static_cast<uint32_t>(rate));
  put32(b, static_cast<uint32_t>(rate * channels * bits / 8));
  put16(b, channels * bits / 8);
  put16(b, bits);
  if (list_chunk) {
    b.insert(b.end(), {'L', 'I', 'S', 'T'});
    put32(b, 5);  // odd size: padded to 6
    b.insert(b.end(), {'I', 'N', 'F', 'O', 'x', 0});
  }
  b.insert(b.end(), {'d', 'a', 't', 'a'});
  put32(b, static_cast<uint32_t>(declared < 0 ? static_cast<int64_t>(data_bytes) : declared));
  for (size_t i = 0; i < data_bytes; ++i) b.push_back(static_cast<uint8_t>(i * 7));
  const auto riff = static_cast<uint32_t>(b.size() - 8);
  for (int k = 0; k < 4; ++k) b[4 + k] = static_cast<uint8_t>(riff >> (8 * k));
  return b;
}

TEST_F(DataFiles, WavFolderLoadsAndSplits) {
  const std::vector<std::string> classes{"down", "go", "up"};
  for (size_t c = 0; c < classes.size(); ++c) {
    fs::create_directory(dir_ / classes[c]);
    for (int k = 0; k < 4; ++k) {
      // Lengths around `samples` (1000): some clips are cut, some zero-padded.
      write_wav(path(classes[c] + "/clip" + std::to_string(k) + ".wav"),
                tone(200.0 * static_cast<double>(c + 1) + 10 * k, 700 + 200 * k));
    }
    write_all(path(classes[c] + "/README.txt"), {'x'});  // not a .wav: ignored
  }
  fs::create_directory(dir_ / "_background_noise_");  // Speech Commands: not a class
  write_wav(path("_background_noise_/noise.wav"), tone(50, 3000));

  auto s = load_wav_folder(dir_.string(), 1000, 0.25, 0);
  EXPECT_EQ(s.train.kind, "audio");
  EXPECT_EQ(s.train.class_names, classes);
  EXPECT_EQ(s.train.num_classes, 3);
  EXPECT_EQ(s.train.inputs.sizes(), (std::vector<int64_t>{9, 1, 1000}));
  EXPECT_EQ(s.test.inputs.sizes(), (std::vector<int64_t>{3, 1, 1000}));
  EXPECT_TRUE(torch::equal(s.train.labels, torch::tensor({0, 0, 0, 1, 1, 1, 2, 2, 2}, at::kLong)));
  EXPECT_TRUE(torch::equal(s.test.labels, torch::tensor({0, 1, 2}, at::kLong)));
  EXPECT_LE(s.train.inputs.abs().max().item<float>(), 1.0f);

  // Every clip comes back as written (16-bit quantization), padded with zeros or cut.
  auto all = load_wav_folder(dir_.string(), 1000, 0.0, 0);
  EXPECT_EQ(all.train.size(), 12);
  EXPECT_EQ(all.test.size(), 0);
  for (int64_t i = 0; i < 12; ++i) {
    const int64_t c = i / 4, k = i % 4, len = 700 + 200 * k;
    auto expected = torch::zeros({1000});
    auto t = torch::tensor(tone(200.0 * static_cast<double>(c + 1) + 10 * k, len));
    expected.slice(0, 0, std::min<int64_t>(len, 1000)).copy_(t.slice(0, 0, 1000));
    EXPECT_TRUE(apex::test::all_close(all.train.inputs[i][0], expected, {0, 1.0 / 32767}))
        << "clip " << i;
  }

  // Deterministic per seed; the seed chooses which files are held out.
  expect_same(s, load_wav_folder(dir_.string(), 1000, 0.25, 0));
  bool differs = false;
  for (uint64_t seed = 1; seed < 6 && !differs; ++seed) {
    differs =
        !torch::equal(s.test.inputs, load_wav_folder(dir_.string(), 1000, 0.25, seed).test.inputs);
  }
  EXPECT_TRUE(differs);
  // A class always keeps at least one training clip.
  EXPECT_EQ(load_wav_folder(dir_.string(), 1000, 0.99, 0).train.size(), 3);
}

TEST_F(DataFiles, WavReaderSkipsUnknownChunks) {
  write_all(path("list.wav"), wav_bytes(1, 1, 16000, 16, 20, /*list_chunk=*/true));
  EXPECT_EQ(read_wav(path("list.wav")).size(), 10u);
}

TEST_F(DataFiles, WavReaderRejectsBadFiles) {
  struct Case {
    std::vector<uint8_t> bytes;
    std::string message;
  };
  std::vector<uint8_t> not_riff{'R', 'I', 'F', 'X', 0, 0, 0, 0, 'W', 'A', 'V', 'E'};
  const std::vector<Case> cases{
      {wav_bytes(1, 1, 44100, 16, 100), "sample rate 44100 Hz, expected 16000"},
      {wav_bytes(1, 2, 16000, 16, 100), "2 channels, expected mono (1)"},
      {wav_bytes(1, 1, 16000, 8, 100), "8 bits per sample, expected 16"},
      {wav_bytes(3, 1, 16000, 32, 100), "audio format 3 (IEEE float), expected 1 (PCM)"},
      {not_riff, "not a RIFF/WAVE file"},
      {{'R', 'I', 'F', 'F'}, "not a RIFF/WAVE file"},
      {wav_bytes(1, 1, 16000, 16, 100, false, 2000),
       "truncated data chunk: header says 2000 bytes, only 100 present"},
      {wav_bytes(1, 1, 16000, 16, 7), "data chunk of 7 bytes is not a whole number"},
  };
  for (const auto& c : cases) {
    write_all(path("bad.wav"), c.bytes);
    EXPECT_TRUE(throws_with([&] { read_wav(path("bad.wav")); },
                            "apex-train: " + path("bad.wav") + ": " + c.message));
  }
  auto no_data = wav_bytes(1, 1, 16000, 16, 0);
  no_data.resize(no_data.size() - 8);  // drop the data chunk header
  write_all(path("bad.wav"), no_data);
  EXPECT_TRUE(throws_with([&] { read_wav(path("bad.wav")); }, "no data chunk"));

  // Through the folder loader the message names the offending file.
  fs::create_directories(dir_ / "set" / "a");
  fs::create_directories(dir_ / "set" / "b");
  write_wav(path("set/a/ok.wav"), tone(300, 100));
  write_all(path("set/b/hifi.wav"), wav_bytes(1, 1, 44100, 16, 100));
  EXPECT_TRUE(throws_with(
      [&] { load_wav_folder(path("set"), 100, 0.0, 0); },
      "apex-train: " + path("set/b/hifi.wav") + ": sample rate 44100 Hz, expected 16000"));
}

TEST_F(DataFiles, WavFolderRejectsBadLayouts) {
  const std::string d = dir_.string();
  EXPECT_TRUE(throws_with([&] { load_wav_folder(d, 100, 0.2, 0); },
                          "apex-train: WAV folder " + d + ": no class sub-folders"));
  EXPECT_TRUE(throws_with([&] { load_wav_folder(path("missing"), 100, 0.2, 0); },
                          "apex-train: WAV folder " + path("missing") + ": not found"));
  write_all(path("file"), {'x'});
  EXPECT_TRUE(throws_with([&] { load_wav_folder(path("file"), 100, 0.2, 0); }, "not a directory"));
  fs::create_directory(dir_ / "yes");
  write_wav(path("yes/a.wav"), tone(300, 100));
  EXPECT_TRUE(throws_with([&] { load_wav_folder(d, 100, 0.2, 0); },
                          "only one class sub-folder ('yes'), expected at least 2"));
  fs::create_directory(dir_ / "no");
  EXPECT_TRUE(throws_with([&] { load_wav_folder(d, 100, 0.2, 0); },
                          "class 'no' (" + path("no") + ") has no .wav files"));
  write_wav(path("no/b.WAV"), tone(300, 100));  // extension case does not matter
  EXPECT_EQ(load_wav_folder(d, 100, 0.0, 0).train.size(), 2);
  EXPECT_TRUE(
      throws_with([&] { load_wav_folder(d, 100, 1.0, 0); }, "test fraction 1, expected in [0, 1)"));
  EXPECT_TRUE(throws_with([&] { load_wav_folder(d, 0, 0.2, 0); }, "samples 0, expected >= 1"));
}

}  // namespace
