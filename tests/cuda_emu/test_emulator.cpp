// Tests of the CUDA-on-CPU emulation itself: that it computes what a GPU computes for correct
// code, and that it fails loudly on what a GPU would do wrongly (divergent barriers and shuffles,
// deadlocks), under every schedule.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "emu_test_util.h"

namespace {

using cuda_emu_test::ScheduleTest;

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), unsigned grid, unsigned block, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(block);
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

/// Sum of each block's input through a warp butterfly and a shared array: shuffles, one barrier.
__global__ void block_sum_kernel(const float* in, float* out) {
  __shared__ float partial[32];
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  float v = in[blockIdx.x * blockDim.x + threadIdx.x];
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    float s = 0.0f;
    for (unsigned w = 0; w < blockDim.x / 32; ++w) s += partial[w];
    out[blockIdx.x] = s;
  }
}

TEST_P(ScheduleTest, BlockSumMatchesSerialSum) {
  const unsigned grid = 5;
  const unsigned block = 256;
  std::vector<float> in(grid * block);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<float>(i % 17) - 8.0f;
  std::vector<float> out(grid, -1.0f);
  ASSERT_EQ(launch(block_sum_kernel, grid, block, in.data(), out.data()), cudaSuccess)
      << cuda_emu::last_fault();
  for (unsigned b = 0; b < grid; ++b) {
    float expect = 0.0f;
    for (unsigned t = 0; t < block; ++t) expect += in[b * block + t];
    EXPECT_EQ(out[b], expect) << "block " << b;
  }
  EXPECT_EQ(cuda_emu::stats().blocks, grid);
  EXPECT_EQ(cuda_emu::stats().barriers, grid);
  EXPECT_EQ(cuda_emu::stats().shuffles, grid * (block / 32) * 5);
}

/// Every shuffle flavour against its definition, with a width of 8 for the segmented forms.
__global__ void shuffle_kinds_kernel(int* out) {
  const int lane = static_cast<int>(threadIdx.x);
  out[0 * 32 + lane] = __shfl_xor_sync(0xffffffffu, lane, 5);
  out[1 * 32 + lane] = __shfl_sync(0xffffffffu, lane, 3, 8);
  out[2 * 32 + lane] = __shfl_down_sync(0xffffffffu, lane, 2, 8);
  out[3 * 32 + lane] = __shfl_up_sync(0xffffffffu, lane, 3);
  // Segments of 8 lanes: a source in a later segment gives the caller's own value, an earlier
  // one is read.
  out[4 * 32 + lane] = __shfl_xor_sync(0xffffffffu, lane, 8, 8);
}

TEST_P(ScheduleTest, ShuffleKinds) {
  std::vector<int> out(5 * 32, -1);
  ASSERT_EQ(launch(shuffle_kinds_kernel, 1, 32, out.data()), cudaSuccess) << cuda_emu::last_fault();
  for (int lane = 0; lane < 32; ++lane) {
    EXPECT_EQ(out[0 * 32 + lane], lane ^ 5);
    EXPECT_EQ(out[1 * 32 + lane], (lane & ~7) + 3);
    EXPECT_EQ(out[2 * 32 + lane], (lane & 7) + 2 < 8 ? lane + 2 : lane);
    EXPECT_EQ(out[3 * 32 + lane], lane >= 3 ? lane - 3 : lane);
    EXPECT_EQ(out[4 * 32 + lane], (lane & 8) == 0 ? lane : lane - 8);
  }
}

/// Records the order in which threads pass a point: schedules must differ observably.
__global__ void order_kernel(int* order, int* next) {
  order[atomicAdd(next, 1)] = static_cast<int>(threadIdx.x);
  __syncthreads();
  order[atomicAdd(next, 1)] = static_cast<int>(threadIdx.x);
}

