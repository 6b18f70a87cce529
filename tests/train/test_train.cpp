// apex-train: command line, every model family at every level, checkpoint/resume, outputs
// (table, metrics, SVG) and errors, through the library and through the binary.
#include <sys/wait.h>
#include <torch/serialize/input-archive.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>

#include <apex/amp/cpu_half.h>
#include <apex/amp/utils.h>

#include "train/cli.h"
#include "train/data.h"
#include "train/json.h"
#include "train/report.h"
#include "train/trainer.h"
#include "train_test_util.h"

namespace apex::test {
namespace {

namespace fs = std::filesystem;
using apex::train::Cli;
using apex::train::parse_cli;
using apex::train::TrainOptions;

using TrainFiles = TempDirTest;

// ---- command line ------------------------------------------------------------------------------

TEST(TrainCli, DefaultsAndFlags) {
  const Cli d = parse_cli({});
  EXPECT_EQ(d.train.model.family, "transformer");
  // O0, O1, O2; O0 alone, with a note saying why, where this CPU multiplies the half type slowly
  // and apex's fp32 route for it is off (each half type decided on its own).
  for (const auto t : {c10::kBFloat16, c10::kHalf}) {
    const Cli c = t == c10::kBFloat16 ? d : parse_cli({"--half-dtype", "fp16"});
    if (apex::amp::cpu_half_matmul_is_fast(t) || apex::amp::cpu_half_fallback_available(t)) {
      EXPECT_EQ(c.compare, (std::vector<std::string>{"O0", "O1", "O2"})) << t;
      EXPECT_TRUE(c.note.empty()) << t;
    } else {
      EXPECT_EQ(c.compare, (std::vector<std::string>{"O0"})) << t;
      EXPECT_NE(c.note.find("--compare O0,O1,O2 runs them anyway"), std::string::npos) << c.note;
    }
  }
  EXPECT_EQ(d.train.half_dtype, c10::kBFloat16);
  EXPECT_GT(d.train.steps, 0);
  EXPECT_EQ(d.train.warmup, -1);  // a tenth of the run, whatever --steps or --epochs make it
  const Cli c = parse_cli({"--model",      "resnet",
                           "--opt-level",  "O2",
                           "--half-dtype", "fp16",
                           "--loss-scale", "128",
                           "--optimizer",  "fused-lamb",
                           "--batch-size", "16",
                           "--accumulate", "2",
                           "--epochs",     "3",
                           "--lr",         "0.01",
                           "--clip",       "1.5",
                           "--seed",       "7",
                           "--threads",    "1",
                           "--resume",     "--checkpoint",
                           "/tmp/x"});
  EXPECT_TRUE(c.compare.empty());
  EXPECT_EQ(c.train.opt_level, "O2");
  EXPECT_EQ(c.train.half_dtype, c10::kHalf);
  EXPECT_EQ(c.train.loss_scale, "128");
  // One spelling per value: the checkpoint's signature compares it as text.
  for (const char* same : {"8", "8.0", "8e0", "0008", "8.000"}) {
    EXPECT_EQ(parse_cli({"--opt-level", "O1", "--loss-scale", same}).train.loss_scale, "8");
  }
  EXPECT_EQ(parse_cli({"--opt-level", "O1", "--loss-scale", "0.1"}).train.loss_scale, "0.1");
  EXPECT_EQ(parse_cli({"--opt-level", "O1", "--loss-scale", "dynamic"}).train.loss_scale,
            "dynamic");
  EXPECT_EQ(c.train.optimizer, "fused-lamb");
  EXPECT_EQ(c.train.batch_size, 16);
  EXPECT_EQ(c.train.accumulate, 2);
  EXPECT_EQ(c.train.epochs, 3);
  EXPECT_EQ(c.train.steps, 0);
  EXPECT_DOUBLE_EQ(c.train.lr, 0.01);
  EXPECT_DOUBLE_EQ(c.train.clip, 1.5);
  EXPECT_EQ(c.train.seed, 7u);
  EXPECT_TRUE(c.train.resume);
  // The per-level flags never reach the children; the rest do.
  const Cli cmp =
      parse_cli({"--compare", "O0,O3", "--plot", "a.svg", "--metrics", "m", "--steps", "5"});
  EXPECT_EQ(cmp.compare, (std::vector<std::string>{"O0", "O3"}));
  EXPECT_EQ(cmp.child_args, (std::vector<std::string>{"--steps", "5"}));
  const Cli rounds = parse_cli({"--rounds", "3", "--steps", "5"});
  EXPECT_EQ(rounds.rounds, 3);
  EXPECT_EQ(rounds.compare, (std::vector<std::string>{"O0", "O1", "O2"}));
  EXPECT_EQ(rounds.child_args, (std::vector<std::string>{"--steps", "5"}));
  EXPECT_EQ(parse_cli({"--device", "cuda", "--opt-level", "O1"}).train.half_dtype, c10::kHalf);
}

TEST(TrainCli, BadInput) {
  EXPECT_TRUE(throws_with([] { parse_cli({"--bogus", "1"}); }, "unknown option '--bogus'"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--steps"}); }, "--steps needs a value"));
  EXPECT_TRUE(throws_with(
      [] {
        parse_cli({"--steps", "ten"});
      },
      "--steps expects an integer in [1, 1000000000], got 'ten'"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--lr", "-1"}); }, "--lr expects a number"));
  EXPECT_TRUE(throws_with(
      [] {
        parse_cli({"--model", "gpt"});
      },
      "--model must be one of mlp, resnet, transformer, wav2vec2; got 'gpt'"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--compare", "O0,O5"}); }, "got 'O5'"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--compare", "O1,O1"}); }, "lists a level twice"));
  EXPECT_TRUE(throws_with(
      [] {
        parse_cli({"--compare", "O1", "--opt-level", "O2"});
      },
      "either --opt-level or --compare"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--resume"}); }, "--resume needs --checkpoint"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--rounds", "0"}); }, "--rounds expects an integer"));
  EXPECT_TRUE(throws_with(
      [] {
        parse_cli({"--rounds", "2", "--opt-level", "O1"});
      },
      "--rounds repeats a --compare"));
  EXPECT_TRUE(throws_with(
      [] {
        parse_cli({"--rounds", "2", "--checkpoint", "ck"});
      },
      "takes no --checkpoint"));
  // Numbers are plain decimals: strtoll/strtod's leading spaces, '+' and hexadecimal are refused.
  for (const char* v : {"+5", " 5", "5 ", "0x10"}) {
    EXPECT_TRUE(throws_with([&] { parse_cli({"--steps", v}); }, "--steps expects an integer")) << v;
  }
  for (const char* v : {"0x1p-10", " 0.1", "+0.1", "inf", "nan"}) {
    EXPECT_TRUE(throws_with([&] { parse_cli({"--lr", v}); }, "--lr expects a number")) << v;
  }
  EXPECT_TRUE(throws_with([] { parse_cli({"--loss-scale", " 8"}); }, "--loss-scale expects"));
  EXPECT_EQ(parse_cli({"--lr", "1e-3", "--steps", "7"}).train.steps, 7);
  EXPECT_TRUE(throws_with(
      [] {
        parse_cli({"--steps", "3", "--epochs", "1"});
      },
      "either --steps or --epochs"));
  EXPECT_TRUE(throws_with([] { parse_cli({"--loss-scale", "big"}); }, "--loss-scale"));
  EXPECT_TRUE(throws_with([] { parse_cli({"stray"}); }, "unexpected argument 'stray'"));
  // Every numeric flag is bounded: overflow, huge and wrapping values are refused, not clamped.
  const std::vector<std::pair<std::vector<std::string>, std::string>> bounds = {
      {{"--steps", "99999999999999999999"}, "--steps expects an integer in [1, 1000000000]"},
      {{"--steps", "9223372036854775807"}, "--steps expects an integer in [1, 1000000000]"},
      {{"--batch-size", "1000000000000"}, "--batch-size expects an integer in [1, 1048576]"},
      {{"--accumulate", "4611686018427387904"}, "--accumulate expects an integer in [1, 1048576]"},
      {{"--batch-size", "4096", "--accumulate", "4096"}, "16777216 samples per step, more than"},
      {{"--width", "1000000000"}, "--width expects an integer in [1, 65536]"},
      {{"--seed", "99999999999999999999"}, "--seed expects an integer in [0, 9223372036854775807]"},
      {{"--epochs", "288230376151711744"}, "--epochs expects an integer in [1, 1000000]"},
      {{"--threads", "4294967297"}, "--threads expects an integer in [1, 1024]"},
      {{"--lr", "1e400"}, "--lr expects a number in [0, "},
      {{"--nproc", "65"}, "--nproc expects an integer in [1, 64]"},
  };
  for (const auto& [args, message] : bounds) {
    EXPECT_TRUE(throws_with([&] { parse_cli(args); }, message)) << args[0] << " " << args[1];
  }
  if (!at::hasCUDA()) {
    EXPECT_TRUE(throws_with(
        [] {
          apex::train::check_device(parse_cli({"--device", "cuda"}).train);
        },
        "CPU-only build"));
  }
}

