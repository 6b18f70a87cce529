#pragma once

// Multi-process tests: the test binary starts copies of itself as ranks (APEX_TEST_WORKER names
// the worker function), on 127.0.0.1 only, and waits for them with a deadline. A worker that
// cannot start, crashes or outlives the deadline fails the test; nothing is skipped.

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

namespace apex::test {

/// A worker: runs in rank `rank` of `world` (the process group's environment is set), returns
/// the process's exit status (0: passed) and prints what went wrong.
using Worker = std::function<int(int rank, int world, const std::string& arg)>;

/// Registers workers by name (at static initialization).
struct RegisterWorker {
  RegisterWorker(const std::string& name, Worker w);
};

struct RankResult {
  int exit_code = -1;  ///< -1: killed (the deadline) or crashed by a signal
  std::string output;  ///< stdout and stderr
  double seconds = 0;
};

struct LaunchOptions {
  int world = 2;
  std::string arg;
  double deadline_s = 120;
  /// Ranks to start (default all of [0, world)); fewer make a world that never fills.
  std::vector<int> ranks;
  /// Extra environment for every rank.
  std::map<std::string, std::string> env;
};

/// Starts the ranks of `worker` and waits for them (killing all at the deadline).
std::vector<RankResult> launch(const std::string& worker, const LaunchOptions& options);

/// Runs the registered worker named by $APEX_TEST_WORKER; returns -1 when none is set.
int run_worker_from_env();

/// Normal values from a generator of their own (the global one's sequence stays untouched), the
/// same on every rank.
at::Tensor randn_seeded(at::IntArrayRef sizes, uint64_t seed);

/// A worker's "key=value,key=value" argument as a map.
std::map<std::string, std::string> parse_args(const std::string& arg);
/// `args[key]`, or `fallback` when absent.
std::string get(const std::map<std::string, std::string>& args, const std::string& key,
                const std::string& fallback);

/// "rank r (exit e, t s): <output>" for every rank, for failure messages.
std::string describe(const std::vector<RankResult>& results);

}  // namespace apex::test
