// What an apex::parallel::ProcessGroup holds (shared by its copies).
#pragma once

#include <apex/parallel/process_group.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Store.hpp>

namespace apex::parallel::detail {

struct ProcessGroupState {
  int64_t rank = 0;
  int64_t size = 1;
  Backend backend = Backend::kGloo;
  c10::Device device = c10::kCPU;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;  ///< under the default_pg prefix
  c10::intrusive_ptr<c10d::ProcessGroup> group;
};

}  // namespace apex::parallel::detail
