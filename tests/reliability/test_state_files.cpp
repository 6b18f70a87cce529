// Every kind of file apex-cpp writes, damaged as a careless or hostile user would damage it: cut
// at 20 lengths, 200 single bytes flipped across the header, the payload and the central
// directory, zeroed, replaced by text, and swapped for each other kind of file. Every case must
// end in a clear error with nothing changed, or (a flip in a byte nothing reads) in exactly the
// state the intact file gives. Bounded to seconds: the files are small.
#include <apex/amp/grad_scaler.h>
#include <apex/amp/initialize.h>
#include <apex/io.h>
#include <apex/optim.h>
#include <apex/serialize.h>
#include <sys/stat.h>
#include <torch/serialize.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "../common/test_util.h"

namespace apex::test {
namespace {

namespace fs = std::filesystem;

std::string slurp(const std::string& path) { return apex::read_file(path); }

void spill(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

/// One kind of file: how to write it from a fresh object, and how to load it into a fresh object
/// and read back everything the load can change.
struct Kind {
  std::string name;
  std::function<void(const std::string& path)> write;
  /// Loads `path` into an object built from `seed`, returning its state afterwards; throws what
  /// the load throws, after checking that the object is as it was before the failed load.
  std::function<std::vector<at::Tensor>(const std::string& path)> load;
  /// False for plain torch::load, whose archive parsing is LibTorch's: its errors are whatever
  /// LibTorch throws (never a crash, and nothing changes), but not ours to word.
  bool clear_errors = true;
};

bool same(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].sizes() != b[i].sizes() || a[i].scalar_type() != b[i].scalar_type() ||
        !at::equal(a[i], b[i])) {
      return false;
    }
  }
  return true;
}

/// Runs `load` and, when it throws, checks that the object's state is what `before` gave.
std::vector<at::Tensor> guarded(const std::function<std::vector<at::Tensor>()>& before,
                                const std::function<void()>& load,
                                const std::function<std::vector<at::Tensor>()>& after) {
  const auto b = before();
  try {
    load();
  } catch (const std::exception&) {
    const auto a = after();
    std::string diff;
    for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
      if (!at::equal(a[i], b[i])) diff += " tensor " + std::to_string(i);
    }
    EXPECT_TRUE(same(a, b)) << "a failed load changed the state:" << diff << " sizes " << a.size()
                            << " " << b.size();
    throw;
  }
  return after();
}

// ---- the objects ------------------------------------------------------------------------------

struct AmpRun {
  Mlp model{nullptr};
  std::unique_ptr<torch::optim::Adam> opt;
  std::optional<apex::amp::Amp> amp;
  explicit AmpRun(int steps) {
    torch::manual_seed(3);
    model = Mlp(6, 8, 3);
    opt = std::make_unique<torch::optim::Adam>(model->parameters());
    amp.emplace(apex::amp::initialize(model, *opt,
                                      apex::amp::Options(apex::amp::OptLevel::O2)
                                          .half_dtype(at::kHalf)
                                          .verbosity(0)
                                          .growth_interval(2)));
    for (int s = 0; s < steps; ++s) {
      auto b = make_blobs(8, 6, 3, 10 + s);
      amp->zero_grad();
      amp->scale_loss(cross_entropy(amp->forward(model, b.x), b.y)).backward();
      amp->step();
    }
  }
  std::vector<at::Tensor> state() {
    auto out = snapshot(model->parameters());
    for (auto& m : amp->master_params()) out.push_back(m.detach().clone());
    out.push_back(at::scalar_tensor(amp->loss_scale(), at::kDouble));
    return out;
  }
};

struct AdamRun {
  std::vector<at::Tensor> params;
  std::unique_ptr<apex::optim::FusedAdam> opt;
  explicit AdamRun(int steps) {
    auto gen = at::detail::createCPUGenerator(5);
    params = {at::randn({33}, gen).set_requires_grad(true),
              at::randn({4, 5}, gen).set_requires_grad(true)};
    opt = std::make_unique<apex::optim::FusedAdam>(params, apex::optim::FusedAdamOptions(1e-2));
    for (int s = 0; s < steps; ++s) {
      for (auto& p : params) p.mutable_grad() = at::randn(p.sizes(), gen);
      opt->step();
    }
  }
  std::vector<at::Tensor> state() {
    auto out = snapshot(params);
    for (const auto& p : params) {
      auto it = opt->state().find(p.unsafeGetTensorImpl());
      if (it == opt->state().end()) continue;
      const auto& s = static_cast<const apex::optim::FusedAdamParamState&>(*it->second);
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
    }
    // The step counter lives on the device (the state's copy is synced at save).
    out.push_back(at::scalar_tensor(opt->step_count(0)));
    out.push_back(at::scalar_tensor(opt->param_groups()[0].options().get_lr(), at::kDouble));
    return out;
  }
};

