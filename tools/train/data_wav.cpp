// WAV files (data.h): PCM and float read, 16-bit PCM written, and a folder of them per class.
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

std::vector<float> read_wav(const std::string& path) {
  const std::string name = "apex-train: " + path + ": ";
  // Through the library's file helper: a regular file only (a FIFO cannot hang a load).
  const std::vector<uint8_t> b = read_bytes(path, "WAV file");
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
  std::vector<uint8_t> b{'R', 'I', 'F', 'F'};
  b.reserve(44 + data_bytes);
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

}  // namespace apex::train
