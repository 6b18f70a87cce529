#include "ops/lists.h"

#include <algorithm>

namespace apex::ops {

bool strides_dense(Dims sizes, Dims strides) {
  std::vector<size_t> order;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] != 1) order.push_back(d);
  }
  std::sort(order.begin(), order.end(),
            [&](size_t a, size_t b) { return strides[a] < strides[b]; });
  int64_t expected = 1;
  for (size_t d : order) {
    if (strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

namespace {
const char* device_type_name(DeviceType t) {
  switch (t) {
    case DeviceType::CPU:
      return "cpu";
    case DeviceType::CUDA:
      return "cuda";
    case DeviceType::HIP:
      return "hip";
    case DeviceType::XPU:
      return "xpu";
    case DeviceType::MPS:
      return "mps";
    case DeviceType::Meta:
      return "meta";
    case DeviceType::XLA:
      return "xla";
    case DeviceType::HPU:
      return "hpu";
    case DeviceType::Lazy:
      return "lazy";
    case DeviceType::MTIA:
      return "mtia";
    case DeviceType::PrivateUse1:
      return "privateuseone";
    default:
      return nullptr;
  }
}
}  // namespace

std::ostream& operator<<(std::ostream& s, DeviceOf d) {
  const char* name = device_type_name(d.t.device_type);
  if (name != nullptr) {
    s << name;
  } else {
    s << "device type " << static_cast<int>(d.t.device_type);
  }
  if (d.t.device_index >= 0) s << ":" << d.t.device_index;
  return s;
}

kernels::DType kernel_dtype(ScalarType t, const char* who) {
  switch (t) {
    case ScalarType::Float:
      return kernels::DType::kFloat32;
    case ScalarType::Half:
      return kernels::DType::kFloat16;
    case ScalarType::BFloat16:
      return kernels::DType::kBFloat16;
    default:
      fail_with(who, ": expected float32, float16 or bfloat16 tensors, got ", DtypeName{t});
  }
}

bool same_memory_order(Dims sizes, Dims a, Dims b) {
  if (a.size() != sizes.size() || b.size() != sizes.size()) return false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && a[d] != b[d]) return false;
  }
  return true;
}

void check_list(const TensorRefs& list, const char* who, const char* arg) {
  APEX_OPS_CHECK(!list.empty(), who, ": ", arg, " must not be empty");
  const TensorRef& first = list.front();
  for (size_t i = 0; i < list.size(); ++i) {
    const TensorRef& t = list[i];
    APEX_OPS_CHECK(t.defined, who, ": ", arg, "[", i, "] is undefined");
    APEX_OPS_CHECK(t.strided, who, ": ", arg, "[", i,
                   "] must be a dense (strided) tensor, got layout ", t.layout);
    APEX_OPS_CHECK(t.same_device(first), who, ": all tensors of ", arg,
                   " must be on one device, got ", DeviceOf{first}, " at index 0 and ", DeviceOf{t},
                   " at index ", i);
    require_backend(t, who);
    APEX_OPS_CHECK(t.dtype == first.dtype, who, ": all tensors of ", arg,
                   " must have one dtype, got ", DtypeName{first.dtype}, " at index 0 and ",
                   DtypeName{t.dtype}, " at index ", i);
    APEX_OPS_CHECK(t.dense, who, ": ", arg, "[", i,
                   "] must be contiguous (non-overlapping and dense)");
    kernel_dtype(t.dtype, who);
  }
}

void check_matching(const TensorRefs& ref, const TensorRefs& other, const char* who,
                    const char* ref_name, const char* other_name) {
  APEX_OPS_CHECK(ref.size() == other.size(), who, ": ", ref_name, " and ", other_name,
                 " must have the same length, got ", ref.size(), " and ", other.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    const TensorRef& a = ref[i];
    const TensorRef& b = other[i];
    APEX_OPS_CHECK(a.sizes == b.sizes, who, ": ", other_name, "[", i, "] has shape ",
                   Shape{b.sizes}, " but ", ref_name, "[", i, "] has shape ", Shape{a.sizes});
    APEX_OPS_CHECK(same_memory_order(a.sizes, a.strides, b.strides), who, ": ", other_name, "[", i,
                   "] has strides ", Shape{b.strides}, " but ", ref_name, "[", i, "] has strides ",
                   Shape{a.strides});
    APEX_OPS_CHECK(a.same_device(b), who, ": ", other_name, "[", i, "] is on ", DeviceOf{b},
                   " but ", ref_name, "[", i, "] is on ", DeviceOf{a});
  }
}

float* scalar_ptr(const TensorRef& t, const TensorRef& device, const char* who, const char* name) {
  if (!t.defined) return nullptr;
  APEX_OPS_CHECK(t.numel == 1 && t.dtype == ScalarType::Float, who, ": ", name,
                 " must be a one-element float32 tensor, got ", DtypeName{t.dtype}, " with ",
                 t.numel, " elements");
  require_backend(t, who);
  APEX_OPS_CHECK(t.same_device(device), who, ": ", name, " must be on ", DeviceOf{device}, ", got ",
                 DeviceOf{t});
  return static_cast<float*>(t.data);
}

void ListBuilder::add(const TensorRef* row, size_t n) {
  APEX_OPS_CHECK(static_cast<int>(n) == num_lists_, "apex-cpp internal: a row of ", n,
                 " tensors for ", num_lists_, " lists");
  const bool first = numel_.empty();
  for (int l = 0; l < num_lists_; ++l) {
    const TensorRef& t = row[l];
    if (first) present_[l] = t.defined;
    APEX_OPS_CHECK(present_[l] == t.defined, "apex-cpp internal: list ", l, " is partly absent");
    if (!t.defined) continue;
    const kernels::DType d = kernel_dtype(t.dtype, "multi-tensor apply");
    if (first) dtype_[l] = d;
    APEX_OPS_CHECK(dtype_[l] == d, "apex-cpp internal: mixed dtypes in list ", l);
    ptrs_[l].push_back(t.data);
  }
  numel_.push_back(row[0].numel);
}

kernels::TensorLists ListBuilder::view() const {
  kernels::TensorLists v;
  v.num_tensors = static_cast<int64_t>(numel_.size());
  v.numel = numel_.data();
  for (int l = 0; l < num_lists_; ++l) {
    v.ptrs[l] = present_[l] ? ptrs_[l].data() : nullptr;
    v.dtype[l] = dtype_[l];
  }
  return v;
}

ListBuilder build_lists(const char* who, std::initializer_list<Named> lists, size_t required,
                        size_t state_from) {
  const TensorRefs& ref = *lists.begin()->list;
  const char* ref_name = lists.begin()->name;
  size_t i = 0;
  for (const Named& l : lists) {
    if (i >= required && l.list->empty()) {
      ++i;
      continue;
    }
    check_list(*l.list, who, l.name);
    if (i > 0) check_matching(ref, *l.list, who, ref_name, l.name);
    APEX_OPS_CHECK(i < state_from || l.list->front().dtype == ScalarType::Float, who, ": ", l.name,
                   " must be float32 (optimizer state and masters are fp32), got ",
                   DtypeName{l.list->front().dtype});
    ++i;
  }
  ListBuilder b(static_cast<int>(lists.size()));
  TensorRef row[kernels::kMaxLists];
  for (size_t r = 0; r < ref.size(); ++r) {
    size_t k = 0;
    for (const Named& l : lists) row[k++] = l.list->empty() ? TensorRef() : (*l.list)[r];
    b.add(row, lists.size());
  }
  return b;
}

}  // namespace apex::ops
