// apex-train's checkpoints and outputs under damage: every file of a step folder cut, flipped,
// zeroed, replaced or mixed with another step's; meta.json and `latest` edited; settings changed
// between runs; outputs that cannot be written; kill -9 while a checkpoint is being written.
// Each case ends in one clear error before anything trains, or in exactly the uninterrupted run.
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <apex/io.h>

#include "train/data.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace apex::test {
namespace {

namespace fs = std::filesystem;
using Checkpoints = TempDirTest;

void spill(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// A run of 6 steps with its checkpoint at step 6 (and one at 3 in `mid`).
struct Fixture {
  TrainOptions o;
  apex::train::Split data;
};

Fixture checkpointed(const std::string& dir, const std::string& level) {
  Fixture f{tiny("mlp", level), {}};
  f.o.steps = 8;
  f.o.stop_after = 6;
  f.o.checkpoint = dir;
  f.data = apex::train::load_data(f.o);
  apex::train::train(f.o, f.data);
  f.o.stop_after = 0;
  f.o.resume = true;
  return f;
}

// Resuming from the (damaged) copy in `dir` must fail with `fragment` before any training, or,
// when `may_pass`, succeed as from the intact folder.
::testing::AssertionResult resume_fails(const Fixture& f, const std::string& dir,
                                        const std::string& fragment) {
  TrainOptions o = f.o;
  o.checkpoint = dir;
  return throws_with([&] { apex::train::train(o, f.data); }, fragment);
}

void copy_folder(const std::string& from, const std::string& to) {
  fs::remove_all(to);
  fs::copy(from, to, fs::copy_options::recursive);
}

TEST_F(Checkpoints, EveryDamagedFileIsRefusedOrHarmless) {
  const Fixture f = checkpointed(path("ck"), "O2");
  copy_folder(path("ck"), path("intact"));
  TrainOptions intact_o = f.o;
  intact_o.checkpoint = path("intact");
  const double intact_loss = apex::train::train(intact_o, f.data).curve.back().loss;
  const std::string step = "/step-6/";
  std::mt19937_64 rng(3);
  int refused = 0;
  int harmless = 0;
  for (const std::string name :
       {"model.pt", "optimizer.pt", "amp.pt", "meta.json", "manifest.json"}) {
    const std::string good = read_text(path("ck") + step + name);
    ASSERT_FALSE(good.empty()) << name;
    std::vector<std::string> damaged;
    for (int i = 0; i < 20; ++i) damaged.push_back(good.substr(0, good.size() * i / 20));
    for (int i = 0; i < 200; ++i) {
      std::string bad = good;
      const size_t region = static_cast<size_t>(i % 3);
      const size_t edge = std::min<size_t>(512, good.size() / 3);
      const size_t lo = region == 2 ? good.size() - edge : 0;
      const size_t hi = region == 0 ? edge : good.size();
      const size_t pos = lo + rng() % std::max<size_t>(1, hi - lo);
      bad[pos] = static_cast<char>(bad[pos] ^ static_cast<char>(1 + rng() % 255));
      damaged.push_back(bad);
    }
    damaged.push_back(std::string(good.size(), '\0'));
    damaged.push_back("not a checkpoint file\n");
    for (const auto& bad : damaged) {
      copy_folder(path("ck"), path("case"));
      spill(path("case") + step + name, bad);
      TrainOptions o = f.o;
      o.checkpoint = path("case");
      try {
        // Every byte of every file is covered by the manifest, and the manifest by a strict
        // parse and its agreement with meta.json and the folder: only a change nothing reads
        // (white space in the JSON) may pass, and then the run is the intact one.
        const auto s = apex::train::train(o, f.data);
        EXPECT_EQ(s.curve.back().loss, intact_loss) << name;
        ++harmless;
      } catch (const c10::Error& e) {
        const std::string msg = e.what_without_backtrace();
        EXPECT_NE(msg.find("apex-train: --resume: "), std::string::npos) << msg;
        EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
        // Nothing was trained or written: no newer step.
        EXPECT_EQ(read_text(path("case") + "/latest"), "step-6\n");
        ++refused;
      }
    }
  }
  EXPECT_EQ(refused + harmless, 5 * 222);
  EXPECT_GT(refused, 5 * 200) << harmless << " harmless";
}

TEST_F(Checkpoints, MetaJsonIsValidatedFieldByField) {
  const Fixture f = checkpointed(path("ck"), "O1");
  const std::string meta = read_text(path("ck") + "/step-6/meta.json");
  const std::string manifest = read_text(path("ck") + "/step-6/manifest.json");
  const auto edited = [&](const std::string& value) {
    std::string m = meta;
    const size_t at = m.find("\"step\": 6");
    EXPECT_NE(at, std::string::npos);
    return m.replace(at, 9, "\"step\": " + value);
  };
  // meta.json alone edited: the manifest no longer matches.
  for (const std::string v : {"0", "-100", "2.7", "1", "5", "7", "1e30", "null", "\"6\""}) {
    copy_folder(path("ck"), path("case"));
    spill(path("case") + "/step-6/meta.json", edited(v));
    EXPECT_TRUE(resume_fails(f, path("case"), "meta.json does not match the manifest")) << v;
  }
  // meta.json and the manifest edited together: the fields themselves are checked.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"0", "\"step\" must be in [1, "},       {"-100", "\"step\" must be in [1, "},
      {"2.7", "\"step\" must be an integer"},  {"1e30", "\"step\" must be an integer"},
      {"null", "\"step\" must be an integer"}, {"5", "step 5 but the manifest says 6"},
      {"7", "step 7 but the manifest says 6"}};
  for (const auto& [v, fragment] : cases) {
    copy_folder(path("ck"), path("case"));
    const std::string m = edited(v);
    spill(path("case") + "/step-6/meta.json", m);
    std::string man = manifest;
    const size_t at = man.find("\"meta.json\": \"");
    const size_t end = man.find('"', at + 14);
    char entry[64];
    std::snprintf(entry, sizeof(entry), "size=%zu crc32=0x%08x", m.size(),
                  static_cast<unsigned>(apex::crc32(m)));
    man.replace(at + 14, end - at - 14, entry);
    spill(path("case") + "/step-6/manifest.json", man);
    EXPECT_TRUE(resume_fails(f, path("case"), fragment)) << v;
  }
}

TEST_F(Checkpoints, MixedStepsAndRunsAreRefused) {
  Fixture f = checkpointed(path("ck"), "O2");
  // Another step of the same run: its files in this step's folder.
  TrainOptions early = f.o;
  early.resume = false;
  early.stop_after = 3;
  early.checkpoint = path("early");
  apex::train::train(early, f.data);
  for (const std::string name : {"model.pt", "optimizer.pt", "amp.pt"}) {
    copy_folder(path("ck"), path("case"));
    fs::copy_file(path("early") + "/step-3/" + name, path("case") + "/step-6/" + name,
                  fs::copy_options::overwrite_existing);
    EXPECT_TRUE(resume_fails(f, path("case"), name + " does not match the manifest")) << name;
  }
  // A whole folder of another step under this step's name.
  fs::remove_all(path("case"));
  fs::create_directories(path("case"));
  fs::copy(path("early") + "/step-3", path("case") + "/step-6", fs::copy_options::recursive);
  spill(path("case") + "/latest", "step-6\n");
  EXPECT_TRUE(resume_fails(f, path("case"), "does not match its folder's name step-6"));
  // The manifest of another run with its files: the run ids disagree with meta.json.
  copy_folder(path("ck"), path("case"));
  fs::copy_file(path("early") + "/step-3/meta.json", path("case") + "/step-6/meta.json",
                fs::copy_options::overwrite_existing);
  EXPECT_TRUE(resume_fails(f, path("case"), "meta.json does not match the manifest"));
}

TEST_F(Checkpoints, UnusableLatestNamesTheNewestCompleteStep) {
  Fixture f = checkpointed(path("ck"), "O1");
  for (const std::string bad : {"", "step-6", "../../etc\n", "step-6\nstep-7\n", "step-99\n"}) {
    copy_folder(path("ck"), path("case"));
    spill(path("case") + "/latest", bad);
    const std::string want =
        bad == "step-99\n" ? "is not a checkpoint folder" : "latest is unusable";
    EXPECT_TRUE(resume_fails(f, path("case"), want)) << bad;
    EXPECT_TRUE(resume_fails(f, path("case"), "--resume-from step-6")) << bad;
  }
  // --resume-from picks that folder, and the run then finishes as the uninterrupted one.
  copy_folder(path("ck"), path("case"));
  spill(path("case") + "/latest", "garbage");
  TrainOptions o = f.o;
  o.checkpoint = path("case");
  o.resume_from = "step-6";
  const auto resumed = apex::train::train(o, f.data);
  EXPECT_EQ(resumed.steps, 2);
  TrainOptions straight = f.o;
  straight.resume = false;
  straight.checkpoint = path("straight");
  apex::train::train(straight, f.data);
  const auto want = archive_tensors(path("straight") + "/step-8/model.pt");
  const auto got = archive_tensors(path("case") + "/step-8/model.pt");
  ASSERT_EQ(got.size(), want.size());
  for (const auto& [k, v] : want) EXPECT_TRUE(at::equal(v, got.at(k))) << k;
  // A folder without its manifest (an interrupted save) is no checkpoint.
  copy_folder(path("ck"), path("case"));
  fs::remove(path("case") + "/step-6/manifest.json");
  EXPECT_TRUE(resume_fails(f, path("case"), "has no manifest.json"));
}

TEST_F(Checkpoints, ChangedSettingsNeedAnExplicitFlag) {
  Fixture f = checkpointed(path("ck"), "O1");
  const std::vector<std::pair<std::function<void(TrainOptions&)>, std::string>> changes = {
      {[](TrainOptions& o) { o.seed = 9; }, "seed 0 -> 9"},
      {[](TrainOptions& o) { o.batch_size = 16; }, "batch_size 32 -> 16"},
      {[](TrainOptions& o) { o.lr = 1e-2; }, "lr 0.0030000000000000001 -> 0.01"},
      {[](TrainOptions& o) { o.warmup = 0; }, "warmup 2 -> 0"},
      {[](TrainOptions& o) { o.steps = 20; }, "steps 8 -> 20"},
      {[](TrainOptions& o) { o.accumulate = 2; }, "accumulate 1 -> 2"},
  };
  for (const auto& [change, fragment] : changes) {
    copy_folder(path("ck"), path("case"));
    TrainOptions o = f.o;
    o.checkpoint = path("case");
    change(o);
    EXPECT_TRUE(throws_with([&] { apex::train::train(o, f.data); }, fragment)) << fragment;
    EXPECT_TRUE(throws_with([&] { apex::train::train(o, f.data); }, "--resume-with-changes"));
    o.resume_with_changes = true;
    EXPECT_NO_THROW(apex::train::train(o, f.data)) << fragment;
  }
  // The model, level and optimizer cannot change at all.
  Fixture other = f;
  other.o.opt_level = "O2";
  EXPECT_TRUE(resume_fails(other, path("ck"), "was written by another run"));
}

TEST_F(Checkpoints, OutputsFailBeforeTrainingAndWritesFollowLinks) {
  const std::string exe = std::string(APEX_TRAIN_EXE) + " --no-progress --model mlp --steps 4 ";
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--opt-level O1 --metrics " + path("nofolder/m.jsonl"), "--metrics '"},
      {"--compare O0,O1 --plot " + path("nofolder/p.svg"), "--plot '"},
      {"--opt-level O1 --metrics /dev/null", "is a character device"},
      {"--compare O0,O1 --plot /dev/null", "is a character device"},
      {"--opt-level O1 --metrics " + dir_.string(), "is a folder"},
      {"--opt-level O1 --checkpoint /dev/null/x", "--checkpoint /dev/null/x"},
  };
  for (const auto& [args, message] : cases) {
    const auto t0 = std::chrono::steady_clock::now();
    const Proc p = run(exe + args);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    EXPECT_NE(p.status, 0) << args;
    EXPECT_NE(p.out.find(message), std::string::npos) << args << " -> " << p.out;
    EXPECT_EQ(p.out.find("step "), std::string::npos) << "trained before failing: " << p.out;
    EXPECT_LT(seconds, 20.0) << args;
  }
  // Through a symlink: the target is written, the link stays a link.
  spill(path("real.svg"), "old");
  fs::create_symlink(path("real.svg"), path("link.svg"));
  const Proc ok = run(exe + "--compare O0,O1 --plot " + path("link.svg"));
  EXPECT_EQ(ok.status, 0) << ok.out;
  EXPECT_TRUE(fs::is_symlink(path("link.svg")));
  EXPECT_NE(read_text(path("real.svg")).find("<svg"), std::string::npos);
}

