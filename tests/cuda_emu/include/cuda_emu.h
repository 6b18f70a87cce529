// Control surface of apex-cpp's CUDA-on-CPU emulation (tests only): schedules, the devices'
// SM counts, faults and counters. The emulation itself is cuda_runtime.h beside this file, which
// shadows the toolkit's for the emulated build; runtime.cpp runs the launches.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace cuda_emu {

/// How the threads of a block take turns. Every thread runs until it blocks (a barrier, a
/// shuffle) or exits; the policy decides who runs next.
enum class Policy : int8_t {
  /// The current warp's threads run until all of them wait at a barrier or have exited; then the
  /// next warp runs (a warp runs to its next barrier before any other warp moves).
  kWarpToBarrier = 0,
  /// Every thread runs to its next blocking point in turn, in one queue over the whole block.
  kRoundRobin = 1,
};

/// The order in which threads (and warps) that become ready together are queued.
enum class Order : int8_t { kForward = 0, kReverse = 1, kRandom = 2 };

struct Schedule {
  Policy policy = Policy::kWarpToBarrier;
  Order order = Order::kForward;
  uint64_t seed = 1;  ///< kRandom only
};

/// "warp-forward", "warp-reverse", "warp-random[:seed]", "rr-forward", "rr-reverse",
/// "rr-random[:seed]". Returns false (and leaves *out alone) for anything else.
bool parse_schedule(const std::string& text, Schedule* out);
std::string to_string(const Schedule& s);

/// The schedule of later launches. The default comes from CUDA_EMU_SCHEDULE (else warp-forward).
void set_schedule(const Schedule& s);
Schedule schedule();

/// One entry per emulated device: its multiprocessor count (cudaDevAttrMultiProcessorCount).
/// The default is CUDA_EMU_SM_COUNTS ("132,1,3" when unset): device 0 is H100-sized, devices 1 and
/// 2 are tiny so that launch-size logic takes its small-device branches. Resets the current
/// device to 0.
void set_sm_counts(const std::vector<int>& counts);
std::vector<int> sm_counts();

/// Counters since the last reset_stats(), for tests of the emulation itself.
struct Stats {
  uint64_t launches = 0;
  uint64_t blocks = 0;
  uint64_t threads = 0;
  uint64_t barriers = 0;  ///< completed __syncthreads (per block)
  uint64_t shuffles = 0;  ///< completed warp shuffles (per warp)
  uint64_t switches = 0;  ///< fiber resumptions
  uint64_t faults = 0;
};
Stats stats();
void reset_stats();

/// What the last failed launch reported (empty when none failed yet). A fault fails the launch:
/// cudaLaunchKernelEx returns cudaErrorLaunchFailure and cudaGetErrorString says this text.
std::string last_fault();

/// Allocations made by cudaMalloc/cudaMallocAsync and not yet freed.
std::size_t live_allocations();

/// Byte every cudaMalloc/cudaMallocAsync allocation is filled with (0xFF: floats read as NaN).
inline constexpr unsigned char kPoisonByte = 0xFF;

}  // namespace cuda_emu
