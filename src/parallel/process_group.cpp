#include <apex/parallel/c10d.h>
#include <apex/parallel/process_group.h>
#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <c10/util/Logging.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <torch/version.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <future>
#include <limits>
#include <mutex>
#include <thread>

#include "parallel/backends.h"
#include "parallel/env.h"
#include "parallel/errors.h"
#include "parallel/process_group_state.h"

namespace apex::parallel {
namespace {

using detail::message_of;

using detail::env;
using detail::parse_int;

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

// A TCP socket bound to host:port and listening, for the TCPStore server to take over: c10d's
// own listener binds every address, and a store for processes on this machine must not.
int listen_on(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  const int rc = getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found);
  TORCH_CHECK(rc == 0, "apex::parallel::init_process_group: cannot resolve MASTER_ADDR '", host,
              "': ", gai_strerror(rc));
  std::string why = "no address";
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, 128) == 0) {
      freeaddrinfo(found);
      return fd;
    }
    why = std::strerror(errno);
    ::close(fd);
  }
  freeaddrinfo(found);
  TORCH_CHECK(false, "apex::parallel::init_process_group: rank 0 cannot listen on ", host, ":",
              port, " for the store: ", why,
              " (another job on this port? pick a free MASTER_PORT)");
}

// The addresses this host's name resolves to (what Gloo advertises without GLOO_SOCKET_IFNAME),
// or empty when it does not resolve.
std::vector<std::string> hostname_addresses(std::string& name) {
  char buf[256] = {};
  if (::gethostname(buf, sizeof(buf) - 1) != 0) return {};
  name = buf;
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  if (getaddrinfo(buf, nullptr, &hints, &found) != 0) return {};
  std::vector<std::string> out;
  for (addrinfo* a = found; a != nullptr; a = a->ai_next) {
    char ip[INET6_ADDRSTRLEN] = {};
    const void* src =
        a->ai_family == AF_INET
            ? static_cast<const void*>(&reinterpret_cast<sockaddr_in*>(a->ai_addr)->sin_addr)
            : static_cast<const void*>(&reinterpret_cast<sockaddr_in6*>(a->ai_addr)->sin6_addr);
    if (inet_ntop(a->ai_family, src, ip, sizeof(ip)) != nullptr) out.emplace_back(ip);
  }
  freeaddrinfo(found);
  return out;
}

// A job whose store is not on loopback spans machines (unless torchrun says all ranks are local):
// Gloo, without GLOO_SOCKET_IFNAME, advertises the address this host's name resolves to, and when
// that is loopback the other machines cannot reach this rank (rank 0 then waits for the whole
// timeout). Refused on every rank before anything connects.
void check_gloo_interface(const std::string& addr, int64_t rank, int64_t world, const char* who) {
  if (world == 1 || is_loopback(addr) || env("GLOO_SOCKET_IFNAME")) return;
  const auto local = env("LOCAL_WORLD_SIZE");
  if (local && *local == std::to_string(world)) return;  // torchrun: one machine
  std::string name;
  const auto addrs = hostname_addresses(name);
  if (addrs.empty()) return;  // Gloo's own error names it
  for (const auto& a : addrs) {
    if (!is_loopback(a)) return;
  }
  TORCH_CHECK(false, who, ": rank ", rank, " of ", world, ": MASTER_ADDR is ", addr,
              ", so the ranks may be on several machines, but this host's name '", name,
              "' resolves to ", addrs.front(),
              " (loopback), which Gloo would give the other ranks as this rank's address; set "
              "GLOO_SOCKET_IFNAME to the network interface that reaches ",
              addr, " (`ip route get ", addr,
              "` names it), or GLOO_SOCKET_IFNAME=lo when every rank is on this machine");
}

std::mutex default_mutex;
ProcessGroup default_group;  // guarded by default_mutex

}  // namespace

std::string to_string(Backend b) {
  switch (b) {
    case Backend::kGloo:
      return "gloo";
    case Backend::kNccl:
      return "nccl";
    case Backend::kAuto:
      break;
  }
  return "auto";
}

bool backend_available(Backend backend) {
  switch (backend) {
    case Backend::kAuto:
      return true;
    case Backend::kGloo:
      return detail::have_gloo();
    case Backend::kNccl:
      return detail::have_nccl();
  }
  return false;
}

