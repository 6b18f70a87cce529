// The CUDA-on-CPU emulation's runtime (see include/cuda_runtime.h): fibers, the block scheduler,
// the checked barrier and warp rendezvous, and the few runtime API calls our kernels make.
//
// A launch runs its blocks one after another. A block's threads run on worker fibers (one per
// stack, reused thread after thread): a thread runs until it waits (barrier, shuffle) or exits,
// then the scheduler picks the next ready one by the schedule's policy and order. When no fiber is
// ready, either every live thread waits at the same barrier (it opens), or the block is stuck:
// the launch fails with a message that says who waits where. A failed launch resumes every
// started fiber once more with an exception, so stacks unwind and the sanitizers stay in step.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <random>
#include <sstream>
#include <string>
#include <unordered_map>
#include <vector>

#include "cuda_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define CUDA_EMU_ASAN 1
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#define CUDA_EMU_TSAN 1
// In libtsan, not in its header: the calling fiber's memory accesses are not recorded between
// them (synchronization still is).
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#define CUDA_EMU_NO_TSAN __attribute__((no_sanitize("thread")))
#else
#define CUDA_EMU_NO_TSAN
#endif
#if !defined(__x86_64__) || defined(CUDA_EMU_UCONTEXT)
#include <ucontext.h>
#define CUDA_EMU_USE_UCONTEXT 1
#endif

thread_local dim3 gridDim;
thread_local dim3 blockDim;

namespace cuda_emu {
namespace detail {

namespace {

thread_local uint3 g_thread_idx;
thread_local uint3 g_block_idx;

/// The emulation's own bookkeeping, touched by fibers and the scheduler alike, is ordered by the
/// stack switches, which ThreadSanitizer is told imply no order (so that the CUDA threads of a
/// block are ordered by barriers and shuffles only). Fibers therefore touch it inside this scope.
struct TsanIgnore {
  TsanIgnore() {
#if defined(CUDA_EMU_TSAN)
    __tsan_ignore_thread_begin();
#endif
  }
  ~TsanIgnore() {
#if defined(CUDA_EMU_TSAN)
    __tsan_ignore_thread_end();
#endif
  }
  TsanIgnore(const TsanIgnore&) = delete;
  TsanIgnore& operator=(const TsanIgnore&) = delete;
};

// ---------------------------------------------------------------------------------------------
// Context switch: a small x86-64 switch of the callee-saved registers (ucontext elsewhere).
// ---------------------------------------------------------------------------------------------

#if !defined(CUDA_EMU_USE_UCONTEXT)
extern "C" void cuda_emu_switch(void** save_sp, void* next_sp);
extern "C" void cuda_emu_fiber_start();
// cuda_emu_switch saves rbp, rbx, r12-r15 on the current stack, stores the stack pointer in
// *save_sp and resumes the stack next_sp. A new fiber's stack holds six register slots (r12 = the
// argument, r13 = the entry) and returns into cuda_emu_fiber_start, which calls entry(arg).
asm(R"(
  .text
  .p2align 4
  .globl cuda_emu_switch
  .hidden cuda_emu_switch
  .type cuda_emu_switch, @function
cuda_emu_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cuda_emu_switch, .-cuda_emu_switch
  .p2align 4
  .globl cuda_emu_fiber_start
  .hidden cuda_emu_fiber_start
  .type cuda_emu_fiber_start, @function
cuda_emu_fiber_start:
  movq %r12, %rdi
  callq *%r13
  ud2
  .size cuda_emu_fiber_start, .-cuda_emu_fiber_start
)");
#endif

struct Context {
#if defined(CUDA_EMU_USE_UCONTEXT)
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

// Where a switch goes, read before the sanitizers are told of the switch (after it, ThreadSanitizer
// counts accesses as the target fiber's).
#if defined(CUDA_EMU_USE_UCONTEXT)
using Target = ucontext_t*;
Target target_of(Context& c) { return &c.uc; }
void switch_context(Context& from, Target to) {
  if (swapcontext(&from.uc, to) != 0) std::abort();
}
#else
using Target = void*;
Target target_of(Context& c) { return c.sp; }
void switch_context(Context& from, Target to) { cuda_emu_switch(&from.sp, to); }
#endif

// ---------------------------------------------------------------------------------------------
// Stacks: mapped once with a guard page below, kept for later blocks and launches.
// ---------------------------------------------------------------------------------------------

#if defined(CUDA_EMU_ASAN) || defined(CUDA_EMU_TSAN)
constexpr std::size_t kDefaultStackBytes = 512 * 1024;
#else
constexpr std::size_t kDefaultStackBytes = 128 * 1024;
#endif

std::size_t stack_bytes() {
  static const std::size_t bytes = [] {
    const char* env = std::getenv("CUDA_EMU_STACK_KB");
    const long kb = env != nullptr ? std::atol(env) : 0;
    return kb > 0 ? static_cast<std::size_t>(kb) * 1024 : kDefaultStackBytes;
  }();
  return bytes;
}

struct Thread;

/// A worker fiber and its stack. It runs one CUDA thread after another: after each it parks at
/// the end of its loop (Block::fiber_main) until the scheduler gives it the next, so no frame is
/// ever abandoned and the sanitizers' view of its stack stays balanced.
struct Stack {
  char* base = nullptr;  ///< lowest usable byte (above the guard page)
  std::size_t size = 0;
  Context ctx;
  bool running = false;   ///< its loop has started
  Thread* job = nullptr;  ///< the CUDA thread it runs next or now
  void* tsan_fiber = nullptr;
  void* asan_fake_stack = nullptr;

