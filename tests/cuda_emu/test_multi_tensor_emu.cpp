// The CUDA multi-tensor kernels (src/kernels/cuda/multi_tensor.cu over multi_tensor_apply.cuh),
// run by the emulation through the kernel-layer entry points the library calls
// (kernels::cuda::scale, axpby, norm, check_finite, adam, sgd, adagrad, lamb_stage1/2, novograd),
// against float64 references: every op and variant, fp32/fp16/bf16 storage, lists of 1, 150 and
// 300 tensors (several launches), empty tensors, chunk edges, misaligned tensors (scalar frames),
// and a tensor split across launches by the block limit. The schedule comes from
// CUDA_EMU_SCHEDULE (CTest runs the suite under two).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "emu_test_util.h"
#include "kernels/multi_tensor.h"

namespace {

namespace k = apex::kernels;
using cuda_emu_test::Buffer;
using cuda_emu_test::close;
using cuda_emu_test::guards_intact;
using cuda_emu_test::kBF16;
using cuda_emu_test::kF16;
using cuda_emu_test::kF32;
using cuda_emu_test::round_to;
using cuda_emu_test::tolerance_for;
using k::DType;
constexpr int64_t kChunk = 65536;

/// Element counts of `count` tensors: chunk edges, empty and tiny tensors among small ones. The
/// 300-tensor lists (for the launch count) keep to small tensors, so that they stay quick.
std::vector<int64_t> sizes(int count, uint64_t seed) {
  static const int64_t edges[] = {kChunk - 1, kChunk, kChunk + 1, 2 * kChunk + 3, 0, 1, 7, 0};
  std::mt19937_64 rng(seed);
  std::vector<int64_t> out;
  for (int i = 0; i < count; ++i) {
    if (count == 1) {
      out.push_back(kChunk + 5);
    } else if (i % 37 == 5) {
      out.push_back(count > 150 ? edges[4 + (i / 37) % 4] : edges[(i / 37) % 8]);
    } else {
      out.push_back(static_cast<int64_t>(rng() % 1500));
    }
  }
  return out;
}

struct ListSpec {
  DType dtype = kF32;
  bool present = true;
  double lo = -1.0;  ///< initial values, uniform in [lo, hi)
  double hi = 1.0;
};

/// Tensor lists in kernel memory: list l, tensor t is a Buffer; some tensors are misaligned (the
/// kernels' scalar frames), some empty ones have null data pointers (allowed for empty tensors).
class Lists {
 public:
  Lists(const std::vector<int64_t>& numel, const std::vector<ListSpec>& specs, uint64_t seed)
      : numel_(numel), specs_(specs) {
    bufs_.resize(specs.size());
    ptrs_.resize(specs.size());
    for (std::size_t l = 0; l < specs.size(); ++l) {
      if (!specs[l].present) continue;
      for (std::size_t t = 0; t < numel.size(); ++t) {
        const int64_t offset = t % 7 == 3 ? 1 : 0;
        Buffer b(specs[l].dtype, numel[t], offset);
        cuda_emu_test::fill_uniform(b, seed * 131 + l * 7919 + t, specs[l].lo, specs[l].hi);
        ptrs_[l].push_back(numel[t] == 0 && t % 2 == 0 ? nullptr : b.data());
        bufs_[l].push_back(std::move(b));
      }
    }
  }

  k::TensorLists view() const {
    k::TensorLists v;
    v.num_tensors = static_cast<int64_t>(numel_.size());
    v.numel = numel_.data();
    for (std::size_t l = 0; l < specs_.size(); ++l) {
      v.ptrs[l] = specs_[l].present ? ptrs_[l].data() : nullptr;
      v.dtype[l] = specs_[l].dtype;
    }
    return v;
  }

  int64_t tensors() const { return static_cast<int64_t>(numel_.size()); }
  int64_t numel(int64_t t) const { return numel_[static_cast<std::size_t>(t)]; }
  bool present(int l) const { return specs_[static_cast<std::size_t>(l)].present; }
  DType dtype(int l) const { return specs_[static_cast<std::size_t>(l)].dtype; }
  Buffer& at(int l, int64_t t) {
    return bufs_[static_cast<std::size_t>(l)][static_cast<std::size_t>(t)];
  }
  const Buffer& at(int l, int64_t t) const {
    return bufs_[static_cast<std::size_t>(l)][static_cast<std::size_t>(t)];
  }

  /// The values of list l over all tensors, in order.
  std::vector<double> values(int l) const {
    std::vector<double> out;
    for (int64_t t = 0; t < tensors(); ++t) {
      const std::vector<double> v = at(l, t).values();
      out.insert(out.end(), v.begin(), v.end());
    }
    return out;
  }

  Lists clone() const {
    Lists c(*this, 0);
    return c;
  }

  ::testing::AssertionResult guards() const {
    for (std::size_t l = 0; l < specs_.size(); ++l) {
      if (!specs_[l].present) continue;
      for (int64_t t = 0; t < tensors(); ++t) {
        const auto r = guards_intact(at(static_cast<int>(l), t),
                                     "list " + std::to_string(l) + " tensor " + std::to_string(t));
        if (!r) return r;
      }
    }
    return ::testing::AssertionSuccess();
  }

  bool same_bits(const Lists& o) const {
    for (std::size_t l = 0; l < specs_.size(); ++l) {
      if (!specs_[l].present) continue;
      for (int64_t t = 0; t < tensors(); ++t) {
        if (!at(static_cast<int>(l), t).same_bits(o.at(static_cast<int>(l), t))) return false;
      }
    }
    return true;
  }

