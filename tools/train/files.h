#pragma once

// apex-train's durable file writes: what it writes is either complete or absent.

#include <filesystem>
#include <string>

namespace apex::train {

/// Writes `text` to `path` atomically: a temporary file, flushed to disk, then renamed over
/// `path`. A one-line c10::Error on failure, and no temporary left behind.
void write_file_atomic(const std::string& path, const std::string& text);

/// Flushes a file or folder to disk (fsync), so that a rename after it cannot expose a torn file.
void sync_path(const std::filesystem::path& path);

}  // namespace apex::train
