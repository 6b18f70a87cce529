// Gloo's TCP transport runs each device's sockets on one thread of its own (gloo/transport/tcp
// Loop), and that thread calls every pair's handleEvents without a handler around it: a peer
// whose data has another size than this rank expects (the ranks called different collectives)
// makes Pair::read throw gloo::EnforceNotMet there, and the process ends in std::terminate and
// SIGABRT. torch does the same (two Python ranks calling all_reduce with 10 and 20 elements).
//
// This file puts a handler there. Gloo is compiled into libtorch_cpu.so, which exports the pair's
// handleEvents with default visibility and without -Bsymbolic, so the loop reaches it through a
// dynamic relocation (the vtable slot of the pair's Handler base); a definition of the same name in
// the executable comes first in the lookup scope and takes that slot. Ours calls Gloo's own (the
// next definition, dlsym(RTLD_NEXT)) inside try/catch; an exception unwinds the pair's lock and
// becomes the pair's error through Gloo's own signalExceptionExternal, the function Gloo's timeouts
// use: the collective waiting on the pair fails with it, later ones on that pair fail with it too,
// and the pair's socket closes, so the peer's collective fails as well ("Connection closed").
//
// The names are Itanium-ABI mangled names of this gloo's members (`this` is the first argument):
// if a torch renamed or relaid them, the symbols would no longer match, nothing would be interposed
// and gloo_transport_guarded() says so (the terminate handler in process_group.cpp then remains).
#include <dlfcn.h>

#include <exception>
#include <string>

#include "parallel/backends.h"

#define APEX_GLOO_PAIR_HANDLE_EVENTS "_ZN4gloo9transport3tcp4Pair12handleEventsERNS1_4LoopEi"
// The non-virtual thunk the loop calls through the Handler base (at offset 16 in the pair).
#define APEX_GLOO_PAIR_HANDLE_EVENTS_THUNK \
  "_ZThn16_N4gloo9transport3tcp4Pair12handleEventsERNS1_4LoopEi"

extern "C" {
// gloo::transport::tcp::Pair::handleEvents(Loop&, int) and its thunk: ours (exported, see
// src/CMakeLists.txt).
__attribute__((visibility("default"))) void apex_gloo_pair_handle_events(
    void* pair, void* loop, int events) __asm__(APEX_GLOO_PAIR_HANDLE_EVENTS);
__attribute__((visibility("default"))) void apex_gloo_pair_handle_events_thunk(
    void* handler, void* loop, int events) __asm__(APEX_GLOO_PAIR_HANDLE_EVENTS_THUNK);
}

// std::exception_ptr gloo::transport::tcp::Pair::signalExceptionExternal(const std::string&):
// Gloo's (libtorch_cpu). A mangled name says nothing of the return type: this gloo returns the
// pair's exception (through a hidden result pointer ahead of `this`), which the test would catch
// if it changed (a crash where the error should be).
std::exception_ptr
apex_gloo_pair_signal_exception_external(void* pair, const std::string& message) __asm__(
    "_ZN4gloo9transport3tcp4Pair23signalExceptionExternalERKNSt7__cxx1112basic_stringIcSt11"
    "char_traitsIcESaIcEEE");

namespace {

using HandleEvents = void (*)(void*, void*, int);

// Gloo's own handleEvents: the next definition after ours in the lookup scope.
HandleEvents gloos_handle_events() {
  static const auto f =
      reinterpret_cast<HandleEvents>(::dlsym(RTLD_NEXT, APEX_GLOO_PAIR_HANDLE_EVENTS));
  return f;
}

std::string what_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
    return "an exception of unknown type";
  }
}

}  // namespace

extern "C" void apex_gloo_pair_handle_events(void* pair, void* loop, int events) {
  const HandleEvents gloos = gloos_handle_events();
  if (gloos == nullptr) std::terminate();  // unreachable where ours was bound (see the check)
  std::exception_ptr failure;
  try {
    gloos(pair, loop, events);
    return;
  } catch (...) {
    failure = std::current_exception();
  }
  // Gloo's lock on the pair was released by the unwinding: the pair takes the error as it takes
  // a timeout's. Should that fail too, the exception goes on to the terminate handler as before.
  try {
    (void)apex_gloo_pair_signal_exception_external(
        pair, "apex::parallel: Gloo's transport thread failed: " + what_of(failure) +
                  " (the ranks called different collectives: different settings, models or code "
                  "paths, or a peer sent bad data); this connection is closed, every later "
                  "collective on it fails");
  } catch (...) {
    std::rethrow_exception(failure);
  }
}

extern "C" void apex_gloo_pair_handle_events_thunk(void* handler, void* loop, int events) {
  apex_gloo_pair_handle_events(static_cast<char*>(handler) - 16, loop, events);
}

namespace apex::parallel::detail {

bool gloo_transport_guarded() {
  // Ours is what the loop reaches when the lookup scope's first definition is ours, and Gloo's is
  // found behind it.
  return ::dlsym(RTLD_DEFAULT, APEX_GLOO_PAIR_HANDLE_EVENTS_THUNK) ==
             reinterpret_cast<void*>(&apex_gloo_pair_handle_events_thunk) &&
         ::dlsym(RTLD_DEFAULT, APEX_GLOO_PAIR_HANDLE_EVENTS) ==
             reinterpret_cast<void*>(&apex_gloo_pair_handle_events) &&
         gloos_handle_events() != nullptr;
}

}  // namespace apex::parallel::detail