 private:
  Lists(const Lists& o, int /*deep*/) : numel_(o.numel_), specs_(o.specs_) {
    bufs_.resize(o.bufs_.size());
    ptrs_.resize(o.ptrs_.size());
    for (std::size_t l = 0; l < o.bufs_.size(); ++l) {
      for (std::size_t t = 0; t < o.bufs_[l].size(); ++t) {
        bufs_[l].push_back(o.bufs_[l][t].clone());
        ptrs_[l].push_back(o.ptrs_[l][t] == nullptr ? nullptr : bufs_[l][t].data());
      }
    }
  }

  std::vector<int64_t> numel_;
  std::vector<ListSpec> specs_;
  std::vector<std::vector<Buffer>> bufs_;
  std::vector<std::vector<void*>> ptrs_;
};

/// The float64 update of one element: v[l] holds list l's input value (NaN when absent) and
/// receives its output value.
using ElementRef = std::function<void(int64_t tensor, double* v)>;

/// Runs `ref` over every element of `before` and compares the written lists of `after` with it
/// (tolerance of each list's dtype); checks the guards of every tensor.
void expect_elementwise(const Lists& before, const Lists& after, const std::vector<int>& written,
                        const ElementRef& ref) {
  std::vector<std::vector<double>> want(k::kMaxLists);
  for (int64_t t = 0; t < before.tensors(); ++t) {
    for (int64_t i = 0; i < before.numel(t); ++i) {
      double v[k::kMaxLists];
      for (int l = 0; l < k::kMaxLists; ++l) {
        v[l] =
            before.present(l) ? before.at(l, t).get(i) : std::numeric_limits<double>::quiet_NaN();
      }
      ref(t, v);
      for (const int l : written) want[static_cast<std::size_t>(l)].push_back(v[l]);
    }
  }
  for (const int l : written) {
    EXPECT_TRUE(
        close(after.values(l), want[static_cast<std::size_t>(l)], tolerance_for(after.dtype(l))))
        << "list " << l;
  }
  EXPECT_TRUE(after.guards());
}

/// A list spec per list; absent lists get present = false. Lists beyond specs are absent.
std::vector<ListSpec> pad(std::vector<ListSpec> specs) {
  while (specs.size() < 6) specs.push_back(ListSpec{kF32, false});
  return specs;
}

/// A float in kernel memory with guards (found_inf, inv_scale, lr, step).
class Scalar {
 public:
  explicit Scalar(float v) : b_(kF32, 1) { b_.set(0, v); }
  float* ptr() { return b_.f32(); }
  float get() const { return static_cast<float>(b_.get(0)); }

