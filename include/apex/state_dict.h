#pragma once

#include <ATen/core/Dict.h>
#include <ATen/core/ivalue.h>
#include <ATen/core/jit_type.h>

namespace apex {

/// A string-keyed dict of IValues: what `state_dict()` returns throughout apex-cpp. It pickles
/// (`torch::pickle_save`) into a file Python reads with `torch.load(f, weights_only=True)`.
using StateDict = c10::impl::GenericDict;

/// An empty `StateDict`.
inline StateDict make_state_dict() {
  return StateDict(c10::StringType::get(), c10::AnyType::get());
}

}  // namespace apex