  Stack() {
    const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    size = (stack_bytes() + page - 1) / page * page;
    void* m =
        mmap(nullptr, size + page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) {
      std::fprintf(stderr, "cuda_emu: cannot map a fiber stack of %zu bytes\n", size);
      std::abort();
    }
    mprotect(m, page, PROT_NONE);  // overflow faults instead of corrupting a neighbour
    base = static_cast<char*>(m) + page;
  }
};

// ---------------------------------------------------------------------------------------------
// Settings and counters
// ---------------------------------------------------------------------------------------------

struct Settings {
  Schedule schedule;
  std::vector<int> sm_counts{132, 1, 3};
  int device = 0;

  Settings() {
    if (const char* env = std::getenv("CUDA_EMU_SCHEDULE"); env != nullptr && *env != '\0') {
      if (!parse_schedule(env, &schedule)) {
        std::fprintf(stderr, "cuda_emu: unknown CUDA_EMU_SCHEDULE '%s'\n", env);
        std::abort();
      }
    }
    if (const char* env = std::getenv("CUDA_EMU_SM_COUNTS"); env != nullptr && *env != '\0') {
      std::vector<int> counts;
      std::stringstream in(env);
      std::string item;
      while (std::getline(in, item, ',')) counts.push_back(std::atoi(item.c_str()));
      if (counts.empty() ||
          std::any_of(counts.begin(), counts.end(), [](int c) { return c <= 0; })) {
        std::fprintf(stderr, "cuda_emu: bad CUDA_EMU_SM_COUNTS '%s'\n", env);
        std::abort();
      }
      sm_counts = counts;
    }
  }
};

Settings& settings() {
  static Settings s;
  return s;
}

Stats g_stats;
thread_local cudaError_t g_last_error = cudaSuccess;
std::string g_last_fault;

struct Allocations {
  std::mutex mutex;
  std::unordered_map<void*, std::size_t> sizes;
};

Allocations& allocations() {
  static Allocations a;
  return a;
}

cudaError_t record(cudaError_t err) {
  if (err != cudaSuccess) g_last_error = err;
  return err;
}

// ---------------------------------------------------------------------------------------------
// Blocks of fibers
// ---------------------------------------------------------------------------------------------

enum class State : int8_t { kNew, kReady, kBarrier, kShuffle, kDone };

struct Abort {};  // thrown into a waiting fiber when its launch has failed

struct Thread {
  Stack* stack = nullptr;
  State state = State::kNew;
  bool started = false;
  int tid = 0;
  std::source_location site;  ///< where it waits
  uint64_t shuffles_done = 0;
  // The shuffle it waits in.
  unsigned mask = 0;
  ShuffleKind kind = ShuffleKind::kXor;
  int arg = 0;
  int width = 0;
  uint64_t value = 0;
  uint64_t result = 0;
};

struct Warp {
  int arrived = 0;  ///< lanes waiting in the pending shuffle
  unsigned mask = 0;
  std::source_location site;
  uint64_t seq = 0;
  uint64_t generation = 0;
  char tsan_sync[2] = {};
  unsigned gone = 0;      ///< lanes that have exited, or do not exist (a partial last warp)
  std::deque<int> ready;  ///< warp-to-barrier policy
  bool queued = false;
};

std::string where(const std::source_location& s) {
  std::string file = s.file_name();
  const std::size_t slash = file.find_last_of('/');
  if (slash != std::string::npos) file = file.substr(slash + 1);
  return file + ":" + std::to_string(s.line()) + ":" + std::to_string(s.column());
}

bool same_site(const std::source_location& a, const std::source_location& b) {
  return a.line() == b.line() && a.column() == b.column() &&
         (a.file_name() == b.file_name() || std::strcmp(a.file_name(), b.file_name()) == 0);
}

/// "0-3,7" for a set of thread or lane indices.
std::string ranges(const std::vector<int>& ids) {
  std::string out;
  for (std::size_t i = 0; i < ids.size();) {
    std::size_t j = i;
    while (j + 1 < ids.size() && ids[j + 1] == ids[j] + 1) ++j;
    if (!out.empty()) out += ",";
    out += std::to_string(ids[i]);
    if (j > i) out += "-" + std::to_string(ids[j]);
    i = j + 1;
  }
  return out;
}

class Block;

struct Launch {
  void (*body)(void*) = nullptr;
  void* ctx = nullptr;
  std::vector<std::unique_ptr<Stack>>* stacks = nullptr;
};

thread_local Block* g_block = nullptr;     // the block being run on this OS thread
thread_local Thread* g_current = nullptr;  // the CUDA thread running now, null in the scheduler
// The scheduler's side of the switches (it runs on the launching thread's stack).
thread_local Context g_main_ctx;
thread_local void* g_main_tsan = nullptr;
#if defined(CUDA_EMU_ASAN)
thread_local void* g_main_fake_stack = nullptr;
thread_local const void* g_main_stack_bottom = nullptr;
thread_local std::size_t g_main_stack_size = 0;
#endif

#if defined(CUDA_EMU_TSAN)
// Blocks in turn: block b acquires g_chain[b % 2] when its threads start and releases
// g_chain[(b + 1) % 2] when they end, so block b + 1 sees everything before it (the emulation
// cannot show races between blocks) while threads of one block are ordered only by barriers and
// shuffles.
char g_chain[2];
#endif

class Block {
 public:
  /// `seq`: the block's turn in the launch; `index`: its blockIdx.x.
  Block(const Launch& launch, unsigned seq, unsigned index, int threads, std::mt19937_64& rng)
      : launch_(launch), seq_(seq), index_(index), rng_(rng), threads_(threads) {
    th_.resize(static_cast<std::size_t>(threads));
    warps_.resize(static_cast<std::size_t>((threads + warpSize - 1) / warpSize));
    auto& stacks = *launch.stacks;
    while (stacks.size() < th_.size()) stacks.push_back(std::make_unique<Stack>());
    for (int t = 0; t < threads; ++t) {
      th_[t].tid = t;
      th_[t].stack = stacks[static_cast<std::size_t>(t)].get();
    }
    const int tail = threads % warpSize;
    if (tail != 0) warps_.back().gone = ~((1u << tail) - 1u);
  }