// ---- every family at every level ---------------------------------------------------------------

TEST(TrainModels, EveryFamilyLearnsAtEveryLevel) {
  for (const std::string& family : apex::train::model_family_names()) {
    const auto data = apex::train::load_data(tiny(family, "O0"));
    for (const std::string level : {"fp32", "O0", "O1", "O2", "O3"}) {
      const auto s = apex::train::train(tiny(family, level), data);
      ASSERT_GE(s.curve.size(), 3u);
      const double first = s.curve.front().loss;
      const double last = s.curve.back().loss;
      EXPECT_TRUE(std::isfinite(last)) << family << " " << level;
      EXPECT_LT(last, first) << family << " " << level << ": loss " << first << " -> " << last;
      EXPECT_EQ(s.steps, 24);
      EXPECT_EQ(s.skipped_steps, 0) << family << " " << level;
      EXPECT_GT(s.test_accuracy, 0.0);
    }
  }
}

TEST(TrainModels, AccumulationClippingAndOtherOptimizers) {
  const auto data = apex::train::load_data(tiny("mlp", "O2"));
  for (const std::string opt :
       {"fused-lamb", "fused-sgd", "fused-novograd", "fused-adagrad", "adam", "sgd"}) {
    auto o = tiny("mlp", "O2");
    o.optimizer = opt;
    o.accumulate = 2;
    o.clip = 1.0;
    // NovoGrad normalizes each layer's gradient: its steps need a larger rate.
    o.lr = 3e-3;
    if (opt == "fused-sgd" || opt == "sgd") o.lr = 0.05;
    if (opt == "fused-adagrad") o.lr = 0.02;
    if (opt == "fused-novograd") o.lr = 0.3;
    const auto s = apex::train::train(o, data);
    EXPECT_LT(s.curve.back().loss, s.curve.front().loss) << opt;
    EXPECT_EQ(s.samples, 24 * 64) << opt;
  }
}

