#pragma once

// Internal: whole-file I/O for state files.

#include <ATen/core/ivalue.h>

#include <string>
#include <vector>

namespace apex::detail {

/// Writes `bytes` to `path` atomically: a temporary file beside it, flushed, then renamed, so a
/// crash never leaves a partial file under `path`.
void write_file_atomic(const std::string& path, const std::vector<char>& bytes);

/// The whole content of `path`; a clear error when it cannot be read.
std::vector<char> read_file(const std::string& path);

/// `torch.save`-format bytes of `value` (a zip with data.pkl and tensor records) that Python's
/// `torch.load(f, weights_only=True)` accepts: unlike `torch::pickle_save`, containers carry no
/// TorchScript type tags (`torch.jit._pickle.restore_type_tag` is not an allowed global).
std::vector<char> pickle_save(const c10::IValue& value);

/// Reads `torch.save` / `pickle_save` bytes.
c10::IValue pickle_load(const std::vector<char>& bytes);

}  // namespace apex::detail
