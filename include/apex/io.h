#pragma once

// Durable file writes: whatever apex-cpp writes (state files, apex-train's checkpoints, metrics,
// plots) is either complete or absent, and a write that fails says so.

#include <cstdint>
#include <string>
#include <string_view>

namespace apex {

/// Writes `bytes` to `path` so that `path` holds either its old content or all of `bytes`, never
/// a part: a temporary file beside the target, flushed to disk, renamed over it, and the folder
/// flushed. A symbolic link is followed (its target is replaced, the link stays); an existing
/// `path` that is not a regular file (a folder, a device, a FIFO, a socket) is refused. Errors
/// (full disk, permissions) name the path and the reason, and leave no temporary behind.
void write_file_atomic(const std::string& path, std::string_view bytes);

/// Checks, before long work starts, that write_file_atomic(path, ...) can succeed: the folder
/// exists and is writable, and `path` is absent, a regular file, or a link to one. Errors name the
/// path and say what is wrong with it; `who` prefixes them (e.g. "apex-train: --metrics").
void check_writable(const std::string& path, const std::string& who);

/// The whole content of the regular file `path` (a folder, device or FIFO is refused: reading one
/// could block or never end). Errors name the path and the reason.
std::string read_file(const std::string& path);

/// CRC-32 (the zip format's, ISO-HDLC) of `bytes`, continuing from `crc` (0 to start).
uint32_t crc32(std::string_view bytes, uint32_t crc = 0);

/// Flushes a file or a folder to disk (fsync), so that a rename after it cannot expose a torn
/// file.
void sync_path(const std::string& path);

}  // namespace apex
