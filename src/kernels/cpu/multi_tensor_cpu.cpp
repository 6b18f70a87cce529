// CPU backend driver: splits every tensor of a call into chunks, runs the chunks on ATen's
// intra-op thread pool and calls the chunk kernels of the best instruction set this CPU has.
// Reductions are combined per tensor in chunk order, so results do not depend on the thread count.

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/cpu/isa.h"
#include "kernels/cpu/parallel.h"

namespace apex::kernels::cpu {
namespace {

// 65536 fp32 elements = 256 KiB per list: big enough to amortise scheduling, small enough that a
// 25M-parameter model gives hundreds of chunks to balance over the threads.
constexpr int64_t kChunk = 65536;

const MultiTensorKernels& table() { return *cpu_kernels().multi_tensor; }

struct Chunk {
  int64_t tensor;
  int64_t begin;
  int64_t size;
};

std::vector<Chunk> make_chunks(const TensorLists& lists) {
  std::vector<Chunk> chunks;
  for (int64_t i = 0; i < lists.num_tensors; ++i) {
    for (int64_t b = 0; b < lists.numel[i]; b += kChunk) {
      chunks.push_back({i, b, std::min(kChunk, lists.numel[i] - b)});
    }
  }
  return chunks;
}

Span span_of(const TensorLists& lists, const Chunk& c) {
  Span s;
  s.n = c.size;
  for (int l = 0; l < kMaxLists; ++l) {
    s.t[l] = lists.dtype[l];
    if (lists.ptrs[l] == nullptr) continue;
    s.p[l] = static_cast<char*>(lists.ptrs[l][c.tensor]) + c.begin * dtype_size(lists.dtype[l]);
  }
  return s;
}

// Runs fn(span, chunk_index) over all chunks in parallel: each thread takes a contiguous run of
// chunks holding an equal share of the elements. (Splitting by chunk count instead left one of two
// threads with most of ResNet-50's bytes: its ~120 small tensors are one short chunk each.)
template <class Fn>
void for_each_chunk(const TensorLists& lists, const std::vector<Chunk>& chunks, const Fn& fn) {
  const auto count = static_cast<int64_t>(chunks.size());
  const int64_t parts = std::min<int64_t>(num_threads(), count);
  if (parts <= 1 || in_parallel_region()) {
    for (int64_t c = 0; c < count; ++c) fn(span_of(lists, chunks[c]), c);
    return;
  }
  // first[t]: the first chunk of part t, cut where the running element count passes t/parts.
  std::vector<int64_t> first(static_cast<size_t>(parts) + 1, count);
  int64_t total = 0;
  for (const auto& c : chunks) total += c.size;
  int64_t seen = 0;
  int64_t t = 0;
  for (int64_t c = 0; c < count && t < parts; ++c) {
    while (t < parts && seen >= total * t / parts) first[static_cast<size_t>(t++)] = c;
    seen += chunks[static_cast<size_t>(c)].size;
  }
  parallel_for(0, parts, 1, [&](int64_t b, int64_t e) {
    for (int64_t part = b; part < e; ++part) {
      for (int64_t c = first[static_cast<size_t>(part)]; c < first[static_cast<size_t>(part) + 1];
           ++c) {
        fn(span_of(lists, chunks[static_cast<size_t>(c)]), c);
      }
    }
  });
}

// Chunks set a byte each (no shared writes between threads), combined afterwards.
template <class Fn>
bool any_chunk(const TensorLists& lists, const Fn& fn) {
  const auto chunks = make_chunks(lists);
  std::vector<int> bad(chunks.size(), 0);
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t c) { bad[c] = fn(s) ? 1 : 0; });
  for (int b : bad) {
    if (b != 0) return true;
  }
  return false;
}

float inv_of(const AmpArgs& amp) { return amp.inv_scale != nullptr ? *amp.inv_scale : 1.0f; }
// The factor the update writes the gradients back with (0: none).
float unscale_of(const AmpArgs& amp) {
  return amp.unscale_grads && amp.inv_scale != nullptr ? *amp.inv_scale : 0.0f;
}

// Whether a non-finite gradient was found: the step changes nothing.
bool overflow(const AmpArgs& amp) { return amp.found_inf != nullptr && *amp.found_inf != 0.0f; }

