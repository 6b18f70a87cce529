// apex-train's distributed faults (docs/reliability.md, "Distributed runs"): ranks started with
// different flags, a store nobody serves or that never answers, the --nproc launcher stopped or
// killed, and two live writers on one checkpoint folder. Real processes over 127.0.0.1; every
// fault must end within its timeout plus a few seconds, in one clear line, never by a signal.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <apex/parallel/process_group.h>
#include "train_test_util.h"

namespace {

namespace fs = std::filesystem;
using apex::test::read_text;
using apex::test::TempDirTest;
using Clock = std::chrono::steady_clock;
using TrainFaults = TempDirTest;

const std::string kSmall =
    " --no-progress --model mlp --width 32 --train-size 256 --test-size 64 --batch-size 8 "
    "--threads 1";

// A process running `command` under sh, its output to `out`.
struct Child {
  pid_t pid = -1;
  std::string out;
  int status = -1;  // exit code; -1: killed by a signal
  double seconds = 0;
  Clock::time_point t0;
};

Child spawn(const std::string& command, const std::string& out) {
  Child c;
  c.out = out;
  c.t0 = Clock::now();
  c.pid = fork();
  if (c.pid == 0) {
    setpgid(0, 0);  // its own group: a test's kill reaches only what it means to
    execl("/bin/sh", "sh", "-c", ("exec " + command + " > " + out + " 2>&1").c_str(), nullptr);
    _exit(127);
  }
  return c;
}

// Waits for `c` at most `limit` seconds (then kills its group); returns false on the limit.
bool wait_for(Child& c, double limit) {
  while (true) {
    int status = 0;
    const pid_t r = waitpid(c.pid, &status, WNOHANG);
    if (r == c.pid) {
      c.seconds = std::chrono::duration<double>(Clock::now() - c.t0).count();
      c.status = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
      return true;
    }
    if (std::chrono::duration<double>(Clock::now() - c.t0).count() > limit) {
      kill(-c.pid, SIGKILL);
      waitpid(c.pid, &status, 0);
      c.status = -2;
      return false;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::string rank_env(int rank, int world, int port) {
  return "env RANK=" + std::to_string(rank) + " WORLD_SIZE=" + std::to_string(world) +
         " MASTER_ADDR=127.0.0.1 MASTER_PORT=" + std::to_string(port) + " ";
}

// Two hand-launched ranks with `flags0` / `flags1`; both must refuse in one line naming `needle`.
void expect_settings_refused(const std::string& dir, const std::string& flags0,
                             const std::string& flags1, const std::string& needle) {
  const int port = apex::parallel::free_loopback_port("test");
  const std::string base = std::string(APEX_TRAIN_EXE) + kSmall + " --ddp --timeout 20 --steps 4 ";
  Child r0 = spawn(rank_env(0, 2, port) + base + flags0, dir + "/r0.log");
  Child r1 = spawn(rank_env(1, 2, port) + base + flags1, dir + "/r1.log");
  ASSERT_TRUE(wait_for(r0, 60));
  ASSERT_TRUE(wait_for(r1, 60));
  for (const Child* c : {&r0, &r1}) {
    const std::string out = read_text(c->out);
    EXPECT_EQ(c->status, 1) << out;
    EXPECT_NE(out.find("the ranks were started with different settings"), std::string::npos) << out;
    EXPECT_NE(out.find(needle), std::string::npos) << out;
    EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
  }
}

TEST_F(TrainFaults, RanksWithDifferentLevelsAreRefusedNotAborted) {
  // Before: Gloo's "Received data size doesn't match" terminated one rank (SIGABRT).
  expect_settings_refused(dir_.string(), "--opt-level O1", "--opt-level O2",
                          "--opt-level is O1 on rank 0 but O2 on rank 1");
}

TEST_F(TrainFaults, RanksWithDifferentTrainingSettingsAreRefused) {
  // Before: trained silently on different settings and exited 0.
  expect_settings_refused(dir_.string(), "--opt-level O2 --lr 0.01 --log-every 2",
                          "--opt-level O2 --lr 0.02 --log-every 3",
                          "--log-every is 2 on rank 0 but 3 on rank 1; --lr is 0.01 on rank 0 "
                          "but 0.02 on rank 1");
  expect_settings_refused(dir_.string(), "--opt-level O2 --seed 1 --accumulate 2",
                          "--opt-level O2 --seed 2 --accumulate 2", "--seed is 1 on rank 0 but 2");
}

// --timeout is the time a rank waits, all of it: nobody serving the store, and a listener that
// accepts and never answers (before: no output at all, still running after 1,500 s).
TEST_F(TrainFaults, UnreachableOrSilentStoreEndsWithinTheTimeout) {
  const double timeout = 3;
  const std::string cmd = std::string(APEX_TRAIN_EXE) + kSmall +
                          " --ddp --opt-level O1 --steps 4 --timeout " + std::to_string(timeout);
  // Nobody listens on the port.
  const int free_port = apex::parallel::free_loopback_port("test");
  Child a = spawn(rank_env(1, 2, free_port) + cmd, path("a.log"));
  // Someone listens, accepts, and never answers.
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 16), 0);
  socklen_t len = sizeof(addr);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  Child b = spawn(rank_env(1, 2, ntohs(addr.sin_port)) + cmd, path("b.log"));
  std::vector<int> accepted;
  std::thread acceptor([&] {
    for (int i = 0; i < 4; ++i) {
      const int c = accept(fd, nullptr, nullptr);
      if (c < 0) break;
      accepted.push_back(c);
    }
  });
  const bool a_ended = wait_for(a, 60), b_ended = wait_for(b, 60);
  shutdown(fd, SHUT_RDWR);
  close(fd);
  acceptor.join();
  for (const int c : accepted) close(c);
  ASSERT_TRUE(a_ended && b_ended);
  for (const Child* c : {&a, &b}) {
    const std::string out = read_text(c->out);
    EXPECT_EQ(c->status, 1) << out;
    EXPECT_LT(c->seconds, timeout + 5) << out;
    EXPECT_NE(out.find("could not reach the store at 127.0.0.1:"), std::string::npos) << out;
    EXPECT_EQ(out.rfind("apex-train: ", 0), 0u) << out;  // every message says whose it is
    EXPECT_NE(out.find("within 3000 ms (waited "), std::string::npos) << out;
    // One line, not c10d's retries with their backtraces.
    EXPECT_LE(std::count(out.begin(), out.end(), '\n'), 2) << out;
    EXPECT_EQ(out.find("frame #"), std::string::npos) << out;
  }
}

std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  std::ifstream in("/proc/" + std::to_string(pid) + "/task/" + std::to_string(pid) + "/children");
  for (pid_t c; in >> c;) out.push_back(c);
  return out;
}

// Alive and not a zombie.
bool running(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string stat;
  if (!std::getline(in, stat)) return false;
  const size_t close = stat.rfind(')');
  return close != std::string::npos && close + 2 < stat.size() && stat[close + 2] != 'Z';
}

bool all_gone_within(const std::vector<pid_t>& pids, double seconds) {
  const auto t0 = Clock::now();
  while (std::chrono::duration<double>(Clock::now() - t0).count() < seconds) {
    bool any = false;
    for (const pid_t p : pids) any = any || running(p);
    if (!any) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// Starts a long --nproc 2 run and returns once both ranks train (checkpoint `latest` written).
Child start_long_nproc(const std::string& dir, std::vector<pid_t>& ranks) {
  Child c = spawn(std::string(APEX_TRAIN_EXE) + kSmall +
                      " --nproc 2 --opt-level O1 --steps 100000 --checkpoint-every 1 "
                      "--checkpoint " +
                      dir + "/ck",
                  dir + "/launcher.log");
  const auto t0 = Clock::now();
  while (!fs::exists(dir + "/ck/latest") &&
         std::chrono::duration<double>(Clock::now() - t0).count() < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ranks = children_of(c.pid);
  return c;
}

TEST_F(TrainFaults, LauncherForwardsSignalsToItsRanks) {
  for (const int sig : {SIGTERM, SIGINT}) {
    std::vector<pid_t> ranks;
    Child c = start_long_nproc(dir_.string(), ranks);
    ASSERT_TRUE(fs::exists(path("ck/latest"))) << read_text(c.out);
    ASSERT_EQ(ranks.size(), 2u) << read_text(c.out);
    kill(c.pid, sig);  // the launcher alone, not its group
    ASSERT_TRUE(wait_for(c, 30)) << read_text(c.out);
    EXPECT_EQ(c.status, 128 + sig) << read_text(c.out);
    EXPECT_NE(read_text(c.out).find("its ranks were stopped too"), std::string::npos);
    EXPECT_TRUE(all_gone_within(ranks, 5)) << "ranks outlived the launcher (signal " << sig << ")";
    fs::remove_all(path("ck"));
  }
}

TEST_F(TrainFaults, RanksDieWithAKilledLauncher) {
  std::vector<pid_t> ranks;
  Child c = start_long_nproc(dir_.string(), ranks);
  ASSERT_EQ(ranks.size(), 2u) << read_text(c.out);
  kill(c.pid, SIGKILL);
  wait_for(c, 10);
  // Before: they trained to the end and wrote checkpoints with no supervisor.
  EXPECT_TRUE(all_gone_within(ranks, 5));
}

// One live writer per checkpoint folder: a second run on it is refused while the first lives,
// and a writer killed by SIGKILL leaves nothing that blocks the resume.
TEST_F(TrainFaults, CheckpointFolderRefusesASecondLiveWriter) {
  const std::string ck = path("ck");
  Child first = spawn(std::string(APEX_TRAIN_EXE) + kSmall +
                          " --opt-level O1 --steps 100000 --checkpoint-every 2 --checkpoint " + ck,
                      path("first.log"));
  const auto t0 = Clock::now();
  while (!fs::exists(ck + "/latest") &&
         std::chrono::duration<double>(Clock::now() - t0).count() < 60) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(fs::exists(ck + "/latest")) << read_text(first.out);
  const std::string resume = std::string(APEX_TRAIN_EXE) + kSmall +
                             " --opt-level O1 --steps 100000 --resume --checkpoint " + ck;
  for (const std::string& how : {std::string(""), std::string(" --nproc 2")}) {
    Child second = spawn(resume + how, path("second.log"));
    ASSERT_TRUE(wait_for(second, 60));
    const std::string out = read_text(second.out);
    EXPECT_EQ(second.status, 1) << how << ": " << out;
    EXPECT_NE(out.find("is in use by another live run (pid " + std::to_string(first.pid) + ")"),
              std::string::npos)
        << how << ": " << out;
  }
  kill(first.pid, SIGKILL);
  wait_for(first, 10);
  // The dead writer's lock is gone with it: the resume passes it and trains on.
  Child third = spawn(std::string(APEX_TRAIN_EXE) + kSmall +
                          " --opt-level O1 --steps 100000 --stop-after 100000 --resume "
                          "--resume-with-changes --checkpoint " +
                          ck,
                      path("third.log"));
  std::this_thread::sleep_for(std::chrono::seconds(3));
  const std::string out = read_text(third.out);
  EXPECT_TRUE(running(third.pid)) << out;
  EXPECT_EQ(out.find("in use"), std::string::npos) << out;
  kill(third.pid, SIGKILL);
  wait_for(third, 10);
}

// Outputs no file can be created in (root's access() says yes to /proc) fail before training,
// not after it; and every message is apex-train's.
TEST_F(TrainFaults, UnwritableOutputsFailBeforeTraining) {
  for (const std::string& flag : {std::string("--metrics"), std::string("--plot")}) {
    const apex::test::Proc p =
        apex::test::run(std::string(APEX_TRAIN_EXE) + kSmall + " --steps 3 --compare O0,O1 " +
                        flag + " /proc/apex-test-output");
    EXPECT_EQ(p.status, 1) << p.out;
    EXPECT_NE(p.out.find("apex-train: " + flag +
                         " '/proc/apex-test-output': cannot create a file "
                         "in '/proc'"),
              std::string::npos)
        << p.out;
    EXPECT_EQ(p.out.find("samples/s"), std::string::npos) << "trained first: " << p.out;
  }
}

}  // namespace
