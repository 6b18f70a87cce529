#pragma once

// apex-train's data layer: built-in synthetic tasks (images, token sequences, audio) and readers
// for MNIST (IDX), CIFAR-10 (binary batches) and folders of 16 kHz WAV clips. Everything is loaded
// into memory as CPU tensors; bad input raises a c10::Error with one line naming the file and the
// problem.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <string>
#include <vector>

namespace apex::train {

/// An in-memory dataset. inputs: images float32 [N, C, H, W] normalized to mean 0 / std ~1 per
/// channel (statistics of the train split); tokens int64 [N, T] in [0, vocab); audio float32
/// [N, 1, L] in [-1, 1]. labels: int64 [N] in [0, num_classes).
struct Dataset {
  std::string kind;  ///< "image", "tokens" or "audio"
  at::Tensor inputs;
  at::Tensor labels;
  int64_t num_classes = 0;
  int64_t vocab_size = 0;                ///< tokens only
  std::vector<std::string> class_names;  ///< e.g. WAV sub-folder names; may be empty
  /// Number of samples (0 when `inputs` is undefined).
  int64_t size() const;
};

/// A train/test pair of datasets of the same kind.
struct Split {
  Dataset train;
  Dataset test;
};

/// Number of classes of each synthetic task.
inline constexpr int64_t kImageClasses = 10;
inline constexpr int64_t kTokenClasses = 4;
inline constexpr int64_t kAudioClasses = 6;
/// Sample rate of the synthetic audio and of the WAV folders apex-train reads.
inline constexpr int kSampleRate = 16000;

/// Procedural shapes, 10 classes (disc, ring, square, hollow square, triangle, cross, horizontal
/// bars, vertical bars, diagonal line, checker) at random position/size/intensity (and colour when
/// channels == 3) on a random background level, plus Gaussian noise; normalized per channel with
/// the train statistics. Labels are balanced (each class n/10 ± 1, in random order). Deterministic
/// under `seed`; the test split does not depend on n_train. Needs n_train >= 10, n_test >= 0,
/// size in [8, 1024], channels 1 or 3.
/// Example: `auto s = synthetic_images(5000, 1000, 32, 1, 0);`
Split synthetic_images(int64_t n_train, int64_t n_test, int64_t size, int64_t channels,
                       uint64_t seed);

/// Token sequences of length `seq_len` (>= 8) over vocabulary `vocab` (>= 8). Position 0 holds the
/// reserved token 0 ([CLS]); tokens 1..4 are markers, the rest fillers >= 5. The label (4 classes)
/// is m - 1 for the marker m that occurs strictly most often. Balanced labels; deterministic under
/// `seed`. Needs n_train >= 4, n_test >= 0.
Split synthetic_tokens(int64_t n_train, int64_t n_test, int64_t seq_len, int64_t vocab,
                       uint64_t seed);

/// Waveforms at 16 kHz, `samples` (>= 400) long, values in [-1, 1]; 6 classes: steady low tone,
/// steady high tone, rising chirp, falling chirp, two-tone alternation, amplitude-modulated tone,
/// with random frequencies/phase/amplitude within each class plus white noise. Balanced labels;
/// deterministic under `seed`. Needs n_train >= 6, n_test >= 0.
Split synthetic_audio(int64_t n_train, int64_t n_test, int64_t samples, uint64_t seed);

/// MNIST from the plain (uncompressed) IDX files in `dir`: train-images-idx3-ubyte,
/// train-labels-idx1-ubyte, t10k-images-idx3-ubyte, t10k-labels-idx1-ubyte. Validates magic numbers
/// (2051 images, 2049 labels), dimensions, counts, labels < 10 and exact file sizes. Images become
/// float32 [N, 1, rows, cols], normalized with the train split's mean/std.
Split load_mnist(const std::string& dir);

/// CIFAR-10 binary version in `dir` (or in `dir`/cifar-10-batches-bin): data_batch_1.bin ..
/// data_batch_5.bin (those that exist, at least one) and test_batch.bin; records of 1 label byte +
/// 3072 pixel bytes (R, G, B planes of 32x32). Images become float32 [N, 3, 32, 32], normalized per
/// channel with the train split's statistics.
Split load_cifar10(const std::string& dir);

/// A folder with one sub-folder per class (Speech Commands layout; sub-folders whose name starts
/// with '.' or '_', such as _background_noise_, are skipped), each holding 16 kHz mono 16-bit PCM
/// .wav files. Each clip is cut or zero-padded to `samples`. Classes and files are sorted by name.
/// Within each class, round(test_fraction * n) files (at most n - 1) go to test, chosen by a hash
/// of (seed, file name): the split is deterministic, independent of the other files' contents.
/// test_fraction must lie in [0, 1). Unknown chunks (LIST, ...) are skipped.
Split load_wav_folder(const std::string& dir, int64_t samples, double test_fraction, uint64_t seed);

/// Reads one mono 16-bit PCM WAV at 16 kHz into floats in [-1, 1) (the check that load_wav_folder
/// applies to every file).
std::vector<float> read_wav(const std::string& path);

/// Writes a mono 16-bit PCM WAV (for tests and tools). samples are clamped to [-1, 1].
void write_wav(const std::string& path, const std::vector<float>& samples,
               int sample_rate = kSampleRate);

/// Writes the four MNIST IDX files into `dir` (which must exist). Images uint8 [N, rows, cols],
/// labels integer [N] in [0, 255].
void write_mnist(const std::string& dir, const at::Tensor& train_images_u8,
                 const at::Tensor& train_labels, const at::Tensor& test_images_u8,
                 const at::Tensor& test_labels);

/// Writes CIFAR-10 binary batches into `dir` (which must exist): the train images all into
/// data_batch_1.bin, the test images into test_batch.bin. Images uint8 [N, 3, 32, 32].
void write_cifar10(const std::string& dir, const at::Tensor& train_images_u8,
                   const at::Tensor& train_labels, const at::Tensor& test_images_u8,
                   const at::Tensor& test_labels);

}  // namespace apex::train
