// apex-train: trains a model with apex-cpp's mixed precision, at one opt level or several side by
// side (--compare), on built-in or real data. See `apex-train --help` and docs/train.md.
#include <apex/amp/cpu_half.h>
#include <apex/io.h>
#include <c10/util/Exception.h>
#include <fcntl.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <thread>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <apex/parallel/process_group.h>
#include "train/cli.h"
#include "train/data.h"
#include "train/json.h"
#include "train/report.h"
#include "train/trainer.h"

namespace {

namespace fs = std::filesystem;
using apex::train::Cli;
using apex::train::Summary;

// In a child between fork and exec: dies with its parent (PR_SET_PDEATHSIG survives exec), so a
// launcher killed even by SIGKILL leaves no rank training and writing on its own.
void die_with_parent(pid_t parent) {
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) _exit(1);  // the parent died before the line above
}

// The signal the launcher got (0: none), forwarded to its ranks as torchrun does.
volatile std::sig_atomic_t stop_signal = 0;
extern "C" void on_stop_signal(int sig) { stop_signal = sig; }

// Runs one level of a comparison in a child process (so each level's peak memory is its own) and
// returns its summary; the child prints its own progress and errors.
Summary run_child(const Cli& cli, const std::string& level, const fs::path& work) {
  std::vector<std::string> args = {"/proc/self/exe"};
  args.insert(args.end(), cli.child_args.begin(), cli.child_args.end());
  const fs::path summary = work / (level + ".summary.json");
  const fs::path metrics = work / (level + ".metrics.jsonl");
  args.insert(args.end(), {"--opt-level", level, "--summary-out", summary.string(), "--metrics",
                           metrics.string()});
  if (!cli.train.checkpoint.empty()) {
    args.insert(args.end(), {"--checkpoint", (fs::path(cli.train.checkpoint) / level).string()});
  }
  if (cli.train.resume && !cli.train.metrics.empty()) {
    // The child resumes its level's curve from the user's metrics file.
    std::ifstream in(cli.train.metrics);
    std::ofstream seed(metrics);
    std::string line;
    while (std::getline(in, line)) {
      if (line.find("\"level\": " + apex::train::json::quote(level)) != std::string::npos) {
        seed << line << "\n";
      }
    }
  }
  std::vector<char*> argv;  // built before fork: the child only execs
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  TORCH_CHECK(pid >= 0, "apex-train: fork failed");
  if (pid == 0) {
    die_with_parent(parent);
    execv(argv[0], argv.data());
    std::perror("apex-train: exec");
    _exit(127);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  TORCH_CHECK(!WIFSIGNALED(status), "apex-train: the ", level, " run was killed by signal ",
              WTERMSIG(status), WTERMSIG(status) == SIGKILL ? " (out of memory?)" : "");
  TORCH_CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "apex-train: the ", level,
              " run failed (see its message above)");
  std::ifstream in(summary);
  std::string line;
  std::getline(in, line);
  Summary s = apex::train::summary_from_json(line);
  // The child's curve comes from its metrics lines.
  std::ifstream m(metrics);
  while (std::getline(m, line)) {
    if (line.find("\"summary\"") != std::string::npos) continue;
    s.curve.push_back(apex::train::json::step_from_json(line));
  }
  return s;
}

