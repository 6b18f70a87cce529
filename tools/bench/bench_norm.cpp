// apex-bench norm: fused LayerNorm against at::layer_norm and fused RMSNorm against the composite
// LibTorch expression, forward and forward+backward, over rows x hidden, in the same run.
#include <apex/normalization.h>
#include <malloc.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdio>
#include <functional>

#include "bench_common.h"

namespace apex::bench {
namespace {

// RMSNorm as LibTorch users write it (LLaMA style): statistics in fp32, output in the input dtype.
at::Tensor composite_rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * w;
}

// cached: a small activation that stays in the caches between calls, timed without the limit
// loop (memory is not what bounds it); each timed run is a batch of calls, enough to be well above
// the clock's resolution and at least 8, and the times are per call. (With batches of 2 the first
// call after the other side's batch paid for what that side left in the caches and the heap: the
// composite RMSNorm's temporaries cost our 128x8192 fp32 forward + backward 190 us of 630.)
void bench_shape(const Config& cfg, FreshWriteStream& stream, int64_t rows, int64_t hidden,
                 at::ScalarType dtype, bool cached, std::vector<Row>& out) {
  const auto opts = torch::TensorOptions().dtype(dtype).device(cfg.device);
  const std::string group = std::to_string(rows) + "x" + std::to_string(hidden) + " " +
                            (dtype == at::kFloat ? "fp32" : "bf16");
  const at::Tensor x = torch::randn({rows, hidden}, opts);
  const at::Tensor dy = torch::randn({rows, hidden}, opts);
  const at::Tensor w = (torch::rand({hidden}, opts) + 0.5).requires_grad_(true);
  const at::Tensor b = torch::randn({hidden}, opts).requires_grad_(true);
  const at::Tensor xg = x.detach().requires_grad_(true);
  const double n = static_cast<double>(rows * hidden) * static_cast<double>(x.element_size());
  at::Tensor sink;
  // runs[2] times the limit loops with the case's traffic: `adds` is 0 for a forward (read x,
  // write y: one copy) and 1 for forward + backward (then read dy and x, write dx: one add).
  auto add = [&](const std::string& name, double bytes,
                 const std::vector<std::vector<double>>& runs, int adds) {
    out.push_back(
        paired_row(group, name, bytes, stream.copy_bytes() + adds * stream.add_bytes(), runs));
    out.back().extra["cached"] = cached ? 1.0 : 0.0;
  };
  // Rounds of ours, the peer and the limit loop. The limit loop's 256 MB evict the caches and
  // the TLB, so each round ends with one more untimed run of ours and of the peer: the next
  // round's runs find the machine as in the steady alternation of the two (small activations in
  // cache, as a training step finds them) instead of whichever runs first paying for the
  // eviction.
  using Fn = std::function<void()>;
  const int64_t reps =
      cached ? std::clamp<int64_t>((int64_t{1} << 21) / (rows * hidden), 8, 1000) : 1;
  auto measure = [&](const Fn& ours, const Fn& peer, const Fn& limit) {
    if (cached) {
      auto batch = [reps](const Fn& f) {
        return Fn([&f, reps] {
          for (int64_t i = 0; i < reps; ++i) f();
        });
      };
      auto runs = interleaved_runs(cfg, {batch(ours), batch(peer)});
      for (auto& side : runs) {
        for (double& t : side) t /= static_cast<double>(reps);
      }
      return runs;
    }
    auto runs = interleaved_runs(cfg, {ours, peer, limit, ours, peer});
    runs.resize(3);
    return runs;
  };
  auto fwd_limit = [&] { stream.copy(); };
  auto fwd_bwd_limit = [&] {
    stream.copy();
    stream.add();
  };
  const std::vector<int64_t> shape{hidden};
  {
    const at::NoGradGuard no_grad;
    add("LayerNorm fwd vs at::layer_norm", 2 * n,
        measure([&] { sink = apex::normalization::fused_layer_norm(x, shape, w, b); },
                [&] { sink = at::layer_norm(x, shape, w, b); }, fwd_limit),
        0);
    add("RMSNorm fwd vs composite", 2 * n,
        measure([&] { sink = apex::normalization::fused_rms_norm(x, shape, w); },
                [&] { sink = composite_rms(x, w, 1e-5); }, fwd_limit),
        0);
  }
  // Forward + backward: the forward reads x and writes y, the backward reads dy and x and writes
  // dx (weight/bias gradients are [hidden]): 5 activation-sized passes.
  auto grads = [&](const at::Tensor& y, const std::vector<at::Tensor>& inputs) {
    sink = torch::autograd::grad({y}, inputs, {dy})[0];
  };
  add("LayerNorm fwd+bwd vs at::layer_norm", 5 * n,
      measure(
          [&] {
            grads(apex::normalization::fused_layer_norm(xg, shape, w, b), {xg, w, b});
          },
          [&] {
            grads(at::layer_norm(xg, shape, w, b), {xg, w, b});
          },
          fwd_bwd_limit),
      1);
  add("RMSNorm fwd+bwd vs composite", 5 * n,
      measure(
          [&] {
            grads(apex::normalization::fused_rms_norm(xg, shape, w), {xg, w});
          },
          [&] {
            grads(composite_rms(xg, w, 1e-5), {xg, w});
          },
          fwd_bwd_limit),
      1);
  sink.reset();
}

}  // namespace