TEST(TrainModels, FamilyAndDataMustMatch) {
  auto o = tiny("resnet", "O1");
  o.data = "tokens";
  const auto data = apex::train::load_data(o);
  EXPECT_TRUE(throws_with([&] { apex::train::train(o, data); },
                          "--model resnet does not take tokens data"));
  auto w = tiny("mlp", "O1");
  w.data = "wav";
  EXPECT_TRUE(throws_with([&] { apex::train::load_data(w); }, "--data wav needs --data-dir"));
}

TEST(TrainModels, DivergenceAtO0StopsWithAMessage) {
  auto o = tiny("mlp", "O0");
  o.lr = 1e12;
  o.optimizer = "sgd";
  const auto data = apex::train::load_data(o);
  EXPECT_TRUE(throws_with([&] { apex::train::train(o, data); }, "training diverged; lower --lr"));
}

// fp16 activations that overflow whatever the scale: every step is skipped, the scale falls to its
// floor, and the run stops rather than "training" forever.
TEST(TrainModels, LossScaleStuckAtItsFloorStopsWithAMessage) {
  auto o = tiny("mlp", "O2");
  o.half_dtype = c10::kHalf;
  o.loss_scale = "dynamic";
  o.log_every = 10;
  auto data = apex::train::load_data(o);
  data.train.inputs = data.train.inputs * 1e6;
  EXPECT_TRUE(
      throws_with([&] { apex::train::train(o, data); }, "the loss scale is stuck at its floor"));
}

// ---- checkpoints ------------------------------------------------------------------------------

// Every tensor of an archive, nested sub-archives (submodules) included, by dotted key.
TEST_F(TrainFiles, ResumeIsBitIdentical) {
  for (const auto& [family, level] : std::vector<std::pair<std::string, std::string>>{
           {"resnet", "O2"}, {"transformer", "O1"}, {"mlp", "O3"}, {"mlp", "fp32"}}) {
    auto straight = tiny(family, level);
    straight.checkpoint = path(family + level + "_a");
    const auto data = apex::train::load_data(straight);
    const auto a = apex::train::train(straight, data);

    auto first = straight;
    first.checkpoint = path(family + level + "_b");
    first.stop_after = 10;
    EXPECT_EQ(apex::train::train(first, data).steps, 10);
    auto second = first;
    second.stop_after = 0;
    second.resume = true;
    const auto b = apex::train::train(second, data);
    EXPECT_EQ(b.steps, 14);
    EXPECT_EQ(read_text(straight.checkpoint + "/latest"), read_text(first.checkpoint + "/latest"));
    const auto ta = archive_tensors(straight.checkpoint + "/step-24/model.pt");
    const auto tb = archive_tensors(first.checkpoint + "/step-24/model.pt");
    ASSERT_EQ(ta.size(), tb.size());
    ASSERT_FALSE(ta.empty());
    for (const auto& [k, v] : ta) {
      EXPECT_TRUE(at::equal(v, tb.at(k))) << family << " " << level << " " << k;
    }
    EXPECT_EQ(a.test_accuracy, b.test_accuracy);
    EXPECT_EQ(a.curve.back().loss, b.curve.back().loss) << family << " " << level;
    // Only the newest checkpoint is kept, and no temporary is left behind.
    for (const auto& e : fs::directory_iterator(first.checkpoint)) {
      const auto name = e.path().filename().string();
      EXPECT_TRUE(name == "latest" || name == "step-24") << name;
    }
  }
}