ProcessGroup::ProcessGroup(std::shared_ptr<detail::ProcessGroupState> state)
    : state_(std::move(state)) {}

namespace {
// Guards the groups' shared state against destroy() on another thread: every operation works on
// a copy taken under it (its own references to the c10d group and store), so a collective in
// flight keeps what it uses alive, and a destroy between the check and the call cannot free it.
std::mutex& state_mutex() {
  static std::mutex m;
  return m;
}

detail::ProcessGroupState checked(const std::shared_ptr<detail::ProcessGroupState>& s,
                                  const char* what) {
  const std::lock_guard<std::mutex> lock(state_mutex());
  TORCH_CHECK(s != nullptr && s->group, "apex::parallel::ProcessGroup::", what,
              ": the group is not initialized (call init_process_group) or was destroyed");
  return *s;
}

// Runs one collective and waits for it, with the rank and the operation in any error.
void run(const detail::ProcessGroupState& s, const char* what,
         const std::function<c10::intrusive_ptr<c10d::Work>()>& start) {
  try {
    start()->wait();
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "apex::parallel: ", what, " failed on rank ", s.rank, " of ", s.size,
                " (timeout ", s.timeout.count(), " ms): ", message_of(e));
  }
}
}  // namespace

int64_t ProcessGroup::rank() const { return checked(state_, "rank").rank; }
int64_t ProcessGroup::size() const { return checked(state_, "size").size; }
Backend ProcessGroup::backend() const { return checked(state_, "backend").backend; }
c10::Device ProcessGroup::device() const { return checked(state_, "device").device; }
std::chrono::milliseconds ProcessGroup::timeout() const {
  return checked(state_, "timeout").timeout;
}
bool ProcessGroup::valid() const {
  const std::lock_guard<std::mutex> lock(state_mutex());
  return state_ != nullptr && state_->group;
}

void ProcessGroup::all_reduce_(at::Tensor& tensor) const {
  const auto& s = checked(state_, "all_reduce_");
  std::vector<at::Tensor> ts{tensor};
  run(s, "all_reduce", [&] { return s.group->allreduce(ts); });
}

