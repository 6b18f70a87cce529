// CIFAR-10's binary batches (data.h): read and written.
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

}  // namespace

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