TEST(CudaEmu, SchedulesOrderThreadsAsNamed) {
  const auto run = [](const char* name) {
    cuda_emu::Schedule s;
    EXPECT_TRUE(cuda_emu::parse_schedule(name, &s)) << name;
    cuda_emu::set_schedule(s);
    std::vector<int> order(128, -1);
    int next = 0;
    EXPECT_EQ(launch(order_kernel, 1, 64, order.data(), &next), cudaSuccess);
    return order;
  };
  const cuda_emu::Schedule saved = cuda_emu::schedule();
  const std::vector<int> fwd = run("warp-forward");
  const std::vector<int> rev = run("rr-reverse");
  const std::vector<int> rnd1 = run("rr-random:7");
  cuda_emu::set_schedule(saved);
  for (int i = 0; i < 64; ++i) {
    EXPECT_EQ(fwd[i], i);
    EXPECT_EQ(rev[i], 63 - i);
  }
  EXPECT_NE(rnd1, fwd);
  EXPECT_NE(rnd1, rev);
  std::vector<int> sorted(rnd1.begin(), rnd1.begin() + 64);
  std::sort(sorted.begin(), sorted.end());
  for (int i = 0; i < 64; ++i) EXPECT_EQ(sorted[i], i);
}

TEST(CudaEmu, ParseSchedule) {
  cuda_emu::Schedule s;
  EXPECT_TRUE(cuda_emu::parse_schedule("warp-random:42", &s));
  EXPECT_EQ(s.policy, cuda_emu::Policy::kWarpToBarrier);
  EXPECT_EQ(s.order, cuda_emu::Order::kRandom);
  EXPECT_EQ(s.seed, 42u);
  EXPECT_EQ(cuda_emu::to_string(s), "warp-random:42");
  EXPECT_FALSE(cuda_emu::parse_schedule("rr-sideways", &s));
  EXPECT_FALSE(cuda_emu::parse_schedule("rr-random:", &s));
  EXPECT_FALSE(cuda_emu::parse_schedule("fifo-forward", &s));
}

// --- what must fail ---------------------------------------------------------------------------

__global__ void early_exit_barrier_kernel(float* out) {
  if (threadIdx.x == 5) return;
  __syncthreads();
  out[threadIdx.x] = 1.0f;
}

TEST_P(ScheduleTest, BarrierAfterAnExitFails) {
  std::vector<float> out(64);
  EXPECT_EQ(launch(early_exit_barrier_kernel, 1, 64, out.data()), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaErrorLaunchFailure);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);  // cleared
  const std::string fault = cuda_emu::last_fault();
  EXPECT_NE(fault.find("is not reached by every thread"), std::string::npos) << fault;
  EXPECT_NE(fault.find("thread(s) 5 exited"), std::string::npos) << fault;
}

__global__ void two_barriers_kernel(float* out) {
  if (threadIdx.x < 32) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1.0f;
}

TEST_P(ScheduleTest, BarriersAtDifferentSitesFail) {
  std::vector<float> out(64);
  EXPECT_EQ(launch(two_barriers_kernel, 1, 64, out.data()), cudaErrorLaunchFailure);
  const std::string fault = cuda_emu::last_fault();
  EXPECT_NE(fault.find("different __syncthreads"), std::string::npos) << fault;
  EXPECT_NE(fault.find("test_emulator.cpp"), std::string::npos) << fault;
}

__global__ void divergent_shuffle_kernel(float* out) {
  float v = static_cast<float>(threadIdx.x);
  if (threadIdx.x % 32 < 16) v += __shfl_xor_sync(0xffffffffu, v, 1);
  out[threadIdx.x] = v;
}

TEST_P(ScheduleTest, ShuffleNamingAnExitedLaneFails) {
  std::vector<float> out(64);
  EXPECT_EQ(launch(divergent_shuffle_kernel, 1, 64, out.data()), cudaErrorLaunchFailure);
  const std::string fault = cuda_emu::last_fault();
  EXPECT_NE(fault.find("divergent shuffle"), std::string::npos) << fault;
}

__global__ void shuffle_then_barrier_kernel(float* out) {
  float v = 1.0f;
  if (threadIdx.x < 32) {
    v = __shfl_xor_sync(0xffffffffu, v, 1);
  } else if (threadIdx.x != 40) {
    __syncthreads();
  } else {
    v = __shfl_xor_sync(0xffffffffu, v, 1);  // lane 8 of warp 1 waits for lanes at the barrier
  }
  out[threadIdx.x] = v;
}

