#include <apex/parallel/c10d.h>
#include <apex/parallel/process_group.h>
#include <arpa/inet.h>
#include <c10/util/Exception.h>
#include <netdb.h>
#include <sys/socket.h>
#include <torch/version.h>
#include <unistd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

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
  c10::intrusive_ptr<c10d::Store> base;
  if (world == 1 && !agent) {
    // A group of one needs no network at all.
    base = c10::make_intrusive<c10d::HashStore>();
  } else {
    c10d::TCPStoreOptions so;
    so.port = static_cast<uint16_t>(port);
    so.isServer = !agent && rank == 0;
    so.numWorkers = agent ? std::nullopt : std::optional<size_t>(world);
    so.waitWorkers = !agent;
    so.timeout = o.timeout();
    if (so.isServer) so.masterListenFd = listen_on(addr, static_cast<int>(port));
    try {
      base = c10::make_intrusive<c10d::TCPStore>(addr, so);
    } catch (const std::exception& e) {
      // (The listening socket is the store's now, whether or not it got far enough to close it.)
      TORCH_CHECK(false, who, ": rank ", rank, " of ", world, " could not ",
                  so.isServer ? "gather every rank at its store on " : "reach the store at ", addr,
                  ":", port, " within ", o.timeout().count(), " ms (",
                  so.isServer ? "did all WORLD_SIZE ranks start?"
                              : "is MASTER_ADDR:MASTER_PORT "
                                "right, and rank 0 up?",
                  "): ", message_of(e));
    }
  }
  // Python's key layout (default_pg, then the group's name, then the device), so that Python and
  // C++ workers on one store do not collide.
  state->store = c10::make_intrusive<c10d::PrefixStore>("default_pg", base);
  auto group_store = c10::make_intrusive<c10d::PrefixStore>("0/", state->store);
  try {
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(group_store, static_cast<int>(rank),
                                                      static_cast<int>(world));
    // CPU tensors go through Gloo in both cases (as Python's "cpu:gloo,cuda:nccl"), so that CPU
    // bookkeeping (losses, flags) can be reduced in an NCCL job too. Loopback jobs keep Gloo's
    // sockets on 127.0.0.1; others let Gloo pick this host's address.
    if (backend == Backend::kGloo || detail::have_gloo()) {
      const std::string host = is_loopback(addr) ? "127.0.0.1" : "";
      auto gloo = detail::make_gloo_backend(
          c10::make_intrusive<c10d::PrefixStore>("cpu/", group_store), static_cast<int>(rank),
          static_cast<int>(world), o.timeout(), host);
      pg->setBackend(c10::kCPU, c10d::ProcessGroup::BackendType::GLOO, gloo);
    }
    if (backend == Backend::kNccl) {
      auto nccl =
          detail::make_nccl_backend(c10::make_intrusive<c10d::PrefixStore>("cuda/", group_store),
                                    static_cast<int>(rank), static_cast<int>(world), o.timeout());
      pg->setBackend(c10::kCUDA, c10d::ProcessGroup::BackendType::NCCL, nccl);
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
    } else {
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
    }
    pg->setGroupName("0");
    state->group = pg;
  } catch (const std::exception& e) {
    TORCH_CHECK(false, who, ": rank ", rank, " of ", world, " could not connect to the other ranks",
                " within ", o.timeout().count(), " ms: ", message_of(e));
  }
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

}  // namespace apex::parallel
