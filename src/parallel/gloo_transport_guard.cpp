// Gloo's TCP transport runs each device's sockets on one thread of its own (gloo/transport/tcp
// Loop), and that thread calls every pair's handleEvents without a handler around it: a peer
// whose data has another size than this rank expects (the ranks called different collectives)
// makes Pair::prepareRead throw gloo::EnforceNotMet there, and the process ends in std::terminate
// and SIGABRT. torch does the same (two Python ranks calling all_reduce with 10 and 20 elements).
//
// This file puts handlers there. Gloo is compiled into libtorch_cpu.so, which exports these
// members with default visibility and without -Bsymbolic, so it reaches them through dynamic
// relocations (the loop: the vtable slot of the pair's Handler base; Pair::read: prepareRead's
// PLT slot); definitions of the same names in the executable come first in the lookup scope and
// take those slots. Each calls Gloo's own (the next definition, dlsym(RTLD_NEXT)) inside try:
// - prepareRead (where a peer's data of another size or for no pending receive throws): the
//   receive Gloo already took off the pair's queue gets the error (the pair's error no longer
//   reaches it: a broadcast's one receive waited out the whole timeout), then the pair, as
//   Pair::read gives it a socket error, under the lock read's caller holds: the collectives waiting
//   on the pair fail with it, later ones on it fail with it too, its socket closes, so the peer's
//   fail.
// - handleEvents (anything else on the loop thread): the exception has unwound the pair's lock; the
//   pair takes it through Gloo's signalExceptionExternal, the route of Gloo's timeouts. One hazard
//   is left there, as narrow as Gloo's own: the loop only try-locks a pair, this waits for the
//   lock; a thread closing that very pair at that instant (destroying the group, or a timeout of
//   its own) holds the lock while it waits for the loop.
//
// The names are Itanium-ABI mangled names of this gloo's members (`this` is the first argument;
// a return type is not in the name, see signalExceptionExternal): if a torch renamed or relaid
// them, nothing would be interposed and gloo_transport_guarded() says so (the terminate handler
// in process_group.cpp then remains). DdpFaults.Mismatched* fail if either drifts.
#include <cxxabi.h>
#include <dlfcn.h>
#include <link.h>
#include <sys/types.h>

#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "parallel/backends.h"
#include "parallel/errors.h"

#define APEX_GLOO_PAIR_HANDLE_EVENTS "_ZN4gloo9transport3tcp4Pair12handleEventsERNS1_4LoopEi"
// The non-virtual thunk the loop calls through the Handler base (at offset 16 in the pair).
#define APEX_GLOO_PAIR_HANDLE_EVENTS_THUNK \
  "_ZThn16_N4gloo9transport3tcp4Pair12handleEventsERNS1_4LoopEi"
#define APEX_GLOO_PAIR_PREPARE_READ                                                       \
  "_ZN4gloo9transport3tcp4Pair11prepareReadERNS1_2OpERNS_12NonOwningPtrINS1_13UnboundBuf" \
  "ferEEER5iovec"
#define APEX_GLOO_PAIR_VTABLE "_ZTVN4gloo9transport3tcp4PairE"

extern "C" {
// Ours (in the executable's dynamic symbols, see src/CMakeLists.txt):
// void gloo::transport::tcp::Pair::handleEvents(Loop&, int) and its thunk,
__attribute__((visibility("default"))) void apex_gloo_pair_handle_events(
    void* pair, void* loop, int events) __asm__(APEX_GLOO_PAIR_HANDLE_EVENTS);
__attribute__((visibility("default"))) void apex_gloo_pair_handle_events_thunk(
    void* handler, void* loop, int events) __asm__(APEX_GLOO_PAIR_HANDLE_EVENTS_THUNK);
// ssize_t gloo::transport::tcp::Pair::prepareRead(Op&, NonOwningPtr<UnboundBuffer>&, iovec&).
__attribute__((visibility("default"))) ssize_t apex_gloo_pair_prepare_read(
    void* pair, void* op, void* buffer_ref, void* iov) __asm__(APEX_GLOO_PAIR_PREPARE_READ);
}

// Gloo's (libtorch_cpu):
// std::exception_ptr gloo::transport::tcp::Pair::signalExceptionExternal(const std::string&)
// returns the pair's exception through a hidden result pointer ahead of `this` (read from its code;
// declared void, the first run crashed);
std::exception_ptr
apex_gloo_pair_signal_exception_external(void* pair, const std::string& message) __asm__(
    "_ZN4gloo9transport3tcp4Pair23signalExceptionExternalERKNSt7__cxx1112basic_stringIcSt11"
    "char_traitsIcESaIcEEE");
// void gloo::transport::tcp::Pair::signalException(const std::string&) (the pair's lock held),
void apex_gloo_pair_signal_exception(void* pair, const std::string& message) __asm__(
    "_ZN4gloo9transport3tcp4Pair15signalExceptionERKNSt7__cxx1112basic_stringIcSt11char_"
    "traitsIcESaIcEEE");
// void gloo::transport::tcp::UnboundBuffer::signalException(std::exception_ptr) (the argument, a
// class with a destructor, goes by hidden reference in both declarations alike).
void apex_gloo_unbound_buffer_signal_exception(void* buffer, std::exception_ptr error) __asm__(
    "_ZN4gloo9transport3tcp13UnboundBuffer15signalExceptionENSt15__exception_ptr13exception_"
    "ptrE");