std::vector<Kind> kinds() {
  std::vector<Kind> k;
  k.push_back({"amp", [](const std::string& p) { AmpRun(3).amp->save(p); },
               [](const std::string& p) {
                 AmpRun r(0);
                 return guarded([&] { return r.state(); }, [&] { r.amp->load(p); },
                                [&] { return r.state(); });
               }});
  k.push_back({"grad_scaler",
               [](const std::string& p) {
                 apex::amp::GradScaler s(
                     apex::amp::GradScalerOptions().device(c10::kCPU).init_scale(512.0));
                 s.save(p);
               },
               [](const std::string& p) {
                 apex::amp::GradScaler s(apex::amp::GradScalerOptions().device(c10::kCPU));
                 auto get = [&] {
                   const auto d = s.state_dict();
                   return std::vector<at::Tensor>{
                       at::scalar_tensor(d.at("scale").toDouble(), at::kDouble),
                       at::scalar_tensor(d.at("growth_factor").toDouble(), at::kDouble),
                       at::scalar_tensor(d.at("_growth_tracker").toInt())};
                 };
                 return guarded(
                     get, [&] { s.load(p); }, get);
               }});
  k.push_back({"fused_adam_archive",
               [](const std::string& p) { apex::save_optimizer(*AdamRun(3).opt, p); },
               [](const std::string& p) {
                 AdamRun r(1);
                 return guarded([&] { return r.state(); }, [&] { apex::load_optimizer(*r.opt, p); },
                                [&] { return r.state(); });
               }});
  k.push_back({"fused_adam_torch_load",
               [](const std::string& p) { torch::save(*AdamRun(3).opt, p); },
               [](const std::string& p) {
                 AdamRun r(1);
                 // Plain torch::load: LibTorch parses the archive; the optimizer's own checks
                 // (kind, options, shapes, checksum) run on what it read.
                 return guarded([&] { return r.state(); }, [&] { torch::load(*r.opt, p); },
                                [&] { return r.state(); });
               },
               false});
  k.push_back(
      {"fused_adam_python",
       [](const std::string& p) { apex::save_pickle(AdamRun(3).opt->python_state_dict(), p); },
       [](const std::string& p) {
         AdamRun r(1);
         return guarded([&] { return r.state(); },
                        [&] {
                          const auto v = apex::load_pickle(p);
                          TORCH_CHECK(v.isGenericDict(), "not a dict");
                          StateDict d = make_state_dict();
                          for (const auto& e : v.toGenericDict()) {
                            TORCH_CHECK(e.key().isString(), "key");
                            d.insert(e.key().toStringRef(), e.value());
                          }
                          r.opt->load_python_state_dict(d);
                        },
                        [&] { return r.state(); });
       }});
  k.push_back({"module",
               [](const std::string& p) {
                 torch::manual_seed(1);
                 apex::save_module(*Cnn(3), p);
               },
               [](const std::string& p) {
                 torch::manual_seed(2);
                 Cnn m(3);
                 auto get = [&] {
                   auto out = snapshot(m->parameters());
                   for (auto& b : m->buffers()) out.push_back(b.clone());
                   return out;
                 };
                 return guarded(
                     get, [&] { apex::load_module(*m, p); }, get);
               }});
  return k;
}

/// Positions to flip: every region gets its share (the first and last 512 bytes hold the first
/// headers and the central directory; the rest is payload).
std::vector<size_t> flip_positions(size_t n, int count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<size_t> out;
  const size_t edge = std::min<size_t>(512, n / 3);
  for (int i = 0; i < count; ++i) {
    const int region = i % 3;
    size_t lo = 0;
    size_t hi = n;
    if (region == 0) hi = edge;
    if (region == 2) lo = n - edge;
    out.push_back(lo + rng() % std::max<size_t>(1, hi - lo));
  }
  return out;
}

class StateFileFuzz : public TempDirTest {};