// --nproc N: starts N ranks of this program on 127.0.0.1 (each with --ddp and the environment
// torchrun would give it), waits for them, and stops the rest soon after one fails.
int run_ranks(const Cli& cli) {
  std::vector<std::string> args = {"/proc/self/exe"};
  bool threads_given = false;
  for (size_t i = 0; i < cli.args.size(); ++i) {
    if (cli.args[i] == "--nproc") {
      ++i;
      continue;
    }
    threads_given = threads_given || cli.args[i] == "--threads";
    args.push_back(cli.args[i]);
  }
  args.push_back("--ddp");
  if (!threads_given) {
    // The cores shared among the ranks (as torchrun's OMP_NUM_THREADS=1 default, at least one).
    const long cores = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
    args.insert(args.end(), {"--threads", std::to_string(std::max(1L, cores / cli.nproc))});
  }
  const std::string port =
      std::to_string(apex::parallel::free_loopback_port("apex-train: --nproc"));
  std::fflush(stdout);
  std::fflush(stderr);
  std::vector<pid_t> pids;
  // SIGTERM, SIGINT or SIGHUP to the launcher reaches every rank; it then waits for them.
  struct sigaction forward {};
  forward.sa_handler = on_stop_signal;
  sigemptyset(&forward.sa_mask);
  for (const int sig : {SIGTERM, SIGINT, SIGHUP}) sigaction(sig, &forward, nullptr);
  const pid_t parent = getpid();
  for (int64_t r = 0; r < cli.nproc; ++r) {
    std::vector<std::string> env = {"RANK=" + std::to_string(r),
                                    "LOCAL_RANK=" + std::to_string(r),
                                    "WORLD_SIZE=" + std::to_string(cli.nproc),
                                    "LOCAL_WORLD_SIZE=" + std::to_string(cli.nproc),
                                    "MASTER_ADDR=127.0.0.1",
                                    "MASTER_PORT=" + port};
    // Ranks share the cores: libgomp's waiting threads must sleep, not spin, or each rank's
    // threads steal the others' cycles (docs/amp.md, OpenMP threads).
    if (std::getenv("OMP_WAIT_POLICY") == nullptr) env.emplace_back("OMP_WAIT_POLICY=PASSIVE");
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    TORCH_CHECK(pid >= 0, "apex-train: fork failed");
    if (pid == 0) {
      die_with_parent(parent);
      for (const int sig : {SIGTERM, SIGINT, SIGHUP}) std::signal(sig, SIG_DFL);
      for (auto& e : env) putenv(e.data());
      unsetenv("TORCHELASTIC_USE_AGENT_STORE");
      if (r > 0) {  // only rank 0 talks to the terminal, as torchrun's --tee would not
        const int null = ::open("/dev/null", O_WRONLY);
        if (null >= 0) ::dup2(null, 1);
      }
      execv(argv[0], argv.data());
      std::perror("apex-train: exec");
      _exit(127);
    }
    pids.push_back(pid);
  }
  int failed_rank = -1, failed_status = 0;
  size_t left = pids.size();
  std::vector<bool> done(pids.size(), false);
  auto deadline = std::chrono::steady_clock::time_point::max();
  int forwarded = 0;
  while (left > 0) {
    if (stop_signal != 0 && forwarded == 0) {
      forwarded = stop_signal;
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) kill(pids[r], forwarded);
      }
      // Ranks that ignore it are stopped for good a little later.
      deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    }
    int status = 0;
    const pid_t pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (size_t r = 0; r < pids.size(); ++r) {
        if (pids[r] != pid) continue;
        done[r] = true;
        --left;
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && failed_rank < 0) {
          failed_rank = static_cast<int>(r);
          failed_status = status;
          // The others fail on their own when a collective finds the rank gone; give them a
          // moment to say so, then stop them.
          deadline = std::chrono::steady_clock::now() + std::chrono::seconds(15);
        }
      }
      continue;
    }
    if (std::chrono::steady_clock::now() > deadline) {
      // After a rank failed: SIGTERM to the others; after a forwarded signal: SIGKILL.
      for (size_t r = 0; r < pids.size(); ++r) {
        if (!done[r]) kill(pids[r], forwarded != 0 ? SIGKILL : SIGTERM);
      }
      deadline = std::chrono::steady_clock::time_point::max();
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (forwarded != 0) {
    std::fprintf(stderr,
                 "apex-train: --nproc %lld: stopped by signal %d (%s); its ranks were "
                 "stopped too\n",
                 static_cast<long long>(cli.nproc), forwarded, strsignal(forwarded));
    return 128 + forwarded;
  }
  TORCH_CHECK(failed_rank < 0, "apex-train: --nproc ", cli.nproc, ": rank ", failed_rank,
              WIFSIGNALED(failed_status) ? " was killed by signal " : " failed with exit code ",
              WIFSIGNALED(failed_status) ? WTERMSIG(failed_status) : WEXITSTATUS(failed_status),
              " (see its message above)");
  return 0;
}

// --rounds: each level's summary is its last round's with the median samples/s and the highest
// peak memory; its speed-up the median of its per-round ratios to the first level of --compare.
std::vector<Summary> run_rounds(const Cli& cli, const fs::path& work,
                                std::vector<double>& speedups) {
  const size_t n = cli.compare.size();
  std::vector<Summary> last(n);
  const apex::train::Rounds rounds = apex::train::run_in_rounds(
      n, cli.rounds,
      [&](size_t i) {
        const double peak = last[i].peak_rss_mb;
        last[i] = run_child(cli, cli.compare[i], work);
        last[i].peak_rss_mb = std::max(peak, last[i].peak_rss_mb);
        return last[i].samples_per_s;
      },
      [&](int64_t r, const apex::train::Rounds& so_far) {
        std::printf("round %lld/%lld:", static_cast<long long>(r + 1),
                    static_cast<long long>(cli.rounds));
        for (size_t i = 0; i < n; ++i) {
          std::printf("%s %s %.1f (%.2fx)", i == 0 ? "" : ",", cli.compare[i].c_str(),
                      so_far.rate[i].back(), so_far.ratio[i].back());
        }
        std::printf("\n");
      });
  speedups.clear();
  for (size_t i = 0; i < n; ++i) {
    last[i].samples_per_s = rounds.median_rate(i);
    speedups.push_back(rounds.median_ratio(i));
  }
  std::printf("(samples/s and speedup: medians over %lld rounds; peak MiB: the highest)\n",
              static_cast<long long>(cli.rounds));
  return last;
}

