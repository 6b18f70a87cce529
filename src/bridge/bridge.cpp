#include "bridge/bridge.h"

#include "bridge/refs.h"

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

kernels::DType kernel_dtype(at::ScalarType t, const char* who) { return ops::kernel_dtype(t, who); }

const char* layout_name(c10::Layout layout) {
  switch (layout) {
    case c10::kStrided:
      return "Strided";
    case c10::kSparse:
      return "Sparse";
    case c10::kSparseCsr:
      return "SparseCsr";
    case c10::kSparseCsc:
      return "SparseCsc";
    case c10::kSparseBsr:
      return "SparseBsr";
    case c10::kSparseBsc:
      return "SparseBsc";
    case c10::kMkldnn:
      return "Mkldnn";
    case c10::kJagged:
      return "Jagged";
    default:
      return "an unknown layout";
  }
}

void ListBuilder::add(at::ArrayRef<at::Tensor> row) {
  ops::TensorRef r[kernels::kMaxLists];
  TORCH_INTERNAL_ASSERT(row.size() <= kernels::kMaxLists);
  // The lists were checked before (check_list or collect()): the row needs no more.
  for (size_t i = 0; i < row.size(); ++i) r[i] = data_ref(row[i]);
  ops::ListBuilder::add(r, row.size());
}

void check_list(const std::vector<at::Tensor>& list, const char* who, const char* arg) {
  ops::check_list(refs(list), who, arg);
}

void check_matching(const std::vector<at::Tensor>& ref, const std::vector<at::Tensor>& other,
                    const char* who, const char* ref_name, const char* other_name) {
  ops::check_matching(refs(ref), refs(other), who, ref_name, other_name);
}

float* scalar_ptr(const at::Tensor& t, c10::Device device, const char* who, const char* name) {
  ops::TensorRef on;
  on.defined = true;
  on.device_type = device.type();
  on.device_index = device.index();
  return ops::scalar_ptr(ref(t), on, who, name);
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