  /// Runs the block to its end; returns the fault, empty when none.
  std::string run() {
    g_block = this;
#if defined(CUDA_EMU_TSAN)
    g_main_tsan = __tsan_get_current_fiber();
#endif
    std::vector<int> all(th_.size());
    for (std::size_t t = 0; t < all.size(); ++t) all[t] = static_cast<int>(t);
    make_ready(all);
    while (fault_.empty()) {
      const int next = pick();
      if (next >= 0) {
        resume(th_[static_cast<std::size_t>(next)]);
        continue;
      }
      if (!no_ready()) break;
    }
    if (!fault_.empty()) abort_all();
    g_block = nullptr;
    return fault_;
  }

  // Called on the running fiber.
  void barrier(const std::source_location& site) {
    Thread& self = *g_current;
    self.state = State::kBarrier;
    self.site = site;
    const uint64_t gen = barrier_generation_;
#if defined(CUDA_EMU_TSAN)
    __tsan_release(&barrier_sync_[gen % 2]);
#endif
    yield(self);
#if defined(CUDA_EMU_TSAN)
    __tsan_acquire(&barrier_sync_[gen % 2]);
#else
    (void)gen;
#endif
  }

  uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width,
                   const std::source_location& site) {
    Thread& self = *g_current;
    const int lane = self.tid % warpSize;
    const int w = self.tid / warpSize;
    Warp& warp = warps_[static_cast<std::size_t>(w)];
    const auto who = [&] {
      return "thread " + std::to_string(self.tid) + " (warp " + std::to_string(w) + ", lane " +
             std::to_string(lane) + ") at " + where(site);
    };
    const bool diverged =
        warp.arrived > 0 && (!same_site(warp.site, site) || warp.mask != mask ||
                             (mask == 0xffffffffu && warp.seq != self.shuffles_done));
    if ((mask & (1u << lane)) == 0) {
      fail(who() + ": the shuffle's mask 0x" + hex(mask) + " does not name the calling lane");
    } else if (width <= 0 || width > warpSize || (width & (width - 1)) != 0) {
      fail(who() + ": shuffle width " + std::to_string(width) + " is not a power of two <= 32");
    } else if ((mask & warp.gone) != 0) {
      fail(who() + ": the shuffle's mask 0x" + hex(mask) + " names lane(s) " +
           ranges(lanes_of(mask & warp.gone)) + " that have exited (divergent shuffle)");
    } else if (diverged) {
      fail(who() + ": divergent shuffle: lane(s) " + ranges(waiting_lanes(warp)) + " wait in " +
           describe_pending(warp) + ", this lane is at its shuffle #" +
           std::to_string(self.shuffles_done) + " with mask 0x" + hex(mask));
    }
    if (!fault_.empty()) {
      yield_failed(self);
    }
    if (warp.arrived == 0) {
      warp.site = site;
      warp.mask = mask;
      warp.seq = self.shuffles_done;
    }
    self.state = State::kShuffle;
    self.site = site;
    self.mask = mask;
    self.kind = kind;
    self.arg = arg;
    self.width = width;
    self.value = bits;
    ++warp.arrived;
    const uint64_t gen = warp.generation;
#if defined(CUDA_EMU_TSAN)
    __tsan_release(&warp.tsan_sync[gen % 2]);
#endif
    if (warp.arrived == __builtin_popcount(mask)) complete_shuffle(w);
    yield(self);
#if defined(CUDA_EMU_TSAN)
    __tsan_acquire(&warp.tsan_sync[gen % 2]);
#else
    (void)gen;
#endif
    ++self.shuffles_done;
    return self.result;
  }