 private:
  Buffer b_;
};

class MultiTensorEmu : public ::testing::TestWithParam<int> {
 protected:
  void TearDown() override { EXPECT_EQ(cuda_emu::live_allocations(), 0u) << "scratch leaked"; }
  int count() const { return GetParam(); }
  /// The 300-tensor lists run the first and last variants and two storages only (the other
  /// combinations run on 1 and 150 tensors): what they add is the number of launches.
  bool skip(std::size_t variant, std::size_t variants, std::size_t storage) const {
    return count() > 150 &&
           ((variant != 0 && variant + 1 != variants) || (storage != 0 && storage != 3));
  }
  std::vector<int64_t> numel() const { return sizes(count(), 1000 + count()); }
};

std::string count_name(const ::testing::TestParamInfo<int>& i) {
  return "tensors" + std::to_string(i.param);
}

INSTANTIATE_TEST_SUITE_P(Lists, MultiTensorEmu, ::testing::Values(1, 150, 300), count_name);

const DType kAll[] = {kF32, kF16, kBF16};

// ---------------------------------------------------------------------------------------------
// scale, axpby, check_finite, norm
// ---------------------------------------------------------------------------------------------

TEST_P(MultiTensorEmu, Scale) {
  for (const DType tin : kAll) {
    for (const DType tout : kAll) {
      if (count() > 150 && tin != tout) continue;
      for (const bool with_inf : {false, true}) {
        SCOPED_TRACE(std::string(cuda_emu_test::dtype_name(tin)) + " -> " +
                     cuda_emu_test::dtype_name(tout) + (with_inf ? ", an inf" : ""));
        Lists lists(numel(), pad({{tin}, {tout}}), 11);
        if (with_inf)
          lists.at(0, lists.tensors() - 1).set(lists.numel(lists.tensors() - 1) - 1, INFINITY);
        const Lists before = lists.clone();
        Scalar found(0.0f);
        k::ScaleArgs a;
        a.scale = 0.375f;
        a.found_inf = found.ptr();
        k::cuda::scale(lists.view(), a, nullptr);
        expect_elementwise(before, lists, {1}, [&](int64_t, double* v) { v[1] = v[0] * 0.375; });
        EXPECT_EQ(found.get(), with_inf ? 1.0f : 0.0f);
      }
    }
  }
}

TEST_P(MultiTensorEmu, Axpby) {
  const DType combos[][3] = {
      {kF32, kF32, kF32}, {kF16, kF32, kF16}, {kBF16, kBF16, kF32}, {kF32, kF16, kBF16}};
  for (std::size_t ci = 0; ci < std::size(combos); ++ci) {
    const auto& d = combos[ci];
    for (const int check : {-1, 0, 1}) {
      for (const int inf_in : {-1, 0, 1}) {  // no inf, an inf in x, an inf in y
        if (count() > 150 && (ci != 1 || inf_in != check)) continue;
        SCOPED_TRACE("arg_to_check " + std::to_string(check) + ", inf in " +
                     std::to_string(inf_in));
        Lists lists(numel(), pad({{d[0]}, {d[1]}, {d[2]}}), 12);
        if (inf_in >= 0) lists.at(inf_in, lists.tensors() - 1).set(0, -INFINITY);
        const Lists before = lists.clone();
        Scalar found(0.0f);
        k::AxpbyArgs a;
        a.a = 0.5f;
        a.b = -1.25f;
        a.arg_to_check = check;
        a.found_inf = found.ptr();
        k::cuda::axpby(lists.view(), a, nullptr);
        expect_elementwise(before, lists, {2},
                           [&](int64_t, double* v) { v[2] = 0.5 * v[0] - 1.25 * v[1]; });
        const bool flagged =
            inf_in >= 0 && (check == -1 || check == inf_in) && lists.numel(lists.tensors() - 1) > 0;
        EXPECT_EQ(found.get(), flagged ? 1.0f : 0.0f);
      }
    }
  }
}

TEST_P(MultiTensorEmu, CheckFinite) {
  for (const DType t : kAll) {
    for (const double bad : {0.0, double{INFINITY}, double{NAN}}) {
      Lists lists(numel(), pad({{t}}), 13);
      int64_t where = -1;
      if (bad != 0.0) {
        for (int64_t i = lists.tensors() - 1; i >= 0 && where < 0; --i) {
          if (lists.numel(i) > 0) where = i;
        }
        lists.at(0, where).set(lists.numel(where) / 2, bad);
      }
      const Lists before = lists.clone();
      Scalar found(0.0f);
      k::cuda::check_finite(lists.view(), found.ptr(), nullptr);
      EXPECT_EQ(found.get(), bad != 0.0 ? 1.0f : 0.0f) << cuda_emu_test::dtype_name(t);
      EXPECT_TRUE(lists.same_bits(before)) << "check_finite wrote its input";
    }
  }
}

/// Norm of x * inv_scale: total and per tensor, L2 and inf, NaN propagation.
void check_norm(const Lists& lists, k::NormType type, const float* inv_scale, bool per_tensor) {
  const int64_t n = lists.tensors();
  Buffer total(kF32, 1);
  Buffer each(kF32, n);
  total.poison();
  each.poison();
  k::NormArgs a;
  a.type = type;
  a.inv_scale = inv_scale;
  a.total = total.f32();
  a.per_tensor = per_tensor ? each.f32() : nullptr;
  k::cuda::norm(lists.view(), a, nullptr);

  const double s = inv_scale != nullptr ? *inv_scale : 1.0;
  std::vector<double> ref(static_cast<std::size_t>(n));
  double all = 0.0;
  for (int64_t t = 0; t < n; ++t) {
    double acc = 0.0;
    for (int64_t i = 0; i < lists.numel(t); ++i) {
      const double v = static_cast<float>(lists.at(0, t).get(i) * s);  // x * s is fp32
      if (type == k::NormType::kL2) {
        acc += v * v;
      } else {
        acc = (std::isnan(v) || std::fabs(v) > acc) ? std::fabs(v) : acc;
        if (std::isnan(acc)) break;
      }
    }
    if (type == k::NormType::kL2) {
      all += acc;
      ref[static_cast<std::size_t>(t)] = std::sqrt(acc);
    } else {
      all = (std::isnan(acc) || acc > all) ? acc : all;
      ref[static_cast<std::size_t>(t)] = acc;
    }
  }
  const double ref_total = type == k::NormType::kL2 ? std::sqrt(all) : all;
  EXPECT_TRUE(close(total.values(), {ref_total}, tolerance_for(kF32))) << "total";
  if (per_tensor) {
    EXPECT_TRUE(close(each.values(), ref, tolerance_for(kF32))) << "per tensor";
  } else {
    EXPECT_TRUE(std::isnan(each.get(0))) << "per-tensor norms written though not asked for";
  }
  EXPECT_TRUE(guards_intact(total, "total"));
  EXPECT_TRUE(guards_intact(each, "per tensor"));
}

TEST_P(MultiTensorEmu, Norms) {
  for (const DType t : kAll) {
    Lists lists(numel(), pad({{t}}), 14);
    Scalar inv(1.0f / 1024.0f);
    for (const auto type : {k::NormType::kL2, k::NormType::kInf}) {
      SCOPED_TRACE(std::string(cuda_emu_test::dtype_name(t)) +
                   (type == k::NormType::kL2 ? " l2" : " inf"));
      check_norm(lists, type, nullptr, true);
      check_norm(lists, type, nullptr, false);
      check_norm(lists, type, inv.ptr(), true);  // unscale-l2norm: the norm of x / scale
    }
    // A NaN propagates to the total and its tensor's norm, in both norms.
    if (lists.numel(0) > 0) {
      lists.at(0, 0).set(0, NAN);
      check_norm(lists, k::NormType::kL2, nullptr, true);
      check_norm(lists, k::NormType::kInf, nullptr, true);
    }
  }
}

TEST(MultiTensorEmuEdges, EmptyListsAndEmptyTensors) {
  // No tensors: total 0, nothing launched.
  cuda_emu::reset_stats();
  Buffer total(kF32, 1);
  total.poison();
  k::NormArgs a;
  a.total = total.f32();
  k::cuda::norm(k::TensorLists{}, a, nullptr);
  EXPECT_EQ(total.get(0), 0.0);
  // Only empty tensors: zeros, and no launch.
  Lists empty({0, 0, 0}, pad({{kF16}}), 15);
  Buffer each(kF32, 3);
  each.poison();
  a.per_tensor = each.f32();
  k::cuda::norm(empty.view(), a, nullptr);
  EXPECT_EQ(total.get(0), 0.0);
  for (int t = 0; t < 3; ++t) EXPECT_EQ(each.get(t), 0.0);
  Scalar found(0.0f);
  k::ScaleArgs s;
  s.found_inf = found.ptr();
  Lists empty2({0, 0}, pad({{kF32}, {kF32}}), 16);
  k::cuda::scale(empty2.view(), s, nullptr);
  EXPECT_EQ(cuda_emu::stats().launches, 0u);
  EXPECT_EQ(cuda_emu::live_allocations(), 0u);
}

TEST(MultiTensorEmuEdges, MessagesNameTheProblem) {
  Lists lists({5}, pad({{kF32}, {kF32}}), 17);
  k::ScaleArgs s;  // found_inf missing
  try {
    k::cuda::scale(lists.view(), s, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "apex::kernels::cuda::scale: found_inf is required");
  }
  Lists adam_lists({5}, pad({{kF32}, {kF32}, {kF16}, {kF32}}), 18);
  try {
    k::cuda::adam(adam_lists.view(), k::AdamArgs{}, nullptr);
    ADD_FAILURE() << "no error";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "apex::kernels::cuda::adam: list 2 must be float32");
  }
}

