#include "train/trainer.h"

#include <ATen/Context.h>
#include <ATen/Parallel.h>
#include <ATen/ops/cross_entropy_loss.h>
#include <apex/amp/initialize.h>
#include <apex/io.h>
#include <apex/optim.h>
#include <apex/parallel/distributed.h>
#include <apex/parallel/distributed_sampler.h>
#include <apex/parallel/process_group.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>

#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <malloc.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <random>
#include <sstream>
#include <utility>
#include <vector>

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "train/data.h"
#include "train/json.h"
#include "train/progress.h"

namespace apex::train {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const TrainOptions& o,
                                                        const std::vector<at::Tensor>& params) {
  namespace ao = apex::optim;
  const std::string& n = o.optimizer;
  if (n == "fused-adam") {
    return std::make_unique<ao::FusedAdam>(params,
                                           ao::FusedAdamOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "fused-lamb") {
    return std::make_unique<ao::FusedLAMB>(params,
                                           ao::FusedLAMBOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "fused-sgd") {
    return std::make_unique<ao::FusedSGD>(
        params, ao::FusedSGDOptions(o.lr).momentum(0.9).weight_decay(o.weight_decay));
  }
  if (n == "fused-novograd") {
    return std::make_unique<ao::FusedNovoGrad>(
        params, ao::FusedNovoGradOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "fused-adagrad") {
    return std::make_unique<ao::FusedAdagrad>(
        params, ao::FusedAdagradOptions(o.lr).weight_decay(o.weight_decay));
  }
  if (n == "adam") {
    return std::make_unique<torch::optim::AdamW>(
        params, torch::optim::AdamWOptions(o.lr).weight_decay(o.weight_decay));
  }
  TORCH_CHECK(n == "sgd", "apex-train: unknown optimizer '", n, "'");
  return std::make_unique<torch::optim::SGD>(
      params, torch::optim::SGDOptions(o.lr).momentum(0.9).weight_decay(o.weight_decay));
}

// Warm-up (default: a tenth of the run), then cosine decay to lr / 10.
double lr_at(const TrainOptions& o, int64_t step, int64_t total) {
  const int64_t warmup = o.warmup >= 0 ? o.warmup : total / 10;
  if (warmup > 0 && step < warmup) {
    return o.lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  }
  const double span = static_cast<double>(std::max<int64_t>(1, total - warmup));
  const double t = std::min(1.0, static_cast<double>(step - warmup) / span);
  return o.lr * (0.1 + 0.9 * 0.5 * (1.0 + std::cos(M_PI * t)));
}

// ---- checkpoints
// ----------------------------------------------------------------------------------

// What a checkpoint must match: the model (family, sizes, every parameter's shape), the level and
// the optimizer.
std::string signature(const TrainOptions& o, const torch::nn::Module& model) {
  std::ostringstream s;
  const ModelConfig c = resolved(o.model);
  s << c.family << " width=" << c.width << " depth=" << c.depth << " heads=" << c.heads
    << " level=" << o.opt_level << " half=" << c10::toString(o.half_dtype)
    << " loss_scale=" << (o.loss_scale.empty() ? "default" : o.loss_scale)
    << " optimizer=" << o.optimizer << " params=";
  for (const auto& p : model.named_parameters()) s << p.key() << p.value().sizes() << ";";
  return s.str();
}

// The settings that change what a run trains, as JSON values: a resume must match them (unless
// --resume-with-changes). The model, level and optimizer are in the signature.
std::vector<std::pair<std::string, std::string>> run_settings(const TrainOptions& o,
                                                              int64_t world) {
  const std::string data = o.data.empty() ? model_family(o.model.family).default_data : o.data;
  return {{"seed", std::to_string(o.seed)},
          {"data", json::quote(data)},
          {"data_dir", json::quote(o.data_dir)},
          {"train_size", std::to_string(o.train_size)},
          {"test_size", std::to_string(o.test_size)},
          {"seq_len", std::to_string(o.seq_len)},
          {"vocab", std::to_string(o.vocab)},
          {"image_size", std::to_string(o.image_size)},
          {"samples", std::to_string(o.samples)},
          {"batch_size", std::to_string(o.batch_size)},
          {"accumulate", std::to_string(o.accumulate)},
          {"lr", json::num_exact(o.lr)},
          {"warmup", std::to_string(o.warmup)},
          {"steps", std::to_string(o.steps)},
          {"epochs", std::to_string(o.epochs)},
          {"weight_decay", json::num_exact(o.weight_decay)},
          {"clip", json::num_exact(o.clip)},
          // The global batch and the shards follow the number of ranks.
          {"world_size", std::to_string(world)},
          {"sync_bn", o.sync_bn ? "true" : "false"}};
}

// How a run was executed: neither changes what it trains, but a resume under other values
// continues it less than bit-identically (the intra-op threads split reductions, the device
// computes differently), which the resume says. Absent from older checkpoints.
std::vector<std::pair<std::string, std::string>> execution_settings(const TrainOptions& o) {
  return {{"device", json::quote(c10::DeviceTypeName(o.device.type(), /*lower_case=*/true))},
          {"threads", std::to_string(at::get_num_threads())}};
}

// Ranks started by hand (or by a script) with different flags would train different runs, or
// call collectives of different sizes (which Gloo answers by terminating the process): every
// rank's settings are compared right after the group forms, and any difference is one error on
// every rank naming the flags and the ranks' values.
void check_same_settings(const TrainOptions& o, const apex::parallel::ProcessGroup& pg) {
  const ModelConfig c = resolved(o.model);
  std::vector<std::pair<std::string, std::string>> flags = {
      {"--model", c.family},
      {"--width", std::to_string(c.width)},
      {"--depth", std::to_string(c.depth)},
      {"--heads", std::to_string(c.heads)},
      {"--opt-level", o.opt_level},
      {"--half-dtype", o.half_dtype == c10::kBFloat16 ? "bf16" : "fp16"},
      {"--loss-scale", o.loss_scale.empty() ? "(default)" : o.loss_scale},
      {"--optimizer", o.optimizer},
      {"--device", c10::DeviceTypeName(o.device.type(), /*lower_case=*/true)},
      {"--log-every", std::to_string(o.log_every)},
      {"--checkpoint", o.checkpoint.empty() ? "(none)" : "(given)"},
      {"--checkpoint-every", std::to_string(o.checkpoint_every)},
      {"--resume", o.resume ? "yes" : "no"},
      {"--resume-from", o.resume_from.empty() ? "(latest)" : o.resume_from},
      {"--resume-with-changes", o.resume_with_changes ? "yes" : "no"},
      {"--stop-after", std::to_string(o.stop_after)},
      {"--bucket-cap-mb", json::num_exact(o.bucket_cap_mb)},
      {"--timeout", json::num_exact(o.timeout_s)}};
  for (const auto& [key, value] : run_settings(o, pg.size())) {
    if (key == "world_size") continue;  // one group: the same everywhere
    std::string flag = "--" + key;
    std::replace(flag.begin(), flag.end(), '_', '-');
    flags.emplace_back(flag, value);
  }
  std::string mine;
  for (const auto& [flag, value] : flags) mine += flag + "\t" + value + "\n";
  const std::vector<std::string> all = pg.all_gather_string(mine);
  const auto parse = [](const std::string& text) {
    std::vector<std::pair<std::string, std::string>> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) {
      const size_t tab = line.find('\t');
      out.emplace_back(line.substr(0, tab), tab == std::string::npos ? "" : line.substr(tab + 1));
    }
    return out;
  };
  const auto zero = parse(all[0]);
  std::string differences;
  for (size_t r = 1; r < all.size(); ++r) {
    if (all[r] == all[0]) continue;
    const auto theirs = parse(all[r]);
    if (theirs.size() != zero.size()) {
      differences += "; rank " + std::to_string(r) + " runs another version of apex-train";
      continue;
    }
    for (size_t i = 0; i < zero.size(); ++i) {
      if (theirs[i] == zero[i]) continue;
      differences += "; " + zero[i].first + " is " + zero[i].second + " on rank 0 but " +
                     theirs[i].second + " on rank " + std::to_string(r);
    }
  }
  TORCH_CHECK(differences.empty(), "apex-train: rank ", pg.rank(), " of ", pg.size(),
              ": the ranks were started with different settings (", differences.substr(2),
              "); give every rank the same flags");
}

constexpr int64_t kCheckpointFormat = 2;
const char* const kManifest = "manifest.json";

std::string new_run_id() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string file_entry(const std::string& bytes) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "size=%zu crc32=0x%08x", bytes.size(),
                static_cast<unsigned>(apex::crc32(bytes)));
  return buf;
}

