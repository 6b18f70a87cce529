#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

namespace apex {

/// A string-keyed dict of IValues: what `state_dict()` returns throughout apex-cpp. Save it with
/// `apex::save_pickle` (apex/serialize.h) for Python's `torch.load(f, weights_only=True)`:
/// `torch::pickle_save` adds TorchScript type tags, which weights_only rejects.
using StateDict = c10::impl::GenericDict;

/// An empty `StateDict`.
inline StateDict make_state_dict() {
  return StateDict(c10::StringType::get(), c10::AnyType::get());
}

}  // namespace apex
