// The CPU kernels' thread pool: ATen's intra-op pool, reached through LibTorch's regular API (the
// C++ library and the Python package's _apex_cpp.so) or through its stable ABI (the Python
// package's _apex_cpp_stable.so, built with APEX_KERNELS_STABLE_ABI, which loads into every torch
// from 2.10 on). The drivers call these three functions and nothing else of torch.
#pragma once

#include <cstdint>

#if defined(APEX_KERNELS_STABLE_ABI)
#include <torch/csrc/stable/ops.h>
#else
#include <ATen/Parallel.h>
#endif

namespace apex::kernels::cpu {

#if defined(APEX_KERNELS_STABLE_ABI)

namespace detail {
// Whether this thread runs inside one of our parallel regions. The stable ABI has no
// in_parallel_region(); torch's pool runs a nested parallel_for inline anyway, so this only keeps
// the drivers' serial shortcut for calls made from inside their own regions.
inline thread_local bool in_region = false;
}  // namespace detail

inline int64_t num_threads() { return static_cast<int64_t>(torch::stable::get_num_threads()); }
inline bool in_parallel_region() { return detail::in_region; }
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  torch::stable::parallel_for(begin, end, grain, [&f](int64_t b, int64_t e) {
    // Restored however f leaves (a kernel may throw std::bad_alloc).
    struct Region {
      bool outer = detail::in_region;
      Region() { detail::in_region = true; }
      ~Region() { detail::in_region = outer; }
      Region(const Region&) = delete;
      Region& operator=(const Region&) = delete;
    } region;
    f(b, e);
  });
}

#else

inline int64_t num_threads() { return at::get_num_threads(); }
inline bool in_parallel_region() { return at::in_parallel_region(); }
template <class F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  at::parallel_for(begin, end, grain, f);
}

#endif

}  // namespace apex::kernels::cpu
