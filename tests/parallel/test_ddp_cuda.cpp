// DistributedDataParallel on CUDA tensors through the NCCL backend: a world of one on GPU 0
// trains exactly as the bare module, at fp32 and at amp O2 (fp16). Skipped with a message where
// there is no GPU; scripts/gpu_check.sh runs it.
#include <ATen/CPUGeneratorImpl.h>
#include <apex/amp/initialize.h>
#include <apex/optim/fused_adam.h>
#include <apex/parallel.h>
#include <torch/cuda.h>
#include <torch/nn.h>
#include <torch/optim/sgd.h>

#include "common/test_util.h"

namespace ap = apex::parallel;

namespace {

const c10::Device kGpu(c10::kCUDA, 0);

torch::nn::Sequential mlp() {
  torch::manual_seed(7);
  auto m =
      torch::nn::Sequential(torch::nn::Linear(12, 32), torch::nn::ReLU(), torch::nn::Linear(32, 32),
                            torch::nn::Tanh(), torch::nn::Linear(32, 4));
  m->to(kGpu);
  return m;
}

at::Tensor input(int step) {
  return at::randn({16, 12}, at::detail::createCPUGenerator(100 + step)).to(kGpu);
}

// The largest absolute difference between two modules' parameters.
double max_diff(torch::nn::Module& a, torch::nn::Module& b) {
  const auto pa = a.parameters();
  const auto pb = b.parameters();
  double m = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    m = std::max(m, (pa[i] - pb[i]).abs().max().item<double>());
  }
  return m;
}

ap::ProcessGroup group_on_gpu() {
  return ap::init_process_group(ap::ProcessGroupOptions().rank(0).world_size(1).device(kGpu));
}

TEST(DdpCuda, GroupOfOneReducesCudaAndCpuTensors) {
  APEX_REQUIRE_CUDA();
  ASSERT_TRUE(ap::backend_available(ap::Backend::kNccl))
      << "this build has no NCCL backend (configure found no nccl.h?)";
  auto pg = group_on_gpu();
  EXPECT_EQ(pg.backend(), ap::Backend::kNccl);
  at::Tensor g = at::arange(6, at::TensorOptions().dtype(at::kFloat).device(kGpu));
  pg.all_reduce_(g);
  pg.broadcast_(g, 0);
  EXPECT_TRUE(g.cpu().equal(at::arange(6, at::kFloat)));
  if (ap::backend_available(ap::Backend::kGloo)) {
    at::Tensor c = at::arange(4, at::kDouble);  // CPU bookkeeping goes through Gloo
    pg.all_reduce_(c);
    EXPECT_TRUE(c.equal(at::arange(4, at::kDouble)));
  }
  EXPECT_EQ(pg.all_gather(g).size(), 1u);
  pg.barrier();
  ap::destroy_process_group();
}

TEST(DdpCuda, WorldOfOneEqualsNoDdp) {
  APEX_REQUIRE_CUDA();
  auto pg = group_on_gpu();
  auto a = mlp();
  auto b = mlp();
  ap::DistributedDataParallel<torch::nn::Sequential> ddp(b, ap::DistributedDataParallelOptions(),
                                                         pg);
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.1));
  torch::optim::SGD ob(ddp->parameters(), torch::optim::SGDOptions(0.1));
  for (int s = 0; s < 4; ++s) {
    oa.zero_grad();
    ob.zero_grad();
    a->forward(input(s)).square().mean().backward();
    ddp->forward(input(s)).square().mean().backward();
    oa.step();
    ob.step();
  }
  EXPECT_LE(max_diff(*a, *b), 1e-6);
  EXPECT_GT(max_diff(*a, *mlp()), 1e-4);  // it trained
  ap::destroy_process_group();
}

TEST(DdpCuda, AmpO2WorldOfOneEqualsNoDdp) {
  APEX_REQUIRE_CUDA();
  auto pg = group_on_gpu();
  const auto options =
      apex::amp::Options(apex::amp::OptLevel::O2).half_dtype(at::kHalf).verbosity(0);
  auto a = mlp();
  auto b = mlp();
  torch::optim::SGD oa(a->parameters(), torch::optim::SGDOptions(0.05));
  torch::optim::SGD ob(b->parameters(), torch::optim::SGDOptions(0.05));
  auto amp_a = apex::amp::initialize(a, oa, options);
  auto amp_b = apex::amp::initialize(b, ob, options);
  ap::DistributedDataParallel<torch::nn::Sequential> ddp(b, ap::DistributedDataParallelOptions(),
                                                         pg);
  for (int s = 0; s < 4; ++s) {
    amp_a.zero_grad();
    amp_b.zero_grad();
    amp_a.scale_loss(amp_a.forward(a, input(s)).to(at::kFloat).square().mean()).backward();
    amp_b.scale_loss(amp_b.forward(ddp, input(s)).to(at::kFloat).square().mean()).backward();
    amp_a.step();
    amp_b.step();
  }
  const auto ma = amp_a.master_params();
  const auto mb = amp_b.master_params();
  ASSERT_EQ(ma.size(), mb.size());
  for (size_t i = 0; i < ma.size(); ++i) {
    EXPECT_LE((ma[i] - mb[i]).abs().max().item<double>(), 1e-6) << "master " << i;
  }
  EXPECT_EQ(amp_a.loss_scale(), amp_b.loss_scale());
  ap::destroy_process_group();
}