// A resumed run's metrics file reads as one run: each step once, in order, one summary.
TEST_F(TrainFiles, ResumedMetricsReadAsOneRun) {
  auto o = tiny("mlp", "O2");
  o.checkpoint = path("ck");
  o.metrics = path("m.jsonl");
  o.log_every = 2;
  o.checkpoint_every = 8;
  o.stop_after = 12;  // stopped after step 12; the checkpoint is at 12, steps 2..12 logged
  const auto data = apex::train::load_data(o);
  apex::train::train(o, data);
  o.stop_after = 0;
  o.resume = true;
  apex::train::train(o, data);
  std::ifstream m(o.metrics);
  std::string line;
  std::vector<int64_t> steps;
  int summaries = 0;
  while (std::getline(m, line)) {
    if (line.find("\"summary\": true") != std::string::npos) {
      ++summaries;
    } else {
      steps.push_back(static_cast<int64_t>(apex::train::json::get_number(line, "step")));
    }
  }
  EXPECT_EQ(summaries, 1);
  std::vector<int64_t> expected;
  for (int64_t s = 2; s <= 24; s += 2) expected.push_back(s);
  EXPECT_EQ(steps, expected);
}

TEST_F(TrainFiles, CheckpointErrors) {
  auto o = tiny("mlp", "O1");
  o.steps = 4;
  o.checkpoint = path("ck");
  const auto data = apex::train::load_data(o);
  apex::train::train(o, data);
  auto other = tiny("mlp", "O1");
  other.model.width = 32;
  other.checkpoint = o.checkpoint;
  other.resume = true;
  EXPECT_TRUE(throws_with([&] { apex::train::train(other, data); }, "was written by another run"));
  auto half = o;
  half.half_dtype = c10::kHalf;
  half.resume = true;
  EXPECT_TRUE(throws_with([&] { apex::train::train(half, data); }, "was written by another run"));
  auto done = o;
  done.resume = true;
  EXPECT_TRUE(throws_with([&] { apex::train::train(done, data); }, "nothing left to train"));
  auto empty = o;
  empty.checkpoint = path("nothing");
  empty.resume = true;
  EXPECT_TRUE(throws_with([&] { apex::train::train(empty, data); }, "no checkpoint in"));
  // A checkpoint that cannot be written fails with a message and leaves nothing partial.
  std::ofstream(path("blocker")) << "a file, not a folder";
  auto blocked = o;
  blocked.checkpoint = path("blocker");
  EXPECT_THROW(apex::train::train(blocked, data), c10::Error);
  EXPECT_EQ(read_text(path("blocker")), "a file, not a folder");
}

// ---- real data formats through training
// ----------------------------------------------------------

TEST_F(TrainFiles, TrainsOnAWavFolderItWrites) {
  // Three classes of tones (low, high, rising), 12 clips each, 0.125 s at 16 kHz.
  const double kPi = 3.14159265358979;
  for (int c = 0; c < 3; ++c) {
    const fs::path cls = dir_ / "wavs" / ("class" + std::to_string(c));
    fs::create_directories(cls);
    for (int k = 0; k < 12; ++k) {
      std::vector<float> s(2000);
      double phase = 0.1 * k;
      for (size_t i = 0; i < s.size(); ++i) {
        const double t = static_cast<double>(i) / 16000.0;
        const double f = c == 0 ? 200 + 10 * k : c == 1 ? 2500 + 50 * k : 300 + 20000 * t;
        phase += 2 * kPi * f / 16000.0;
        s[i] = static_cast<float>(0.5 * std::sin(phase));
      }
      apex::train::write_wav((cls / ("clip" + std::to_string(k) + ".wav")).string(), s);
    }
  }
  auto o = tiny("wav2vec2", "O1");
  o.data = "wav";
  o.data_dir = path("wavs");
  o.samples = 2000;
  o.batch_size = 8;
  o.steps = 20;
  const auto data = apex::train::load_data(o);
  EXPECT_EQ(data.train.num_classes, 3);
  const auto s = apex::train::train(o, data);
  EXPECT_LT(s.curve.back().loss, s.curve.front().loss);
}

TEST_F(TrainFiles, TrainsOnMnistAndCifarFiles) {
  auto gen = at::detail::createCPUGenerator(3);
  const auto u8 = at::TensorOptions().dtype(at::kByte);
  const auto labels = [&](int64_t n) { return at::arange(n, at::kLong).remainder(10); };
  // Images whose brightness encodes the label: learnable from a few steps.
  auto images = [&](int64_t n, std::vector<int64_t> shape) {
    shape.insert(shape.begin(), n);
    auto base = (labels(n).to(at::kFloat) * 25).view({n, 1, 1, 1}).flatten(1).view({n, 1});
    auto noise = at::randint(0, 20, shape, gen, at::kFloat).flatten(1);
    return (base + noise).clamp(0, 255).to(at::kByte).view(shape);
  };
  fs::create_directories(path("mnist"));
  fs::create_directories(path("cifar"));
  apex::train::write_mnist(path("mnist"), images(200, {28, 28}), labels(200), images(50, {28, 28}),
                           labels(50));
  apex::train::write_cifar10(path("cifar"), images(200, {3, 32, 32}), labels(200),
                             images(50, {3, 32, 32}), labels(50));
  (void)u8;
  for (const std::string name : {"mnist", "cifar10"}) {
    auto o = tiny("resnet", "O2");
    o.data = name;
    o.data_dir = path(name == "mnist" ? "mnist" : "cifar");
    o.steps = 12;
    const auto data = apex::train::load_data(o);
    EXPECT_EQ(data.train.size(), 200) << name;
    const auto s = apex::train::train(o, data);
    EXPECT_LT(s.curve.back().loss, s.curve.front().loss) << name;
  }
}