  [[noreturn]] static void fiber_main(Stack* stack);
  static bool run_kernel(Block& block, const Launch& launch, int tid);

 private:
  static std::string hex(unsigned v) {
    char buf[16];
    std::snprintf(buf, sizeof buf, "%08x", v);
    return buf;
  }

  void fail(const std::string& what) {
    if (!fault_.empty()) return;
    fault_ = "block " + std::to_string(index_) + " of the launch: " + what + " [schedule " +
             to_string(settings().schedule) + "]";
  }

  static std::vector<int> lanes_of(unsigned bits) {
    std::vector<int> out;
    for (int lane = 0; lane < warpSize; ++lane) {
      if ((bits & (1u << lane)) != 0) out.push_back(lane);
    }
    return out;
  }

  std::vector<int> waiting_lanes(const Warp& warp) const {
    std::vector<int> out;
    const int w = static_cast<int>(&warp - warps_.data());
    for (int lane = 0; lane < warpSize; ++lane) {
      const int t = w * warpSize + lane;
      if (t < threads_ && th_[static_cast<std::size_t>(t)].state == State::kShuffle) {
        out.push_back(lane);
      }
    }
    return out;
  }

  std::string describe_pending(const Warp& warp) const {
    return "the shuffle at " + where(warp.site) + " (their shuffle #" + std::to_string(warp.seq) +
           ", mask 0x" + hex(warp.mask) + ")";
  }

  void complete_shuffle(int w) {
    Warp& warp = warps_[static_cast<std::size_t>(w)];
    std::vector<int> lanes;
    for (int lane = 0; lane < warpSize; ++lane) {
      if ((warp.mask & (1u << lane)) != 0) lanes.push_back(lane);
    }
    for (const int lane : lanes) {
      Thread& t = th_[static_cast<std::size_t>(w * warpSize + lane)];
      const int seg = lane & ~(t.width - 1);
      int src = lane;
      switch (t.kind) {
        case ShuffleKind::kIndex:
          src = seg + (t.arg & (t.width - 1));
          break;
        case ShuffleKind::kXor:
          src = lane ^ t.arg;
          if ((src & ~(t.width - 1)) > seg) src = lane;  // a later segment: own value
          break;
        case ShuffleKind::kDown:
          src = (lane - seg) + t.arg < t.width ? lane + t.arg : lane;
          break;
        case ShuffleKind::kUp:
          src = (lane - seg) - t.arg >= 0 ? lane - t.arg : lane;
          break;
      }
      if (src < 0 || src >= warpSize || (warp.mask & (1u << src)) == 0) {
        fail("thread " + std::to_string(t.tid) + " at " + where(t.site) + " reads lane " +
             std::to_string(src) + ", which the mask 0x" + hex(warp.mask) + " does not name");
        return;
      }
      t.result = th_[static_cast<std::size_t>(w * warpSize + src)].value;
    }
    std::vector<int> tids;
    for (const int lane : lanes) {
      const int t = w * warpSize + lane;
      th_[static_cast<std::size_t>(t)].state = State::kReady;
      tids.push_back(t);
    }
    warp.arrived = 0;
    ++warp.generation;
    ++g_stats.shuffles;
    make_ready(tids);
  }

  /// Nothing is ready: open the barrier all live threads wait at, or report why the block is
  /// stuck. Returns false when the block is done (or failed).
  bool no_ready() {
    std::vector<int> done;
    std::vector<int> at_barrier;
    std::vector<int> in_shuffle;
    for (const Thread& t : th_) {
      if (t.state == State::kDone) done.push_back(t.tid);
      if (t.state == State::kBarrier) at_barrier.push_back(t.tid);
      if (t.state == State::kShuffle) in_shuffle.push_back(t.tid);
    }
    if (done.size() == th_.size()) return false;
    if (!in_shuffle.empty()) {
      const Thread& t = th_[static_cast<std::size_t>(in_shuffle.front())];
      std::string what = "deadlock: thread(s) " + ranges(in_shuffle) +
                         " wait in shuffles (thread " + std::to_string(t.tid) + " at " +
                         where(t.site) + ")";
      if (!at_barrier.empty()) {
        what += " while thread(s) " + ranges(at_barrier) + " wait at __syncthreads (" +
                where(th_[static_cast<std::size_t>(at_barrier.front())].site) + ")";
      }
      fail(what);
      return false;
    }
    // Every live thread waits at a barrier.
    const Thread& first = th_[static_cast<std::size_t>(at_barrier.front())];
    if (!done.empty()) {
      fail("__syncthreads at " + where(first.site) + " is not reached by every thread: thread(s) " +
           ranges(done) + " exited while thread(s) " + ranges(at_barrier) + " wait there");
      return false;
    }
    std::vector<int> elsewhere;
    for (const int t : at_barrier) {
      if (!same_site(th_[static_cast<std::size_t>(t)].site, first.site)) elsewhere.push_back(t);
    }
    if (!elsewhere.empty()) {
      fail("threads wait at different __syncthreads: thread " + std::to_string(first.tid) + " at " +
           where(first.site) + ", thread(s) " + ranges(elsewhere) + " at " +
           where(th_[static_cast<std::size_t>(elsewhere.front())].site));
      return false;
    }
    for (Thread& t : th_) t.state = State::kReady;
    ++barrier_generation_;
    ++g_stats.barriers;
    make_ready(at_barrier);
    return true;
  }