// "step-N" -> N, or -1 when `name` is not such a folder name.
int64_t step_of_folder(const std::string& name) {
  if (name.rfind("step-", 0) != 0 || name.size() <= 5 || name.size() > 5 + 18) return -1;
  int64_t n = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (!std::isdigit(static_cast<unsigned char>(name[i]))) return -1;
    n = n * 10 + (name[i] - '0');
  }
  return name[5] == '0' ? -1 : n;
}

void save_checkpoint(const TrainOptions& o, int64_t world, int64_t step, const std::string& run,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     apex::amp::Amp* amp) {
  const fs::path dir(o.checkpoint);
  const fs::path tmp = dir / (".tmp-step-" + std::to_string(step));
  const fs::path final_dir = dir / ("step-" + std::to_string(step));
  try {
    fs::create_directories(dir);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    std::vector<std::string> files = {"model.pt", "optimizer.pt"};
    apex::save_module(model, (tmp / "model.pt").string());
    apex::save_optimizer(optimizer, (tmp / "optimizer.pt").string());
    if (amp != nullptr) {
      amp->save((tmp / "amp.pt").string());
      files.push_back("amp.pt");
    }
    std::string meta = "{\"format\": " + std::to_string(kCheckpointFormat) +
                       ", \"step\": " + std::to_string(step) + ", \"run\": " + json::quote(run) +
                       ", \"signature\": " + json::quote(signature(o, model));
    for (const auto& [key, value] : run_settings(o, world)) meta += ", \"" + key + "\": " + value;
    for (const auto& [key, value] : execution_settings(o)) meta += ", \"" + key + "\": " + value;
    meta += "}\n";
    apex::write_file_atomic((tmp / "meta.json").string(), meta);
    files.push_back("meta.json");
    // The manifest is written last, from the files as they are on disk: a folder without it,
    // or whose files do not match it, is not a checkpoint.
    std::string manifest = "{\"format\": " + std::to_string(kCheckpointFormat) +
                           ", \"step\": " + std::to_string(step) + ", \"run\": " + json::quote(run);
    for (const auto& f : files) {
      manifest += ", " + json::quote(f) + ": " +
                  json::quote(file_entry(apex::read_file((tmp / f).string())));
    }
    manifest += "}\n";
    apex::write_file_atomic((tmp / kManifest).string(), manifest);
    apex::sync_path(tmp.string());
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
    apex::write_file_atomic((dir / "latest").string(), final_dir.filename().string() + "\n");
    apex::sync_path(dir.string());
  } catch (const std::exception& e) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    const auto* c10e = dynamic_cast<const c10::Error*>(&e);
    TORCH_CHECK(false, "apex-train: saving checkpoint to ", dir.string(),
                " failed: ", c10e ? c10e->what_without_backtrace() : e.what());
  }
  // Only the newest checkpoint is kept (it is on disk now, so the older one can go).
  for (const auto& entry : fs::directory_iterator(dir)) {
    const std::string name = entry.path().filename().string();
    if (name.rfind("step-", 0) == 0 && entry.path() != final_dir) fs::remove_all(entry.path());
  }
}

// A checkpoint folder whose every file matches its manifest, with its parsed meta.json.
struct Checkpoint {
  fs::path folder;
  int64_t step = 0;
  std::string run;
  json::Object meta;
  bool has_amp = false;
};