// ---- the binary: --compare table, metrics, SVG, errors ----------------------------------------

TEST_F(TrainFiles, CompareTableMetricsAndPlot) {
  const std::string cmd = std::string(APEX_TRAIN_EXE) +
                          " --model mlp --data shapes --image-size 16 --train-size 256 "
                          "--test-size 64 --steps 8 --log-every 2 --compare O0,O1,O2 --metrics " +
                          path("m.jsonl") + " --plot " + path("loss.svg");
  const Proc p = run(cmd);
  ASSERT_EQ(p.status, 0) << p.out;
  for (const char* level : {"O0 ", "O1 ", "O2 "}) {
    EXPECT_NE(p.out.find(std::string("\n") + level), std::string::npos) << level << p.out;
  }
  EXPECT_NE(p.out.find("samples/s"), std::string::npos);
  EXPECT_NE(p.out.find("test acc"), std::string::npos);
  std::ifstream m(path("m.jsonl"));
  std::string line;
  int steps = 0;
  int summaries = 0;
  while (std::getline(m, line)) {
    ASSERT_EQ(line.front(), '{');
    ASSERT_EQ(line.back(), '}');
    if (line.find("\"summary\": true") != std::string::npos) {
      ++summaries;
      EXPECT_GT(apex::train::json::get_number(line, "samples_per_s"), 0);
      EXPECT_GE(apex::train::json::get_number(line, "test_accuracy"), 0);
      EXPECT_GT(apex::train::json::get_number(line, "peak_rss_mb"), 0);
    } else {
      ++steps;
      EXPECT_TRUE(std::isfinite(apex::train::json::get_number(line, "loss")));
    }
  }
  EXPECT_EQ(summaries, 3);
  EXPECT_EQ(steps, 3 * 4);
  // Valid XML with one curve per level (checked by Python's XML parser).
  const Proc xml = run(std::string(APEX_PYTHON) +
                       " -c \"import xml.etree.ElementTree as E; r = E.parse('" + path("loss.svg") +
                       "').getroot(); print(sorted(p.get('data-level') for p in "
                       "r.iter('{http://www.w3.org/2000/svg}polyline')))\"");
  EXPECT_EQ(xml.status, 0) << xml.out;
  EXPECT_NE(xml.out.find("['O0', 'O1', 'O2']"), std::string::npos) << xml.out;
}

// --rounds: a line per round, and the table's speed-up is the median of the rounds' ratios (of two
// rounds, their mean), its samples/s the median of the rounds'.
TEST(TrainBinary, RoundsReportMedians) {
  const Proc p = run(std::string(APEX_TRAIN_EXE) +
                     " --no-progress --model mlp --compare O0,O1 --steps 3 --rounds 2");
  ASSERT_EQ(p.status, 0) << p.out;
  double rate[2][2] = {}, ratio[2] = {};
  for (int r = 0; r < 2; ++r) {
    const std::string head = "round " + std::to_string(r + 1) + "/2: O0 ";
    const size_t at = p.out.find(head);
    ASSERT_NE(at, std::string::npos) << p.out;
    ASSERT_EQ(std::sscanf(p.out.c_str() + at + head.size(), "%lf (1.00x), O1 %lf (%lfx)",
                          &rate[r][0], &rate[r][1], &ratio[r]),
              3)
        << p.out;
  }
  EXPECT_NE(p.out.find("medians over 2 rounds"), std::string::npos) << p.out;
  const size_t row = p.out.find("\nO1 ");
  ASSERT_NE(row, std::string::npos) << p.out;
  double samples = 0, speedup = 0;
  ASSERT_EQ(std::sscanf(p.out.c_str() + row + 4, "%lf %lfx", &samples, &speedup), 2) << p.out;
  EXPECT_NEAR(speedup, (ratio[0] + ratio[1]) / 2, 0.011) << p.out;
  EXPECT_NEAR(samples, (rate[0][1] + rate[1][1]) / 2, 0.11) << p.out;
}

// The header says when amp computes half matmuls through fp32 (APEX_CPU_HALF_FALLBACK=1 forces
// the route on any CPU, =0 turns it off), and the levels still train.
TEST(TrainBinary, SaysWhenHalfMatmulsGoThroughFp32) {
  for (const std::string v : {"0", "1"}) {
    const Proc p = run("APEX_CPU_HALF_FALLBACK=" + v + " " + std::string(APEX_TRAIN_EXE) +
                       " --no-progress --model mlp --compare O0,O1 --steps 3");
    ASSERT_EQ(p.status, 0) << p.out;
    EXPECT_EQ(p.out.find("half matmuls through fp32") != std::string::npos, v == "1") << p.out;
    EXPECT_NE(p.out.find("O1 "), std::string::npos) << p.out;
  }
}

