#pragma once

#include <ATen/core/Tensor.h>
#include <torch/arg.h>

#include <cstddef>
#include <cstdint>
#include <vector>

namespace apex::amp {

namespace detail {
struct AmpState;
}

/// Options of `Amp::scale_loss`.
struct ScaleLossOptions {
  /// Leave the gradients scaled at scope exit, to accumulate more backward passes (same loss_id)
  /// before the one that unscales. No `step()` is allowed while gradients are still scaled.
  TORCH_ARG(bool, delay_unscale) = false;
  /// Indices (in `initialize` order) of the optimizers whose gradients this loss produces; empty
  /// means all of them. Only these optimizers skip their next step if this loss overflows.
  TORCH_ARG(std::vector<size_t>, optimizers) = {};
};

/// The scoped scaled loss returned by `Amp::scale_loss` (apex's `with amp.scale_loss(...)`).
///
/// `backward()` backpropagates `loss * scale`. When the object goes out of scope the gradients
/// are unscaled into the fp32 (master) gradients and checked for inf/NaN on the device; the
/// optimizer step that follows is skipped if they overflowed. The destructor never throws: an
/// error found there is raised by the next call on the `Amp` handle. Call `finish()` to end the
/// scope explicitly and get errors at once.
///
///   amp.scale_loss(loss).backward();              // one line: the temporary ends the scope
///   { auto scaled = amp.scale_loss(loss); scaled.backward(); }
class ScaledLoss {
 public:
  ~ScaledLoss();
  ScaledLoss(const ScaledLoss&) = delete;
  ScaledLoss& operator=(const ScaledLoss&) = delete;
  ScaledLoss(ScaledLoss&&) = delete;
  ScaledLoss& operator=(ScaledLoss&&) = delete;

  /// The scaled fp32 loss.
  const at::Tensor& value() const { return scaled_; }
  /// Runs backward on the scaled loss. May be called once per scope.
  void backward(bool retain_graph = false);
  /// Ends the scope now (unscale and overflow check); idempotent.
  void finish();

 private:
  friend class Amp;
  ScaledLoss(detail::AmpState* state, at::Tensor scaled, int64_t loss_id,
             std::vector<size_t> targets, bool delay_unscale);

  detail::AmpState* state_;
  at::Tensor scaled_;
  int64_t loss_id_;
  std::vector<size_t> targets_;  // validated optimizer indices this loss feeds
  bool delay_unscale_;
  int uncaught_at_entry_;
  bool finished_ = false;
  bool backward_done_ = false;
};

}  // namespace apex::amp