/// A tensor longer than one launch's 320 blocks continues in the next launch (slot 0), between
/// two small tensors: scale, check_finite and the norms (whose partials are numbered across
/// launches) must see every chunk once.
TEST(MultiTensorEmuEdges, TensorSplitAcrossLaunches) {
  const int64_t big = 320 * kChunk + 3 * kChunk / 2 + 1;  // 322 chunks, the last partial
  const std::vector<int64_t> numel = {1000, big, 5};
  Lists lists(numel, pad({{kF16}, {kF16}}), 19);
  // Mark both sides of the launch boundary and the very last element.
  lists.at(0, 1).set(319 * kChunk - 1, 8.0);
  lists.at(0, 1).set(319 * kChunk, -8.0);
  lists.at(0, 1).set(big - 1, 4.0);
  cuda_emu::reset_stats();
  check_norm(lists, k::NormType::kL2, nullptr, true);
  check_norm(lists, k::NormType::kInf, nullptr, true);
  EXPECT_GE(cuda_emu::stats().launches, 2u * 2u);  // two apply launches per norm, at least

  const Lists before = lists.clone();
  Scalar found(0.0f);
  k::ScaleArgs a;
  a.scale = 2.0f;
  a.found_inf = found.ptr();
  k::cuda::scale(lists.view(), a, nullptr);
  expect_elementwise(before, lists, {1}, [](int64_t, double* v) { v[1] = 2.0 * v[0]; });
  EXPECT_EQ(found.get(), 0.0f);

  lists.at(0, 1).set(big - 1, INFINITY);  // in the second launch only
  k::cuda::check_finite(lists.view(), found.ptr(), nullptr);
  EXPECT_EQ(found.get(), 1.0f);
}

// ---------------------------------------------------------------------------------------------
// Optimizers
// ---------------------------------------------------------------------------------------------

/// Parameter dtype, gradient dtype, fp32 master present.
struct Storage {
  DType p;
  DType g;
  bool master;
  std::string name() const {
    return std::string("p") + cuda_emu_test::dtype_name(p) + "_g" + cuda_emu_test::dtype_name(g) +
           (master ? "_master" : "");
  }
};

const Storage kStorages[] = {{kF32, kF32, false},
                             {kF16, kF16, false},
                             {kBF16, kBF16, false},
                             {kF16, kF16, true},
                             {kBF16, kF32, true}};

/// After the update, the model param list holds the master's value rounded to its dtype.
void round_model(double* v, int master_list, DType p, bool master) {
  if (master) v[0] = round_to(p, v[master_list]);
}