namespace {

using HandleEvents = void (*)(void*, void*, int);
using PrepareRead = ssize_t (*)(void*, void*, void*, void*);

// Gloo's own: the next definitions after ours in the lookup scope.
HandleEvents gloos_handle_events() {
  static const auto f =
      reinterpret_cast<HandleEvents>(::dlsym(RTLD_NEXT, APEX_GLOO_PAIR_HANDLE_EVENTS));
  return f;
}
PrepareRead gloos_prepare_read() {
  static const auto f =
      reinterpret_cast<PrepareRead>(::dlsym(RTLD_NEXT, APEX_GLOO_PAIR_PREPARE_READ));
  return f;
}

std::string message_for(const std::exception_ptr& e) {
  std::string what = apex::parallel::detail::message_of(e);
  if (what.empty()) what = "an exception of unknown type";
  return "apex::parallel: Gloo's transport thread failed: " + what +
         " (the ranks called different collectives: different settings, models or code paths, "
         "or a peer sent bad data); this connection is closed, every later collective on it fails";
}

// An address in this object (a function with internal linkage: never another object's).
void anchor() {}

// Whether `address` is this object's definition of `name`.
bool is_ours(const void* address, const char* name) {
  Dl_info mine{}, its{};
  return address != nullptr && ::dladdr(reinterpret_cast<const void*>(&anchor), &mine) != 0 &&
         ::dladdr(address, &its) != 0 && its.dli_fbase == mine.dli_fbase &&
         its.dli_sname != nullptr && std::strcmp(its.dli_sname, name) == 0;
}

}  // namespace

extern "C" ssize_t apex_gloo_pair_prepare_read(void* pair, void* op, void* buffer_ref, void* iov) {
  const PrepareRead gloos = gloos_prepare_read();
  if (gloos == nullptr) std::terminate();  // unreachable where ours was bound (see the check)
  try {
    return gloos(pair, op, buffer_ref, iov);
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (...) {
    const std::exception_ptr failure = std::current_exception();
    const std::string message = message_for(failure);
    // buffer_ref is a gloo::NonOwningPtr<UnboundBuffer>, a boxed std::shared_ptr whose first word
    // is the buffer; set where the throw came after the receive was taken off the queue.
    if (void* buffer = *static_cast<void**>(buffer_ref)) {
      try {
        apex_gloo_unbound_buffer_signal_exception(
            buffer, std::make_exception_ptr(std::runtime_error(message)));
      } catch (...) {  // NOLINT(bugprone-empty-catch): the pair still gets the error below
      }
    }
    // Pair::read calls this with the pair's lock held (by the loop's handleEvents, or by a
    // receive in sync mode): the pair takes the error as read() gives it a socket's, and -1
    // ("nothing to read yet") ends read() as after one (in sync mode it then throws the pair's
    // error). Should that fail, the exception goes on to handleEvents' handler.
    try {
      apex_gloo_pair_signal_exception(pair, message);
    } catch (...) {
      std::rethrow_exception(failure);
    }
    return -1;
  }
}

extern "C" void apex_gloo_pair_handle_events(void* pair, void* loop, int events) {
  const HandleEvents gloos = gloos_handle_events();
  if (gloos == nullptr) std::terminate();  // unreachable where ours was bound (see the check)
  std::exception_ptr failure;
  try {
    gloos(pair, loop, events);
    return;
  } catch (abi::__forced_unwind&) {
    throw;
  } catch (...) {
    failure = std::current_exception();
  }
  // Gloo's lock on the pair was released by the unwinding: the pair takes the error as it takes
  // a timeout's. Should that fail too, the exception goes on to the terminate handler as before.
  const std::string message = message_for(failure);
  try {
    (void)apex_gloo_pair_signal_exception_external(pair, message);
  } catch (...) {
    std::rethrow_exception(failure);
  }
}

extern "C" void apex_gloo_pair_handle_events_thunk(void* handler, void* loop, int events) {
  apex_gloo_pair_handle_events(static_cast<char*>(handler) - 16, loop, events);
}

namespace apex::parallel::detail {

bool gloo_transport_guarded() {
  // What the loop calls is the pair's vtable slot: it must hold this object's thunk (an address
  // taken here could be another object's definition of the name, through the GOT). Gloo's own
  // definitions must be found behind ours, and Pair::read's prepareRead must resolve to ours.
  const auto* vtable = static_cast<void* const*>(::dlsym(RTLD_DEFAULT, APEX_GLOO_PAIR_VTABLE));
  if (vtable == nullptr || gloos_handle_events() == nullptr || gloos_prepare_read() == nullptr ||
      !is_ours(::dlsym(RTLD_DEFAULT, APEX_GLOO_PAIR_PREPARE_READ), APEX_GLOO_PAIR_PREPARE_READ)) {
    return false;
  }
  Dl_info info{};
  void* entry = nullptr;  // the vtable's ElfW(Sym), for its size
  if (::dladdr1(vtable, &info, &entry, RTLD_DL_SYMENT) == 0 || entry == nullptr) return false;
  const auto* symbol = static_cast<const ElfW(Sym)*>(entry);
  for (size_t i = 0; i < symbol->st_size / sizeof(void*); ++i) {
    if (is_ours(vtable[i], APEX_GLOO_PAIR_HANDLE_EVENTS_THUNK)) return true;
  }
  return false;
}

}  // namespace apex::parallel::detail