TEST_F(StateFileFuzz, EveryDamageIsAClearErrorOrHarmless) {
  const auto all = kinds();
  std::map<std::string, std::string> valid;
  for (const auto& k : all) {
    const std::string p = path(k.name + ".valid");
    k.write(p);
    valid[k.name] = slurp(p);
  }
  // APEX_FUZZ_KIND=<name>: only that kind (for hand runs, e.g. under a sanitizer).
  const char* only = std::getenv("APEX_FUZZ_KIND");
  for (const auto& k : all) {
    if (only != nullptr && k.name != only) continue;
    SCOPED_TRACE(k.name);
    const std::string good = valid[k.name];
    const auto expected = k.load(path(k.name + ".valid"));
    int errors = 0;
    int harmless = 0;
    auto attempt = [&](const std::string& bytes, const std::string& label) {
      const std::string p = path(k.name + ".case");
      spill(p, bytes);
      try {
        const auto got = k.load(p);
        EXPECT_TRUE(same(got, expected)) << label << ": loaded, but not the intact file's state";
        ++harmless;
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        // Clear: one line, never LibTorch's internal unpickler or archive jargon alone.
        if (k.clear_errors) {
          EXPECT_EQ(msg.find("Unpickler found unknown"), std::string::npos) << label << ": " << msg;
          EXPECT_EQ(msg.find('\n'), std::string::npos) << label << ": " << msg;
        }
        EXPECT_FALSE(msg.empty()) << label;
        ++errors;
      } catch (const std::exception& e) {
        EXPECT_FALSE(k.clear_errors) << label << ": not a c10::Error: " << e.what();
        ++errors;
      }
    };
    for (int i = 0; i < 20; ++i) {
      const size_t len = good.size() * static_cast<size_t>(i) / 20;
      attempt(good.substr(0, len), "truncated to " + std::to_string(len));
    }
    std::mt19937 bits(7);
    for (size_t pos : flip_positions(good.size(), 200, 11)) {
      std::string bad = good;
      bad[pos] = static_cast<char>(bad[pos] ^ static_cast<char>(1 + bits() % 255));
      attempt(bad, "byte " + std::to_string(pos) + " flipped");
    }
    // APEX_FUZZ_EXHAUSTIVE=1: every byte, three ways (minutes; run by hand, not in CI).
    if (std::getenv("APEX_FUZZ_EXHAUSTIVE") != nullptr) {
      for (size_t pos = 0; pos < good.size(); ++pos) {
        for (int x : {0x01, 0x10, 0xff}) {
          std::string bad = good;
          bad[pos] = static_cast<char>(bad[pos] ^ x);
          attempt(bad, "byte " + std::to_string(pos) + " ^ " + std::to_string(x));
        }
      }
    }
    attempt(std::string(good.size(), '\0'), "zeroed");
    attempt("{\"step\": 3, \"note\": \"not a state file\"}\n", "text");
    for (const auto& other : all) {
      if (other.name == k.name) continue;
      // The same file format holding another object: a clear error, never a silent load.
      if ((k.name.rfind("fused_adam_", 0) == 0 && other.name.rfind("fused_adam_", 0) == 0)) {
        continue;
      }
      const std::string p = path(k.name + ".case");
      spill(p, valid[other.name]);
      EXPECT_ANY_THROW(k.load(p)) << "a " << other.name << " file loaded as " << k.name;
    }
    // Every flip inside a record's bytes is an error; flips in bytes no reader uses (padding,
    // timestamps) load the intact state.
    EXPECT_GT(errors, 20) << harmless << " harmless";
  }
}

// A loader handed another kind of file names what it is.
TEST_F(StateFileFuzz, ForeignFilesAreNamed) {
  AmpRun r(1);
  r.amp->save(path("amp.pt"));
  apex::amp::GradScaler scaler(apex::amp::GradScalerOptions().device(c10::kCPU));
  scaler.save(path("scaler.pt"));
  apex::save_optimizer(*AdamRun(1).opt, path("opt.pt"));
  spill(path("text.json"), "{\"step\": 3}\n");
  spill(path("empty"), "");
  EXPECT_TRUE(throws_with([&] { r.amp->load(path("scaler.pt")); },
                          "is a GradScaler state (GradScaler::save), expected an Amp state"));
  EXPECT_TRUE(throws_with([&] { scaler.load(path("amp.pt")); },
                          "is an Amp state (Amp::save), expected a GradScaler state"));
  EXPECT_TRUE(throws_with([&] { r.amp->load(path("opt.pt")); },
                          "is a torch::save archive (TorchScript format"));
  EXPECT_TRUE(throws_with([&] { r.amp->load(path("text.json")); },
                          "is a text file (it begins \"{\"step\": 3}"));
  EXPECT_TRUE(throws_with([&] { r.amp->load(path("empty")); }, "is an empty file"));
  EXPECT_TRUE(throws_with([&] { apex::load_optimizer(*AdamRun(1).opt, path("amp.pt")); },
                          "is an Amp state (Amp::save), expected an optimizer archive"));
  AdamRun a(1);
  auto sgd_params = std::vector<at::Tensor>{at::zeros({33}).set_requires_grad(true),
                                            at::zeros({4, 5}).set_requires_grad(true)};
  apex::optim::FusedSGD sgd(sgd_params, apex::optim::FusedSGDOptions(0.1).momentum(0.9));
  EXPECT_TRUE(throws_with([&] { apex::load_optimizer(sgd, path("opt.pt")); },
                          "the archive holds the state of a FusedAdam, expected a FusedSGD state"));
  EXPECT_TRUE(throws_with([&] { apex::load_pickle(path("text.json")); }, "is a text file"));
  EXPECT_TRUE(throws_with([&] { apex::load_pickle(path("/nonexistent")); }, "cannot read"));
}