TEST_P(MultiTensorEmu, Adam) {
  struct Variant {
    bool adam_w;
    float wd;
    bool bias_correction;
    bool capturable;
    bool scaled;  // inv_scale given
    int64_t step;
  };
  const Variant variants[] = {{true, 0.01f, true, false, false, 1},
                              {false, 0.1f, true, false, true, 7},
                              {true, 0.0f, false, false, false, 3},
                              {true, 0.05f, true, true, true, 10},
                              {false, 0.0f, true, true, false, 2}};
  for (std::size_t si = 0; si < std::size(kStorages); ++si) {
    const Storage& st = kStorages[si];
    for (std::size_t vi = 0; vi < std::size(variants); ++vi) {
      if (skip(vi, std::size(variants), si)) continue;
      const Variant& var = variants[vi];
      SCOPED_TRACE(st.name() + (var.adam_w ? " adamw" : " adam") + " wd " + std::to_string(var.wd) +
                   (var.capturable ? " capturable" : "") + " step " + std::to_string(var.step));
      Lists lists(numel(),
                  pad({{st.p},
                       {st.g, true, -2.0, 2.0},
                       {kF32, true, -0.1, 0.1},
                       {kF32, true, 0.0, 0.01},
                       {kF32, st.master}}),
                  20 + var.step);
      const Lists before = lists.clone();
      Scalar inv(0.5f);
      Scalar lr(2e-3f);
      Scalar step(static_cast<float>(var.step));
      k::AdamArgs a;
      a.lr = var.capturable ? 99.0f : 2e-3f;  // capturable mode must read lr_ptr instead
      a.beta1 = 0.9f;
      a.beta2 = 0.999f;
      a.eps = 1e-8f;
      a.weight_decay = var.wd;
      a.adam_w_mode = var.adam_w;
      a.bias_correction = var.bias_correction;
      a.step = var.capturable ? 12345 : var.step;
      a.lr_ptr = var.capturable ? lr.ptr() : nullptr;
      a.step_ptr = var.capturable ? step.ptr() : nullptr;
      a.amp.inv_scale = var.scaled ? inv.ptr() : nullptr;
      k::cuda::adam(lists.view(), a, nullptr);

      const double b1 = a.beta1, b2 = a.beta2, eps = a.eps, wd = a.weight_decay;
      const double lr_v = 2e-3f;
      const double bc1 = var.bias_correction ? 1.0 - std::pow(b1, var.step) : 1.0;
      const double bc2 = var.bias_correction ? 1.0 - std::pow(b2, var.step) : 1.0;
      const double gs = var.scaled ? 0.5 : 1.0;
      const int ml = 4;
      expect_elementwise(before, lists,
                         st.master ? std::vector<int>{0, 2, 3, 4} : std::vector<int>{0, 2, 3},
                         [&](int64_t, double* v) {
                           double p = st.master ? v[ml] : v[0];
                           double g = v[1] * gs;
                           if (wd != 0.0) {
                             if (var.adam_w) {
                               p *= 1.0 - lr_v * wd;
                             } else {
                               g += wd * p;
                             }
                           }
                           v[2] = b1 * v[2] + (1.0 - b1) * g;
                           v[3] = b2 * v[3] + (1.0 - b2) * g * g;
                           p -= (lr_v / bc1) * v[2] / (std::sqrt(v[3]) / std::sqrt(bc2) + eps);
                           if (st.master) v[ml] = p;
                           v[0] = p;
                           round_model(v, ml, st.p, st.master);
                         });
    }
  }
}

TEST_P(MultiTensorEmu, FoundInfSkipsEveryOptimizer) {
  Scalar found(1.0f);
  Scalar gnorm(1.0f);
  const std::vector<int64_t> n = numel();
  Buffer sums_u(kF32, static_cast<int64_t>(n.size()));
  Buffer sums_p(kF32, static_cast<int64_t>(n.size()));
  Buffer v(kF32, static_cast<int64_t>(n.size()));
  for (int64_t t = 0; t < v.size(); ++t) v.set(t, 0.5);
  for (const Storage& st : kStorages) {
    SCOPED_TRACE(st.name());
    Lists l5(n, pad({{st.p}, {st.g}, {kF32}, {kF32, true, 0.0, 1.0}, {kF32, st.master}}), 30);
    Lists l4(n, pad({{st.p}, {st.g}, {kF32, true, 0.0, 1.0}, {kF32, st.master}}), 31);
    const Lists b5 = l5.clone();
    const Lists b4 = l4.clone();
    k::AdamArgs adam;
    adam.amp.found_inf = found.ptr();
    k::cuda::adam(l5.view(), adam, nullptr);
    k::LambArgs lamb;
    lamb.global_grad_norm = gnorm.ptr();
    lamb.u_sumsq = sums_u.f32();
    lamb.p_sumsq = sums_p.f32();
    lamb.amp.found_inf = found.ptr();
    k::cuda::lamb_stage1(l5.view(), lamb, nullptr);
    k::cuda::lamb_stage2(l5.view(), lamb, nullptr);
    EXPECT_TRUE(l5.same_bits(b5)) << "adam/lamb changed something on a skipped step";
    k::SgdArgs sgd;
    sgd.lr = 0.1f;
    sgd.momentum = 0.9f;
    sgd.amp.found_inf = found.ptr();
    k::cuda::sgd(l4.view(), sgd, nullptr);
    k::AdagradArgs adagrad;
    adagrad.amp.found_inf = found.ptr();
    k::cuda::adagrad(l4.view(), adagrad, nullptr);
    k::NovoGradArgs novograd;
    novograd.v = v.f32();
    novograd.amp.found_inf = found.ptr();
    k::cuda::novograd(l4.view(), novograd, nullptr);
    EXPECT_TRUE(l4.same_bits(b4)) << "sgd/adagrad/novograd changed something on a skipped step";
  }
}

