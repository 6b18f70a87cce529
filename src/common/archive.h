#pragma once

// Internal: integrity of the zip archives apex-cpp writes and reads (torch.save's format, and
// LibTorch's torch::save archives). LibTorch's reader does not check the records' CRC-32 (its
// miniz is built without it), so a flipped byte in a tensor's payload loads silently; these
// checks read the whole central directory and every record before any state is touched.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace apex::detail {

/// CRC-32 (ISO-HDLC, the zip format's) of `n` bytes, continuing from `crc` (0 to start).
uint32_t crc32(const void* data, size_t n, uint32_t crc = 0);

/// One record of a zip archive: its name and where its (stored, uncompressed) bytes lie.
struct ZipRecord {
  std::string name;
  uint64_t offset = 0;
  uint64_t size = 0;  ///< stored bytes (compressed size for a deflated record)
  uint32_t crc = 0;
  uint16_t method = 0;  ///< 0 stored, 8 deflated
};

/// The records of the zip archive `bytes`, after checking its structure (end of central
/// directory, zip64 fields, every local header against its central entry, sizes within the file)
/// and every record's CRC-32. Errors say which of these failed for which record, prefixed by
/// `what` (e.g. "Amp::load: 'ckpt/amp.pt'").
std::vector<ZipRecord> verify_zip(std::string_view bytes, const std::string& what);

/// What kind of file `bytes` holds, for messages of loaders handed the wrong file: an apex-cpp
/// state ("an Amp state", "a GradScaler state", ...), "a torch::save archive (TorchScript
/// format)", "a torch.save / apex::save_pickle file", "a legacy (pre-1.6) torch.save file",
/// "an empty file", "a text file", or "not a file apex-cpp or LibTorch writes". Never throws.
std::string describe_file(std::string_view bytes);

/// The kind record apex-cpp adds to the files it writes ("apex_kind" inside the archive: e.g.
/// "amp", "grad_scaler"), or "" when the archive has none. `records` from verify_zip.
std::string kind_of(std::string_view bytes, const std::vector<ZipRecord>& records);

/// The readable name of a kind ("amp" -> "an Amp state").
std::string kind_name(std::string_view kind);

}  // namespace apex::detail
