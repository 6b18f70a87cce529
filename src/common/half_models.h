#pragma once

#include <c10/core/ScalarType.h>

namespace torch::nn {
class Module;
}

namespace apex::detail {

/// Models that apex::amp::initialize cast to half (O2/O3), while their handle lives. apex's O2
/// gave such a model an fp32 state dict (a checkpoint loads into an fp32 model for evaluation or
/// export), so save_module writes their half tensors widened to fp32 and load_module narrows fp32
/// archive tensors back to the half dtype (exactly: they were widened from it).
void register_half_model(const torch::nn::Module* module);
void unregister_half_model(const torch::nn::Module* module);
bool is_half_model(const torch::nn::Module* module);

/// fp16 or bf16: the dtypes amp casts models to.
inline bool is_half(c10::ScalarType t) { return t == c10::kHalf || t == c10::kBFloat16; }

}  // namespace apex::detail