// Checks `folder` completely (manifest, every file's size and CRC-32, meta.json's fields and
// their agreement with the manifest and the folder's name) before anything is loaded.
Checkpoint verify_checkpoint(const fs::path& folder) {
  const std::string where = folder.string();
  std::error_code ec;
  TORCH_CHECK(fs::is_directory(folder, ec), where,
              " is not a checkpoint folder (it does not exist)");
  const fs::path manifest_path = folder / kManifest;
  TORCH_CHECK(fs::exists(manifest_path, ec), where,
              " has no manifest.json: it is incomplete (a save was interrupted) or was written "
              "by an older apex-train");
  const std::string mwhat = manifest_path.string();
  const json::Object manifest = json::parse_object(apex::read_file(manifest_path.string()), mwhat);
  TORCH_CHECK(json::int_at(manifest, "format", 0, 1 << 20, mwhat) == kCheckpointFormat, mwhat,
              ": format ", manifest.at("format").text, ", this apex-train reads format ",
              kCheckpointFormat);
  Checkpoint ck;
  ck.folder = folder;
  ck.step = json::int_at(manifest, "step", 1, int64_t{1} << 62, mwhat);
  ck.run = json::string_at(manifest, "run", mwhat);
  TORCH_CHECK(step_of_folder(folder.filename().string()) == ck.step, mwhat, ": step ", ck.step,
              " does not match its folder's name ", folder.filename().string(),
              " (files of different checkpoints mixed?)");
  for (const auto& [name, field] : manifest) {
    if (name == "format" || name == "step" || name == "run") continue;
    TORCH_CHECK(
        name == "model.pt" || name == "optimizer.pt" || name == "amp.pt" || name == "meta.json",
        mwhat, ": unexpected entry \"", name, "\"");
    const std::string want = json::string_at(manifest, name, mwhat);
    const fs::path file = folder / name;
    TORCH_CHECK(fs::exists(file, ec), where, ": ", name, " is missing (listed in the manifest)");
    const std::string got = file_entry(apex::read_file(file.string()));
    TORCH_CHECK(got == want, file.string(), " does not match the manifest (", got,
                ", the manifest says ", want,
                "): the file is corrupted, or comes from another step or run");
    ck.has_amp = ck.has_amp || name == "amp.pt";
  }
  for (const char* name : {"model.pt", "optimizer.pt", "meta.json"}) {
    TORCH_CHECK(manifest.count(name) == 1, mwhat, ": the entry for ", name, " is missing");
  }
  const std::string meta_path = (folder / "meta.json").string();
  ck.meta = json::parse_object(apex::read_file(meta_path), meta_path);
  TORCH_CHECK(json::int_at(ck.meta, "format", 0, 1 << 20, meta_path) == kCheckpointFormat,
              meta_path, ": unknown format");
  const int64_t meta_step = json::int_at(ck.meta, "step", 1, int64_t{1} << 62, meta_path);
  TORCH_CHECK(meta_step == ck.step, meta_path, ": step ", meta_step, " but the manifest says ",
              ck.step);
  TORCH_CHECK(json::string_at(ck.meta, "run", meta_path) == ck.run, meta_path, ": written by run ",
              json::string_at(ck.meta, "run", meta_path), " but the manifest is run ", ck.run,
              " (files of different runs mixed)");
  json::string_at(ck.meta, "signature", meta_path);
  return ck;
}

// The newest step folder of `dir` that verifies completely, or "" when none does.
std::string newest_complete(const fs::path& dir, const std::string& except) {
  std::vector<std::pair<int64_t, std::string>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const int64_t n = step_of_folder(name);
    if (n > 0 && name != except) found.emplace_back(n, name);
  }
  std::sort(found.rbegin(), found.rend());
  for (const auto& [n, name] : found) {
    try {
      verify_checkpoint(dir / name);
      return name;
    } catch (const c10::Error&) {
    }
  }
  return "";
}

// Returns the step to continue from, and the run's id in `run`.
int64_t load_checkpoint(const TrainOptions& o, int64_t world, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer, apex::amp::Amp* amp, std::string& run) {
  const fs::path dir(o.checkpoint);
  const std::string who = "apex-train: --resume: ";
  std::string name = o.resume_from;
  if (name.empty()) {
    std::error_code ec;
    std::string why = "it is missing";
    if (fs::exists(dir / "latest", ec)) {
      try {
        const std::string text = apex::read_file((dir / "latest").string());
        const size_t nl = text.find('\n');
        name = text.substr(0, nl);
        if (nl == std::string::npos || nl + 1 != text.size() || step_of_folder(name) < 0) {
          why = "it does not hold one line naming a step-N folder";
          name.clear();
        }
      } catch (const c10::Error& e) {
        why = e.what_without_backtrace();
      }
    }
    if (name.empty()) {
      const std::string alt = newest_complete(dir, "");
      TORCH_CHECK(!alt.empty() || fs::exists(dir / "latest", ec), who, "no checkpoint in ",
                  dir.string(), " (missing ", (dir / "latest").string(), ")");
      TORCH_CHECK(!alt.empty(), who, (dir / "latest").string(), " is unusable (", why, ") and ",
                  dir.string(), " holds no complete checkpoint");
      TORCH_CHECK(false, who, (dir / "latest").string(), " is unusable (", why,
                  "); the newest complete checkpoint is ", (dir / alt).string(),
                  ": resume from it with --resume-from ", alt);
    }
  }
  TORCH_CHECK(step_of_folder(name) > 0, who, "--resume-from expects a folder name step-N, got '",
              name, "'");
  Checkpoint ck;
  try {
    ck = verify_checkpoint(dir / name);
  } catch (const c10::Error& e) {
    const std::string alt = newest_complete(dir, name);
    TORCH_CHECK(false, who, e.what_without_backtrace(),
                alt.empty() ? std::string("; no other complete checkpoint is in ") + dir.string()
                            : "; the newest complete checkpoint is " + (dir / alt).string() +
                                  ": resume from it with --resume-from " + alt);
  }
  const std::string meta_path = (ck.folder / "meta.json").string();
  const std::string theirs = json::string_at(ck.meta, "signature", meta_path);
  const std::string ours = signature(o, model);
  TORCH_CHECK(theirs == ours, who, "checkpoint ", ck.folder.string(),
              " was written by another run (", theirs.substr(0, theirs.find(" params=")),
              "), this run is ", ours.substr(0, ours.find(" params=")));
  TORCH_CHECK(ck.has_amp == (amp != nullptr), who, ck.folder.string(),
              ck.has_amp ? " holds an amp state this run has no use for"
                         : " has no amp state, which this run needs");
  // "key old -> new, ..." for the settings that differ; a missing key is an error when
  // `required`, else (a setting older checkpoints lack) not compared.
  const auto differences = [&](const std::vector<std::pair<std::string, std::string>>& settings,
                               bool required) {
    std::string out;
    for (const auto& [key, value] : settings) {
      auto it = ck.meta.find(key);
      TORCH_CHECK(it != ck.meta.end() || !required, who, meta_path, ": \"", key, "\" is missing");
      if (it == ck.meta.end()) continue;
      const std::string stored = it->second.kind == json::Field::Kind::kString
                                     ? json::quote(it->second.text)
                                     : it->second.text;
      if (stored != value) out += (out.empty() ? "" : ", ") + key + " " + stored + " -> " + value;
    }
    return out;
  };
  const std::string changed = differences(run_settings(o, world), true);
  TORCH_CHECK(changed.empty() || o.resume_with_changes, who, "this run's settings differ from ",
              ck.folder.string(), "'s (", changed,
              "); resuming would train something else than the run. Pass "
              "--resume-with-changes to continue with the new settings deliberately");
  if (!changed.empty()) {
    std::fprintf(stderr, "apex-train: resuming with changed settings: %s\n", changed.c_str());
  }
  const std::string executed = differences(execution_settings(o), false);
  if (!executed.empty()) {
    std::fprintf(stderr,
                 "apex-train: resuming under other execution settings (%s): the run continues, "
                 "but not bit-identically to one left uninterrupted\n",
                 executed.c_str());
  }
  apex::load_module(model, (ck.folder / "model.pt").string());
  apex::load_optimizer(optimizer, (ck.folder / "optimizer.pt").string());
  if (amp != nullptr) amp->load((ck.folder / "amp.pt").string());
  run = ck.run;
  return ck.step;
}

