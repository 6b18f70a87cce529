#include "train/checkpoint.h"

#include <ATen/Parallel.h>
#include <apex/amp/initialize.h>
#include <apex/io.h>
#include <apex/optim.h>
#include <apex/parallel/process_group.h>
#include <apex/serialize.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "train/json.h"
#include "train/models.h"

// apex-train's checkpoints (the step folders, their manifest and meta.json, resume and its
// checks), the settings a run is defined by, and the lock that keeps one writer per folder.

namespace apex::train {
namespace fs = std::filesystem;
namespace {

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
          {"threads", std::to_string(at::get_num_threads())},
          {"zero", o.zero ? "true" : "false"}};
}

constexpr int64_t kCheckpointFormat = 2;
const char* const kManifest = "manifest.json";

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

// A checkpoint folder whose every file matches its manifest, with its parsed meta.json.
struct Checkpoint {
  fs::path folder;
  int64_t step = 0;
  std::string run;
  json::Object meta;
  bool has_amp = false;
  bool has_zero = false;    ///< a sharded optimizer (zero/) instead of optimizer.pt
  bool has_scaler = false;  ///< a GradScaler's state (--zero at fp16 levels)
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
    const bool shard = name.rfind("zero/", 0) == 0 && name.find('/', 5) == std::string::npos &&
                       name.find("..") == std::string::npos && name.size() > 5;
    TORCH_CHECK(name == "model.pt" || name == "optimizer.pt" || name == "amp.pt" ||
                    name == "scaler.pt" || name == "meta.json" || shard,
                mwhat, ": unexpected entry \"", name, "\"");
    ck.has_zero = ck.has_zero || shard;
    const std::string want = json::string_at(manifest, name, mwhat);
    const fs::path file = folder / name;
    TORCH_CHECK(fs::exists(file, ec), where, ": ", name, " is missing (listed in the manifest)");
    const std::string got = file_entry(apex::read_file(file.string()));
    TORCH_CHECK(got == want, file.string(), " does not match the manifest (", got,
                ", the manifest says ", want,
                "): the file is corrupted, or comes from another step or run");
    ck.has_amp = ck.has_amp || name == "amp.pt";
    ck.has_scaler = ck.has_scaler || name == "scaler.pt";
  }
  for (const char* name :
       {"model.pt", ck.has_zero ? "zero/manifest.pt" : "optimizer.pt", "meta.json"}) {
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

}  // namespace

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
      {"--timeout", json::num_exact(o.timeout_s)},
      {"--zero", o.zero ? "yes" : "no"},
      {"--zero-reduce-scatter", o.zero_reduce_scatter},
      {"--zero-message-cap-mb", json::num_exact(o.zero_message_cap_mb)}};
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

std::string new_run_id() {
  std::random_device rd;
  const uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

void save_checkpoint(const TrainOptions& o, int64_t world, int64_t step, const std::string& run,
                     torch::nn::Module& model, torch::optim::Optimizer& optimizer,
                     apex::amp::Amp* amp, const std::string& shards,
                     const apex::amp::GradScaler* scaler) {
  const fs::path dir(o.checkpoint);
  const fs::path tmp = dir / (".tmp-step-" + std::to_string(step));
  const fs::path final_dir = dir / ("step-" + std::to_string(step));
  try {
    fs::create_directories(dir);
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    std::vector<std::string> files = {"model.pt"};
    apex::save_module(model, (tmp / "model.pt").string());
    if (shards.empty()) {
      apex::save_optimizer(optimizer, (tmp / "optimizer.pt").string());
      files.push_back("optimizer.pt");
    } else {
      fs::rename(shards, tmp / "zero");
      std::vector<std::string> names;
      for (const auto& e : fs::directory_iterator(tmp / "zero")) {
        names.push_back("zero/" + e.path().filename().string());
      }
      std::sort(names.begin(), names.end());
      files.insert(files.end(), names.begin(), names.end());
    }
    if (amp != nullptr) {
      amp->save((tmp / "amp.pt").string());
      files.push_back("amp.pt");
    }
    if (scaler != nullptr) {
      scaler->save((tmp / "scaler.pt").string());
      files.push_back("scaler.pt");
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

std::string save_zero_shards(const TrainOptions& o, int64_t step,
                             apex::parallel::DistributedFusedAdam& optimizer) {
  const auto& pg = optimizer.process_group();
  const fs::path stage = fs::path(o.checkpoint) / (".zero-step-" + std::to_string(step));
  std::string error;
  if (pg.rank() == 0) {
    try {
      fs::create_directories(o.checkpoint);
      fs::remove_all(stage);
      fs::create_directories(stage);
    } catch (const std::exception& e) {
      error = e.what();
    }
  }
  const auto all = pg.all_gather_string(error);
  TORCH_CHECK(all[0].empty(), "apex-train: saving checkpoint to ", o.checkpoint,
              " failed: ", all[0]);
  optimizer.save_sharded(stage.string());
  return stage.string();
}

// Returns the step to continue from, and the run's id in `run`.
int64_t load_checkpoint(const TrainOptions& o, int64_t world, torch::nn::Module& model,
                        torch::optim::Optimizer& optimizer, apex::amp::Amp* amp, std::string& run,
                        apex::amp::GradScaler* scaler) {
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
  TORCH_CHECK(ck.has_zero == o.zero, who, ck.folder.string(),
              ck.has_zero ? " holds a sharded optimizer (written with --zero): resume with --zero"
                          : " holds an unsharded optimizer: resume without --zero");
  TORCH_CHECK(ck.has_scaler == (scaler != nullptr), who, ck.folder.string(),
              ck.has_scaler ? " holds a GradScaler state this run has no use for"
                            : " has no GradScaler state, which this run needs");
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
  auto* zero = dynamic_cast<apex::parallel::DistributedFusedAdam*>(&optimizer);
  if (zero != nullptr) {
    zero->load_sharded((ck.folder / "zero").string());
  } else {
    apex::load_optimizer(optimizer, (ck.folder / "optimizer.pt").string());
  }
  if (amp != nullptr) amp->load((ck.folder / "amp.pt").string());
  if (scaler != nullptr) scaler->load((ck.folder / "scaler.pt").string());
  run = ck.run;
  return ck.step;
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

}  // namespace apex::train