// AmpArgs::unscale_grads (GradScaler's contract, the kernel writes g * inv_scale back): every
// optimizer, every storage, stepped and skipped. Against the same call without it: every other
// list bit-identical (the update reads what it read before), the gradients exactly the fp32
// product rounded to their dtype; skipped: only the gradients change; without inv_scale: nothing
// is written.
TEST_P(MultiTensorEmu, UnscaleGradsWritesTheUnscaledGradientsOnly) {
  const std::vector<int64_t> n = numel();
  Buffer v(kF32, static_cast<int64_t>(n.size()));
  for (int64_t t = 0; t < v.size(); ++t) v.set(t, 0.5);
  Scalar gnorm(3.0f);
  const float inv_value = 0.375f;  // not a power of two: the product rounds
  for (const Storage& st : kStorages) {
    for (const bool skipped : {false, true}) {
      for (const bool with_inv : {true, false}) {
        SCOPED_TRACE(st.name() + (skipped ? " skipped" : " stepped") +
                     (with_inv ? "" : " without inv_scale"));
        Lists l5(n,
                 pad({{st.p},
                      {st.g, true, -4.0, 4.0},
                      {kF32},
                      {kF32, true, 0.0, 1.0},
                      {kF32, st.master}}),
                 50);
        Lists l4(n,
                 pad({{st.p}, {st.g, true, -4.0, 4.0}, {kF32, true, 0.0, 1.0}, {kF32, st.master}}),
                 51);
        Scalar inv(inv_value);
        Scalar found(skipped ? 1.0f : 0.0f);
        // Runs every optimizer on fresh clones, with or without the write-back.
        const auto run = [&](bool unscale, Lists& a5, Lists& b4, Lists& c4, Lists& d4, Lists& e5) {
          k::AmpArgs amp;
          amp.inv_scale = with_inv ? inv.ptr() : nullptr;
          amp.found_inf = found.ptr();
          amp.unscale_grads = unscale;
          k::AdamArgs adam;
          adam.weight_decay = 0.01f;
          adam.amp = amp;
          k::cuda::adam(a5.view(), adam, nullptr);
          k::SgdArgs sgd;
          sgd.lr = 0.1f;
          sgd.momentum = 0.9f;
          sgd.amp = amp;
          k::cuda::sgd(b4.view(), sgd, nullptr);
          k::AdagradArgs adagrad;
          adagrad.amp = amp;
          k::cuda::adagrad(c4.view(), adagrad, nullptr);
          k::NovoGradArgs novograd;
          novograd.v = v.f32();
          novograd.amp = amp;
          k::cuda::novograd(d4.view(), novograd, nullptr);
          Buffer su(kF32, static_cast<int64_t>(n.size()));
          Buffer sp(kF32, static_cast<int64_t>(n.size()));
          k::LambArgs lamb;
          lamb.global_grad_norm = gnorm.ptr();
          lamb.u_sumsq = su.f32();
          lamb.p_sumsq = sp.f32();
          lamb.amp = amp;
          k::cuda::lamb_stage1(e5.view(), lamb, nullptr);
          k::cuda::lamb_stage2(e5.view(), lamb, nullptr);
        };
        Lists a5 = l5.clone(), b4 = l4.clone(), c4 = l4.clone(), d4 = l4.clone(), e5 = l5.clone();
        Lists A5 = l5.clone(), B4 = l4.clone(), C4 = l4.clone(), D4 = l4.clone(), E5 = l5.clone();
        run(false, a5, b4, c4, d4, e5);
        run(true, A5, B4, C4, D4, E5);
        const auto check = [&](const char* name, const Lists& before, const Lists& plain,
                               const Lists& written) {
          SCOPED_TRACE(name);
          for (int l = 0; l < k::kMaxLists; ++l) {
            if (!before.present(l)) continue;
            for (int64_t t = 0; t < before.tensors(); ++t) {
              if (l != 1) {
                EXPECT_TRUE(written.at(l, t).same_bits(plain.at(l, t)))
                    << "list " << l << " tensor " << t << " differs with the write-back";
                continue;
              }
              EXPECT_TRUE(plain.at(1, t).same_bits(before.at(1, t)))
                  << "gradients written without unscale_grads, tensor " << t;
              for (int64_t i = 0; i < before.numel(t); ++i) {
                const double g = before.at(1, t).get(i);
                const double want =
                    with_inv
                        ? round_to(st.g, static_cast<double>(static_cast<float>(g) * inv_value))
                        : g;
                ASSERT_EQ(written.at(1, t).get(i), want)
                    << "tensor " << t << " element " << i << " (g " << g << ")";
              }
            }
          }
          EXPECT_TRUE(written.guards());
        };
        check("adam", l5, a5, A5);
        check("sgd", l4, b4, B4);
        check("adagrad", l4, c4, C4);
        check("novograd", l4, d4, D4);
        check("lamb", l5, e5, E5);
        if (skipped) {
          EXPECT_TRUE(a5.same_bits(l5)) << "a skipped step changed something";
        }
      }
    }
  }
}

TEST_P(MultiTensorEmu, Sgd) {
  struct Variant {
    float momentum;
    float dampening;
    float wd;
    bool nesterov;
    bool wd_after;
    bool first_run;
  };
  const Variant variants[] = {
      {0.0f, 0.0f, 0.0f, false, false, false}, {0.0f, 0.0f, 0.01f, false, false, false},
      {0.9f, 0.0f, 0.01f, false, false, true}, {0.9f, 0.1f, 0.01f, false, false, false},
      {0.9f, 0.0f, 0.02f, true, false, false}, {0.8f, 0.0f, 0.02f, true, true, false}};
  for (std::size_t si = 0; si < std::size(kStorages); ++si) {
    const Storage& st = kStorages[si];
    for (std::size_t vi = 0; vi < std::size(variants); ++vi) {
      if (skip(vi, std::size(variants), si)) continue;
      const Variant& var = variants[vi];
      SCOPED_TRACE(st.name() + " momentum " + std::to_string(var.momentum) +
                   (var.nesterov ? " nesterov" : "") + (var.first_run ? " first run" : "") +
                   (var.wd_after ? " wd after momentum" : ""));
      const bool buf = var.momentum != 0.0f;
      Lists lists(numel(), pad({{st.p}, {st.g}, {kF32, buf}, {kF32, st.master}}), 40);
      const Lists before = lists.clone();
      Scalar inv(0.25f);
      k::SgdArgs a;
      a.lr = 0.05f;
      a.momentum = var.momentum;
      a.dampening = var.dampening;
      a.weight_decay = var.wd;
      a.nesterov = var.nesterov;
      a.wd_after_momentum = var.wd_after;
      a.first_run = var.first_run;
      a.amp.inv_scale = inv.ptr();
      k::cuda::sgd(lists.view(), a, nullptr);
      std::vector<int> written = {0};
      if (buf) written.push_back(2);
      if (st.master) written.push_back(3);
      const double mom = var.momentum, damp = var.dampening, wd = var.wd, lr = a.lr;
      expect_elementwise(before, lists, written, [&](int64_t, double* v) {
        const double p = st.master ? v[3] : v[0];
        double g = v[1] * 0.25;
        if (wd != 0.0 && !var.wd_after) g += wd * p;
        if (buf) {
          v[2] = var.first_run ? g : mom * v[2] + (1.0 - damp) * g;
          g = var.nesterov ? g + mom * v[2] : v[2];
        }
        if (wd != 0.0 && var.wd_after) g += wd * p;
        v[0] = p - lr * g;
        if (st.master) v[3] = v[0];
        round_model(v, 3, st.p, st.master);
      });
    }
  }
}

