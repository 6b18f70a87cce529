// Every environment variable apex-cpp reads is read through here, and nowhere else: the list, with
// what each means, is docs/environment.md. Torch-free (the stable-ABI op library compiles it too).
#pragma once

#include <optional>
#include <string>

namespace apex::detail {

/// $name as set, or nullopt when it is unset or empty: the library's one read of the environment.
std::optional<std::string> env(const char* name);

/// Whether $name is set to exactly `value`.
bool env_is(const char* name, const char* value);

}  // namespace apex::detail