TEST_F(TrainFiles, BinaryErrorsAreOneLineAndNonZero) {
  fs::create_directories(dir_ / "badwav" / "a");
  fs::create_directories(dir_ / "badwav" / "b");
  std::vector<float> tone(1600, 0.1f);
  apex::train::write_wav(path("badwav/a/x.wav"), tone, 16000);
  apex::train::write_wav(path("badwav/b/y.wav"), tone, 44100);
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--bogus 1", "unknown option '--bogus'"},
      {"--model mlp --opt-level O7", "--opt-level must be one of"},
      {"--model wav2vec2 --data wav --data-dir " + path("missing") + " --opt-level O1", "missing"},
      {"--model wav2vec2 --data wav --data-dir " + path("badwav") + " --opt-level O1",
       "sample rate 44100 Hz, expected 16000"},
      {"--model mlp --opt-level O1 --resume --checkpoint " + path("none"), "no checkpoint in"},
      {"--width 65536 --depth 100 --opt-level O1", "would have at least 5.15396e+12 parameters"},
      {"--model resnet --train-size 67108864 --image-size 4096 --opt-level O1",
       "the built-in shapes data"},
  };
  for (const auto& [args, message] : cases) {
    const Proc p = run(std::string(APEX_TRAIN_EXE) + " --no-progress " + args);
    EXPECT_NE(p.status, 0) << args;
    EXPECT_NE(p.out.find(message), std::string::npos) << args << " -> " << p.out;
    EXPECT_EQ(std::count(p.out.begin(), p.out.end(), '\n'), 1) << args << " -> " << p.out;
    EXPECT_EQ(p.out.find("Exception raised from"), std::string::npos) << p.out;
  }
  const Proc help = run(std::string(APEX_TRAIN_EXE) + " --help");
  EXPECT_EQ(help.status, 0);
  EXPECT_NE(help.out.find("--compare"), std::string::npos);
}

// Data-parallel apex-train: the same run started by torchrun (its agent's store, --no-python)
// and by --nproc gives the same records bit for bit. torchrun's store listens on every address,
// so that run happens in a network namespace of its own (loopback only; needs root, as CI has).
std::string step_lines(const std::string& metrics) {
  std::ifstream in(metrics);
  std::string kept, line;
  while (std::getline(in, line)) {
    if (line.find("\"summary\": true") == std::string::npos) kept += line + "\n";
  }
  return kept;
}

TEST_F(TrainFiles, TorchrunAndNprocTrainAlike) {
  const std::string torchrun = fs::path(APEX_PYTHON).parent_path() / "torchrun";
  ASSERT_TRUE(fs::exists(torchrun)) << torchrun;
  const std::string common =
      " --no-progress --model resnet --sync-bn --opt-level O2 --steps 6 "
      "--log-every 2 --batch-size 8 --train-size 256 --test-size 64 "
      "--threads 1 --metrics ";
  const Proc a = run(std::string(APEX_TRAIN_EXE) + " --nproc 2" + common + path("nproc.jsonl"));
  ASSERT_EQ(a.status, 0) << a.out;
  const Proc b = run("unshare -n sh -c 'ip link set lo up && OMP_NUM_THREADS=1 " + torchrun +
                     " --standalone --nproc-per-node 2 --no-python " + APEX_TRAIN_EXE + " --ddp" +
                     common + path("torchrun.jsonl") + "'");
  ASSERT_EQ(b.status, 0) << b.out;
  const std::string la = step_lines(path("nproc.jsonl")), lb = step_lines(path("torchrun.jsonl"));
  EXPECT_FALSE(la.empty());
  EXPECT_EQ(la.substr(0, la.find("samples_per_s")), lb.substr(0, lb.find("samples_per_s")));
  // Every record's loss, step and scale agree (samples/s and times differ).
  std::istringstream ia(la), ib(lb);
  for (std::string x, y; std::getline(ia, x) && std::getline(ib, y);) {
    EXPECT_EQ(apex::train::json::get_number(x, "loss"), apex::train::json::get_number(y, "loss"));
    EXPECT_EQ(apex::train::json::get_number(x, "step"), apex::train::json::get_number(y, "step"));
  }
  const std::string sa = read_text(path("nproc.jsonl"));
  EXPECT_NE(sa.find("\"world_size\": 2"), std::string::npos) << sa;
}