// Appends `text` to the metrics file and flushes it; a failed write (full disk, a removed
// folder) is an error, not a lost record.
void write_metrics(std::FILE* f, const std::string& text, const std::string& path) {
  if (text.empty()) return;
  TORCH_CHECK(std::fputs(text.c_str(), f) >= 0 && std::fflush(f) == 0, "apex-train: --metrics ",
              path, ": write failed: ", std::strerror(errno));
}

// Steps that must overflow in a row before a dynamic loss scale counts as stuck.
constexpr int64_t kStuckSteps = 20;

// The step records of `path` up to `step` (all levels), as text; "" when the file is absent.
std::string metrics_up_to(const std::string& path, int64_t step) {
  std::ifstream in(path);
  std::string kept;
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty() || line.find("\"summary\": true") != std::string::npos) continue;
    // A line cut short by a kill while it was written is dropped, not fatal.
    try {
      if (json::get_number(line, "step") <= static_cast<double>(step)) kept += line + "\n";
    } catch (const c10::Error&) {
    }
  }
  return kept;
}

struct Eval {
  double loss = 0;
  double accuracy = 0;
};

Eval evaluate(std::shared_ptr<Classifier>& model, apex::amp::Amp* amp, const Dataset& test,
              c10::Device device, int64_t batch) {
  const at::NoGradGuard no_grad;
  model->eval();
  double loss = 0;
  int64_t correct = 0;
  const int64_t n = test.size();
  for (int64_t i = 0; i < n; i += batch) {
    const int64_t e = std::min(n, i + batch);
    const at::Tensor x = test.inputs.slice(0, i, e).to(device);
    const at::Tensor y = test.labels.slice(0, i, e).to(device);
    const at::Tensor logits = (amp ? amp->forward(model, x) : model->forward(x)).to(at::kFloat);
    loss += at::cross_entropy_loss(logits, y, {}, at::Reduction::Sum).item<double>();
    correct += logits.argmax(1).eq(y).sum().item<int64_t>();
  }
  model->train();
  return {loss / static_cast<double>(std::max<int64_t>(n, 1)),
          static_cast<double>(correct) / static_cast<double>(std::max<int64_t>(n, 1))};
}

}  // namespace

at::Tensor EpochSampler::indices(int64_t first, int64_t count) {
  std::vector<at::Tensor> parts;
  while (count > 0) {
    const int64_t epoch = first / n_;
    if (epoch != epoch_) {
      // The epoch's order is the public sampler's (one replica: the whole permutation, Python's
      // DistributedSampler order for seed + epoch); the ranks' shards are cut from it below as
      // global micro-batches, so that R ranks see exactly one process's batches.
      const auto order =
          apex::parallel::DistributedSampler(
              static_cast<size_t>(n_),
              apex::parallel::DistributedSamplerOptions().num_replicas(1).rank(0).seed(seed_))
              .indices(epoch);
      perm_ = at::empty({n_}, at::TensorOptions().dtype(at::kLong));
      int64_t* p = perm_.data_ptr<int64_t>();
      for (int64_t i = 0; i < n_; ++i) p[i] = static_cast<int64_t>(order[static_cast<size_t>(i)]);
      epoch_ = epoch;
    }
    const int64_t off = first % n_;
    const int64_t take = std::min(count, n_ - off);
    parts.push_back(perm_.slice(0, off, off + take));
    first += take;
    count -= take;
  }
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

at::Tensor EpochSampler::shard(int64_t micro_batch, int64_t batch, int64_t world, int64_t rank) {
  return indices(micro_batch * batch * world + rank * batch, batch);
}

int64_t total_steps(const TrainOptions& o, int64_t train_size, int64_t world) {
  if (o.steps > 0) return o.steps;
  const int64_t per_step = o.batch_size * o.accumulate * world;
  return std::max<int64_t>(1, std::max<int64_t>(o.epochs, 1) * train_size / per_step);
}

Split load_data(const TrainOptions& o) {
  const std::string name = o.data.empty() ? model_family(o.model.family).default_data : o.data;
  const bool file_based = name == "mnist" || name == "cifar10" || name == "wav";
  TORCH_CHECK(!file_based || !o.data_dir.empty(), "apex-train: --data ", name,
              " needs --data-dir DIR");
  const uint64_t seed = o.seed + 12345;
  if (name == "shapes") {
    return synthetic_images(o.train_size > 0 ? o.train_size : 8192,
                            o.test_size > 0 ? o.test_size : 1024, o.image_size, 1, seed);
  }
  if (name == "tokens") {
    return synthetic_tokens(o.train_size > 0 ? o.train_size : 16384,
                            o.test_size > 0 ? o.test_size : 2048, o.seq_len, o.vocab, seed);
  }
  if (name == "tones") {
    return synthetic_audio(o.train_size > 0 ? o.train_size : 4096,
                           o.test_size > 0 ? o.test_size : 512, o.samples, seed);
  }
  if (name == "mnist") return load_mnist(o.data_dir);
  if (name == "cifar10") return load_cifar10(o.data_dir);
  TORCH_CHECK(name == "wav", "apex-train: unknown --data '", name,
              "' (expected shapes, tokens, tones, mnist, cifar10 or wav)");
  return load_wav_folder(o.data_dir, o.samples, 0.2, o.seed);
}

double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;  // kB
  }
  return 0.0;
}

