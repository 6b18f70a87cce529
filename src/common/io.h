#pragma once

// Internal: whole-file I/O for state files.

#include <ATen/core/ivalue.h>

#include <string>
#include <string_view>
#include <vector>

namespace apex::detail {

/// The whole content of `path`; a clear error when it cannot be read.
std::vector<char> read_file(const std::string& path);

/// `torch.save`-format bytes of `value` (a zip with data.pkl and tensor records) that Python's
/// `torch.load(f, weights_only=True)` accepts: unlike `torch::pickle_save`, containers carry no
/// TorchScript type tags (`torch.jit._pickle.restore_type_tag` is not an allowed global).
/// `kind` (e.g. "amp"), when given, is stored as the archive's "apex_kind" record, so that a
/// loader handed another kind of file can say what it is (torch.load ignores the record).
std::vector<char> pickle_save(const c10::IValue& value, std::string_view kind = "");

/// Reads `torch.save` / `pickle_save` bytes.
c10::IValue pickle_load(const std::vector<char>& bytes);

/// Reads a state file written by pickle_save (or Python's torch.save) and checks it before
/// anything is unpickled: a zip archive whose every record passes its CRC-32, of kind `kind` when
/// it carries one (files without a kind record, e.g. from Python, pass). Errors start with
/// "<who>: '<path>'" and say what the file is when it is not what was expected: `expected`
/// names it (e.g. "an Amp state (Amp::save, or Python's amp.state_dict() saved by torch.save)").
c10::IValue load_state_file(const std::string& path, std::string_view kind, const std::string& who,
                            const std::string& expected);

}  // namespace apex::detail