void ProcessGroup::all_reduce_max_(at::Tensor& tensor) const {
  const auto& s = checked(state_, "all_reduce_max_");
  std::vector<at::Tensor> ts{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = c10d::ReduceOp::MAX;
  run(s, "all_reduce(max)", [&] { return s.group->allreduce(ts, opts); });
}

void ProcessGroup::broadcast_(at::Tensor& tensor, int64_t root) const {
  const auto& s = checked(state_, "broadcast_");
  TORCH_CHECK(root >= 0 && root < s.size,
              "apex::parallel::ProcessGroup::broadcast_: root must be "
              "in [0, ",
              s.size, "), got ", root);
  std::vector<at::Tensor> ts{tensor};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  run(s, "broadcast", [&] { return s.group->broadcast(ts, opts); });
}

std::vector<at::Tensor> ProcessGroup::all_gather(const at::Tensor& tensor) const {
  const auto& s = checked(state_, "all_gather");
  const at::Tensor in = tensor.contiguous();
  std::vector<std::vector<at::Tensor>> out(1);
  for (int64_t r = 0; r < s.size; ++r) out[0].push_back(at::empty_like(in));
  std::vector<at::Tensor> ins{in};
  run(s, "all_gather", [&] { return s.group->allgather(out, ins); });
  return out[0];
}

std::vector<std::string> ProcessGroup::all_gather_string(const std::string& bytes) const {
  const auto& s = checked(state_, "all_gather_string");
  // CPU tensors where Gloo carries them (an NCCL group has Gloo for the CPU where it is built).
  const c10::Device where =
      s.backend == Backend::kGloo || detail::have_gloo() ? c10::kCPU : s.device;
  const auto on = [&](c10::ScalarType t) { return at::TensorOptions().dtype(t).device(where); };
  // One fixed-size exchange of the lengths, then every rank's bytes padded to the longest.
  std::vector<std::vector<at::Tensor>> lengths(1);
  for (int64_t r = 0; r < s.size; ++r) lengths[0].push_back(at::empty({1}, on(at::kLong)));
  std::vector<at::Tensor> mine{at::full({1}, static_cast<int64_t>(bytes.size()), on(at::kLong))};
  run(s, "all_gather_string (lengths)", [&] { return s.group->allgather(lengths, mine); });
  std::vector<int64_t> n;
  int64_t longest = 1;
  for (const auto& l : lengths[0]) {
    n.push_back(l.cpu().item<int64_t>());
    longest = std::max(longest, n.back());
  }
  at::Tensor padded = at::zeros({longest}, at::kByte);
  std::memcpy(padded.data_ptr(), bytes.data(), bytes.size());
  std::vector<std::vector<at::Tensor>> out(1);
  for (int64_t r = 0; r < s.size; ++r) out[0].push_back(at::empty({longest}, on(at::kByte)));
  std::vector<at::Tensor> in{padded.to(where)};
  run(s, "all_gather_string", [&] { return s.group->allgather(out, in); });
  std::vector<std::string> result;
  for (int64_t r = 0; r < s.size; ++r) {
    const at::Tensor b = out[0][static_cast<size_t>(r)].cpu();
    result.emplace_back(static_cast<const char*>(b.data_ptr()), static_cast<size_t>(n[r]));
  }
  return result;
}

void ProcessGroup::barrier() const {
  const auto& s = checked(state_, "barrier");
  run(s, "barrier", [&] { return s.group->barrier(); });
}

void ProcessGroup::destroy() {
  if (state_ == nullptr) return;
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  c10::intrusive_ptr<c10d::Store> store;
  {
    const std::lock_guard<std::mutex> lock(state_mutex());
    group = std::move(state_->group);  // leaves the state's pointers null
    store = std::move(state_->store);
  }
  // Released outside the lock (a last reference tears Gloo's connections down).
}

c10::intrusive_ptr<c10d::ProcessGroup> c10d_group(const ProcessGroup& group) {
  return checked(group.state(), "c10d_group").group;
}

c10::intrusive_ptr<c10d::Store> c10d_store(const ProcessGroup& group) {
  return checked(group.state(), "c10d_store").store;
}

ProcessGroup process_group_of(c10::intrusive_ptr<c10d::ProcessGroup> group, c10::Device device,
                              std::chrono::milliseconds timeout) {
  TORCH_CHECK(group, "apex::parallel::process_group_of: the c10d group is null");
  const std::string name = group->getBackendName();
  TORCH_CHECK(name == "gloo" || name == "nccl",
              "apex::parallel::process_group_of: the group's backend must be gloo or nccl, got ",
              name);
  TORCH_CHECK(name == "nccl" ? device.is_cuda() : device.is_cpu(),
              "apex::parallel::process_group_of: a ", name, " group takes ",
              name == "nccl" ? "CUDA" : "CPU", " tensors, got device ", device);
  TORCH_CHECK(timeout.count() > 0,
              "apex::parallel::process_group_of: the timeout must be > 0, got ", timeout.count(),
              " ms");
  auto s = std::make_shared<detail::ProcessGroupState>();
  s->rank = group->getRank();
  s->size = group->getSize();
  s->backend = name == "nccl" ? Backend::kNccl : Backend::kGloo;
  s->device = device;
  s->timeout = timeout;
  s->group = std::move(group);
  return ProcessGroup(std::move(s));
}

namespace {

// A Gloo transport thread that finds a peer's data of another size than expected (ranks that
// called different collectives) throws where Gloo has no handler: std::terminate, SIGABRT and a
// core. gloo_transport_guard.cpp catches it where the executable binds Gloo's names to ours (the
// collective's call throws instead); here, what is left (that guard not in effect, Gloo's listener
// or deferred callbacks) becomes one line naming the rank and exit status 1. Every other uncaught
// exception goes to the handler there was before.
std::atomic<int64_t> terminate_rank{-1};
std::atomic<int64_t> terminate_world{0};
std::terminate_handler previous_terminate = nullptr;

[[noreturn]] void on_terminate() {
  const std::string what = message_of(std::current_exception());
  if (what.find("gloo") != std::string::npos || what.find("c10d") != std::string::npos) {
    std::fprintf(stderr,
                 "apex::parallel: rank %lld of %lld: a collective failed on a communication "
                 "thread: %s\n(the ranks called different collectives: different settings, "
                 "models or code paths, or a peer sent bad data); exiting\n",
                 static_cast<long long>(terminate_rank.load()),
                 static_cast<long long>(terminate_world.load()), what.c_str());
    std::fflush(stderr);
    std::_Exit(1);
  }
  if (previous_terminate != nullptr) previous_terminate();
  std::abort();
}

void install_terminate_handler(int64_t rank, int64_t world) {
  terminate_rank = rank;
  terminate_world = world;
  static std::once_flag once;
  std::call_once(once, [] { previous_terminate = std::set_terminate(on_terminate); });
}

// c10d logs every retry of a store connection with a C++ backtrace (~500 lines for one
// unreachable store); the failure reaches the user as one error of ours instead. c10's logs stay
// as they were where the user asked for them (TORCH_CPP_LOG_LEVEL).
class QuietC10Logs {
 public:
  QuietC10Logs() : saved_(FLAGS_caffe2_log_level) {
    if (!env("TORCH_CPP_LOG_LEVEL")) FLAGS_caffe2_log_level = 3;  // fatal only
  }
  // Restored only after a rendezvous that completed: after a deadline the connecting thread
  // still runs (detached) and would log its retries while the error unwinds.
  ~QuietC10Logs() {
    if (!std::uncaught_exceptions()) FLAGS_caffe2_log_level = saved_;
  }
  QuietC10Logs(const QuietC10Logs&) = delete;
  QuietC10Logs& operator=(const QuietC10Logs&) = delete;

 private:
  int saved_;
};

struct Rendezvous {
  const char* who = "";
  std::string addr;
  int port = 0;
  int64_t rank = 0;
  int64_t world = 1;
  bool agent = false;
  Backend backend = Backend::kGloo;
  std::chrono::milliseconds timeout{0};
};

struct Connected {
  c10::intrusive_ptr<c10d::Store> store;  // under the default_pg prefix
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

std::string waited(std::chrono::steady_clock::time_point t0) {
  char buf[48];
  std::snprintf(buf, sizeof(buf), "waited %.1f s", seconds_since(t0));
  return buf;
}

// The two ways a rendezvous fails, with what was tried, how long it waited, a hint and c10d's
// own words (`why`) where there are any: in connect() and at connect_within_deadline()'s deadline.
[[noreturn]] void store_failed(const Rendezvous& rv, std::chrono::steady_clock::time_point t0,
                               const std::string& why) {
  const bool server = !rv.agent && rv.rank == 0;
  TORCH_CHECK(false, rv.who, ": rank ", rv.rank, " of ", rv.world, " could not ",
              server ? "gather every rank at its store on " : "reach the store at ", rv.addr, ":",
              rv.port, " within ", rv.timeout.count(), " ms (", waited(t0), "; ",
              server ? "did all WORLD_SIZE ranks start?"
                     : "is MASTER_ADDR:MASTER_PORT right, and rank 0 up?",
              ")", why.empty() ? "" : ": ", why);
}

[[noreturn]] void group_failed(const Rendezvous& rv, std::chrono::steady_clock::time_point t0,
                               const std::string& why) {
  TORCH_CHECK(false, rv.who, ": rank ", rv.rank, " of ", rv.world,
              " could not connect to the other ranks within ", rv.timeout.count(), " ms (",
              waited(t0), "; did every rank start, each with its own RANK?)",
              why.empty() ? "" : ": ", why);
}

// The store, then the group on it. `stage` says how far it got (0: store, 1: group).
Connected connect(const Rendezvous& rv, int listen_fd, std::atomic<int>& stage,
                  std::chrono::steady_clock::time_point t0) {
  const bool server = !rv.agent && rv.rank == 0;
  c10::intrusive_ptr<c10d::Store> base;
  if (rv.world == 1 && !rv.agent) {
    // A group of one needs no network at all.
    base = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(rv.port);
    so.isServer = server;
    so.numWorkers = rv.agent ? std::nullopt : std::optional<size_t>(rv.world);
    so.waitWorkers = !rv.agent;
    so.timeout = rv.timeout;
    if (listen_fd >= 0) so.masterListenFd = listen_fd;
    try {
      base = c10::make_intrusive<c10d::TCPStore>(rv.addr, so);
    } catch (const std::exception& e) {
      // (The listening socket is the store's now, whether or not it got far enough to close it.)
      store_failed(rv, t0, message_of(e));
    }
  }
  stage = 1;
  Connected c;
  // Python's key layout (default_pg, then the group's name, then the device), so that Python and
  // C++ workers on one store do not collide.
  c.store = c10::make_intrusive<c10d::PrefixStore>("default_pg", base);
  if (rv.world > 1 && !rv.agent) {
    // Two processes given one RANK would wait for each other's peers until the timeout.
    const int64_t joined = c.store->add("apex/rank/" + std::to_string(rv.rank), 1);
    TORCH_CHECK(joined == 1, rv.who, ": rank ", rv.rank, " of ", rv.world,
                " joined the group twice: two processes were given RANK=", rv.rank,
                " (each process needs its own rank in [0, ", rv.world, "))");
  }
  auto group_store = c10::make_intrusive<c10d::PrefixStore>("0/", c.store);
  try {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(group_store, static_cast<int>(rv.rank),
                                                      static_cast<int>(rv.world));
    // CPU tensors go through Gloo in both cases (as Python's "cpu:gloo,cuda:nccl"), so that CPU
    // bookkeeping (losses, flags) can be reduced in an NCCL job too. Loopback jobs keep Gloo's
    // sockets on 127.0.0.1; others let Gloo pick this host's address.
    if (rv.backend == Backend::kGloo || detail::have_gloo()) {
      const std::string host = is_loopback(rv.addr) ? "127.0.0.1" : "";
      auto gloo = detail::make_gloo_backend(
          c10::make_intrusive<c10d::PrefixStore>("cpu/", group_store), static_cast<int>(rv.rank),
          static_cast<int>(rv.world), rv.timeout, host);
      pg->setBackend(c10::kCPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    }
    if (rv.backend == Backend::kNccl) {
      auto nccl = detail::make_nccl_backend(
          c10::make_intrusive<c10d::PrefixStore>("cuda/", group_store), static_cast<int>(rv.rank),
          static_cast<int>(rv.world), rv.timeout);
      pg->setBackend(c10::kCUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    } else {
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    }
    pg->setGroupName("0");
    c.group = pg;
  } catch (const std::exception& e) {
    group_failed(rv, t0, message_of(e));
  }
  return c;
}

// connect() on a thread of its own, given up at the timeout (plus a moment for c10d's own
// timeout to speak first): LibTorch's store client retries a failed connect once more after its
// timeout, and waits without end on a listener that accepts and never answers. A thread given up
// on is left to end by itself; it holds only what it was given.
Connected connect_within_deadline(const Rendezvous& rv) {
  const auto t0 = std::chrono::steady_clock::now();
  const bool server = !rv.agent && rv.rank == 0;
  const int listen_fd = rv.world > 1 && server ? listen_on(rv.addr, rv.port) : -1;
  const QuietC10Logs quiet;
  if (rv.world == 1 && !rv.agent) {  // no network: nothing to wait for
    std::atomic<int> stage{0};
    return connect(rv, listen_fd, stage, t0);
  }
  auto stage = std::make_shared<std::atomic<int>>(0);
  auto task = std::make_shared<std::packaged_task<Connected()>>(
      [rv, listen_fd, stage, t0] { return connect(rv, listen_fd, *stage, t0); });
  std::future<Connected> done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  const auto grace = std::chrono::milliseconds(1500);
  if (done.wait_for(rv.timeout + grace) == std::future_status::ready) return done.get();
  if (*stage == 0) store_failed(rv, t0, "");
  group_failed(rv, t0, "");
}

}  // namespace

ProcessGroup init_process_group(const ProcessGroupOptions& o) {
  const char* who = "apex::parallel::init_process_group";
  using detail::kMaxWorld;
  // -1 means "unset" (the environment, else the default); any other negative value is an error.
  TORCH_CHECK(o.world_size() >= -1, who, ": world_size must be in [1, ", kMaxWorld,
              "] (or -1: $WORLD_SIZE), got ", o.world_size());
  TORCH_CHECK(o.rank() >= -1, who, ": rank must be >= 0 (or -1: $RANK), got ", o.rank());
  TORCH_CHECK(o.master_port() >= -1, who,
              ": master_port must be in [1, 65535] (or -1: $MASTER_PORT), got ", o.master_port());
  const int64_t world = o.world_size() >= 0 ? o.world_size()
                        : env("WORLD_SIZE")
                            ? parse_int(*env("WORLD_SIZE"), who, "WORLD_SIZE", 1, kMaxWorld)
                            : 1;
  const int64_t rank = o.rank() >= 0 ? o.rank()
                       : env("RANK") ? parse_int(*env("RANK"), who, "RANK", 0, kMaxWorld - 1)
                                     : 0;
  TORCH_CHECK(world >= 1 && world <= kMaxWorld, who, ": world_size must be in [1, ", kMaxWorld,
              "], got ", world);
  TORCH_CHECK(rank >= 0 && rank < world, who, ": rank must be in [0, world_size = ", world,
              "), got ", rank);
  TORCH_CHECK(o.timeout().count() > 0, who, ": timeout must be > 0 ms, got ", o.timeout().count());
  const std::string addr =
      !o.master_addr().empty() ? o.master_addr() : env("MASTER_ADDR").value_or("127.0.0.1");
  const int64_t port = o.master_port() >= 0 ? o.master_port()
                       : env("MASTER_PORT")
                           ? parse_int(*env("MASTER_PORT"), who, "MASTER_PORT", 1, 65535)
                           : 29500;
  TORCH_CHECK(port >= 1 && port <= 65535, who, ": master_port must be in [1, 65535], got ", port);
  const bool agent = o.use_agent_store().has_value()
                         ? *o.use_agent_store()
                         : env("TORCHELASTIC_USE_AGENT_STORE").value_or("") == "True";

  Backend backend = o.backend();
  if (backend == Backend::kAuto) backend = o.device().is_cuda() ? Backend::kNccl : Backend::kGloo;
  if (backend == Backend::kNccl) {
    TORCH_CHECK(detail::have_nccl(), who,
                ": the NCCL backend is not available in this build (it needs a CUDA build of "
                "LibTorch and nccl.h at configure time; this LibTorch is ",
                TORCH_VERSION_MAJOR, ".", TORCH_VERSION_MINOR,
                "); pass Backend::kGloo, or keep the model on the CPU");
    TORCH_CHECK(o.device().is_cuda(), who, ": the NCCL backend reduces CUDA tensors, got device ",
                o.device(), " (pass the rank's CUDA device, e.g. cuda:LOCAL_RANK)");
  } else {
    TORCH_CHECK(o.device().is_cpu(), who, ": the Gloo backend reduces CPU tensors, got device ",
                o.device(), " (use Backend::kNccl or kAuto for CUDA)");
  }

  auto state = std::make_shared<detail::ProcessGroupState>();
  state->rank = rank;
  state->size = world;
  state->backend = backend;
  state->device = o.device();
  state->timeout = o.timeout();
  Rendezvous rv;
  rv.who = who;
  rv.addr = addr;
  rv.port = static_cast<int>(port);
  rv.rank = rank;
  rv.world = world;
  rv.agent = agent;
  rv.backend = backend;
  rv.timeout = o.timeout();
  if (backend == Backend::kGloo || detail::have_gloo())
    check_gloo_interface(addr, rank, world, who);
  if (world > 1) install_terminate_handler(rank, world);
  const Connected c = connect_within_deadline(rv);
  state->store = c.store;
  state->group = c.group;
  ProcessGroup group(state);
  const std::lock_guard<std::mutex> lock(default_mutex);
  default_group = group;
  return group;
}

ProcessGroup default_process_group() {
  const std::lock_guard<std::mutex> lock(default_mutex);
  return default_group;
}

void destroy_process_group() {
  const std::lock_guard<std::mutex> lock(default_mutex);
  default_group.destroy();
  default_group = ProcessGroup();
}

int free_loopback_port(const char* who) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  TORCH_CHECK(fd >= 0, who, ": cannot create a socket");
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0;
  ::close(fd);
  TORCH_CHECK(ok, who, ": no free port on 127.0.0.1");
  return ntohs(a.sin_port);
}

}  // namespace apex::parallel