void check_device(const TrainOptions& o) {
  TORCH_CHECK(!o.device.is_cuda() || at::hasCUDA(),
              "apex-train: --device cuda, but this LibTorch is a CPU-only build (or sees no "
              "GPU): install a CUDA build of torch and rebuild (scripts/setup with "
              "APEX_TORCH_SPEC), or use --device cpu");
}

void check_fits(const TrainOptions& o) {
  const ModelConfig c = resolved(o.model);
  const double params = model_family(c.family).min_parameters(c);
  // fp32 weights, gradients and two optimizer moments at least.
  const double bytes = params * 16.0;
  const double memory =
      static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  TORCH_CHECK(memory <= 0 || bytes <= memory, "apex-train: --model ", c.family, " --width ",
              c.width, " --depth ", c.depth, " would have at least ", params,
              " parameters, which with their gradients and optimizer state need at least ",
              bytes / (1 << 30), " GiB; this machine has ", memory / (1 << 30),
              " GiB (lower --width or --depth)");

  // The built-in data sets are generated in memory: samples times their size.
  const std::string data = o.data.empty() ? model_family(c.family).default_data : o.data;
  double per_sample = 0;
  double samples = 0;
  if (data == "shapes") {
    per_sample = 4.0 * static_cast<double>(o.image_size) * static_cast<double>(o.image_size);
    samples = (o.train_size > 0 ? o.train_size : 8192) + (o.test_size > 0 ? o.test_size : 1024);
  } else if (data == "tokens") {
    per_sample = 8.0 * static_cast<double>(o.seq_len);
    samples = (o.train_size > 0 ? o.train_size : 16384) + (o.test_size > 0 ? o.test_size : 2048);
  } else if (data == "tones") {
    per_sample = 4.0 * static_cast<double>(o.samples);
    samples = (o.train_size > 0 ? o.train_size : 4096) + (o.test_size > 0 ? o.test_size : 512);
  }
  const double data_bytes = per_sample * samples;
  TORCH_CHECK(memory <= 0 || data_bytes <= memory, "apex-train: the built-in ", data, " data (",
              samples, " samples of ", per_sample, " bytes) needs ", data_bytes / (1 << 30),
              " GiB; this machine has ", memory / (1 << 30),
              " GiB (lower --train-size, --test-size or the sample size)");
}

void check_outputs(const TrainOptions& o) {
  if (!o.metrics.empty()) apex::check_writable(o.metrics, "apex-train: --metrics");
  if (!o.checkpoint.empty()) {
    std::error_code ec;
    fs::create_directories(o.checkpoint, ec);
    TORCH_CHECK(!ec, "apex-train: --checkpoint ", o.checkpoint, ": cannot create it (",
                ec.message(), ")");
    TORCH_CHECK(fs::is_directory(o.checkpoint, ec), "apex-train: --checkpoint ", o.checkpoint,
                " is not a folder");
    apex::check_writable((fs::path(o.checkpoint) / "latest").string(), "apex-train: --checkpoint");
    // A new run would replace the checkpoint there at its first save, without a word.
    TORCH_CHECK(o.resume || !fs::exists(fs::path(o.checkpoint) / "latest", ec),
                "apex-train: --checkpoint ", o.checkpoint,
                " already holds a run's checkpoint; pass --resume to continue it, or another "
                "folder (or remove that one) to start a new run");
  }
}

CheckpointLock::CheckpointLock(const std::string& dir, bool probe) {
  const std::string path = (fs::path(dir) / ".lock").string();
  for (int attempt = 0;; ++attempt) {
    const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    TORCH_CHECK(fd >= 0, "apex-train: --checkpoint ", dir, ": cannot create its lock file ", path,
                ": ", std::strerror(errno));
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      char buf[32] = {};
      const ssize_t n = ::pread(fd, buf, sizeof(buf) - 1, 0);
      ::close(fd);
      const std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "?";
      TORCH_CHECK(err != EWOULDBLOCK, "apex-train: --checkpoint ", dir,
                  " is in use by another live run (pid ", holder.substr(0, holder.find('\n')),
                  "): two writers would overwrite each other's checkpoints; wait for it to end "
                  "or stop it, or give another folder");
      TORCH_CHECK(false, "apex-train: --checkpoint ", dir, ": cannot lock ", path, ": ",
                  std::strerror(err));
    }
    // A holder that was ending may have unlinked the file between our open and our lock: then
    // the lock is on a file nobody else will see; take the one at the path instead.
    struct stat held {};
    struct stat named {};
    if (::fstat(fd, &held) == 0 && ::stat(path.c_str(), &named) == 0 &&
        held.st_ino == named.st_ino && held.st_dev == named.st_dev) {
      if (probe) {
        ::close(fd);
        return;
      }
      const std::string pid = std::to_string(::getpid()) + "\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) < 0) {
        // The pid is only for the message a second writer gets; the lock holds regardless.
      }
      fd_ = fd;
      path_ = path;
      return;
    }
    ::close(fd);
    TORCH_CHECK(attempt < 100, "apex-train: --checkpoint ", dir, ": cannot lock ", path,
                " (it keeps being replaced)");
  }
}