int run(const Cli& cli) {
  // Before any data is loaded or rank started: a bad device or output path fails at once.
  apex::train::check_device(cli.train);
  apex::train::check_fits(cli.train);
  if (!cli.plot.empty()) apex::check_writable(cli.plot, "apex-train: --plot");
  if (!cli.summary_out.empty()) apex::check_writable(cli.summary_out, "apex-train: --summary-out");
  apex::train::check_outputs(cli.train);
  // A second live writer on the folder is refused before anything starts: a --compare parent
  // holds it (its levels write into subfolders, each locked by its child); a --nproc launcher
  // only checks (its rank 0 writes, and locks).
  apex::train::CheckpointLock lock;
  if (!cli.train.checkpoint.empty() && (cli.nproc > 0 || !cli.compare.empty())) {
    lock = apex::train::CheckpointLock(cli.train.checkpoint, /*probe=*/cli.compare.empty());
  }
  if (cli.compare.empty() && cli.nproc > 0) return run_ranks(cli);
  if (cli.compare.empty()) {
    const auto data = apex::train::load_data(cli.train);
    const Summary s = apex::train::train(cli.train, data);
    if (s.rank != 0) return 0;  // rank 0 reports for the group
    if (!cli.summary_out.empty()) {
      apex::write_file_atomic(cli.summary_out, apex::train::to_json(s) + "\n");
      return 0;  // a --compare child: the parent prints
    }
    std::printf("%s\n%s", s.model.c_str(), apex::train::compare_table({s}).c_str());
    if (!cli.plot.empty()) apex::train::write_svg(cli.plot, {s});
    return 0;
  }
  // Check the data once before starting the children (a bad folder fails here, once).
  {
    const auto data = apex::train::load_data(cli.train);
    // Where LibTorch's half matmuls are slow, amp computes them through fp32 (cpu_half.h): say so.
    const bool through_fp32 =
        cli.train.device.is_cpu() && apex::amp::cpu_half_fallback_available(cli.train.half_dtype);
    std::printf(
        "apex-train: %s, %lld train / %lld held-out samples, %lld steps of %lld, half %s%s\n",
        cli.train.model.family.c_str(), static_cast<long long>(data.train.size()),
        static_cast<long long>(data.test.size()),
        static_cast<long long>(apex::train::total_steps(cli.train, data.train.size(),
                                                        std::max<int64_t>(1, cli.nproc))),
        static_cast<long long>(cli.train.batch_size * cli.train.accumulate *
                               std::max<int64_t>(1, cli.nproc)),
        cli.train.half_dtype == c10::kBFloat16 ? "bf16" : "fp16",
        through_fp32 ? " (half matmuls through fp32 on this CPU)" : "");
  }
  const fs::path work = fs::temp_directory_path() / ("apex-train-" + std::to_string(getpid()));
  fs::create_directories(work);
  // The children's files go whatever happens below.
  struct RemoveOnExit {
    fs::path path;
    ~RemoveOnExit() {
      std::error_code ec;
      fs::remove_all(path, ec);
    }
  } cleanup{work};
  std::vector<Summary> runs;
  std::vector<double> speedups;
  if (cli.rounds == 1) {
    for (const auto& level : cli.compare) runs.push_back(run_child(cli, level, work));
  } else {
    runs = run_rounds(cli, work, speedups);
  }
  std::printf("\n%s\n%s", runs.front().model.c_str(),
              apex::train::compare_table(runs, speedups).c_str());
  if (!cli.train.metrics.empty()) {
    std::string all;
    for (const auto& level : cli.compare) {
      std::ifstream m(work / (level + ".metrics.jsonl"));
      all.append(std::istreambuf_iterator<char>(m), std::istreambuf_iterator<char>());
    }
    apex::write_file_atomic(cli.train.metrics, all);
  }
  if (!cli.plot.empty()) apex::train::write_svg(cli.plot, runs);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Cli cli = apex::train::parse_cli(std::vector<std::string>(argv + 1, argv + argc));
    if (cli.help) {
      std::printf("%s", apex::train::usage().c_str());
      return 0;
    }
    if (!cli.note.empty()) std::printf("%s\n\n", cli.note.c_str());
    return run(cli);
  } catch (const c10::Error& e) {
    // Every line says whose it is, also the library's and the file helpers' messages.
    const std::string m = e.what_without_backtrace();
    std::fprintf(stderr, "%s%s\n", m.rfind("apex-train", 0) == 0 ? "" : "apex-train: ", m.c_str());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "apex-train: %s\n", e.what());
    return 1;
  }
}