// The AmpArgs skip: on overflow the optimizer changes nothing, but for unscaling the gradients
// (list 1) when asked, as GradScaler's unscale_ would have.
bool skipped(const TensorLists& lists, const AmpArgs& amp) {
  if (!overflow(amp)) return false;
  const float unscale = unscale_of(amp);
  if (unscale != 0.0f && lists.ptrs[1] != nullptr) {
    TensorLists grads;
    grads.num_tensors = lists.num_tensors;
    grads.numel = lists.numel;
    grads.ptrs[0] = grads.ptrs[1] = lists.ptrs[1];
    grads.dtype[0] = grads.dtype[1] = lists.dtype[1];
    any_chunk(grads, [&](const Span& sp) { return table().scale(sp, unscale); });
  }
  return true;
}

}  // namespace

void scale(const TensorLists& lists, const ScaleArgs& args) {
  const float s = args.scale;
  if (any_chunk(lists, [&](const Span& sp) { return table().scale(sp, s); })) {
    *args.found_inf = 1.0f;
  }
}

void axpby(const TensorLists& lists, const AxpbyArgs& args) {
  if (any_chunk(lists, [&](const Span& sp) {
        return table().axpby(sp, args.a, args.b, args.arg_to_check);
      })) {
    *args.found_inf = 1.0f;
  }
}

void check_finite(const TensorLists& lists, float* found_inf) {
  if (any_chunk(lists, [&](const Span& sp) { return table().non_finite(sp); })) *found_inf = 1.0f;
}

void norm(const TensorLists& lists, const NormArgs& args) {
  const float mul = args.inv_scale != nullptr ? *args.inv_scale : 1.0f;
  const auto chunks = make_chunks(lists);
  std::vector<double> partial(chunks.size(), 0.0);
  const bool l2 = args.type == NormType::kL2;
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t c) {
    partial[c] = l2 ? table().sumsq(s, mul) : static_cast<double>(table().absmax(s, mul));
  });
  std::vector<double> per(static_cast<size_t>(lists.num_tensors), 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    double& acc = per[static_cast<size_t>(chunks[c].tensor)];
    if (l2) {
      acc += partial[c];
    } else if (std::isnan(partial[c]) || partial[c] > acc) {
      acc = std::isnan(acc) ? acc : partial[c];
    }
  }
  double total = 0.0;
  for (size_t i = 0; i < per.size(); ++i) {
    if (l2) {
      total += per[i];
      per[i] = std::sqrt(per[i]);
    } else if (std::isnan(per[i]) || per[i] > total) {
      total = std::isnan(total) ? total : per[i];
    }
    if (args.per_tensor != nullptr) args.per_tensor[i] = static_cast<float>(per[i]);
  }
  *args.total = static_cast<float>(l2 ? std::sqrt(total) : total);
}

void adam(const TensorLists& lists, const AdamArgs& args) {
  if (skipped(lists, args.amp)) return;
  const double lr = args.lr_ptr != nullptr ? *args.lr_ptr : args.lr;
  const double step = args.step_ptr != nullptr ? *args.step_ptr : static_cast<double>(args.step);
  const double bc1 = args.bias_correction ? 1.0 - std::pow(double{args.beta1}, step) : 1.0;
  const double bc2 = args.bias_correction ? 1.0 - std::pow(double{args.beta2}, step) : 1.0;
  AdamChunk a{};
  a.inv = inv_of(args.amp);
  a.unscale = unscale_of(args.amp);
  a.l2 = args.adam_w_mode ? 0.0f : args.weight_decay;
  a.decay = args.adam_w_mode ? static_cast<float>(1.0 - lr * args.weight_decay) : 1.0f;
  a.beta1 = args.beta1;
  a.one_minus_beta1 = static_cast<float>(1.0 - args.beta1);
  a.beta2 = args.beta2;
  a.one_minus_beta2 = static_cast<float>(1.0 - args.beta2);
  a.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  a.eps = args.eps;
  a.step_size = static_cast<float>(lr / bc1);
  const auto chunks = make_chunks(lists);
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t) { table().adam(s, a); });
}

void sgd(const TensorLists& lists, const SgdArgs& args) {
  if (skipped(lists, args.amp)) return;
  SgdChunk a{};
  a.inv = inv_of(args.amp);
  a.unscale = unscale_of(args.amp);
  a.wd_before = args.wd_after_momentum ? 0.0f : args.weight_decay;
  a.wd_after = args.wd_after_momentum ? args.weight_decay : 0.0f;
  a.momentum = args.momentum;
  a.one_minus_dampening = static_cast<float>(1.0 - args.dampening);
  a.lr = args.lr;
  a.nesterov = args.nesterov;
  a.first_run = args.first_run;
  a.has_momentum = args.momentum != 0.0f;
  const auto chunks = make_chunks(lists);
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t) { table().sgd(s, a); });
}

