#pragma once

#include <ATen/core/ivalue.h>

#include <string>

namespace apex {

/// Writes `value` (dicts, lists, tuples, strings, numbers, tensors) to `path` in `torch.save`'s
/// format, atomically. Python reads it with `torch.load(path, weights_only=True)`: containers are
/// written without TorchScript type tags, which `torch::pickle_save` adds and weights_only rejects.
void save_pickle(const c10::IValue& value, const std::string& path);

/// Reads a file written by `save_pickle` or by Python's `torch.save`.
c10::IValue load_pickle(const std::string& path);

}  // namespace apex