TEST_P(MultiTensorEmu, Adagrad) {
  for (std::size_t si = 0; si < std::size(kStorages); ++si) {
    const Storage& st = kStorages[si];
    for (const bool w_mode : {false, true}) {
      if (skip(0, 1, si)) continue;
      SCOPED_TRACE(st.name() + (w_mode ? " w mode" : " l2 mode"));
      Lists lists(numel(), pad({{st.p}, {st.g}, {kF32, true, 0.0, 1.0}, {kF32, st.master}}), 50);
      const Lists before = lists.clone();
      k::AdagradArgs a;
      a.lr = 0.01f;
      a.eps = 1e-10f;
      a.weight_decay = 0.1f;
      a.adagrad_w_mode = w_mode;
      k::cuda::adagrad(lists.view(), a, nullptr);
      const double lr = a.lr, eps = a.eps, wd = a.weight_decay;
      expect_elementwise(before, lists,
                         st.master ? std::vector<int>{0, 2, 3} : std::vector<int>{0, 2},
                         [&](int64_t, double* v) {
                           double p = st.master ? v[3] : v[0];
                           double g = v[1];
                           if (!w_mode) g += wd * p;
                           v[2] += g * g;
                           if (w_mode) p *= 1.0 - lr * wd;
                           p -= lr * g / (std::sqrt(v[2]) + eps);
                           v[0] = p;
                           if (st.master) v[3] = p;
                           round_model(v, 3, st.p, st.master);
                         });
    }
  }
}

