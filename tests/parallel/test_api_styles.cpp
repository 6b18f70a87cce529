// The call styles LibTorch users write (a module held by std::shared_ptr or a holder, `ddp(x)`,
// deduced template arguments), and DistributedSampler against Python's DistributedSampler.

#include <apex/amp/initialize.h>
#include <apex/parallel.h>
#include <torch/data.h>
#include <torch/nn/modules/linear.h>
#include <torch/optim/sgd.h>
#include <torch/serialize.h>

#include <array>
#include <cstdio>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <type_traits>

#include "common/test_util.h"

namespace ap = apex::parallel;

namespace {

// pytorch/examples' style: a module class, held by std::shared_ptr, no TORCH_MODULE holder.
struct Net : torch::nn::Module {
  Net()
      : fc1(register_module("fc1", torch::nn::Linear(6, 8))),
        fc2(register_module("fc2", torch::nn::Linear(8, 3))) {}
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(torch::relu(fc1->forward(x))); }
  torch::nn::Linear fc1, fc2;
};

std::string run_python(const std::string& code) {
  const std::string cmd = std::string(APEX_TEST_PYTHON) + " -c '" + code + "' 2>&1";
  FILE* pipe = popen(cmd.c_str(), "r");
  if (pipe == nullptr) return "popen failed";
  std::string out;
  std::array<char, 4096> buf{};
  while (fgets(buf.data(), static_cast<int>(buf.size()), pipe) != nullptr) out += buf.data();
  const int rc = pclose(pipe);
  return rc == 0 ? out : "python failed: " + out;
}

std::string join(const std::vector<size_t>& v) {
  std::ostringstream s;
  for (size_t i = 0; i < v.size(); ++i) s << (i ? "," : "") << v[i];
  return s.str();
}

}  // namespace

TEST(ApiStyles, DdpDeducesAndCallsLikeLibTorchModules) {
  auto pg = ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1));
  torch::manual_seed(1);
  auto net = std::make_shared<Net>();
  torch::optim::SGD optimizer(net->parameters(), torch::optim::SGDOptions(0.1));
  auto amp = apex::amp::initialize(net, optimizer,
                                   apex::amp::Options(apex::amp::OptLevel::O1).verbosity(0));
  // Deduced from a std::shared_ptr to a module class, and from a holder; ddp(x) and ddp->forward.
  ap::DistributedDataParallel ddp(net, ap::DistributedDataParallelOptions(), pg);
  static_assert(std::is_same_v<decltype(ddp), ap::DistributedDataParallel<Net>>);
  torch::nn::Linear holder(6, 3);
  auto ddp2 = ap::make_distributed_data_parallel(holder, ap::DistributedDataParallelOptions(), pg);
  static_assert(std::is_same_v<decltype(ddp2), ap::DistributedDataParallel<torch::nn::Linear>>);
  ap::DistributedDataParallel<Net> ddp3(std::make_shared<Net>(),
                                        ap::DistributedDataParallelOptions(), pg);
  const at::Tensor x = at::randn({4, 6});
  const at::Tensor a = ddp(x);
  const at::Tensor b = ddp->forward(x);
  EXPECT_TRUE(at::equal(a, b));
  EXPECT_TRUE(at::equal(a, net->forward(x)));
  EXPECT_EQ(ddp2(x).sizes(), (std::vector<int64_t>{4, 3}));
  EXPECT_EQ(ddp3(x).sizes(), (std::vector<int64_t>{4, 3}));
  // The three amp lines through DDP, with the user's own step.
  const auto before = apex::test::snapshot(net->parameters());
  optimizer.zero_grad();
  amp.scale_loss(amp.forward(ddp, x).square().mean()).backward();
  optimizer.step();
  EXPECT_FALSE(at::equal(before[0], net->fc1->weight));
  ap::destroy_process_group();
}

