// MNIST's IDX files (data.h): read (train-* and t10k-*, uncompressed) and written.
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

}  // namespace

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

}  // namespace apex::train
