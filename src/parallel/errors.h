// Error text shared by src/parallel: c10d rethrows c10::Errors (whose what() carries a
// backtrace) and Gloo's own exceptions alike.
#pragma once

#include <c10/util/Exception.h>

#include <exception>
#include <string>

namespace apex::parallel::detail {

/// The message of `e`, without c10's backtrace.
inline std::string message_of(const std::exception& e) {
  const auto* c = dynamic_cast<const c10::Error*>(&e);
  return c != nullptr ? c->what_without_backtrace() : e.what();
}

/// The message of the exception `e` holds; empty for none or one that is no std::exception.
inline std::string message_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return message_of(x);
  } catch (...) {
    return {};
  }
}

}  // namespace apex::parallel::detail
