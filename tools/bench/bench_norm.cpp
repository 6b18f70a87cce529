// apex-bench norm: fused LayerNorm against at::layer_norm and fused RMSNorm against the composite
// LibTorch expression, forward and forward+backward, over rows x hidden, in the same run.
#include <apex/normalization.h>
#include <malloc.h>
#include <torch/autograd.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdio>

#include "bench_common.h"

namespace apex::bench {
namespace {

// RMSNorm as LibTorch users write it (LLaMA style): statistics in fp32, output in the input dtype.
at::Tensor composite_rms(const at::Tensor& x, const at::Tensor& w, double eps) {
  const at::Tensor xf = x.to(at::kFloat);
  return (xf * torch::rsqrt(xf.pow(2).mean(-1, /*keepdim=*/true) + eps)).to(x.scalar_type()) * w;
}

void bench_shape(const Config& cfg, int64_t rows, int64_t hidden, at::ScalarType dtype,
                 std::vector<Row>& out) {
  const auto opts = torch::TensorOptions().dtype(dtype).device(cfg.device);
  const std::string group = std::to_string(rows) + "x" + std::to_string(hidden) + " " +
                            (dtype == at::kFloat ? "fp32" : "bf16");
  const at::Tensor x = torch::randn({rows, hidden}, opts);
  const at::Tensor dy = torch::randn({rows, hidden}, opts);
  const at::Tensor w = (torch::rand({hidden}, opts) + 0.5).requires_grad_(true);
  const at::Tensor b = torch::randn({hidden}, opts).requires_grad_(true);
  const at::Tensor xg = x.detach().requires_grad_(true);
  const double n = static_cast<double>(rows * hidden) * static_cast<double>(x.element_size());
  // The streaming loop over as many fp32 elements as the activation (capped at 32M, enough to
  // leave the caches).
  StreamLoop stream(cfg, std::min<int64_t>(rows * hidden, int64_t{32} << 20));
  at::Tensor sink;
  auto add = [&](const std::string& name, double bytes, const std::vector<double>& ms) {
    Row r{group, name, ms[0], ms[1], bytes, {}};
    r.extra["stream_gbs"] = stream.bytes() / (ms[2] * 1e6);
    out.push_back(r);
  };
  const std::vector<int64_t> shape{hidden};
  {
    const at::NoGradGuard no_grad;
    add("LayerNorm fwd vs at::layer_norm", 2 * n,
        interleaved_ms(cfg, {[&] { sink = apex::normalization::fused_layer_norm(x, shape, w, b); },
                             [&] { sink = at::layer_norm(x, shape, w, b); }, [&] { stream(); }}));
    add("RMSNorm fwd vs composite", 2 * n,
        interleaved_ms(cfg, {[&] { sink = apex::normalization::fused_rms_norm(x, shape, w); },
                             [&] { sink = composite_rms(x, w, 1e-5); }, [&] { stream(); }}));
  }
  // Forward + backward: the forward reads x and writes y, the backward reads dy and x and writes
  // dx (weight/bias gradients are [hidden]): 5 activation-sized passes.
  auto grads = [&](const at::Tensor& y, const std::vector<at::Tensor>& inputs) {
    sink = torch::autograd::grad({y}, inputs, {dy})[0];
  };
  add("LayerNorm fwd+bwd vs at::layer_norm", 5 * n,
      interleaved_ms(cfg,
                     {[&] {
                        grads(apex::normalization::fused_layer_norm(xg, shape, w, b), {xg, w, b});
                      },
                      [&] {
                        grads(at::layer_norm(xg, shape, w, b), {xg, w, b});
                      },
                      [&] { stream(); }}));
  add("RMSNorm fwd+bwd vs composite", 5 * n,
      interleaved_ms(cfg, {[&] {
                             grads(apex::normalization::fused_rms_norm(xg, shape, w), {xg, w});
                           },
                           [&] {
                             grads(composite_rms(xg, w, 1e-5), {xg, w});
                           },
                           [&] { stream(); }}));
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
  std::vector<Row> rows;
  for (auto dtype : {at::kFloat, at::kBFloat16}) {
    for (const auto& [r, h] : shapes) {
      const std::string name = std::to_string(r) + "x" + std::to_string(h);
      if (!selected(cfg, name)) continue;
      std::printf("%s %s\n", name.c_str(), dtype == at::kFloat ? "fp32" : "bf16");
      std::fflush(stdout);
      bench_shape(cfg, r, h, dtype, rows);
    }
  }
  report(cfg, "norm", rows);
  return 0;
}

}  // namespace apex::bench