  /// Queues threads that became ready together, in the schedule's order.
  void make_ready(std::vector<int> tids) {
    const Schedule& s = settings().schedule;
    if (s.order == Order::kReverse) std::reverse(tids.begin(), tids.end());
    if (s.order == Order::kRandom) std::shuffle(tids.begin(), tids.end(), rng_);
    for (const int t : tids) {
      if (th_[static_cast<std::size_t>(t)].state == State::kNew) {
        th_[static_cast<std::size_t>(t)].state = State::kReady;
      }
      if (s.policy == Policy::kRoundRobin) {
        ready_.push_back(t);
      } else {
        Warp& w = warps_[static_cast<std::size_t>(t / warpSize)];
        w.ready.push_back(t);
        if (!w.queued && t / warpSize != current_warp_) {
          w.queued = true;
          warp_queue_.push_back(t / warpSize);
        }
      }
    }
  }

  int pick() {
    if (settings().schedule.policy == Policy::kRoundRobin) {
      if (ready_.empty()) return -1;
      const int t = ready_.front();
      ready_.pop_front();
      return t;
    }
    if (current_warp_ >= 0) {
      Warp& w = warps_[static_cast<std::size_t>(current_warp_)];
      if (!w.ready.empty()) {
        const int t = w.ready.front();
        w.ready.pop_front();
        return t;
      }
    }
    while (!warp_queue_.empty()) {
      const int wi = warp_queue_.front();
      warp_queue_.pop_front();
      Warp& w = warps_[static_cast<std::size_t>(wi)];
      w.queued = false;
      if (w.ready.empty()) continue;
      current_warp_ = wi;
      const int t = w.ready.front();
      w.ready.pop_front();
      return t;
    }
    current_warp_ = -1;
    return -1;
  }

  void resume(Thread& t) {
    g_current = &t;
    g_thread_idx = uint3{static_cast<unsigned>(t.tid), 0, 0};
    ++g_stats.switches;
    if (!t.started) {
      t.started = true;
      t.stack->job = &t;
      if (!t.stack->running) start_fiber(*t.stack);
    }
    const Target to = target_of(t.stack->ctx);
#if defined(CUDA_EMU_ASAN)
    __sanitizer_start_switch_fiber(&g_main_fake_stack, t.stack->base, t.stack->size);
#endif
#if defined(CUDA_EMU_TSAN)
    __tsan_switch_to_fiber(t.stack->tsan_fiber, __tsan_switch_to_fiber_no_sync);
#endif
    switch_context(g_main_ctx, to);
#if defined(CUDA_EMU_ASAN)
    __sanitizer_finish_switch_fiber(g_main_fake_stack, nullptr, nullptr);
#endif
    g_current = nullptr;
  }

  /// Starts the worker loop of a stack (once per stack).
  static void start_fiber(Stack& st) {
    st.running = true;
    char* top = st.base + st.size - 64;
    top = reinterpret_cast<char*>(reinterpret_cast<std::uintptr_t>(top) & ~std::uintptr_t{15});
#if defined(CUDA_EMU_TSAN)
    st.tsan_fiber = __tsan_create_fiber(0);
#endif
#if defined(CUDA_EMU_USE_UCONTEXT)
    getcontext(&st.ctx.uc);
    st.ctx.uc.uc_stack.ss_sp = st.base;
    st.ctx.uc.uc_stack.ss_size = static_cast<std::size_t>(top - st.base);
    st.ctx.uc.uc_link = nullptr;
    // makecontext passes ints: the pointer travels in two halves.
    const auto p = reinterpret_cast<std::uintptr_t>(&st);
    makecontext(&st.ctx.uc, reinterpret_cast<void (*)()>(&Block::fiber_entry_uc), 2,
                static_cast<unsigned>(p >> 32), static_cast<unsigned>(p & 0xffffffffu));
#else
    // [top-8] = cuda_emu_fiber_start, below it r15, r14, r13 (entry), r12 (arg), rbx, rbp.
    auto* slot = reinterpret_cast<void**>(top - 8);
    slot[0] = reinterpret_cast<void*>(&cuda_emu_fiber_start);
    slot[-1] = nullptr;                                      // rbp
    slot[-2] = nullptr;                                      // rbx
    slot[-3] = &st;                                          // r12
    slot[-4] = reinterpret_cast<void*>(&Block::fiber_main);  // r13
    slot[-5] = nullptr;                                      // r14
    slot[-6] = nullptr;                                      // r15
    st.ctx.sp = &slot[-6];
#endif
  }

#if defined(CUDA_EMU_USE_UCONTEXT)
  static void fiber_entry_uc(unsigned hi, unsigned lo) {
    fiber_main(reinterpret_cast<Stack*>((static_cast<std::uintptr_t>(hi) << 32) | lo));
  }
#endif

