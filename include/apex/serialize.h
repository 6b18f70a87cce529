#pragma once

#include <ATen/core/ivalue.h>

#include <string>

namespace torch::nn {
class Module;
}  // namespace torch::nn
namespace torch::optim {
class Optimizer;
}  // namespace torch::optim

namespace apex {

/// Writes `value` (dicts, lists, tuples, strings, numbers, tensors) to `path` in `torch.save`'s
/// format, atomically. Python reads it with `torch.load(path, weights_only=True)`: containers are
/// written without TorchScript type tags, which `torch::pickle_save` adds and weights_only rejects.
void save_pickle(const c10::IValue& value, const std::string& path);

/// Reads a file written by `save_pickle` or by Python's `torch.save`. The file is checked before
/// it is unpickled: every zip record must pass its CRC-32 (LibTorch's reader checks none), and a
/// file of another kind is named in the error ("... is a text file, expected ...").
c10::IValue load_pickle(const std::string& path);

/// `torch::save(module, path)` (parameters and buffers, LibTorch's archive format), written
/// atomically.
void save_module(const torch::nn::Module& module, const std::string& path);

/// `torch::load(module, path)`, checked: every zip record's CRC-32 first, then every parameter
/// and buffer must keep its shape and dtype. On any failure the module's tensors are as they were,
/// and the error names the file and what failed. (Plain torch::load checks none of this: a flipped
/// byte loads silently, and an archive of another model re-shapes the parameters.)
void load_module(torch::nn::Module& module, const std::string& path);

/// `torch::save(optimizer, path)`, written atomically.
void save_optimizer(const torch::optim::Optimizer& optimizer, const std::string& path);

/// `torch::load(optimizer, path)` after the CRC-32 checks; on failure the optimizer's options and
/// state are as they were. apex's fused optimizers also check the archive's kind, their options,
/// their state's shapes and its checksum (and do so under plain torch::load too).
void load_optimizer(torch::optim::Optimizer& optimizer, const std::string& path);

}  // namespace apex