// SyncBatchNorm on CUDA input (the ATen route; the collectives on the NCCL group), world of one:
// equals ATen's BatchNorm in float64 on the same batch, incl. channels-last and fp16.
TEST(DdpCuda, SyncBatchNormEqualsBatchNorm) {
  APEX_REQUIRE_CUDA();
  auto pg = group_on_gpu();
  for (const bool channels_last : {false, true}) {
    for (const auto dtype : {at::kFloat, at::kHalf}) {
      torch::nn::BatchNormOptions o(6);
      ap::SyncBatchNorm bn(o, pg);
      bn->to(kGpu);
      torch::nn::BatchNorm2d ref(o);
      ref->to(at::kDouble);
      at::Tensor x = (at::randn({5, 6, 7, 9}, at::detail::createCPUGenerator(3)) * 3 + 10);
      const at::Tensor g = at::randn({5, 6, 7, 9}, at::detail::createCPUGenerator(4));
      at::Tensor xd = x.to(kGpu, dtype);
      if (channels_last) xd = xd.contiguous(at::MemoryFormat::ChannelsLast);
      xd.requires_grad_();
      at::Tensor xr = x.to(dtype).to(at::kDouble).requires_grad_();  // the same rounded input
      at::Tensor y = bn->forward(xd);
      (y.to(at::kFloat) * g.to(kGpu)).sum().backward();
      const at::Tensor yr = ref->forward(xr);
      yr.mul(g.to(at::kDouble)).sum().backward();
      const auto tol = apex::test::tolerance_for(dtype);
      EXPECT_EQ(y.scalar_type(), dtype);
      EXPECT_TRUE(apex::test::all_close(y.cpu(), yr.detach(), tol))
          << channels_last << " " << dtype;
      EXPECT_TRUE(apex::test::all_close(xd.grad().cpu(), xr.grad(), tol));
      EXPECT_TRUE(apex::test::all_close(bn->weight.grad().cpu(), ref->weight.grad(), tol));
      EXPECT_TRUE(apex::test::all_close(bn->bias.grad().cpu(), ref->bias.grad(), tol));
      EXPECT_TRUE(apex::test::all_close(bn->running_mean.cpu(), ref->running_mean, tol));
      EXPECT_TRUE(apex::test::all_close(bn->running_var.cpu(), ref->running_var, tol));
    }
  }
  ap::destroy_process_group();
}

}  // namespace

// ZeRO-2 on one GPU (NCCL, a world of one): DistributedFusedAdam steps as FusedAdam does, bit for
// bit (the same CUDA kernel; one rank's gradients are not reordered), fp32 and bf16 with masters.
TEST(DistributedFusedAdamCuda, WorldOfOneEqualsFusedAdam) {
  APEX_REQUIRE_CUDA();
  ASSERT_TRUE(ap::backend_available(ap::Backend::kNccl));
  auto pg = group_on_gpu();
  for (const auto dtype : {at::kFloat, at::kBFloat16}) {
    auto a = mlp();
    auto b = mlp();
    a->to(dtype);
    b->to(dtype);
    apex::optim::FusedAdam ref(
        a->parameters(),
        apex::optim::FusedAdamOptions(1e-2).weight_decay(0.01).master_weights(true));
    ap::DistributedFusedAdam dfa(
        b->parameters(),
        ap::DistributedFusedAdamOptions(1e-2).weight_decay(0.01).bucket_cap_mb(0.001), pg);
    for (int step = 0; step < 4; ++step) {
      ref.zero_grad();
      dfa.zero_grad();
      a->forward(input(step).to(dtype)).to(at::kFloat).pow(2).mean().backward();
      b->forward(input(step).to(dtype)).to(at::kFloat).pow(2).mean().backward();
      ref.step();
      dfa.step();
      EXPECT_EQ(max_diff(*a, *b), 0.0) << "step " << step << ", " << dtype;
    }
  }
  ap::destroy_process_group();
}