CheckpointLock::~CheckpointLock() {
  if (fd_ < 0) return;
  // Unlinked while still held: a process that opened it before sees another inode and retries.
  ::unlink(path_.c_str());
  ::close(fd_);
}

CheckpointLock::CheckpointLock(CheckpointLock&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)), path_(std::move(other.path_)) {}

CheckpointLock& CheckpointLock::operator=(CheckpointLock&& other) noexcept {
  if (this != &other) {
    this->~CheckpointLock();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
  }
  return *this;
}

// glibc serves the activation-sized tensors of every step with mmap and unmaps them on free, so
// each step page-faults its outputs in again: 12 % of a transformer step here (kernel page-fault
// and unmap time in perf), against 3 % in the same model under Python, where glibc's adaptive
// threshold had settled higher. A fixed threshold of 64 MiB and trimming only beyond 128 MiB keep
// freed memory for reuse: +5-8 % samples/s and a lower peak (650 against 726 MiB; 256/512 MiB
// gave 794), docs/perf-notes.md. A user's own malloc settings (GLIBC_TUNABLES, MALLOC_*_) win.
static void keep_freed_memory() {
#ifdef __GLIBC__
  static const bool once = [] {
    const char* tunables = std::getenv("GLIBC_TUNABLES");
    if ((tunables != nullptr && std::strstr(tunables, "malloc") != nullptr) ||
        std::getenv("MALLOC_MMAP_THRESHOLD_") != nullptr ||
        std::getenv("MALLOC_TRIM_THRESHOLD_") != nullptr) {
      return false;
    }
    mallopt(M_MMAP_THRESHOLD, 64 << 20);
    mallopt(M_TRIM_THRESHOLD, 128 << 20);
    return true;
  }();
  (void)once;
#endif
}

