#include "launcher.h"

#include <apex/parallel/process_group.h>

#include <apex/parallel/sync_batch_norm.h>

#include <fcntl.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

extern char** environ;

namespace apex::test {
namespace {

std::map<std::string, Worker>& registry() {
  static std::map<std::string, Worker> r;
  return r;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

}  // namespace

RegisterWorker::RegisterWorker(const std::string& name, Worker w) {
  registry()[name] = std::move(w);
}

std::vector<RankResult> launch(const std::string& worker, const LaunchOptions& o) {
  const int port = apex::parallel::free_loopback_port("apex::test::launch");
  std::vector<int> ranks = o.ranks;
  if (ranks.empty()) {
    for (int r = 0; r < o.world; ++r) ranks.push_back(r);
  }
  char dir_template[] = "/tmp/apex-parallel-XXXXXX";
  const std::string dir = ::mkdtemp(dir_template);
  std::vector<pid_t> pids;
  std::vector<RankResult> results(ranks.size());
  const auto t0 = std::chrono::steady_clock::now();
  for (size_t i = 0; i < ranks.size(); ++i) {
    std::map<std::string, std::string> env;
    for (char** e = environ; *e != nullptr; ++e) {
      const std::string kv(*e);
      const auto eq = kv.find('=');
      if (eq != std::string::npos) env[kv.substr(0, eq)] = kv.substr(eq + 1);
    }
    env["APEX_TEST_WORKER"] = worker;
    env["APEX_TEST_ARG"] = o.arg;
    env["RANK"] = std::to_string(ranks[i]);
    env["LOCAL_RANK"] = std::to_string(ranks[i]);
    env["WORLD_SIZE"] = std::to_string(o.world);
    env["MASTER_ADDR"] = "127.0.0.1";
    env["MASTER_PORT"] = std::to_string(port);
    env["OMP_NUM_THREADS"] = "1";
    env.erase("TORCHELASTIC_USE_AGENT_STORE");
    env.erase("GLOO_SOCKET_IFNAME");  // would bind that interface instead of 127.0.0.1
    for (const auto& [k, v] : o.env) env[k] = v;
    std::vector<std::string> kv;
    for (const auto& [k, v] : env) kv.push_back(k + "=" + v);
    const std::string out = dir + "/rank" + std::to_string(i) + ".log";
    const pid_t pid = ::fork();
    if (pid == 0) {
      const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(fd, 1);
      ::dup2(fd, 2);
      std::vector<char*> envp;
      for (auto& s : kv) envp.push_back(s.data());
      envp.push_back(nullptr);
      char self[] = "/proc/self/exe";
      char* argv[] = {self, nullptr};
      ::execve("/proc/self/exe", argv, envp.data());
      std::perror("execve");
      ::_exit(127);
    }
    pids.push_back(pid);
  }
  size_t left = pids.size();
  std::vector<bool> done(pids.size(), false);
  while (left > 0) {
    for (size_t i = 0; i < pids.size(); ++i) {
      if (done[i]) continue;
      int status = 0;
      if (::waitpid(pids[i], &status, WNOHANG) == pids[i]) {
        done[i] = true;
        --left;
        results[i].exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
        results[i].seconds =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      }
    }
    const double elapsed =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (left > 0 && elapsed > o.deadline_s) {
      for (size_t i = 0; i < pids.size(); ++i) {
        if (!done[i]) ::kill(pids[i], SIGKILL);
      }
      for (size_t i = 0; i < pids.size(); ++i) {
        if (done[i]) continue;
        ::waitpid(pids[i], nullptr, 0);
        results[i].exit_code = -1;
        results[i].seconds = elapsed;
        results[i].output = "[killed at the " + std::to_string(o.deadline_s) + " s deadline]\n";
      }
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  for (size_t i = 0; i < pids.size(); ++i) {
    results[i].output += read_all(dir + "/rank" + std::to_string(i) + ".log");
  }
  std::error_code ec;
  std::filesystem::remove_all(dir, ec);
  return results;
}

at::Tensor randn_seeded(at::IntArrayRef sizes, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randn(sizes, gen);
}

std::string describe(const std::vector<RankResult>& results) {
  std::ostringstream s;
  for (size_t i = 0; i < results.size(); ++i) {
    s << "--- rank " << i << " (exit " << results[i].exit_code << ", " << results[i].seconds
      << " s):\n"
      << results[i].output << "\n";
  }
  return s.str();
}

int run_worker_from_env() {
  const char* name = std::getenv("APEX_TEST_WORKER");
  if (name == nullptr) return -1;
  const auto it = registry().find(name);
  if (it == registry().end()) {
    std::cerr << "no worker named " << name << "\n";
    return 100;
  }
  const char* arg = std::getenv("APEX_TEST_ARG");
  // The ctest entry SyncBatchNorm.AtenRoute: every worker on the device-generic route.
  if (const char* aten = std::getenv("APEX_TEST_SYNC_BN_ATEN"); aten && *aten == '1') {
    apex::parallel::detail::force_sync_batch_norm_aten(true);
  }
  try {
    return it->second(std::atoi(std::getenv("RANK")), std::atoi(std::getenv("WORLD_SIZE")),
                      arg != nullptr ? arg : "");
  } catch (const c10::Error& e) {
    std::cerr << "uncaught: " << e.what_without_backtrace() << "\n";
    return 101;
  } catch (const std::exception& e) {
    std::cerr << "uncaught: " << e.what() << "\n";
    return 101;
  }
}

std::map<std::string, std::string> parse_args(const std::string& arg) {
  std::map<std::string, std::string> m;
  std::istringstream in(arg);
  for (std::string kv; std::getline(in, kv, ',');) {
    const auto eq = kv.find('=');
    if (eq != std::string::npos) m[kv.substr(0, eq)] = kv.substr(eq + 1);
  }
  return m;
}

std::string get(const std::map<std::string, std::string>& args, const std::string& key,
                const std::string& fallback) {
  const auto it = args.find(key);
  return it == args.end() ? fallback : it->second;
}

}  // namespace apex::test

int main(int argc, char** argv) {
  const int worker = apex::test::run_worker_from_env();
  if (worker >= 0) {
    std::cout.flush();
    std::cerr.flush();
    // Leave without static destructors: c10d's background threads may still be winding down.
    std::_Exit(worker);
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
