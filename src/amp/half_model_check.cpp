// An O2/O3 model (cast to half by amp::initialize) called with fp32 input outside amp.forward:
// LibTorch's own message ("mat1 and mat2 must have the same dtype") says nothing of amp. While
// such a handle lives, linear, addmm, conv1d/2d/3d and matmul say what happened and what to call
// instead. C++ modules have no forward hooks through which amp could cast the input as apex's
// Python O2 did, so the check sits in these ops' composite kernels (addmm, which LibTorch's C++
// Linear calls directly, has none: its check sits at ADInplaceOrView, between autograd and the
// CPU kernel): one dtype comparison, then LibTorch's own kernel.

#include "amp/half_model_check.h"

#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/conv1d_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/conv2d_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/conv3d_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/linear_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/matmul_compositeimplicitautograd_dispatch.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include "amp/quiet_registration.h"
#include "common/half_models.h"

#include <atomic>
#include <mutex>
#include <optional>

namespace apex::amp::detail {
namespace {

std::atomic<int> live_half_models{0};

void check(const char* op, const at::Tensor& input, const at::Tensor& weight) {
  if (live_half_models.load(std::memory_order_relaxed) == 0) return;
  if (!input.defined() || !weight.defined()) return;
  TORCH_CHECK(input.scalar_type() != at::kFloat || !apex::detail::is_half(weight.scalar_type()),
              "apex::amp: ", op, " got ", input.scalar_type(), " input and ", weight.scalar_type(),
              " weights. A model that amp::initialize cast to ", weight.scalar_type(),
              " (O2/O3) must be called through amp.forward(model, x), which casts its floating "
              "inputs (for evaluation too); or cast the input to ",
              weight.scalar_type(), " yourself");
}

at::Tensor linear(const at::Tensor& input, const at::Tensor& weight,
                  const std::optional<at::Tensor>& bias) {
  check("linear", input, weight);
  return at::compositeimplicitautograd::linear(input, weight, bias);
}

at::Tensor addmm(c10::DispatchKeySet keys, const at::Tensor& self, const at::Tensor& mat1,
                 const at::Tensor& mat2, const at::Scalar& beta, const at::Scalar& alpha) {
  check("linear (addmm)", mat1, mat2);
  return at::_ops::addmm::redispatch(keys & c10::after_ADInplaceOrView_keyset, self, mat1, mat2,
                                     beta, alpha);
}

at::Tensor matmul(const at::Tensor& self, const at::Tensor& other) {
  check("matmul", self, other);
  return at::compositeimplicitautograd::matmul(self, other);
}

template <at::Tensor (*Conv)(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             c10::SymIntArrayRef, c10::SymIntArrayRef, c10::SymIntArrayRef,
                             c10::SymInt)>
at::Tensor conv(const at::Tensor& input, const at::Tensor& weight,
                const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                c10::SymIntArrayRef padding, c10::SymIntArrayRef dilation, c10::SymInt groups) {
  check("convolution", input, weight);
  return Conv(input, weight, bias, stride, padding, dilation, std::move(groups));
}

template <at::Tensor (*Conv)(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                             c10::SymIntArrayRef, c10::string_view, c10::SymIntArrayRef,
                             c10::SymInt)>
at::Tensor conv_padding(const at::Tensor& input, const at::Tensor& weight,
                        const std::optional<at::Tensor>& bias, c10::SymIntArrayRef stride,
                        c10::string_view padding, c10::SymIntArrayRef dilation,
                        c10::SymInt groups) {
  check("convolution", input, weight);
  return Conv(input, weight, bias, stride, padding, dilation, std::move(groups));
}

void register_checks() {
  static std::once_flag once;
  std::call_once(once, [] {
    QuietRegistration quiet;
    const c10::WarningUtils::WarningHandlerGuard guard(&quiet);
    namespace ci = at::compositeimplicitautograd;
    static auto* lib =
        new torch::Library(torch::Library::IMPL, "aten",
                           c10::DispatchKey::CompositeImplicitAutograd, __FILE__, __LINE__);
    lib->impl("linear", TORCH_FN(linear));
    lib->impl("matmul", TORCH_FN(matmul));
    lib->impl("conv1d", TORCH_FN(conv<ci::conv1d_symint>));
    lib->impl("conv2d", TORCH_FN(conv<ci::conv2d_symint>));
    lib->impl("conv3d", TORCH_FN(conv<ci::conv3d_symint>));
    lib->impl("conv1d.padding", TORCH_FN(conv_padding<ci::conv1d_symint>));
    lib->impl("conv2d.padding", TORCH_FN(conv_padding<ci::conv2d_symint>));
    lib->impl("conv3d.padding", TORCH_FN(conv_padding<ci::conv3d_symint>));
    static auto* view_lib = new torch::Library(
        torch::Library::IMPL, "aten", c10::DispatchKey::ADInplaceOrView, __FILE__, __LINE__);
    view_lib->impl("addmm", TORCH_FN(addmm));
  });
}

}  // namespace

HalfModelCheck::HalfModelCheck(std::vector<std::shared_ptr<torch::nn::Module>> models)
    : models_(std::move(models)) {
  register_checks();
  live_half_models.fetch_add(1, std::memory_order_relaxed);
  for (const auto& m : models_) apex::detail::register_half_model(m.get());
}

HalfModelCheck::~HalfModelCheck() {
  for (const auto& m : models_) apex::detail::unregister_half_model(m.get());
  live_half_models.fetch_sub(1, std::memory_order_relaxed);
}

}  // namespace apex::amp::detail