// Values outside what a writer with these options can produce are refused at load, not at the
// next step.
TEST_F(StateFileFuzz, LoadedValuesAreValidated) {
  AmpRun r(1);
  auto d = r.amp->state_dict();
  auto scaler = d.at("loss_scaler0").toGenericDict();
  scaler.insert_or_assign("loss_scale", 3.4e38);
  const auto before = r.state();
  EXPECT_TRUE(throws_with([&] { r.amp->load_state_dict(d); }, "is outside [0, max_scale="));
  EXPECT_TRUE(same(r.state(), before));
  // Another model's optimizer state: refused by load, not by the next step().
  AdamRun a(2);
  apex::save_optimizer(*a.opt, path("opt.pt"));
  auto other = std::vector<at::Tensor>{at::zeros({33}).set_requires_grad(true),
                                       at::zeros({5, 4}).set_requires_grad(true)};
  apex::optim::FusedAdam b(other, apex::optim::FusedAdamOptions(1e-2));
  EXPECT_TRUE(throws_with([&] { torch::load(b, path("opt.pt")); },
                          "the loaded state of parameter 1 of group 0 has shape [4, 5] but the "
                          "parameter has shape [5, 4]"));
  EXPECT_TRUE(b.state().empty());
  // A module archive of another shape leaves the module as it was.
  torch::manual_seed(1);
  apex::save_module(*Mlp(6, 8, 3), path("mlp.pt"));
  Mlp wider(6, 9, 3);
  const auto params = snapshot(wider->parameters());
  EXPECT_TRUE(throws_with([&] { apex::load_module(*wider, path("mlp.pt")); },
                          "does not hold this module's parameters and buffers"));
  EXPECT_TRUE(same(snapshot(wider->parameters()), params));
}

// What apex-cpp writes is either complete or absent, through links, and never over a device.
TEST_F(StateFileFuzz, AtomicWritesFollowLinksAndRefuseSpecialFiles) {
  spill(path("target"), "old");
  fs::create_symlink(path("target"), path("link"));
  apex::write_file_atomic(path("link"), "new");
  EXPECT_TRUE(fs::is_symlink(path("link")));
  EXPECT_EQ(slurp(path("target")), "new");
  EXPECT_TRUE(throws_with([&] { apex::write_file_atomic("/dev/null", "x"); },
                          "'/dev/null' is a character device; expected a regular file"));
  EXPECT_TRUE(
      throws_with([&] { apex::check_writable(path("missing/x"), "--metrics"); }, "does not exist"));
  EXPECT_TRUE(throws_with([&] { apex::check_writable(dir_.string(), "--plot"); }, "is a folder"));
  EXPECT_TRUE(throws_with([&] { apex::read_file("/dev/zero"); }, "not a regular file"));
  for (const auto& e : fs::directory_iterator(dir_)) {
    EXPECT_EQ(e.path().filename().string().find(".tmp."), std::string::npos) << e.path();
  }
  // A new file's mode follows the umask, as any write's; a replaced file keeps its mode.
  const mode_t old_mask = ::umask(077);
  apex::write_file_atomic(path("private"), "x");
  ::umask(old_mask);
  EXPECT_EQ(fs::status(path("private")).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write);
  fs::permissions(path("target"),
                  fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  apex::write_file_atomic(path("link"), "again");
  EXPECT_EQ(fs::status(path("target")).permissions() & fs::perms::all,
            fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
}

}  // namespace
}  // namespace apex::test