// A metrics write that fails (here: the file-size limit, as a full disk would) is an error
// naming the file, not a lost record.
TEST_F(Checkpoints, FailedMetricsWritesAreErrors) {
  const pid_t pid = fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    const rlimit limit{200, 200};
    setrlimit(RLIMIT_FSIZE, &limit);
    const std::string out = path("err.txt");
    (void)freopen(out.c_str(), "w", stderr);
    execl(APEX_TRAIN_EXE, APEX_TRAIN_EXE, "--no-progress", "--model", "mlp", "--steps", "40",
          "--log-every", "1", "--opt-level", "O1", "--metrics", path("m.jsonl").c_str(),
          static_cast<char*>(nullptr));
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 1);
  const std::string err = read_text(path("err.txt"));
  EXPECT_NE(err.find("--metrics " + path("m.jsonl") + ": write failed"), std::string::npos) << err;
}

// A new run into a folder that holds a checkpoint is refused (its first save would replace it
// without a word), before any training, and the checkpoint stays; a resumed run's --stop-after
// must lie after the checkpoint's step.
TEST_F(Checkpoints, ExistingCheckpointNeedsResume) {
  const std::string common = std::string(APEX_TRAIN_EXE) +
                             " --no-progress --model mlp --width 32 --opt-level O1 "
                             "--train-size 128 --checkpoint " +
                             path("ck") + " ";
  const Proc first = run(common + "--steps 5 --stop-after 3");
  ASSERT_EQ(first.status, 0) << first.out;
  const Proc again = run(common + "--steps 5");
  EXPECT_NE(again.status, 0);
  EXPECT_NE(again.out.find("already holds a run's checkpoint"), std::string::npos) << again.out;
  EXPECT_TRUE(std::filesystem::exists(path("ck") + "/step-3/model.pt"));
  const Proc late = run(common + "--steps 5 --resume --stop-after 3");
  EXPECT_NE(late.status, 0);
  EXPECT_NE(late.out.find("--stop-after 3 is not after the resumed checkpoint's step 3"),
            std::string::npos)
      << late.out;
  const Proc resumed = run(common + "--steps 5 --resume");
  EXPECT_EQ(resumed.status, 0) << resumed.out;
  EXPECT_TRUE(std::filesystem::exists(path("ck") + "/step-5/model.pt"));
}

