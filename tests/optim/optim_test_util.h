#pragma once

// Helpers for the optimizer tests: parameter sets of awkward sizes, reproducible gradients, and
// side-by-side stepping of two optimizers on identical data.

#include <apex/optim/fused_optimizer.h>

#include <functional>
#include <vector>

#include "../common/test_util.h"

namespace apex::test {

/// Sizes the issue asks for: 1, 7, 278011 and the 65536 chunk edges.
inline std::vector<int64_t> edge_sizes() { return {1, 7, 278011, 65535, 65536, 65537}; }

/// 120 tensors of mixed sizes (seeded), from 1 to ~40k elements.
inline std::vector<int64_t> many_sizes() {
  std::vector<int64_t> s;
  for (int64_t i = 0; i < 120; ++i) s.push_back(1 + (i * 7919 + i * i * 104729) % 40000);
  return s;
}

/// Parameters (requires_grad leaves) of the given sizes, values ~N(0, 1), in `dtype`.
inline std::vector<at::Tensor> make_params(const std::vector<int64_t>& sizes, at::ScalarType dtype,
                                           uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  std::vector<at::Tensor> out;
  for (int64_t n : sizes) {
    out.push_back(at::randn({n}, gen).to(dtype).set_requires_grad(true));
  }
  return out;
}

/// Detached copies in `dtype` (requires_grad leaves).
inline std::vector<at::Tensor> copies(const std::vector<at::Tensor>& params, at::ScalarType dtype) {
  std::vector<at::Tensor> out;
  for (const auto& p : params) out.push_back(p.detach().to(dtype).clone().set_requires_grad(true));
  return out;
}

/// Gradient of tensor i at `step`: N(0, 1) from a generator seeded by (seed, step, i), times
/// `scale`, in the parameter's dtype unless `dtype` is given.
inline at::Tensor grad_for(const at::Tensor& p, int step, size_t i, uint64_t seed, double scale = 1,
                           std::optional<at::ScalarType> dtype = std::nullopt) {
  auto gen =
      at::detail::createCPUGenerator(seed * 1000003 + static_cast<uint64_t>(step) * 7919 + i);
  return (at::randn(p.sizes(), gen) * scale).to(dtype.value_or(p.scalar_type()));
}

inline void set_grads(const std::vector<at::Tensor>& params, int step, uint64_t seed,
                      double scale = 1, std::optional<at::ScalarType> dtype = std::nullopt) {
  for (size_t i = 0; i < params.size(); ++i) {
    params[i].mutable_grad() = grad_for(params[i], step, i, seed, scale, dtype);
  }
}

/// Element-wise closeness of two lists at tolerance `tol`.
inline ::testing::AssertionResult lists_close(const std::vector<at::Tensor>& actual,
                                              const std::vector<at::Tensor>& expected,
                                              Tolerance tol) {
  if (actual.size() != expected.size()) return ::testing::AssertionFailure() << "list sizes";
  for (size_t i = 0; i < actual.size(); ++i) {
    auto r = all_close(actual[i], expected[i], tol);
    if (!r) return ::testing::AssertionFailure() << "tensor " << i << ": " << r.message();
  }
  return ::testing::AssertionSuccess();
}

inline bool lists_equal(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!at::equal(a[i], b[i])) return false;
  }
  return true;
}

/// Every state tensor of `opt` (in parameter order, fields in a fixed order), cloned.
inline std::vector<at::Tensor> state_tensors(
    const torch::optim::Optimizer& opt,
    const std::function<std::vector<at::Tensor>(const torch::optim::OptimizerParamState&)>& get) {
  std::vector<at::Tensor> out;
  for (const auto& g : opt.param_groups()) {
    for (const auto& p : g.params()) {
      auto it = opt.state().find(p.unsafeGetTensorImpl());
      if (it == opt.state().end()) continue;
      for (auto& t : get(*it->second)) out.push_back(t.defined() ? t.clone() : t);
    }
  }
  return out;
}

}  // namespace apex::test
