#pragma once

#include <apex/amp/cpu_half.h>
#include <apex/amp/cpu_half_testing.h>
#include <apex/amp/initialize.h>

#include "../common/test_util.h"

#include <vector>

namespace apex::test {

/// While it lives, the CPU half fallback counts as available whatever this CPU (so the route's
/// tests run on every CPU); then it is decided from the CPU and the environment again.
struct ForceCpuHalfFallback {
  ForceCpuHalfFallback() { apex::amp::detail::force_cpu_half_fallback_available(true); }
  ~ForceCpuHalfFallback() { apex::amp::detail::force_cpu_half_fallback_available(std::nullopt); }
  ForceCpuHalfFallback(const ForceCpuHalfFallback&) = delete;
  ForceCpuHalfFallback& operator=(const ForceCpuHalfFallback&) = delete;
};

/// Options of `level` without the stderr lines on skipped steps, in fp16 (the dtype these tests
/// were written for, with its dynamic loss scaling; on the CPU an unset half_dtype is bf16).
inline apex::amp::Options quiet(apex::amp::OptLevel level) {
  return apex::amp::Options(level).verbosity(0).half_dtype(c10::kHalf);
}

/// Batch `step` of a deterministic stream (same data for every run that asks for that step).
inline Blobs blob_batch(int64_t step, int64_t batch = 64) {
  return make_blobs(batch, 16, 4, 1000 + static_cast<uint64_t>(step));
}

inline bool all_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() || !at::equal(a[i], b[i])) return false;
  }
  return true;
}

/// The Adam moments and step counters of `opt`, in parameter order.
inline std::vector<at::Tensor> adam_state(torch::optim::Adam& opt) {
  std::vector<at::Tensor> out;
  for (auto& g : opt.param_groups()) {
    for (auto& p : g.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      auto& s = static_cast<torch::optim::AdamParamState&>(*it->second);
      out.push_back(s.exp_avg().clone());
      out.push_back(s.exp_avg_sq().clone());
      out.push_back(at::tensor({s.step()}));
    }
  }
  return out;
}

}  // namespace apex::test
