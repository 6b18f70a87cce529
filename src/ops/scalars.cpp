#include "ops/scalars.h"

#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace apex::ops {
namespace {

// f(T*) with T the C++ type of a tensor's dtype (the real ones and bool).
template <class F>
decltype(auto) with_element_type(const TensorRef& t, F&& f) {
  void* p = t.data;
  switch (t.dtype) {
    case ScalarType::Float:
      return f(static_cast<float*>(p));
    case ScalarType::Double:
      return f(static_cast<double*>(p));
    case ScalarType::Half:
      return f(static_cast<torch::headeronly::Half*>(p));
    case ScalarType::BFloat16:
      return f(static_cast<torch::headeronly::BFloat16*>(p));
    case ScalarType::Long:
      return f(static_cast<int64_t*>(p));
    case ScalarType::Int:
      return f(static_cast<int32_t*>(p));
    case ScalarType::Short:
      return f(static_cast<int16_t*>(p));
    case ScalarType::Char:
      return f(static_cast<int8_t*>(p));
    case ScalarType::Byte:
      return f(static_cast<uint8_t*>(p));
    case ScalarType::Bool:
      return f(static_cast<bool*>(p));
    default:
      fail_with("apex-cpp: unsupported dtype for a scalar tensor: ", DtypeName{t.dtype});
  }
}

void check_one(const TensorRef& t) {
  APEX_OPS_CHECK(t.numel == 1, "apex-cpp: expected a one-element tensor, got ", t.numel,
                 " elements");
}

// The rule in the scale's precision R: the new {scale, growth, hysteresis_left}.
template <class R>
void update(const TensorRef& scale, const TensorRef& growth_tracker,
            const TensorRef& hysteresis_tracker, bool inf, double growth_factor,
            double backoff_factor, int64_t growth_interval, int64_t hysteresis) {
  const R s = static_cast<R>(read_scalar(scale));
  const auto hyst = static_cast<int64_t>(read_scalar(hysteresis_tracker));
  const auto growth = static_cast<int64_t>(read_scalar(growth_tracker));
  // Overflow: one hysteresis step used; back off when none are left.
  const int64_t hyst_after = inf ? hyst - 1 : hyst;
  const bool back_off = inf && hyst_after <= 0;
  // Clean: count towards growth; grow when the interval is reached (and the result is finite).
  const int64_t growth_after = inf ? 0 : growth + 1;
  const bool grow = growth_after >= growth_interval;
  const R grown = s * static_cast<R>(growth_factor);
  const R next =
      back_off ? s * static_cast<R>(backoff_factor) : (grow && std::isfinite(grown) ? grown : s);
  write_scalar(scale, static_cast<double>(next));
  write_scalar(growth_tracker, static_cast<double>(grow ? 0 : growth_after));
  // The budget refills after a clean step (apex); it stays at zero tolerance until then.
  write_scalar(hysteresis_tracker,
               static_cast<double>(inf ? std::max<int64_t>(hyst_after, 0) : hysteresis));
}

}  // namespace

double read_scalar(const TensorRef& t) {
  check_one(t);
  return with_element_type(t, [](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_arithmetic_v<T>) {
      return static_cast<double>(*p);
    } else {
      return static_cast<double>(static_cast<float>(*p));  // Half, BFloat16: through float
    }
  });
}

void write_scalar(const TensorRef& t, double v) {
  check_one(t);
  with_element_type(t, [v](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    if constexpr (std::is_same_v<T, bool>) {
      *p = v != 0.0;
    } else if constexpr (std::is_arithmetic_v<T>) {
      *p = static_cast<T>(v);
    } else {
      *p = static_cast<T>(static_cast<float>(v));  // Half, BFloat16: from float
    }
  });
}

void check_update_scale_hysteresis(const TensorRef& scale, const TensorRef& growth_tracker,
                                   const TensorRef& hysteresis_tracker, const TensorRef& found_inf,
                                   int64_t growth_interval, int64_t hysteresis) {
  constexpr const char* who = "update_scale_hysteresis";
  for (const TensorRef* t : {&scale, &growth_tracker, &hysteresis_tracker, &found_inf}) {
    APEX_OPS_CHECK(t->numel == 1, who, ": expected one-element tensors");
  }
  APEX_OPS_CHECK(growth_interval >= 1 && hysteresis >= 1, who,
                 ": growth_interval and hysteresis must be >= 1");
}

void update_scale_hysteresis(const TensorRef& scale, const TensorRef& growth_tracker,
                             const TensorRef& hysteresis_tracker, const TensorRef& found_inf,
                             double growth_factor, double backoff_factor, int64_t growth_interval,
                             int64_t hysteresis) {
  check_update_scale_hysteresis(scale, growth_tracker, hysteresis_tracker, found_inf,
                                growth_interval, hysteresis);
  for (const TensorRef* t : {&scale, &growth_tracker, &hysteresis_tracker, &found_inf}) {
    require_backend(*t, "update_scale_hysteresis");
    APEX_OPS_CHECK(t->is_cpu(), "update_scale_hysteresis: the host form takes CPU tensors, got ",
                   DeviceOf{*t});
  }
  const bool inf = read_scalar(found_inf) != 0.0;
  if (scale.dtype == ScalarType::Double) {
    update<double>(scale, growth_tracker, hysteresis_tracker, inf, growth_factor, backoff_factor,
                   growth_interval, hysteresis);
  } else {
    update<float>(scale, growth_tracker, hysteresis_tracker, inf, growth_factor, backoff_factor,
                  growth_interval, hysteresis);
  }
}

}  // namespace apex::ops
