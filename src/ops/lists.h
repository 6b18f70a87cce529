#pragma once

// Internal, ATen-free: the checks of the multi-tensor ops' tensor lists and the kernels' view of
// them, for both op libraries (src/ops/tensor_ref.h).

#include <initializer_list>
#include <vector>

#include "kernels/multi_tensor.h"
#include "ops/tensor_ref.h"

namespace apex::ops {

/// fp32, fp16 or bf16, else an error naming `who` and the dtype.
kernels::DType kernel_dtype(ScalarType t, const char* who);

/// Whether two dense tensors of `sizes` lay their elements out in the same order: their strides
/// agree on every dimension longer than 1 (a size-1 dimension's stride is never used, and
/// channels-last gradients of depthwise or 1-channel convolutions differ only there).
bool same_memory_order(Dims sizes, Dims a, Dims b);

/// Checks one list argument: non-empty, dense, one device, one fp32/fp16/bf16 dtype. Messages
/// name `who`, the argument and the offending index.
void check_list(const TensorRefs& list, const char* who, const char* arg);

/// Checks that `other` matches `ref` element-wise (same length, shape, memory order, device).
void check_matching(const TensorRefs& ref, const TensorRefs& other, const char* who,
                    const char* ref_name, const char* other_name);

/// A one-element fp32 tensor's float* (kernel memory) on `device`'s device, or null for an
/// undefined one.
float* scalar_ptr(const TensorRef& t, const TensorRef& device, const char* who, const char* name);

/// Owns the pointer arrays a kernels::TensorLists refers to.
class ListBuilder {
 public:
  explicit ListBuilder(int num_lists) : num_lists_(num_lists) {}
  /// Appends tensor i of every list; absent optional lists pass undefined refs.
  void add(std::initializer_list<TensorRef> row) { add(row.begin(), row.size()); }
  void add(const TensorRef* row, size_t n);
  int64_t size() const { return static_cast<int64_t>(numel_.size()); }
  kernels::TensorLists view() const;

 private:
  int num_lists_;
  std::vector<int64_t> numel_;
  std::vector<void*> ptrs_[kernels::kMaxLists];
  kernels::DType dtype_[kernels::kMaxLists] = {};
  bool present_[kernels::kMaxLists] = {};
};

/// A list argument and its name in messages.
struct Named {
  const TensorRefs* list;
  const char* name;
};

/// The kernel's parallel lists: lists [0, required) checked, non-empty and matching the first;
/// later ones optional (absent when empty, else checked alike). Lists from `state_from` on hold
/// optimizer state or masters and must be fp32.
ListBuilder build_lists(const char* who, std::initializer_list<Named> lists, size_t required,
                        size_t state_from = kernels::kMaxLists);

}  // namespace apex::ops
