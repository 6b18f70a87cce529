#pragma once

// SyncBatchNorm: BatchNorm whose training statistics are those of the batch of every rank
// together. On the CPU (which PyTorch refuses) through apex-cpp's own fused kernels.

#include <apex/detail/affine_batch_norm.h>
#include <apex/parallel/process_group.h>
#include <torch/nn/cloneable.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/options/batchnorm.h>
#include <torch/nn/pimpl.h>

#include <memory>

namespace apex::parallel {

/// BatchNorm over (N, C, *) input (BatchNorm1d/2d/3d alike) with BatchNorm's options, parameters
/// and buffers (weight, bias, running_mean, running_var, num_batches_tracked: a state_dict loads
/// into either). In training, mean and variance are those of all ranks' batches together (right
/// for uneven per-rank batches and for a rank with an empty batch), the running statistics are
/// updated as BatchNorm updates them (unbiased variance over the global count), and backward
/// all-reduces the two per-channel sums it needs; weight and bias gradients stay local (DDP
/// averages them). Evaluation uses the running statistics and no communication. Input fp32, bf16
/// or fp16 (the output has its dtype; values are widened to fp32, sums are fp64), contiguous
/// or channels-last.
///
///   apex::parallel::SyncBatchNorm bn(torch::nn::BatchNormOptions(64));
/// Existing tensors for a SyncBatchNorm to register as its own (convert_sync_batchnorm passes a
/// BatchNorm's, so that the two share them).
struct SyncBatchNormState {
  at::Tensor weight;
  at::Tensor bias;
  at::Tensor running_mean;
  at::Tensor running_var;
  at::Tensor num_batches_tracked;
};

class SyncBatchNormImpl : public torch::nn::Cloneable<SyncBatchNormImpl>,
                          public apex::detail::AffineBatchNorm {
 public:
  explicit SyncBatchNormImpl(const torch::nn::BatchNormOptions& options,
                             ProcessGroup group = default_process_group(),
                             SyncBatchNormState state = {});
  explicit SyncBatchNormImpl(int64_t num_features)
      : SyncBatchNormImpl(torch::nn::BatchNormOptions(num_features)) {}

  void reset() override;
  void reset_running_stats();
  void reset_parameters();
  void pretty_print(std::ostream& stream) const override;
  bool is_affine_batch_norm() const override { return options.affine(); }

  at::Tensor forward(const at::Tensor& input);

  torch::nn::BatchNormOptions options;
  at::Tensor weight;
  at::Tensor bias;
  at::Tensor running_mean;
  at::Tensor running_var;
  at::Tensor num_batches_tracked;
  /// The ranks whose batches are normalized together (the default group when constructed).
  ProcessGroup group;

 private:
  SyncBatchNormState adopt_;  // consumed by the first reset()
};
TORCH_MODULE(SyncBatchNorm);

/// `module` with every BatchNorm1d/2d/3d replaced by a SyncBatchNorm holding the same parameter
/// and buffer tensors (an optimizer built on them keeps working) and the same train/eval mode.
/// Works on a BatchNorm itself and on a Sequential (a new Sequential is returned, its other
/// elements shared). A BatchNorm held by a member of a custom module cannot be swapped from
/// outside in LibTorch (the member keeps pointing at the old one): that throws, naming it;
/// construct SyncBatchNorm there instead.
std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    const std::shared_ptr<torch::nn::Module>& module, ProcessGroup group = default_process_group());
torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module,
                                             ProcessGroup group = default_process_group());

namespace detail {
/// Tests only: CPU input takes the device-generic route (ATen ops, what CUDA input takes) instead
/// of the CPU kernels, so that the route CUDA runs is tested on the CPU.
void force_sync_batch_norm_aten(bool on);
}  // namespace detail

}  // namespace apex::parallel
