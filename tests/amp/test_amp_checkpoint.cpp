#include "amp_test_util.h"

#include <apex/serialize.h>
#include <torch/serialize.h>

#include <unistd.h>

#include <filesystem>

using apex::amp::Options;
using apex::amp::OptLevel;
using namespace apex::test;

namespace {

struct TrainRun {
  Cnn model{nullptr};
  std::unique_ptr<torch::optim::Adam> opt;
  std::optional<apex::amp::Amp> amp;

  TrainRun(const Options& options, uint64_t seed) {
    torch::manual_seed(seed);
    model = Cnn(3);
    // eps 1e-4: O3 keeps Adam's state in fp16, where 1e-8 rounds to zero and training diverges.
    opt = std::make_unique<torch::optim::Adam>(model->parameters(),
                                               torch::optim::AdamOptions(1e-2).eps(1e-4));
    amp.emplace(apex::amp::initialize(model, *opt, options));
  }

  void train(int from, int to, int inject_at = -1) {
    for (int s = from; s < to; ++s) {
      auto b = make_images(16, 2000 + s);
      amp->zero_grad();
      {
        auto scaled = amp->scale_loss(cross_entropy(amp->forward(model, b.x), b.y));
        scaled.backward();
        if (s == inject_at) {
          model->fc->weight.mutable_grad()[0][0] = std::numeric_limits<float>::infinity();
        }
      }
      amp->step();
    }
  }
};

std::vector<at::Tensor> everything(TrainRun& r) {
  auto out = snapshot(r.model->parameters());
  for (auto& b : r.model->buffers()) out.push_back(b.clone());
  for (auto& m : r.amp->master_params()) out.push_back(m.detach().clone());
  return out;
}

}  // namespace

TEST(AmpCheckpoint, ResumeIsBitIdenticalAtEveryLevel) {
  const auto dir = std::filesystem::temp_directory_path() / "apex_amp_ckpt_test";
  std::filesystem::create_directories(dir);
  for (auto level : {OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3}) {
    SCOPED_TRACE(apex::amp::to_string(level));
    // fp16 with a small growth interval so that the scaler state moves during the run.
    const auto options =
        Options(level).half_dtype(at::kHalf).verbosity(0).growth_interval(3).init_loss_scale(4096);
    // Injected overflow only where it is checked (O0/O3 step with whatever the gradients hold).
    const int inject = (level == OptLevel::O1 || level == OptLevel::O2) ? 2 : -1;
    TrainRun full(options, 1);
    full.train(0, 10, inject);

    TrainRun first(options, 1);
    first.train(0, 6, inject);
    torch::save(first.model, (dir / "model.pt").string());
    torch::save(*first.opt, (dir / "opt.pt").string());
    first.amp->save((dir / "amp.pt").string());

    TrainRun resumed(options,
                     99);  // different initial weights: everything must come from the files
    torch::load(resumed.model, (dir / "model.pt").string());
    torch::load(*resumed.opt, (dir / "opt.pt").string());
    resumed.amp->load((dir / "amp.pt").string());
    EXPECT_EQ(resumed.amp->loss_scale(), first.amp->loss_scale());
    EXPECT_EQ(resumed.amp->loss_scaler().unskipped(), first.amp->loss_scaler().unskipped());
    resumed.train(6, 10);

    const auto got = everything(resumed);
    const auto want = everything(full);
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_TRUE(got[i].scalar_type() == want[i].scalar_type() && at::equal(got[i], want[i]))
          << "tensor " << i << " differs";
    }
    EXPECT_EQ(resumed.amp->loss_scale(), full.amp->loss_scale());
  }
  std::filesystem::remove_all(dir);
}

TEST(AmpCheckpoint, StateDictHoldsScalersAndMasters) {
  TrainRun r(Options(OptLevel::O2).verbosity(0).num_losses(2), 3);
  r.train(0, 2);
  auto d = r.amp->state_dict();
  EXPECT_EQ(d.at("opt_level").toStringRef(), "O2");
  EXPECT_TRUE(d.contains("loss_scaler0"));
  EXPECT_TRUE(d.contains("loss_scaler1"));
  auto masters = d.at("master_params").toList();
  ASSERT_EQ(masters.size(), 1u);
  const auto list = masters.get(0).toTensorVector();
  // Only the half parameters have separate masters (conv + fc weights and biases: 6).
  EXPECT_EQ(list.size(), 6u);
  for (const auto& t : list) EXPECT_EQ(t.scalar_type(), at::kFloat);
}

// apex's O2 model state dict is fp32 (its hook): apex::save_module of an O2/O3 model writes the
// half tensors widened, so the file loads into an fp32 model; load_module narrows them back into
// the half model exactly. Without a live handle the model is saved as it is.
TEST(AmpCheckpoint, HalfModelSavesAsFp32AndLoadsBothWays) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("apex_amp_half_model_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string file = (dir / "model.pt").string();
  for (auto level : {OptLevel::O2, OptLevel::O3}) {
    SCOPED_TRACE(apex::amp::to_string(level));
    torch::manual_seed(3);
    apex::test::Mlp model(16, 32, 4);
    torch::optim::SGD opt(model->parameters(), torch::optim::SGDOptions(0.1));
    auto amp =
        apex::amp::initialize(model, opt, Options(level).half_dtype(at::kBFloat16).verbosity(0));
    const auto b = apex::test::blob_batch(0);
    amp.scale_loss(apex::test::cross_entropy(amp.forward(model, b.x), b.y)).backward();
    opt.step();
    amp.sync_model();
    const auto saved = apex::test::snapshot(model->parameters());
    apex::save_module(*model, file);

    apex::test::Mlp plain(16, 32, 4);  // fp32
    apex::load_module(*plain, file);
    for (size_t i = 0; i < saved.size(); ++i) {
      EXPECT_EQ(plain->parameters()[i].scalar_type(), at::kFloat);
      EXPECT_TRUE(at::equal(plain->parameters()[i], saved[i].to(at::kFloat))) << i;
    }
    // Back into the half model (changed meanwhile): bit for bit, dtype kept.
    {
      const at::NoGradGuard g;
      for (auto& p : model->parameters()) p.add_(1.0);
    }
    apex::load_module(*model, file);
    for (size_t i = 0; i < saved.size(); ++i) {
      EXPECT_EQ(model->parameters()[i].scalar_type(), at::kBFloat16);
      EXPECT_TRUE(at::equal(model->parameters()[i], saved[i])) << i;
    }
  }
  // No handle alive: a half model is saved as it is (and an fp32 model refuses it).
  apex::test::Mlp half(16, 32, 4);
  half->to(at::kBFloat16);
  apex::save_module(*half, file);
  apex::test::Mlp plain(16, 32, 4);
  EXPECT_TRUE(apex::test::throws_with([&] { apex::load_module(*plain, file); },
                                      "is BFloat16 in the file, the module's is Float"));
  // The other way: an fp32 file into a bf16 model that no amp handle cast. LibTorch's loader
  // re-pointed the bf16 tensors at the fp32 bytes (garbage, no error); now refused, unchanged.
  apex::save_module(*plain, file);
  const auto before = apex::test::snapshot(half->parameters());
  EXPECT_TRUE(apex::test::throws_with([&] { apex::load_module(*half, file); },
                                      "is Float in the file, the module's is BFloat16"));
  for (size_t i = 0; i < before.size(); ++i) {
    EXPECT_TRUE(at::equal(half->parameters()[i], before[i])) << i;
  }
  std::filesystem::remove_all(dir);
}