Summary train(const TrainOptions& o, const Split& data) {
  keep_freed_memory();
  check_device(o);
  check_fits(o);
  check_outputs(o);
  TORCH_CHECK(o.batch_size > 0, "apex-train: --batch-size must be > 0, got ", o.batch_size);
  TORCH_CHECK(o.accumulate > 0, "apex-train: --accumulate must be > 0, got ", o.accumulate);
  TORCH_CHECK(data.train.size() > 0 && data.test.size() > 0,
              "apex-train: the data has an empty train or test split");
  if (o.threads > 0) at::set_num_threads(o.threads);
  const bool plain = o.opt_level == "fp32";
  // Data-parallel: every rank trains on its shard of each global batch of batch_size * world.
  std::optional<apex::parallel::ProcessGroup> pg;
  if (o.ddp && o.device.is_cuda()) {
    // This rank's GPU as the current device: NCCL's barrier and any unplaced CUDA work go there,
    // not to GPU 0.
    c10::impl::getDeviceGuardImpl(c10::kCUDA)->setDevice(o.device);
  }
  if (o.ddp) {
    const auto ms = std::chrono::milliseconds(static_cast<int64_t>(std::ceil(o.timeout_s * 1000)));
    pg = apex::parallel::init_process_group(
        apex::parallel::ProcessGroupOptions().device(o.device).timeout(ms));
    check_same_settings(o, *pg);
  }
  // One live writer per checkpoint folder (rank 0 writes; every rank learns whether it may).
  CheckpointLock lock;
  if (!o.checkpoint.empty()) {
    std::string refused;
    if (!pg || pg->rank() == 0) {
      try {
        lock = CheckpointLock(o.checkpoint);
      } catch (const c10::Error& e) {
        if (!pg) throw;
        refused = e.what_without_backtrace();
      }
    }
    if (pg) {
      const std::vector<std::string> all = pg->all_gather_string(refused);
      TORCH_CHECK(all[0].empty(), all[0]);
    }
  }
  const int64_t rank = pg ? pg->rank() : 0;
  const int64_t world = pg ? pg->size() : 1;
  const int64_t per_step = o.batch_size * o.accumulate * world;
  int64_t total = total_steps(o, data.train.size(), world);

  ModelConfig mc = o.model;
  mc.sync_bn = o.sync_bn;
  std::shared_ptr<Classifier> model = make_model(mc, data.train, o.seed);
  model->to(o.device);
  std::unique_ptr<torch::optim::Optimizer> optimizer = make_optimizer(o, model->parameters());
  std::optional<apex::amp::Amp> amp;
  if (!plain) {
    apex::amp::Options ao(apex::amp::parse_opt_level(o.opt_level));
    ao.half_dtype(o.half_dtype).verbosity(0);
    if (!o.loss_scale.empty()) ao.loss_scale(apex::amp::LossScale::parse(o.loss_scale));
    amp.emplace(apex::amp::initialize({model}, {optimizer.get()}, ao));
  }
  apex::amp::Amp* ampp = amp ? &*amp : nullptr;
  int64_t start = 0;
  std::string run_id = new_run_id();
  if (o.resume) start = load_checkpoint(o, world, *model, *optimizer, ampp, run_id);
  TORCH_CHECK(o.stop_after == 0 || o.stop_after > start, "apex-train: --stop-after ", o.stop_after,
              " is not after the resumed checkpoint's step ", start);
  // After initialize (DDP reduces the gradients of the parameters as amp cast them).
  using Ddp = apex::parallel::DistributedDataParallel<std::shared_ptr<Classifier>>;
  std::optional<Ddp> ddp;
  if (pg) {
    apex::parallel::DistributedDataParallelOptions ddp_options;
    if (o.bucket_cap_mb > 0)
      ddp_options.bucket_cap_mb(o.bucket_cap_mb).first_bucket_mb(o.bucket_cap_mb);
    ddp.emplace(model, ddp_options, *pg);
  }
  const auto forward = [&](const at::Tensor& x) {
    if (ddp) return ampp ? ampp->forward(*ddp, x) : (*ddp)->forward(x);
    return ampp ? ampp->forward(model, x) : model->forward(x);
  };
  TORCH_CHECK(start < total, "apex-train: --resume: the checkpoint is at step ", start,
              " and this run has ", total,
              " steps: nothing left to train (raise --steps, with --resume-with-changes)");

  Summary s;
  s.level = o.opt_level;
  s.model = describe(o.model, *model);
  EpochSampler sampler(data.train.size(), o.seed);
  std::FILE* metrics = nullptr;
  if (!o.metrics.empty() && rank == 0) {
    // A resumed run keeps the records up to its checkpoint and drops the rest (steps logged after
    // the checkpoint, and the interrupted run's summary), so the file reads as one run.
    const std::string kept = o.resume ? metrics_up_to(o.metrics, start) : std::string();
    apex::check_writable(o.metrics, "apex-train: --metrics");
    // The kept records replace the file in one step (a kill while rewriting them in place would
    // lose the history), then this run appends.
    apex::write_file_atomic(o.metrics, kept);
    metrics = std::fopen(o.metrics.c_str(), "a");
    TORCH_CHECK(metrics != nullptr, "apex-train: cannot write --metrics ", o.metrics, ": ",
                std::strerror(errno));
  }
  Progress progress(o.opt_level, start, total, o.progress && rank == 0);
  const auto t0 = Clock::now();
  double train_seconds = 0;
  double timed_seconds = 0;  // from step start + untimed on (samples_per_s)
  int64_t timed_steps = 0;
  const int64_t untimed = std::clamp<int64_t>(o.untimed_steps, 0, total - start - 1);
  // The window's loss stays on the device until it is logged: no host sync per micro-batch.
  at::Tensor window_loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(o.device));
  int64_t window_steps = 0;
  int64_t skipped_before = ampp ? ampp->skipped_steps() : 0;
  int64_t skipped_in_a_row = 0;
  double last_logged_time = 0;
  const bool dynamic = ampp != nullptr && ampp->loss_scaler().dynamic();
  try {
    for (int64_t step = start; step < total; ++step) {
      const auto step_t0 = Clock::now();
      const double lr = lr_at(o, step, total);
      for (auto& g : optimizer->param_groups()) g.options().set_lr(lr);
      if (ampp) {
        ampp->zero_grad();
      } else {
        optimizer->zero_grad();
      }
      for (int64_t micro = 0; micro < o.accumulate; ++micro) {
        // This rank's slice of the micro-batch's global sample positions.
        const at::Tensor idx =
            sampler.shard(step * o.accumulate + micro, o.batch_size, world, rank);
        const at::Tensor x = data.train.inputs.index_select(0, idx).to(o.device);
        const at::Tensor y = data.train.labels.index_select(0, idx).to(o.device);
        // Micro-batches before the last only accumulate: DDP reduces once per step.
        std::optional<apex::parallel::NoSyncGuard> no_sync;
        if (ddp && micro + 1 < o.accumulate) no_sync.emplace(*ddp);
        const at::Tensor logits = forward(x);
        at::Tensor loss = at::cross_entropy_loss(logits.to(at::kFloat), y);
        window_loss += loss.detach() / static_cast<double>(o.accumulate);
        if (o.accumulate > 1) loss = loss / static_cast<double>(o.accumulate);
        if (ampp) {
          ampp->scale_loss(loss, 0,
                           apex::amp::ScaleLossOptions().delay_unscale(micro + 1 < o.accumulate))
              .backward();
        } else {
          loss.backward();
        }
      }
      if (o.clip > 0) {
        apex::optim::clip_grad_norm_(ampp ? ampp->master_params() : model->parameters(), o.clip);
      }
      if (ampp) {
        ampp->step();
      } else {
        optimizer->step();
      }
      ++window_steps;
      const double step_seconds = seconds_since(step_t0);
      train_seconds += step_seconds;
      if (step - start >= untimed) {
        timed_seconds += step_seconds;
        ++timed_steps;
      }
      if (ampp != nullptr) {
        const int64_t skipped = ampp->skipped_steps();
        skipped_in_a_row = skipped > skipped_before ? skipped_in_a_row + 1 : 0;
        skipped_before = skipped;
        // From the default 2^16 the scale is below 0.1 after 20 halvings: it is at its floor.
        TORCH_CHECK(
            skipped_in_a_row < kStuckSteps, "apex-train: ", kStuckSteps,
            " steps in a row overflowed (loss scale ", ampp->loss_scale(), ") at ", o.opt_level,
            ": the loss scale is stuck at its floor and training has diverged; lower --lr (", o.lr,
            ") or use bf16");
      }
      const bool interrupted = o.stop_after > 0 && step + 1 == o.stop_after;
      const bool last = step + 1 == total || interrupted;
      if ((step + 1) % o.log_every == 0 || last) {
        StepRecord r;
        r.step = step + 1;
        if (pg) {
          at::Tensor all = window_loss.to(at::kDouble);
          pg->all_reduce_(all);  // the mean over ranks: the loss of the global batch
          window_loss.copy_(all / static_cast<double>(world));
        }
        r.loss = window_loss.item<double>() / static_cast<double>(window_steps);
        r.loss_scale = ampp ? ampp->loss_scale() : 1.0;
        r.lr = lr;
        r.elapsed_s = seconds_since(t0);
        r.samples_per_s = static_cast<double>(window_steps * per_step) /
                          std::max(1e-9, train_seconds - last_logged_time);
        last_logged_time = train_seconds;
        // Without dynamic loss scaling nothing skips a bad step: a non-finite loss is final.
        TORCH_CHECK(std::isfinite(r.loss) || dynamic, "apex-train: the loss became ", r.loss,
                    " by step ", r.step, " at ", o.opt_level,
                    " (no dynamic loss scaling): training diverged; lower --lr (", o.lr, ")");
        s.curve.push_back(r);
        if (rank == 0) progress.update(r);
        if (metrics != nullptr) {
          write_metrics(metrics, json::step_record(o.opt_level, r) + "\n", o.metrics);
        }
        s.final_loss = r.loss;
        window_loss.zero_();
        window_steps = 0;
      }
      if (!o.checkpoint.empty() &&
          (last || (o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0))) {
        // Never save weights a non-finite loss may have spoiled (between logged steps too), and
        // decide it alike on every rank (a rank that stopped alone would leave the others
        // waiting at the barrier below).
        double finite = std::isfinite(window_loss.item<double>()) ? 1.0 : 0.0;
        if (pg) {
          // On the training device: an NCCL group reduces CPU tensors only where Gloo is built.
          at::Tensor all = at::full({1}, finite, at::TensorOptions(at::kDouble).device(o.device));
          pg->all_reduce_(all);
          finite = all.item<double>() == static_cast<double>(world) ? 1.0 : 0.0;
        }
        TORCH_CHECK(dynamic || finite == 1.0, "apex-train: the loss became non-finite before step ",
                    step + 1, " at ", o.opt_level,
                    ": training diverged (no checkpoint written); lower --lr (", o.lr, ")");
        // Rank 0 writes (every rank holds the same state); the others wait for it.
        if (rank == 0) save_checkpoint(o, world, step + 1, run_id, *model, *optimizer, ampp);
        if (pg) pg->barrier();
      }
      if (interrupted) {
        total = step + 1;
        break;
      }
    }
  } catch (...) {
    progress.finish();
    if (metrics != nullptr) std::fclose(metrics);
    throw;
  }
  progress.finish();
  // Rank 0 evaluates (every rank holds the same weights); the summary is its.
  const Eval e = rank == 0 ? evaluate(model, ampp, data.test, o.device, 256) : Eval{};
  s.rank = rank;
  s.world_size = world;
  if (ddp) {
    const auto t = (*ddp)->engine().timings();
    s.ddp_backward_compute_ms = static_cast<double>(t.backward_compute_ns) / 1e6;
    s.ddp_backward_comm_ms = static_cast<double>(t.backward_comm_ns) / 1e6;
    s.ddp_overlap_ms = static_cast<double>(t.backward_compute_comm_overlap_ns) / 1e6;
    s.ddp_buckets = static_cast<int64_t>((*ddp)->engine().bucket_indices().size());
  }
  s.steps = total - start;
  s.samples = s.steps * per_step;
  s.train_seconds = train_seconds;
  s.samples_per_s = static_cast<double>(timed_steps * per_step) / std::max(1e-9, timed_seconds);
  s.test_loss = e.loss;
  s.test_accuracy = e.accuracy;
  s.skipped_steps = ampp ? ampp->skipped_steps() : 0;
  s.loss_scale = ampp ? ampp->loss_scale() : 1.0;
  s.peak_rss_mb = peak_rss_mb();
  if (metrics != nullptr) {
    std::FILE* f = std::exchange(metrics, nullptr);
    const bool written = std::fputs((to_json(s) + "\n").c_str(), f) >= 0;
    const int err = errno;
    TORCH_CHECK(std::fclose(f) == 0 && written, "apex-train: --metrics ", o.metrics,
                ": write failed: ", std::strerror(written ? errno : err));
  }
  return s;
}