// --bucket-cap-mb reaches DDP (tiny buckets: one per parameter, all-reduced while backward runs)
// and changes no result: two ranks' sums are exact in any bucket layout.
TEST_F(TrainFiles, SmallBucketsTrainAlike) {
  const std::string common = std::string(APEX_TRAIN_EXE) +
                             " --no-progress --model mlp --opt-level O2 --nproc 2 --steps 6 "
                             "--log-every 2 --batch-size 8 --train-size 256 --test-size 64 "
                             "--threads 1 --metrics ";
  const Proc a = run(common + path("default.jsonl"));
  ASSERT_EQ(a.status, 0) << a.out;
  const Proc b = run(common + path("small.jsonl") + " --bucket-cap-mb 0.0001");
  ASSERT_EQ(b.status, 0) << b.out;
  std::istringstream ia(step_lines(path("default.jsonl"))), ib(step_lines(path("small.jsonl")));
  int records = 0;
  for (std::string x, y; std::getline(ia, x) && std::getline(ib, y); ++records) {
    EXPECT_EQ(apex::train::json::get_number(x, "loss"), apex::train::json::get_number(y, "loss"));
  }
  EXPECT_EQ(records, 3);
  // The mlp's 6 parameters: one bucket by default; with 100-byte buckets each parameter closes
  // one, but a small bias shares the next one's.
  EXPECT_EQ(apex::train::summary_from_json(read_text(path("default.jsonl"))).ddp_buckets, 1);
  EXPECT_GE(apex::train::summary_from_json(read_text(path("small.jsonl"))).ddp_buckets, 4);
}

// A data-parallel run's checkpoint (written by rank 0) resumes in one process, and a run of one
// resumes in two: checkpoints hold the bare model, whatever the world size.
TEST_F(TrainFiles, CheckpointsResumeOnAnotherWorldSize) {
  const std::string common = std::string(APEX_TRAIN_EXE) +
                             " --no-progress --model mlp --opt-level O2 --steps 8 --batch-size 8 "
                             "--train-size 128 --test-size 32 --threads 1 --checkpoint-every 2 ";
  const Proc a = run(common + "--nproc 2 --stop-after 4 --checkpoint " + path("two"));
  ASSERT_EQ(a.status, 0) << a.out;
  EXPECT_EQ(read_text(path("two") + "/latest"), "step-4\n");
  // Another world size changes the global batch: refused, then resumed deliberately.
  const Proc refused = run(common + "--resume --checkpoint " + path("two"));
  EXPECT_NE(refused.status, 0);
  EXPECT_NE(refused.out.find("world_size 2 -> 1"), std::string::npos) << refused.out;
  const Proc b = run(common + "--resume --resume-with-changes --checkpoint " + path("two"));
  ASSERT_EQ(b.status, 0) << b.out;
  EXPECT_EQ(read_text(path("two") + "/latest"), "step-8\n");
  EXPECT_EQ(b.out.find("execution settings"), std::string::npos) << b.out;
  const Proc c = run(common + "--stop-after 4 --checkpoint " + path("one"));
  ASSERT_EQ(c.status, 0) << c.out;
  // Another thread count changes no setting, but the resume says it is not bit-identical.
  const Proc d = run(common + "--nproc 2 --resume --resume-with-changes --threads 2 --checkpoint " +
                     path("one"));
  ASSERT_EQ(d.status, 0) << d.out;
  EXPECT_EQ(read_text(path("one") + "/latest"), "step-8\n");
  EXPECT_NE(d.out.find("other execution settings (threads 1 -> 2)"), std::string::npos) << d.out;
}

