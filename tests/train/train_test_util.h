#pragma once

// Helpers of the apex-train suites: small settings per family, running the binary, reading
// files and checkpoint archives back.
#include <sys/wait.h>
#include <torch/serialize/input-archive.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <string>

#include "common/test_util.h"
#include "train/trainer.h"

namespace apex::test {

using apex::train::TrainOptions;

// Small, fast settings per family (seconds per run on 2 cores).
inline TrainOptions tiny(const std::string& family, const std::string& level) {
  TrainOptions o;
  o.model.family = family;
  o.model.width = family == "resnet" ? 8 : family == "mlp" ? 64 : 32;
  o.model.depth = 1;
  o.model.heads = 2;
  o.opt_level = level;
  o.train_size = 512;
  o.test_size = 64;
  o.seq_len = 16;
  o.image_size = 16;
  o.samples = 1000;
  o.batch_size = 32;
  o.steps = 24;
  o.warmup = 2;
  o.lr = 3e-3;
  o.log_every = 4;
  o.progress = false;
  return o;
}

// Results: run `command`, capture stdout+stderr and the exit status.
struct Proc {
  int status;
  std::string out;
};
inline Proc run(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  const int status = pclose(p);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

inline std::string read_text(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

inline void collect(torch::serialize::InputArchive& a, const std::string& prefix,
                    std::map<std::string, at::Tensor>& out) {
  for (const auto& key : a.keys()) {
    at::Tensor t;
    torch::serialize::InputArchive sub;
    if (a.try_read(key, t)) {
      out[prefix + key] = t;
    } else if (a.try_read(key, sub)) {
      collect(sub, prefix + key + ".", out);
    }
  }
}

inline std::map<std::string, at::Tensor> archive_tensors(const std::string& file) {
  torch::serialize::InputArchive a;
  a.load_from(file);
  std::map<std::string, at::Tensor> out;
  collect(a, "", out);
  return out;
}

}  // namespace apex::test