  /// Back to the scheduler; returns when the scheduler resumes this fiber. A failed launch
  /// resumes it once more with Abort.
  void yield(Thread& self) {
    switch_to_main(*self.stack);
    if (!fault_.empty()) throw Abort{};
  }

  [[noreturn]] void yield_failed(Thread& self) {
    yield(self);
    throw Abort{};
  }

  /// From a worker fiber back to the scheduler; returns when the scheduler resumes the fiber.
  static void switch_to_main(Stack& st) {
    Target to;
    void* main_tsan = nullptr;
    {
      const TsanIgnore ignore;
      to = target_of(g_main_ctx);
      main_tsan = g_main_tsan;
    }
#if defined(CUDA_EMU_ASAN)
    __sanitizer_start_switch_fiber(&st.asan_fake_stack, g_main_stack_bottom, g_main_stack_size);
#endif
#if defined(CUDA_EMU_TSAN)
    __tsan_switch_to_fiber(main_tsan, __tsan_switch_to_fiber_no_sync);
#else
    (void)main_tsan;
#endif
    switch_context(st.ctx, to);
#if defined(CUDA_EMU_ASAN)
    __sanitizer_finish_switch_fiber(st.asan_fake_stack, nullptr, nullptr);
#endif
  }

  /// The launch failed: every started fiber that still waits is resumed to unwind.
  void abort_all() {
    ++g_stats.faults;
    for (Thread& t : th_) {
      if (t.state == State::kDone) continue;
      if (!t.started) {
        t.state = State::kDone;
        continue;
      }
      resume(t);
    }
  }

  /// A thread leaves: a pending shuffle of its warp that names it can no longer complete.
  void exited(Thread& self) {
    self.state = State::kDone;
    const int lane = self.tid % warpSize;
    Warp& warp = warps_[static_cast<std::size_t>(self.tid / warpSize)];
    warp.gone |= 1u << lane;
    if (warp.arrived > 0 && (warp.mask & (1u << lane)) != 0) {
      fail("thread " + std::to_string(self.tid) + " (lane " + std::to_string(lane) +
           ") exited while lane(s) " + ranges(waiting_lanes(warp)) + " wait in " +
           describe_pending(warp) + ", whose mask names it (divergent shuffle)");
    }
  }