TEST(DistributedSampler, ShardsAreDisjointCoverTheEpochAndReshuffle) {
  for (bool drop_last : {false, true}) {
    for (size_t n : {1ul, 10ul, 12ul, 101ul}) {
      for (int64_t world : {1, 3, 4}) {
        std::multiset<size_t> seen;
        size_t per_rank = 0;
        for (int64_t r = 0; r < world; ++r) {
          ap::DistributedSampler s(
              n, ap::DistributedSamplerOptions().num_replicas(world).rank(r).seed(7).drop_last(
                     drop_last));
          const auto e0 = s.indices(0);
          per_rank = e0.size();
          EXPECT_EQ(e0.size(), s.num_samples());
          seen.insert(e0.begin(), e0.end());
          if (n >= 10) {
            EXPECT_NE(e0, s.indices(1)) << "epoch 1 reshuffles";
          }
          EXPECT_EQ(e0, s.indices(0)) << "an epoch's order depends on seed and epoch only";
        }
        const size_t expected = drop_last && n % world != 0 ? n / world : (n + world - 1) / world;
        EXPECT_EQ(per_rank, expected) << n << " samples on " << world << " ranks";
        std::set<size_t> distinct(seen.begin(), seen.end());
        if (drop_last) {
          EXPECT_EQ(seen.size(), distinct.size()) << "no sample twice when dropping the tail";
          EXPECT_EQ(seen.size(), per_rank * world);
        } else {
          EXPECT_EQ(distinct.size(), n) << "every sample once per epoch";
          EXPECT_EQ(seen.size(), per_rank * world);
        }
      }
    }
  }
}

TEST(DistributedSampler, EqualsPythonsDistributedSampler) {
  for (bool shuffle : {true, false}) {
    for (bool drop_last : {false, true}) {
      for (int64_t rank : {0, 2}) {
        ap::DistributedSampler s(23, ap::DistributedSamplerOptions()
                                         .num_replicas(3)
                                         .rank(rank)
                                         .seed(5)
                                         .shuffle(shuffle)
                                         .drop_last(drop_last));
        const std::string py =
            "import torch.utils.data as d; s = d.DistributedSampler(range(23), num_replicas=3, "
            "rank=" +
            std::to_string(rank) + ", shuffle=" + (shuffle ? "True" : "False") +
            ", seed=5, drop_last=" + (drop_last ? "True" : "False") +
            "); s.set_epoch(4); print(\",\".join(map(str, s)))";
        EXPECT_EQ(run_python(py), join(s.indices(4)) + "\n")
            << "shuffle " << shuffle << " drop_last " << drop_last << " rank " << rank;
      }
    }
  }
}

TEST(DistributedSampler, DataLoaderEpochsAndResume) {
  using Data = torch::data::datasets::TensorDataset;
  auto data = Data(at::arange(20).to(at::kFloat))
                  .map(torch::data::transforms::Stack<torch::data::TensorExample>());
  ap::DistributedSampler sampler(20, ap::DistributedSamplerOptions().num_replicas(2).rank(1));
  auto loader = torch::data::make_data_loader(std::move(data), sampler, 4);
  std::vector<std::vector<size_t>> epochs;
  for (int e = 0; e < 2; ++e) {
    std::vector<size_t> got;
    for (auto& batch : *loader) {
      for (int64_t i = 0; i < batch.data.size(0); ++i) {
        got.push_back(static_cast<size_t>(batch.data[i].item<float>()));
      }
    }
    epochs.push_back(got);
  }
  EXPECT_EQ(epochs[0], sampler.indices(0));
  EXPECT_EQ(epochs[1], sampler.indices(1));  // no set_epoch needed for a new order
  EXPECT_NE(epochs[0], epochs[1]);

  // set_epoch names the next epoch; save/load keep the place within one.
  ap::DistributedSampler a(20, ap::DistributedSamplerOptions().num_replicas(2).rank(0));
  a.set_epoch(5);
  a.reset();
  EXPECT_EQ(a.epoch(), 5);
  const auto first = a.next(3);
  torch::serialize::OutputArchive out;
  a.save(out);
  std::ostringstream bytes;
  out.save_to(bytes);
  ap::DistributedSampler b(20, ap::DistributedSamplerOptions().num_replicas(2).rank(0));
  torch::serialize::InputArchive in;
  std::istringstream is(bytes.str());
  in.load_from(is);
  b.load(in);
  EXPECT_EQ(b.epoch(), 5);
  EXPECT_EQ(a.next(4), b.next(4));

  EXPECT_TRUE(apex::test::throws_with(
      [] { ap::DistributedSampler(5, ap::DistributedSamplerOptions().num_replicas(2).rank(2)); },
      "rank must be in [0, 1] for 2 replica(s), got 2"));
  EXPECT_TRUE(apex::test::throws_with(
      [] { ap::DistributedSampler(5, ap::DistributedSamplerOptions().num_replicas(0)); },
      "num_replicas must be >= 1, got 0"));
  EXPECT_TRUE(apex::test::throws_with([&] { a.set_epoch(-1); }, "epoch must be >= 0, got -1"));
}
