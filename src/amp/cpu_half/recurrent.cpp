// The CPU half fallback's recurrent layers (fallback.h): LSTM, GRU and the plain RNNs, whole
// layer stacks in fp32 on widened inputs, state and weights.
#include <ATen/ops/gru.h>
#include <ATen/ops/gru_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/lstm.h>
#include <ATen/ops/lstm_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/rnn_relu.h>
#include <ATen/ops/rnn_relu_compositeimplicitautograd_dispatch.h>
#include <ATen/ops/rnn_tanh.h>
#include <ATen/ops/rnn_tanh_compositeimplicitautograd_dispatch.h>
#include <torch/library.h>

#include "amp/cpu_half/fallback.h"

#include <tuple>
#include <vector>

namespace apex::amp::cpu_half {
namespace {

// LSTM, GRU and the plain RNNs: in a half dtype LibTorch runs them step by step, a few small ops
// per step (8-27x the fp32 time under the AVX2 emulation, docs/benchmarks.md), where fp32 runs
// oneDNN's fused LSTM or MKL's products over the whole sequence. The whole layer stack is run in
// fp32 on the widened input, state and weights and its outputs rounded once. Registered for
// AutogradCPU (and CPU, for inference mode), above autograd, so that the widenings are part of the
// graph: gradients reach the half weights through them. Elsewhere the op's own composite
// implementation.
bool take_all(const at::Tensor& input, at::TensorList a, at::TensorList b) {
  std::vector<const at::Tensor*> ts{&input};
  for (const at::Tensor& t : a) ts.push_back(&t);
  for (const at::Tensor& t : b) ts.push_back(&t);
  return take(ts);
}

std::vector<at::Tensor> wide_all(at::TensorList ts) {
  std::vector<at::Tensor> out;
  out.reserve(ts.size());
  for (const at::Tensor& t : ts) out.push_back(wide(t));
  return out;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm(const at::Tensor& input, at::TensorList hx,
                                                    at::TensorList params, bool has_biases,
                                                    int64_t num_layers, double dropout, bool train,
                                                    bool bidirectional, bool batch_first) {
  if (!take_all(input, hx, params)) {
    return at::compositeimplicitautograd::lstm(input, hx, params, has_biases, num_layers, dropout,
                                               train, bidirectional, batch_first);
  }
  auto [out, h, c] = at::lstm(wide(input), wide_all(hx), wide_all(params), has_biases, num_layers,
                              dropout, train, bidirectional, batch_first);
  const auto t = input.scalar_type();
  return {out.to(t), h.to(t), c.to(t)};
}

// GRU and the plain RNNs (tanh, relu): one hidden state.
using HiddenRnn = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&,
                                                         at::TensorList, bool, int64_t, double,
                                                         bool, bool, bool);
template <HiddenRnn Op, HiddenRnn Composite>
std::tuple<at::Tensor, at::Tensor> hidden_rnn(const at::Tensor& input, const at::Tensor& hx,
                                              at::TensorList params, bool has_biases,
                                              int64_t num_layers, double dropout, bool train,
                                              bool bidirectional, bool batch_first) {
  if (!take_all(input, hx, params)) {
    return Composite(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                     batch_first);
  }
  auto [out, h] = Op(wide(input), wide(hx), wide_all(params), has_biases, num_layers, dropout,
                     train, bidirectional, batch_first);
  const auto t = input.scalar_type();
  return {out.to(t), h.to(t)};
}

// Packed sequences: batch_sizes (int64) passed as it is.
std::tuple<at::Tensor, at::Tensor, at::Tensor> lstm_packed(
    const at::Tensor& data, const at::Tensor& batch_sizes, at::TensorList hx, at::TensorList params,
    bool has_biases, int64_t num_layers, double dropout, bool train, bool bidirectional) {
  if (!take_all(data, hx, params)) {
    return at::compositeimplicitautograd::lstm(data, batch_sizes, hx, params, has_biases,
                                               num_layers, dropout, train, bidirectional);
  }
  auto [out, h, c] = at::lstm(wide(data), batch_sizes, wide_all(hx), wide_all(params), has_biases,
                              num_layers, dropout, train, bidirectional);
  const auto t = data.scalar_type();
  return {out.to(t), h.to(t), c.to(t)};
}

using PackedHiddenRnn = std::tuple<at::Tensor, at::Tensor> (*)(const at::Tensor&, const at::Tensor&,
                                                               const at::Tensor&, at::TensorList,
                                                               bool, int64_t, double, bool, bool);
template <PackedHiddenRnn Op, PackedHiddenRnn Composite>
std::tuple<at::Tensor, at::Tensor> packed_hidden_rnn(const at::Tensor& data,
                                                     const at::Tensor& batch_sizes,
                                                     const at::Tensor& hx, at::TensorList params,
                                                     bool has_biases, int64_t num_layers,
                                                     double dropout, bool train,
                                                     bool bidirectional) {
  if (!take_all(data, hx, params)) {
    return Composite(data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
                     bidirectional);
  }
  auto [out, h] = Op(wide(data), batch_sizes, wide(hx), wide_all(params), has_biases, num_layers,
                     dropout, train, bidirectional);
  const auto t = data.scalar_type();
  return {out.to(t), h.to(t)};
}

}  // namespace

void register_recurrent(torch::Library& cpu, torch::Library& autograd) {
  // Above autograd (AutogradCPU) so that the widenings are part of the graph, and for the CPU key
  // too (inference mode skips autograd).
  for (torch::Library* l : {&cpu, &autograd}) {
    l->impl("lstm.input", TORCH_FN(lstm));
    l->impl("lstm.data", TORCH_FN(lstm_packed));
    l->impl("gru.input", TORCH_FN((hidden_rnn<at::gru, at::compositeimplicitautograd::gru>)));
    l->impl("gru.data", TORCH_FN((packed_hidden_rnn<at::gru, at::compositeimplicitautograd::gru>)));
    l->impl("rnn_tanh.input",
            TORCH_FN((hidden_rnn<at::rnn_tanh, at::compositeimplicitautograd::rnn_tanh>)));
    l->impl("rnn_tanh.data",
            TORCH_FN((packed_hidden_rnn<at::rnn_tanh, at::compositeimplicitautograd::rnn_tanh>)));
    l->impl("rnn_relu.input",
            TORCH_FN((hidden_rnn<at::rnn_relu, at::compositeimplicitautograd::rnn_relu>)));
    l->impl("rnn_relu.data",
            TORCH_FN((packed_hidden_rnn<at::rnn_relu, at::compositeimplicitautograd::rnn_relu>)));
  }
}

}  // namespace apex::amp::cpu_half
