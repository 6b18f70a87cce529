#pragma once

#include <memory>
#include <vector>

namespace torch::nn {
class Module;
}

namespace apex::amp::detail {

/// What a live Amp handle at O2/O3 means for the models it cast to half, from construction to
/// destruction: linear, matmul and the convolutions refuse fp32 input with half weights with a
/// message that names amp.forward (LibTorch's own says nothing of amp; the checks go into the
/// dispatcher at the first construction and stay, passing every call through while no handle
/// lives), and apex::save_module writes the models' half tensors as fp32 (common/half_models.h).
class HalfModelCheck {
 public:
  explicit HalfModelCheck(std::vector<std::shared_ptr<torch::nn::Module>> models);
  ~HalfModelCheck();
  HalfModelCheck(const HalfModelCheck&) = delete;
  HalfModelCheck& operator=(const HalfModelCheck&) = delete;

 private:
  std::vector<std::shared_ptr<torch::nn::Module>> models_;
};

}  // namespace apex::amp::detail
