#pragma once

// Loopback helpers for the tools' and tests' own ranks.

namespace apex::train {

/// A TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back, closed).
/// Throws c10::Error naming `who` when no socket can be had.
int free_loopback_port(const char* who);

}  // namespace apex::train