int run_norm(const Config& cfg) {
  // Activation-sized outputs are fresh allocations on every call. glibc serves them with mmap
  // and returns them on free, so each call would page-fault its output in (both ours and the
  // peer's, at a few GB/s). Keeping freed memory in the heap measures the kernels, as a training
  // loop that reuses its memory sees them.
  mallopt(M_MMAP_MAX, 0);
  mallopt(M_TRIM_THRESHOLD, -1);
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {4096, 64},   {4096, 768},   {4096, 1024}, {4096, 4096},
      {8192, 2048}, {16384, 1024}, {16384, 8192}};
  // The limit loops run over 256 MB arrays, far outside the caches: the machine's memory limit.
  // (Arrays of the activation's size were tried: from 6 to 32 MB they partly stayed in the L3
  // between runs, and the "limit" rose to 70-170 GB/s for some shapes and not others.) Norms on
  // activations that fit the caches can pass this limit.
  FreshWriteStream stream(cfg, int64_t{256} << 20);
  // Small activations, which stay in the caches: a few rows (a robot's batch, one decoding
  // step), the hidden sizes of real models. Here per-call costs (allocations, the autograd node,
  // waking threads) and the partition of the backward matter more than bandwidth.
  const std::vector<std::pair<int64_t, int64_t>> cached_shapes = {
      {1, 64},    {1, 4096},  {8, 1024},   {8, 8192},   {32, 1024},
      {32, 4096}, {128, 768}, {128, 8192}, {512, 4096}, {2048, 1024}};
  std::vector<Row> rows;
  // The cached shapes first: the large ones leave a heap of hundreds of MB behind (freed memory
  // is kept, see above), in which small allocations were seen to cost up to twice as much.
  for (bool cached : {true, false}) {
    for (auto dtype : {at::kFloat, at::kBFloat16}) {
      for (const auto& [r, h] : cached ? cached_shapes : shapes) {
        const std::string name = std::to_string(r) + "x" + std::to_string(h);
        if (!selected(cfg, name)) continue;
        std::printf("%s %s%s\n", name.c_str(), dtype == at::kFloat ? "fp32" : "bf16",
                    cached ? " (cached)" : "");
        std::fflush(stdout);
        bench_shape(cfg, stream, r, h, dtype, cached, rows);
      }
    }
  }
  report(cfg, "norm", rows);
  return 0;
}

}  // namespace apex::bench