// --zero (ZeRO-2: DistributedFusedAdam) trains as DDP + FusedAdam does, its sharded checkpoint
// resumes at another world size, and what it does not run is refused before training.
TEST_F(TrainFiles, ZeroTrainsAsDdpAndResumesOnAnotherWorldSize) {
  const std::string common = std::string(APEX_TRAIN_EXE) +
                             " --no-progress --model mlp --nproc 2 --steps 6 --log-every 2 "
                             "--batch-size 8 --train-size 192 --test-size 32 --threads 1 ";
  const Proc a = run(common + "--opt-level fp32 --metrics " + path("ddp.jsonl"));
  ASSERT_EQ(a.status, 0) << a.out;
  const Proc b =
      run(common + "--opt-level fp32 --zero --bucket-cap-mb 0.01 --metrics " + path("zero.jsonl"));
  ASSERT_EQ(b.status, 0) << b.out;
  EXPECT_NE(b.out.find("of Adam state and"), std::string::npos) << b.out;
  std::istringstream ia(step_lines(path("ddp.jsonl"))), ib(step_lines(path("zero.jsonl")));
  int records = 0;
  for (std::string x, y; std::getline(ia, x) && std::getline(ib, y); ++records) {
    const double lx = apex::train::json::get_number(x, "loss");
    const double ly = apex::train::json::get_number(y, "loss");
    EXPECT_NEAR(lx, ly, 1e-5 * std::abs(lx)) << x << "\n" << y;
  }
  EXPECT_EQ(records, 3);
  EXPECT_GT(apex::train::summary_from_json(read_text(path("zero.jsonl"))).optimizer_state_mb, 0);
  // amp's levels: amp casts the model and runs the forward, the shards keep the fp32 masters, a
  // GradScaler scales fp16 losses (and is checkpointed beside the shards).
  const Proc o1 = run(common + "--opt-level O1 --zero");
  EXPECT_EQ(o1.status, 0) << o1.out;
  const Proc o2 = run(common +
                      "--opt-level O2 --half-dtype fp16 --zero --checkpoint-every 2 "
                      "--stop-after 4 --checkpoint " +
                      path("o2"));
  ASSERT_EQ(o2.status, 0) << o2.out;
  EXPECT_TRUE(fs::exists(path("o2") + "/step-4/scaler.pt"));
  const Proc o2r =
      run(common + "--opt-level O2 --half-dtype fp16 --zero --resume --checkpoint " + path("o2"));
  ASSERT_EQ(o2r.status, 0) << o2r.out;
  EXPECT_EQ(read_text(path("o2") + "/latest"), "step-6\n");
  const Proc scale = run(common + "--opt-level O2 --zero --loss-scale 128");
  EXPECT_NE(scale.status, 0);
  EXPECT_NE(scale.out.find("--loss-scale does not apply to --zero"), std::string::npos)
      << scale.out;
  // Saved by two ranks, resumed by three, deliberately (the global batch changes).
  const std::string ck =
      common + "--opt-level fp32 --zero --checkpoint-every 2 --checkpoint " + path("ck") + " ";
  const Proc s = run(ck + "--stop-after 4");
  ASSERT_EQ(s.status, 0) << s.out;
  EXPECT_TRUE(fs::exists(path("ck") + "/step-4/zero/shard-1-of-2.pt"));
  const std::string three = std::string(APEX_TRAIN_EXE) +
                            " --no-progress --model mlp --nproc 3 --steps 6 --log-every 2 "
                            "--batch-size 8 --train-size 192 --test-size 32 --threads 1 "
                            "--opt-level fp32 --checkpoint " +
                            path("ck") + " --resume --resume-with-changes";
  const Proc without = run(three);
  EXPECT_NE(without.status, 0);
  EXPECT_NE(without.out.find("resume with --zero"), std::string::npos) << without.out;
  const Proc r = run(three + " --zero");
  ASSERT_EQ(r.status, 0) << r.out;
  EXPECT_EQ(read_text(path("ck") + "/latest"), "step-6\n");
  EXPECT_TRUE(fs::exists(path("ck") + "/step-6/zero/shard-2-of-3.pt"));
}

// The data-parallel shards: disjoint across ranks, every sample once per epoch, reshuffled per
// epoch from the seed alone.
TEST(TrainData, DistributedShardsCoverEachEpochOnce) {
  const int64_t n = 96, batch = 4, world = 3;
  apex::train::EpochSampler a(n, 5), b(n, 5);
  std::vector<int> seen(n, 0);
  for (int64_t m = 0; m < n / (batch * world); ++m) {
    for (int64_t r = 0; r < world; ++r) {
      const at::Tensor idx = a.shard(m, batch, world, r);
      ASSERT_EQ(idx.numel(), batch);
      for (int64_t i = 0; i < batch; ++i) ++seen[idx[i].item<int64_t>()];
      EXPECT_TRUE(idx.equal(b.shard(m, batch, world, r)));  // the same seed, the same shards
    }
  }
  for (int64_t i = 0; i < n; ++i) EXPECT_EQ(seen[i], 1) << "sample " << i;
  // The next epoch is another permutation.
  const at::Tensor e0 = a.indices(0, n), e1 = a.indices(n, n);
  EXPECT_FALSE(e0.equal(e1));
  EXPECT_TRUE(std::get<0>(e1.sort()).equal(at::arange(n, at::kLong)));
}

TEST_F(TrainFiles, DistributedFlagErrors) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--model resnet --sync-bn --opt-level O0", "--sync-bn needs --ddp"},
      {"--model mlp --ddp --nproc 2 --opt-level O0", "give either --ddp"},
      {"--model mlp --nproc 0 --opt-level O0", "--nproc expects an integer in [1, 64]"},
      {"--model mlp --nproc 65 --opt-level O0", "--nproc expects an integer in [1, 64]"},
      {"--model mlp --bucket-cap-mb 1 --opt-level O0", "--bucket-cap-mb needs --ddp"},
      {"--model mlp --nproc 2 --bucket-cap-mb 0 --opt-level O0",
       "--bucket-cap-mb expects a number in [1e-06, 1e+06], got '0'"},
      {"--model mlp --nproc 2 --bucket-cap-mb nan --opt-level O0",
       "--bucket-cap-mb expects a number"},
      {"--model mlp --nproc 2 --zero-message-cap-mb 0.25 --opt-level O0",
       "--zero-message-cap-mb needs --zero"},
      {"--model mlp --nproc 2 --zero --zero-message-cap-mb -1 --opt-level O0",
       "--zero-message-cap-mb expects a number in [0, 1e+06], got '-1'"},
  };
  for (const auto& [args, message] : cases) {
    const Proc p = run(std::string(APEX_TRAIN_EXE) + " --no-progress " + args);
    EXPECT_NE(p.status, 0) << args;
    EXPECT_NE(p.out.find(message), std::string::npos) << args << " -> " << p.out;
  }
}

}  // namespace
}  // namespace apex::test