TEST_P(MultiTensorEmu, LambBothStages) {
  struct Variant {
    bool adam_w;
    bool nvlamb;
    float wd;
    float max_grad_norm;
    float gnorm;
  };
  const Variant variants[] = {{true, false, 0.01f, 1.0f, 3.0f},   // clipped
                              {false, false, 0.01f, 1.0f, 0.5f},  // L2 mode, not clipped
                              {true, true, 0.0f, 0.0f, 2.0f},     // nvlamb, no clipping
                              {true, false, 0.0f, 2.0f, 1.0f}};   // ratio lr (wd 0, no nvlamb)
  for (std::size_t si = 0; si < std::size(kStorages); ++si) {
    const Storage& st = kStorages[si];
    for (std::size_t vi = 0; vi < std::size(variants); ++vi) {
      if (skip(vi, std::size(variants), si)) continue;
      const Variant& var = variants[vi];
      SCOPED_TRACE(st.name() + (var.adam_w ? " adamw" : " l2") + (var.nvlamb ? " nvlamb" : "") +
                   " gnorm " + std::to_string(var.gnorm));
      const std::vector<int64_t> n = numel();
      const auto tensors = static_cast<int64_t>(n.size());
      Lists lists(n,
                  pad({{st.p},
                       {st.g},
                       {kF32, true, -0.1, 0.1},
                       {kF32, true, 0.0, 0.01},
                       {kF32, st.master}}),
                  60);
      const Lists before = lists.clone();
      Buffer u_sumsq(kF32, tensors);
      Buffer p_sumsq(kF32, tensors);
      for (int64_t t = 0; t < tensors; ++t) {
        u_sumsq.set(t, 0.0);  // the caller zeroes the sums before stage 1
        p_sumsq.set(t, 0.0);
      }
      Scalar gnorm(var.gnorm);
      Scalar inv(0.5f);
      k::LambArgs a;
      a.lr = 1e-2f;
      a.beta1 = 0.9f;
      a.beta2 = 0.999f;
      a.beta3 = k::grad_weight(0.9, true);
      a.eps = 1e-6f;
      a.weight_decay = var.wd;
      a.bias_correction1 = static_cast<float>(k::bias_correction(0.9, 3, true));
      a.bias_correction2 = static_cast<float>(k::bias_correction(0.999, 3, true));
      a.adam_w_mode = var.adam_w;
      a.use_nvlamb = var.nvlamb;
      a.max_grad_norm = var.max_grad_norm;
      a.global_grad_norm = gnorm.ptr();
      a.u_sumsq = u_sumsq.f32();
      a.p_sumsq = p_sumsq.f32();
      a.amp.inv_scale = inv.ptr();
      k::cuda::lamb_stage1(lists.view(), a, nullptr);
      const Lists mid = lists.clone();
      k::cuda::lamb_stage2(lists.view(), a, nullptr);

      // float64 reference of both stages.
      const double b1 = a.beta1, b2 = a.beta2, b3 = a.beta3, eps = a.eps, wd = a.weight_decay;
      const double bc1 = a.bias_correction1, bc2 = a.bias_correction2;
      const double clip = var.max_grad_norm > 0 && var.gnorm > var.max_grad_norm
                              ? var.gnorm / var.max_grad_norm
                              : 1.0;
      std::vector<double> ref_u(static_cast<std::size_t>(tensors), 0.0);
      std::vector<double> ref_p(static_cast<std::size_t>(tensors), 0.0);
      const auto update = [&](double* v) {  // stage 1 on v; returns u
        const double p = st.master ? v[4] : v[0];
        double g = v[1] * 0.5 / clip;
        if (!var.adam_w && wd != 0.0) g += wd * p;
        v[2] = b1 * v[2] + b3 * g;
        v[3] = b2 * v[3] + (1.0 - b2) * g * g;
        double u = (v[2] / bc1) / (std::sqrt(v[3] / bc2) + eps);
        if (var.adam_w && wd != 0.0) u += wd * p;
        return u;
      };
      for (int64_t t = 0; t < tensors; ++t) {
        for (int64_t i = 0; i < n[static_cast<std::size_t>(t)]; ++i) {
          double v[k::kMaxLists];
          for (int l = 0; l < k::kMaxLists; ++l) {
            v[l] = before.present(l) ? before.at(l, t).get(i) : NAN;
          }
          const double u = update(v);
          ref_u[static_cast<std::size_t>(t)] += u * u;
          ref_p[static_cast<std::size_t>(t)] +=
              (st.master ? v[4] : v[0]) * (st.master ? v[4] : v[0]);
        }
      }
      EXPECT_TRUE(close(u_sumsq.values(), ref_u, tolerance_for(kF32))) << "u_sumsq";
      EXPECT_TRUE(close(p_sumsq.values(), ref_p, tolerance_for(kF32))) << "p_sumsq";
      EXPECT_TRUE(guards_intact(u_sumsq, "u_sumsq"));
      // Stage 1 writes m and v only.
      expect_elementwise(before, mid, {2, 3}, [&](int64_t, double* v) { update(v); });
      EXPECT_TRUE(mid.at(0, 0).same_bits(before.at(0, 0))) << "stage 1 wrote the parameters";
      std::vector<int> written = {0, 2, 3};
      if (st.master) written.push_back(4);
      expect_elementwise(before, lists, written, [&](int64_t t, double* v) {
        const double u = update(v);
        const double pn = std::sqrt(ref_p[static_cast<std::size_t>(t)]);
        const double un = std::sqrt(ref_u[static_cast<std::size_t>(t)]);
        const bool adapt = (var.nvlamb || wd != 0.0) && pn != 0.0 && un != 0.0;
        const double ratio = adapt ? a.lr * (pn / un) : a.lr;
        const double p = (st.master ? v[4] : v[0]) - ratio * u;
        v[0] = p;
        if (st.master) v[4] = p;
        round_model(v, 4, st.p, st.master);
      });
    }
  }
}

TEST_P(MultiTensorEmu, NovoGrad) {
  for (std::size_t si = 0; si < std::size(kStorages); ++si) {
    const Storage& st = kStorages[si];
    for (const bool inside : {false, true}) {
      if (skip(0, 1, si)) continue;
      SCOPED_TRACE(st.name() + (inside ? " reg inside moment" : ""));
      const std::vector<int64_t> n = numel();
      Lists lists(n, pad({{st.p}, {st.g}, {kF32, true, -0.1, 0.1}, {kF32, st.master}}), 70);
      const Lists before = lists.clone();
      Buffer vn(kF32, static_cast<int64_t>(n.size()));
      cuda_emu_test::fill_uniform(vn, 71, 0.5, 2.0);
      Scalar inv(0.5f);
      k::NovoGradArgs a;
      a.lr = 1e-2f;
      a.beta1 = 0.95f;
      a.beta3 = k::grad_weight(0.95, true);
      a.eps = 1e-8f;
      a.weight_decay = 0.01f;
      a.bias_correction1 = static_cast<float>(k::bias_correction(0.95, 4, true));
      a.bias_correction2 = static_cast<float>(std::sqrt(k::bias_correction(0.98, 4, true)));
      a.reg_inside_moment = inside;
      a.v = vn.f32();
      a.amp.inv_scale = inv.ptr();
      k::cuda::novograd(lists.view(), a, nullptr);
      const double b1 = a.beta1, b3 = a.beta3, wd = a.weight_decay, lr = a.lr;
      const double bc1 = a.bias_correction1, bc2 = a.bias_correction2, eps = a.eps;
      expect_elementwise(before, lists,
                         st.master ? std::vector<int>{0, 2, 3} : std::vector<int>{0, 2},
                         [&](int64_t t, double* v) {
                           const double d = static_cast<float>(vn.get(t) / bc2 + eps);
                           const double p = st.master ? v[3] : v[0];
                           double g = v[1] * 0.5;
                           double out;
                           if (inside) {
                             g = g / d + wd * p;
                             v[2] = b1 * v[2] + b3 * g;
                             out = p - lr * (v[2] / bc1);
                           } else {
                             v[2] = b1 * v[2] + b3 * g;
                             out = p - lr * ((v[2] / bc1) / d + wd * p);
                           }
                           v[0] = out;
                           if (st.master) v[3] = out;
                           round_model(v, 3, st.p, st.master);
                         });
    }
  }
}

}  // namespace
