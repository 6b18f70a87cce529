#pragma once

#include <c10/util/Exception.h>

#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <string>
#include "common/environment.h"

namespace apex::parallel::detail {

/// The largest world size apex's groups and samplers accept (as init_process_group's checks).
inline constexpr int64_t kMaxWorld = 1 << 20;

using apex::detail::env;  // $name, or nullopt when unset or empty

/// A whole decimal integer in [lo, hi], or a one-line error "`who`: `what` must be ...".
inline int64_t parse_int(const std::string& text, const char* who, const char* what, int64_t lo,
                         int64_t hi) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(text.c_str(), &end, 10);
  TORCH_CHECK(errno == 0 && end != text.c_str() && *end == '\0' && v >= lo && v <= hi, who, ": ",
              what, " must be an integer in [", lo, ", ", hi, "], got '", text, "'");
  return v;
}

}  // namespace apex::parallel::detail