  Launch launch_;
  unsigned seq_;
  unsigned index_;
  std::mt19937_64& rng_;
  int threads_;
  std::vector<Thread> th_;
  std::vector<Warp> warps_;
  std::deque<int> ready_;
  std::deque<int> warp_queue_;
  int current_warp_ = -1;
  uint64_t barrier_generation_ = 0;
  char barrier_sync_[2] = {};
  std::string fault_;
};

/// Runs the kernel on this fiber as CUDA thread `tid`; true when a failed launch unwound it.
bool Block::run_kernel(Block& block, const Launch& launch, int tid) {
  std::string error;
  try {
    launch.body(launch.ctx);
    return false;
  } catch (const Abort&) {
    return true;
  } catch (const std::exception& e) {
    error = std::string("threw: ") + e.what();
  } catch (...) {
    error = "threw an exception";
  }
  const TsanIgnore ignore;
  block.fail("thread " + std::to_string(tid) + " " + error);
  return false;
}

void Block::fiber_main(Stack* st) {
#if defined(CUDA_EMU_ASAN)
  __sanitizer_finish_switch_fiber(nullptr, &g_main_stack_bottom, &g_main_stack_size);
#endif
  for (;;) {
    Block* block = nullptr;
    Thread* self = nullptr;
    Launch launch;
    int tid = 0;
    {
      const TsanIgnore ignore;
      block = g_block;
      self = st->job;
      tid = self->tid;
      launch = block->launch_;
#if defined(CUDA_EMU_TSAN)
      __tsan_acquire(&g_chain[block->seq_ % 2]);
#endif
    }
    const bool aborted = run_kernel(*block, launch, tid);
    {
      const TsanIgnore ignore;
      if (aborted) {
        self->state = State::kDone;
      } else {
        block->exited(*self);
      }
      st->job = nullptr;
#if defined(CUDA_EMU_TSAN)
      __tsan_release(&g_chain[(block->seq_ + 1) % 2]);
#endif
    }
    switch_to_main(*st);  // parked until the scheduler gives this fiber its next thread
  }
}

std::vector<std::unique_ptr<Stack>>& stack_pool() {
  static thread_local std::vector<std::unique_ptr<Stack>> pool;
  return pool;
}

}  // namespace

CUDA_EMU_NO_TSAN uint3 thread_idx() { return g_thread_idx; }
CUDA_EMU_NO_TSAN uint3 block_idx() { return g_block_idx; }

void barrier(const std::source_location& site) {
  const TsanIgnore ignore;
  if (g_block == nullptr || g_current == nullptr) {
    std::fprintf(stderr, "cuda_emu: __syncthreads outside a kernel (%s)\n", where(site).c_str());
    std::abort();
  }
  g_block->barrier(site);
}

uint64_t shuffle(unsigned mask, uint64_t bits, ShuffleKind kind, int arg, int width,
                 const std::source_location& site) {
  const TsanIgnore ignore;
  if (g_block == nullptr || g_current == nullptr) {
    std::fprintf(stderr, "cuda_emu: a shuffle outside a kernel (%s)\n", where(site).c_str());
    std::abort();
  }
  return g_block->shuffle(mask, bits, kind, arg, width, site);
}

int blocks_per_sm(int threads) {
  // An H100's limits: 2048 threads and 32 blocks per SM (registers and shared memory ignored).
  return std::max(1, std::min(32, 2048 / threads));
}

cudaError_t launch(const cudaLaunchConfig_t& config, void (*body)(void*), void* ctx) {
  if (g_block != nullptr) {
    g_last_fault = "a kernel launch from device code is not emulated";
    return record(cudaErrorNotSupported);
  }
  const dim3 grid = config.gridDim;
  const dim3 block = config.blockDim;
  if (grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x == 0 || block.y == 0 || block.z == 0 ||
      grid.x > 0x7fffffffu || grid.y > 65535 || grid.z > 65535) {
    return record(cudaErrorInvalidConfiguration);
  }
  if (block.x * block.y * block.z > 1024 || block.y != 1 || block.z != 1 || grid.y != 1 ||
      grid.z != 1) {
    // 2-D/3-D launches are not used by our kernels; the emulation knows 1-D only.
    g_last_fault = "only 1-D launches of at most 1024 threads are emulated";
    return record(block.x * block.y * block.z > 1024 ? cudaErrorInvalidConfiguration
                                                     : cudaErrorNotSupported);
  }
  if (config.dynamicSmemBytes != 0 || config.numAttrs != 0) {
    g_last_fault = "dynamic shared memory and launch attributes are not emulated";
    return record(cudaErrorNotSupported);
  }
  Settings& s = settings();
  ++g_stats.launches;
  static thread_local uint64_t launch_count = 0;
  std::mt19937_64 rng(s.schedule.seed * 0x9E3779B97F4A7C15ull + launch_count++);
  gridDim = grid;
  blockDim = block;
  Launch l{body, ctx, &stack_pool()};
#if defined(CUDA_EMU_TSAN)
  __tsan_release(&g_chain[0]);
#endif
  // Blocks in turn, in the schedule's order.
  std::vector<unsigned> order(grid.x);
  for (unsigned b = 0; b < grid.x; ++b) order[b] = b;
  if (s.schedule.order == Order::kReverse) std::reverse(order.begin(), order.end());
  if (s.schedule.order == Order::kRandom) std::shuffle(order.begin(), order.end(), rng);
  std::string fault;
  for (unsigned i = 0; i < grid.x && fault.empty(); ++i) {
    g_block_idx = uint3{order[i], 0, 0};
    ++g_stats.blocks;
    g_stats.threads += block.x;
    Block b(l, i, order[i], static_cast<int>(block.x), rng);
    fault = b.run();
  }
#if defined(CUDA_EMU_TSAN)
  __tsan_acquire(&g_chain[0]);
  __tsan_acquire(&g_chain[1]);
#endif
  if (fault.empty()) return cudaSuccess;
  g_last_fault = "emulated kernel fault: " + fault;
  if (std::getenv("CUDA_EMU_ABORT_ON_FAULT") != nullptr) {
    std::fprintf(stderr, "cuda_emu: %s\n", g_last_fault.c_str());
    std::abort();
  }
  return record(cudaErrorLaunchFailure);
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Control API
// ---------------------------------------------------------------------------------------------

bool parse_schedule(const std::string& text, Schedule* out) {
  Schedule s;
  std::string rest;
  if (text.rfind("warp-", 0) == 0) {
    s.policy = Policy::kWarpToBarrier;
    rest = text.substr(5);
  } else if (text.rfind("rr-", 0) == 0) {
    s.policy = Policy::kRoundRobin;
    rest = text.substr(3);
  } else {
    return false;
  }
  if (rest == "forward") {
    s.order = Order::kForward;
  } else if (rest == "reverse") {
    s.order = Order::kReverse;
  } else if (rest.rfind("random", 0) == 0) {
    s.order = Order::kRandom;
    if (rest.size() > 6) {
      if (rest[6] != ':' || rest.size() == 7) return false;
      char* end = nullptr;
      s.seed = std::strtoull(rest.c_str() + 7, &end, 10);
      if (*end != '\0') return false;
    }
  } else {
    return false;
  }
  *out = s;
  return true;
}

std::string to_string(const Schedule& s) {
  std::string out = s.policy == Policy::kRoundRobin ? "rr-" : "warp-";
  switch (s.order) {
    case Order::kForward:
      return out + "forward";
    case Order::kReverse:
      return out + "reverse";
    case Order::kRandom:
      return out + "random:" + std::to_string(s.seed);
  }
  return out;
}

void set_schedule(const Schedule& s) { detail::settings().schedule = s; }
Schedule schedule() { return detail::settings().schedule; }

void set_sm_counts(const std::vector<int>& counts) {
  if (counts.empty() || std::any_of(counts.begin(), counts.end(), [](int c) { return c <= 0; })) {
    std::fprintf(stderr, "cuda_emu: SM counts must be positive\n");
    std::abort();
  }
  detail::settings().sm_counts = counts;
  detail::settings().device = 0;
}
std::vector<int> sm_counts() { return detail::settings().sm_counts; }

Stats stats() { return detail::g_stats; }
void reset_stats() { detail::g_stats = Stats{}; }
std::string last_fault() { return detail::g_last_fault; }

std::size_t live_allocations() {
  auto& a = detail::allocations();
  const std::lock_guard<std::mutex> lock(a.mutex);
  return a.sizes.size();
}

}  // namespace cuda_emu

// ---------------------------------------------------------------------------------------------
// Runtime API (declared by the toolkit's cuda_runtime_api.h). Every stream is synchronous.
// ---------------------------------------------------------------------------------------------

using cuda_emu::detail::record;

extern "C" {

cudaError_t cudaGetLastError(void) {
  const cudaError_t err = cuda_emu::detail::g_last_error;
  cuda_emu::detail::g_last_error = cudaSuccess;
  return err;
}

cudaError_t cudaPeekAtLastError(void) { return cuda_emu::detail::g_last_error; }

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorNotSupported:
      return cuda_emu::detail::g_last_fault.c_str();
    case cudaErrorLaunchFailure:
      return cuda_emu::detail::g_last_fault.c_str();
    default:
      return "unknown error (cuda_emu)";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  if (count == nullptr) return record(cudaErrorInvalidValue);
  *count = static_cast<int>(cuda_emu::detail::settings().sm_counts.size());
  return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
  auto& s = cuda_emu::detail::settings();
  if (device < 0 || device >= static_cast<int>(s.sm_counts.size())) {
    return record(cudaErrorInvalidDevice);
  }
  s.device = device;
  return cudaSuccess;
}

cudaError_t cudaGetDevice(int* device) {
  if (device == nullptr) return record(cudaErrorInvalidValue);
  *device = cuda_emu::detail::settings().device;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, enum cudaDeviceAttr attr, int device) {
  auto& s = cuda_emu::detail::settings();
  if (value == nullptr) return record(cudaErrorInvalidValue);
  if (device < 0 || device >= static_cast<int>(s.sm_counts.size())) {
    return record(cudaErrorInvalidDevice);
  }
  switch (attr) {
    case cudaDevAttrMultiProcessorCount:
      *value = s.sm_counts[static_cast<std::size_t>(device)];
      return cudaSuccess;
    case cudaDevAttrMaxThreadsPerBlock:
      *value = 1024;
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = warpSize;
      return cudaSuccess;
    default:
      return record(cudaErrorInvalidValue);
  }
}

cudaError_t cudaMalloc(void** ptr, size_t size) {
  if (ptr == nullptr) return record(cudaErrorInvalidValue);
  const std::size_t bytes = (std::max<std::size_t>(size, 1) + 255) / 256 * 256;
  void* p = std::aligned_alloc(256, bytes);
  if (p == nullptr) return record(cudaErrorMemoryAllocation);
  std::memset(p, cuda_emu::kPoisonByte, bytes);  // unwritten scratch reads back as NaN
  auto& a = cuda_emu::detail::allocations();
  const std::lock_guard<std::mutex> lock(a.mutex);
  a.sizes.emplace(p, size);
  *ptr = p;
  return cudaSuccess;
}

cudaError_t cudaFree(void* ptr) {
  if (ptr == nullptr) return cudaSuccess;
  auto& a = cuda_emu::detail::allocations();
  {
    const std::lock_guard<std::mutex> lock(a.mutex);
    if (a.sizes.erase(ptr) == 0) return record(cudaErrorInvalidValue);
  }
  std::free(ptr);
  return cudaSuccess;
}

cudaError_t cudaMallocAsync(void** ptr, size_t size, cudaStream_t /*stream*/) {
  return cudaMalloc(ptr, size);
}

cudaError_t cudaFreeAsync(void* ptr, cudaStream_t /*stream*/) { return cudaFree(ptr); }

cudaError_t cudaMemsetAsync(void* ptr, int value, size_t count, cudaStream_t /*stream*/) {
  if (ptr == nullptr && count != 0) return record(cudaErrorInvalidValue);
  if (count != 0) std::memset(ptr, value, count);
  return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize(void) { return cudaSuccess; }
cudaError_t cudaStreamSynchronize(cudaStream_t /*stream*/) { return cudaSuccess; }

}  // extern "C"