void adagrad(const TensorLists& lists, const AdagradArgs& args) {
  if (skipped(lists, args.amp)) return;
  AdagradChunk a{};
  a.inv = inv_of(args.amp);
  a.unscale = unscale_of(args.amp);
  a.l2 = args.adagrad_w_mode ? 0.0f : args.weight_decay;
  a.decay =
      args.adagrad_w_mode ? static_cast<float>(1.0 - double{args.lr} * args.weight_decay) : 1.0f;
  a.lr = args.lr;
  a.eps = args.eps;
  const auto chunks = make_chunks(lists);
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t) { table().adagrad(s, a); });
}

namespace {
LambChunk lamb_chunk_args(const LambArgs& args) {
  LambChunk a{};
  const float gnorm = *args.global_grad_norm;
  const float clip =
      (args.max_grad_norm > 0.0f && gnorm > args.max_grad_norm) ? gnorm / args.max_grad_norm : 1.0f;
  a.g_mul = inv_of(args.amp) / clip;
  a.unscale = unscale_of(args.amp);
  a.l2 = args.adam_w_mode ? 0.0f : args.weight_decay;
  a.wd_update = args.adam_w_mode ? args.weight_decay : 0.0f;
  a.beta1 = args.beta1;
  a.beta3 = args.beta3;
  a.beta2 = args.beta2;
  a.one_minus_beta2 = static_cast<float>(1.0 - args.beta2);
  a.bc1 = args.bias_correction1;
  a.bc2 = args.bias_correction2;
  a.eps = args.eps;
  return a;
}
}  // namespace

void lamb_stage1(const TensorLists& lists, const LambArgs& args) {
  if (skipped(lists, args.amp)) return;
  const LambChunk a = lamb_chunk_args(args);
  const auto chunks = make_chunks(lists);
  std::vector<double> u(chunks.size(), 0.0);
  std::vector<double> p(chunks.size(), 0.0);
  for_each_chunk(lists, chunks,
                 [&](const Span& s, int64_t c) { table().lamb_stage1(s, a, &u[c], &p[c]); });
  std::vector<double> u_acc(static_cast<size_t>(lists.num_tensors), 0.0);
  std::vector<double> p_acc(static_cast<size_t>(lists.num_tensors), 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) {
    u_acc[static_cast<size_t>(chunks[c].tensor)] += u[c];
    p_acc[static_cast<size_t>(chunks[c].tensor)] += p[c];
  }
  for (size_t i = 0; i < u_acc.size(); ++i) {
    args.u_sumsq[i] += static_cast<float>(u_acc[i]);
    args.p_sumsq[i] += static_cast<float>(p_acc[i]);
  }
}

void lamb_stage2(const TensorLists& lists, const LambArgs& args) {
  if (overflow(args.amp)) return;  // (stage 1 unscaled the gradients, skipped or not)
  const LambChunk a = lamb_chunk_args(args);
  const bool trust = args.use_nvlamb || args.weight_decay != 0.0f;
  std::vector<float> ratio(static_cast<size_t>(lists.num_tensors), args.lr);
  for (size_t i = 0; i < ratio.size(); ++i) {
    const float pn = std::sqrt(args.p_sumsq[i]);
    const float un = std::sqrt(args.u_sumsq[i]);
    if (trust && pn != 0.0f && un != 0.0f) ratio[i] = args.lr * (pn / un);
  }
  const auto chunks = make_chunks(lists);
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t c) {
    table().lamb_stage2(s, a, ratio[static_cast<size_t>(chunks[c].tensor)]);
  });
}

void novograd(const TensorLists& lists, const NovoGradArgs& args) {
  if (skipped(lists, args.amp)) return;
  NovoGradChunk base{};
  base.inv = inv_of(args.amp);
  base.unscale = unscale_of(args.amp);
  base.beta1 = args.beta1;
  base.beta3 = args.beta3;
  base.bc1 = args.bias_correction1;
  base.wd = args.weight_decay;
  base.lr = args.lr;
  base.reg_inside_moment = args.reg_inside_moment;
  const auto chunks = make_chunks(lists);
  for_each_chunk(lists, chunks, [&](const Span& s, int64_t c) {
    NovoGradChunk a = base;
    a.denom = args.v[chunks[c].tensor] / args.bias_correction2 + args.eps;
    table().novograd(s, a);
  });
}

}  // namespace apex::kernels::cpu
