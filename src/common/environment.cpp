#include "common/environment.h"

#include <cstdlib>
#include <cstring>

namespace apex::detail {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);  // NOLINT(concurrency-mt-unsafe): read-only use
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool env_is(const char* name, const char* value) {
  const std::optional<std::string> v = env(name);
  return v.has_value() && std::strcmp(v->c_str(), value) == 0;
}

}  // namespace apex::detail
