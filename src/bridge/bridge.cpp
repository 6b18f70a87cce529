#include "bridge/bridge.h"

#include <c10/util/Exception.h>

#include <algorithm>
#include <iterator>
#include <utility>

#ifdef APEX_HAS_CUDA_BACKEND
#include <c10/cuda/CUDAStream.h>
#endif

namespace apex::bridge {

kernels::DType kernel_dtype(const at::Tensor& t, const char* who) {
  return kernel_dtype(t.scalar_type(), who);
}

kernels::DType kernel_dtype(at::ScalarType t, const char* who) {
  switch (t) {
    case at::kFloat:
      return kernels::DType::kFloat32;
    case at::kHalf:
      return kernels::DType::kFloat16;
    case at::kBFloat16:
      return kernels::DType::kBFloat16;
    default:
      TORCH_CHECK(false, who, ": expected float32, float16 or bfloat16 tensors, got ", t);
  }
}

void ListBuilder::add(at::ArrayRef<at::Tensor> row) {
  TORCH_INTERNAL_ASSERT(static_cast<int>(row.size()) == num_lists_);
  const bool first = numel_.empty();
  int l = 0;
  for (const at::Tensor& t : row) {
    if (first) present_[l] = t.defined();
    TORCH_INTERNAL_ASSERT(present_[l] == t.defined(), "list ", l, " is partly absent");
    if (t.defined()) {
      const kernels::DType d = kernel_dtype(t, "multi-tensor apply");
      if (first) dtype_[l] = d;
      TORCH_INTERNAL_ASSERT(dtype_[l] == d, "mixed dtypes in list ", l);
      ptrs_[l].push_back(t.data_ptr());
    }
    ++l;
  }
  numel_.push_back(row.begin()->numel());
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

void check_list(const std::vector<at::Tensor>& list, const char* who, const char* arg) {
  TORCH_CHECK(!list.empty(), who, ": ", arg, " must not be empty");
  const at::Tensor& first = list.front();
  for (size_t i = 0; i < list.size(); ++i) {
    const at::Tensor& t = list[i];
    TORCH_CHECK(t.defined(), who, ": ", arg, "[", i, "] is undefined");
    TORCH_CHECK(t.layout() == at::kStrided, who, ": ", arg, "[", i,
                "] must be a dense (strided) tensor, got layout ", t.layout());
    TORCH_CHECK(t.device() == first.device(), who, ": all tensors of ", arg,
                " must be on one device, got ", first.device(), " at index 0 and ", t.device(),
                " at index ", i);
    TORCH_CHECK(t.scalar_type() == first.scalar_type(), who, ": all tensors of ", arg,
                " must have one dtype, got ", first.scalar_type(), " at index 0 and ",
                t.scalar_type(), " at index ", i);
    TORCH_CHECK(t.is_non_overlapping_and_dense(), who, ": ", arg, "[", i,
                "] must be contiguous (non-overlapping and dense)");
    kernel_dtype(t, who);
  }
}

bool same_memory_order(c10::IntArrayRef sizes, c10::IntArrayRef a, c10::IntArrayRef b) {
  if (a.size() != sizes.size() || b.size() != sizes.size()) return false;
  for (size_t d = 0; d < sizes.size(); ++d) {
    if (sizes[d] > 1 && a[d] != b[d]) return false;
  }
  return true;
}

void check_matching(const std::vector<at::Tensor>& ref, const std::vector<at::Tensor>& other,
                    const char* who, const char* ref_name, const char* other_name) {
  TORCH_CHECK(ref.size() == other.size(), who, ": ", ref_name, " and ", other_name,
              " must have the same length, got ", ref.size(), " and ", other.size());
  for (size_t i = 0; i < ref.size(); ++i) {
    TORCH_CHECK(ref[i].sizes() == other[i].sizes(), who, ": ", other_name, "[", i, "] has shape ",
                other[i].sizes(), " but ", ref_name, "[", i, "] has shape ", ref[i].sizes());
    TORCH_CHECK(same_memory_order(ref[i].sizes(), ref[i].strides(), other[i].strides()), who, ": ",
                other_name, "[", i, "] has strides ", other[i].strides(), " but ", ref_name, "[", i,
                "] has strides ", ref[i].strides());
    TORCH_CHECK(ref[i].device() == other[i].device(), who, ": ", other_name, "[", i, "] is on ",
                other[i].device(), " but ", ref_name, "[", i, "] is on ", ref[i].device());
  }
}

float* scalar_ptr(const at::Tensor& t, c10::Device device, const char* who, const char* name) {
  if (!t.defined()) return nullptr;
  TORCH_CHECK(t.numel() == 1 && t.scalar_type() == at::kFloat, who, ": ", name,
              " must be a one-element float32 tensor, got ", t.scalar_type(), " with ", t.numel(),
              " elements");
  TORCH_CHECK(t.device() == device, who, ": ", name, " must be on ", device, ", got ", t.device());
  return t.data_ptr<float>();
}

std::vector<std::vector<at::Tensor>> by_device_and_dtype(const std::vector<at::Tensor>& tensors) {
  std::vector<std::pair<std::pair<c10::Device, c10::ScalarType>, std::vector<at::Tensor>>> groups;
  for (const auto& t : tensors) {
    if (!t.defined()) continue;
    const auto key = std::make_pair(t.device(), t.scalar_type());
    auto it =
        std::find_if(groups.begin(), groups.end(), [&](const auto& g) { return g.first == key; });
    if (it == groups.end()) {
      groups.push_back({key, {}});
      it = std::prev(groups.end());
    }
    it->second.push_back(t);
  }
  std::vector<std::vector<at::Tensor>> out;
  out.reserve(groups.size());
  for (auto& g : groups) out.push_back(std::move(g.second));
  return out;
}

bool backend_available(c10::Device device) {
#ifdef APEX_HAS_CUDA_BACKEND
  return device.is_cpu() || device.is_cuda();
#else
  return device.is_cpu();
#endif
}

void* cuda_stream(c10::Device device) {
#ifdef APEX_HAS_CUDA_BACKEND
  TORCH_CHECK(device.is_cuda(), "apex-cpp kernels run on CPU or CUDA tensors, got ", device);
  return c10::cuda::getCurrentCUDAStream(device.index()).stream();
#else
  TORCH_CHECK(false, "apex-cpp kernels run on CPU tensors in this build (it was built without ",
              "CUDA kernels or against a CPU-only torch), got a tensor on ", device);
#endif
}

}  // namespace apex::bridge
