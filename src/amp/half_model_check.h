#pragma once

namespace apex::amp::detail {

/// While one lives (an Amp handle at O2/O3), linear, matmul and the convolutions refuse fp32
/// input with half weights with a message that names amp.forward (LibTorch's own says nothing of
/// amp). The checks go into the dispatcher at the first construction and stay; with no handle
/// alive they pass every call through.
class HalfModelCheck {
 public:
  HalfModelCheck();
  ~HalfModelCheck();
  HalfModelCheck(const HalfModelCheck&) = delete;
  HalfModelCheck& operator=(const HalfModelCheck&) = delete;
};

}  // namespace apex::amp::detail