std::string to_json(const Summary& s) {
  std::ostringstream out;
  out << "{\"summary\": true, \"level\": " << json::quote(s.level)
      << ", \"model\": " << json::quote(s.model) << ", \"steps\": " << s.steps
      << ", \"samples\": " << s.samples << ", \"train_seconds\": " << json::num(s.train_seconds)
      << ", \"samples_per_s\": " << json::num(s.samples_per_s)
      << ", \"final_loss\": " << json::num(s.final_loss)
      << ", \"test_loss\": " << json::num(s.test_loss)
      << ", \"test_accuracy\": " << json::num(s.test_accuracy)
      << ", \"skipped_steps\": " << s.skipped_steps
      << ", \"loss_scale\": " << json::num(s.loss_scale)
      << ", \"peak_rss_mb\": " << json::num(s.peak_rss_mb) << ", \"world_size\": " << s.world_size
      << ", \"ddp_backward_compute_ms\": " << json::num(s.ddp_backward_compute_ms)
      << ", \"ddp_backward_comm_ms\": " << json::num(s.ddp_backward_comm_ms)
      << ", \"ddp_overlap_ms\": " << json::num(s.ddp_overlap_ms)
      << ", \"ddp_buckets\": " << s.ddp_buckets << "}";
  return out.str();
}

Summary summary_from_json(const std::string& line) {
  Summary s;
  s.level = json::get_string(line, "level");
  s.model = json::get_string(line, "model");
  s.steps = static_cast<int64_t>(json::get_number(line, "steps"));
  s.samples = static_cast<int64_t>(json::get_number(line, "samples"));
  s.train_seconds = json::get_number(line, "train_seconds");
  s.samples_per_s = json::get_number(line, "samples_per_s");
  s.final_loss = json::get_number(line, "final_loss");
  s.test_loss = json::get_number(line, "test_loss");
  s.test_accuracy = json::get_number(line, "test_accuracy");
  s.skipped_steps = static_cast<int64_t>(json::get_number(line, "skipped_steps"));
  s.loss_scale = json::get_number(line, "loss_scale");
  s.peak_rss_mb = json::get_number(line, "peak_rss_mb");
  s.world_size = static_cast<int64_t>(json::get_number(line, "world_size"));
  s.ddp_backward_compute_ms = json::get_number(line, "ddp_backward_compute_ms");
  s.ddp_backward_comm_ms = json::get_number(line, "ddp_backward_comm_ms");
  s.ddp_overlap_ms = json::get_number(line, "ddp_overlap_ms");
  s.ddp_buckets = static_cast<int64_t>(json::get_number(line, "ddp_buckets"));
  return s;
}

}  // namespace apex::train