TEST_P(ScheduleTest, DeadlockIsReported) {
  std::vector<float> out(64);
  EXPECT_EQ(launch(shuffle_then_barrier_kernel, 1, 64, out.data()), cudaErrorLaunchFailure);
  const std::string fault = cuda_emu::last_fault();
  EXPECT_NE(fault.find("deadlock"), std::string::npos) << fault;
}

__global__ void partial_mask_kernel(int* out) {
  // Lanes 0-7 only, with a mask that names exactly them: legal.
  if (threadIdx.x < 8) out[threadIdx.x] = __shfl_xor_sync(0xffu, static_cast<int>(threadIdx.x), 1);
}

TEST_P(ScheduleTest, PartialMaskIsLegal) {
  std::vector<int> out(32, -1);
  ASSERT_EQ(launch(partial_mask_kernel, 1, 32, out.data()), cudaSuccess) << cuda_emu::last_fault();
  for (int lane = 0; lane < 8; ++lane) EXPECT_EQ(out[lane], lane ^ 1);
}

__global__ void mask_without_self_kernel(int* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xfffffffeu, 1, 1);
}

TEST_P(ScheduleTest, MaskWithoutTheCallerFails) {
  std::vector<int> out(32);
  EXPECT_EQ(launch(mask_without_self_kernel, 1, 32, out.data()), cudaErrorLaunchFailure);
  // Depending on the order, the caller is caught, or a lane that reads from it.
  const std::string fault = cuda_emu::last_fault();
  EXPECT_TRUE(fault.find("does not name the calling lane") != std::string::npos ||
              fault.find("which the mask 0xfffffffe does not name") != std::string::npos)
      << fault;
}

__global__ void partial_warp_kernel(float* out) {
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, 1.0f, 1);
}

TEST_P(ScheduleTest, FullMaskInAPartialWarpFails) {
  std::vector<float> out(48);
  EXPECT_EQ(launch(partial_warp_kernel, 1, 48, out.data()), cudaErrorLaunchFailure);
  EXPECT_NE(cuda_emu::last_fault().find("exited"), std::string::npos) << cuda_emu::last_fault();
}

TEST(CudaEmu, LaunchConfigurationIsChecked) {
  std::vector<float> out(2048);
  EXPECT_EQ(launch(partial_warp_kernel, 0, 32, out.data()), cudaErrorInvalidConfiguration);
  EXPECT_EQ(launch(partial_warp_kernel, 1, 2048, out.data()), cudaErrorInvalidConfiguration);
  (void)cudaGetLastError();
}

TEST(CudaEmu, MallocAsyncIsPoisonedAndTracked) {
  const std::size_t before = cuda_emu::live_allocations();
  float* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(reinterpret_cast<void**>(&p), 10 * sizeof(float), nullptr),
            cudaSuccess);
  EXPECT_EQ(cuda_emu::live_allocations(), before + 1);
  for (int i = 0; i < 10; ++i) EXPECT_TRUE(std::isnan(p[i]));
  EXPECT_EQ(cudaFreeAsync(p, nullptr), cudaSuccess);
  EXPECT_EQ(cuda_emu::live_allocations(), before);
  EXPECT_EQ(cudaFreeAsync(p, nullptr), cudaErrorInvalidValue);  // double free
  (void)cudaGetLastError();
}

TEST(CudaEmu, DevicesHaveTheirSmCounts) {
  int count = 0;
  ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
  ASSERT_EQ(count, static_cast<int>(cuda_emu::sm_counts().size()));
  for (int d = 0; d < count; ++d) {
    ASSERT_EQ(cudaSetDevice(d), cudaSuccess);
    int dev = -1;
    int sms = 0;
    ASSERT_EQ(cudaGetDevice(&dev), cudaSuccess);
    ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev), cudaSuccess);
    EXPECT_EQ(sms, cuda_emu::sm_counts()[static_cast<std::size_t>(d)]);
  }
  EXPECT_EQ(cudaSetDevice(count), cudaErrorInvalidDevice);
  (void)cudaGetLastError();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  int blocks = 0;
  ASSERT_EQ(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, block_sum_kernel, 256, 0),
            cudaSuccess);
  EXPECT_EQ(blocks, 8);
}

INSTANTIATE_TEST_SUITE_P(Schedules, ScheduleTest, cuda_emu_test::all_schedules(),
                         cuda_emu_test::schedule_name);

}  // namespace