// kill -9 at 20 random moments of a run that checkpoints every step: resuming (or starting
// over where no checkpoint was complete yet) always ends in exactly the uninterrupted run.
TEST_F(Checkpoints, KillNineWhileCheckpointingResumesExactly) {
  const std::string common = std::string(APEX_TRAIN_EXE) +
                             " --no-progress --model mlp --width 64 --steps 12 --opt-level O2 "
                             "--checkpoint-every 1 --log-every 1 --train-size 512 ";
  const Proc straight = run(common + "--checkpoint " + path("straight"));
  ASSERT_EQ(straight.status, 0) << straight.out;
  const auto want = archive_tensors(path("straight") + "/step-12/model.pt");
  std::mt19937 rng(5);
  for (int attempt = 0; attempt < 20; ++attempt) {
    const std::string dir = path("killed" + std::to_string(attempt));
    const pid_t pid = fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      (void)freopen("/dev/null", "w", stdout);
      (void)freopen("/dev/null", "w", stderr);
      execl("/bin/sh", "sh", "-c", ("exec " + common + "--checkpoint " + dir).c_str(),
            static_cast<char*>(nullptr));
      _exit(127);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(300 + rng() % 1500));
    kill(pid, SIGKILL);
    int status = 0;
    waitpid(pid, &status, 0);
    const bool has = fs::exists(dir + "/latest");
    const Proc rest = run(common + "--checkpoint " + dir + (has ? " --resume" : ""));
    if (rest.status != 0 && rest.out.find("nothing left to train") != std::string::npos) {
      // Killed after its last checkpoint: the run was already complete.
    } else {
      ASSERT_EQ(rest.status, 0) << "attempt " << attempt << ": " << rest.out;
    }
    const auto got = archive_tensors(dir + "/step-12/model.pt");
    ASSERT_EQ(got.size(), want.size());
    for (const auto& [k, v] : want) EXPECT_TRUE(at::equal(v, got.at(k))) << attempt << " " << k;
  }
}

}  // namespace
}  // namespace apex::test
