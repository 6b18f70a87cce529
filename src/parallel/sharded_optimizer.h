// Internal: the layout and state of one rank of a sharded optimizer (DistributedFusedOptimizer),
// shared by the base (gradients, collectives, checkpoints) and the algorithms (the update).
#pragma once

#include <ATen/Parallel.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <apex/optim/multi_tensor.h>
#include <apex/parallel/c10d.h>
#include <apex/parallel/distributed_fused_optimizer.h>
#include <c10/util/Exception.h>
#include <torch/utils.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bridge/bridge.h"
#include "parallel/errors.h"

namespace apex::parallel {
namespace detail {

// A shard starts on 128 bytes of fp32: bucket sizes are multiples of world * kAlign elements.
constexpr int64_t kAlign = 32;

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

inline std::string describe(const at::Tensor& p) {
  std::ostringstream s;
  s << p.scalar_type() << p.sizes();
  return s.str();
}

/// `groups`, after `check` accepted the defaults and every group's own options: a sharded
/// optimizer's options are checked before its base constructor's collectives.
template <class Options, class Check>
const std::vector<torch::optim::OptimizerParamGroup>& checked_groups(
    const std::vector<torch::optim::OptimizerParamGroup>& groups, const Options& defaults,
    const Check& check) {
  check(defaults);
  for (const auto& g : groups) {
    if (g.has_options()) check(static_cast<const Options&>(g.options()));
  }
  return groups;
}

// store_param_remainders: a bf16 parameter p and a 16-bit remainder r are an fp32 master m, bit for
// bit. p is m's high half rounded half up in magnitude (it is m to bf16 within half a unit; at an
// exact tie round-to-nearest-even may round down instead), r m's low half as a signed number,
// negative exactly where the high half was rounded up. Both ways are exact (modulo 2^16, so even
// the few masters that round to an infinite bf16 come back). Contiguous CPU tensors of n elements.
inline void merge_master(const at::Tensor& p, const at::Tensor& r, const at::Tensor& m) {
  const auto* pb = static_cast<const uint16_t*>(p.const_data_ptr());
  const auto* rb = static_cast<const int16_t*>(r.const_data_ptr());
  auto* mb = static_cast<uint32_t*>(m.mutable_data_ptr());
  at::parallel_for(0, p.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const uint32_t high = static_cast<uint16_t>(pb[i] - (rb[i] < 0 ? 1 : 0));
      mb[i] = (high << 16) | static_cast<uint16_t>(rb[i]);
    }
  });
}

// The other way: m into p (bf16) and r, each where defined.
inline void split_master(const at::Tensor& m, const at::Tensor& p, const at::Tensor& r) {
  const auto* mb = static_cast<const uint32_t*>(m.const_data_ptr());
  auto* pb = p.defined() ? static_cast<uint16_t*>(p.mutable_data_ptr()) : nullptr;
  auto* rb = r.defined() ? static_cast<int16_t*>(r.mutable_data_ptr()) : nullptr;
  at::parallel_for(0, m.numel(), 1 << 16, [&](int64_t lo, int64_t hi) {
    for (int64_t i = lo; i < hi; ++i) {
      const auto low = static_cast<uint16_t>(mb[i]);
      if (pb != nullptr) pb[i] = static_cast<uint16_t>((mb[i] >> 16) + (low >= 0x8000 ? 1 : 0));
      if (rb != nullptr) rb[i] = static_cast<int16_t>(low);
    }
  });
}

}  // namespace detail

struct DistributedFusedOptimizer::Impl {
  // A piece of a parameter inside one bucket.
  struct Fragment {
    int64_t param = 0;
    int64_t param_offset = 0;
    int64_t bucket = 0;
    int64_t bucket_offset = 0;
    int64_t length = 0;
  };
  // A piece of a parameter inside one rank's shard of a bucket.
  struct ShardFragment {
    int64_t param = 0;
    int64_t param_offset = 0;
    int64_t bucket = 0;
    int64_t shard_offset = 0;  // within the bucket's shard
    int64_t local_offset = 0;  // within the rank's flat buffers
    int64_t length = 0;
  };
  enum class BucketState { kEmpty, kFilling, kInFlight, kReduced };
  struct Bucket {
    int64_t size = 0;   // elements, a multiple of world * detail::kAlign
    int64_t shard = 0;  // size / world
    int64_t local_offset = 0;
    std::vector<Fragment> fragments;
    std::vector<int64_t> params;  // distinct parameters with a fragment here
    int64_t arrived = 0;
    BucketState state = BucketState::kEmpty;
    at::Tensor full;      // gradients of the whole bucket, while they live
    at::Tensor sent;      // `full` in pieces (message_cap_mb), while they travel
    at::Tensor received;  // all-to-all output
    std::vector<c10::intrusive_ptr<c10d::Work>> works;  // one per piece
  };
  // A piece of every rank's shard of a bucket: shard elements [offset, offset + length) of each
  // rank travel as one collective. A bucket's pieces lie one after the other, each as [world]
  // [length] (with one piece that is the bucket's own [world][shard] layout).
  struct Piece {
    int64_t offset = 0;
    int64_t length = 0;
  };
  struct Param {
    at::Tensor tensor;
    size_t group = 0;
    int64_t numel = 0;
    std::vector<int64_t> buckets;  // distinct, in order
    std::vector<int64_t> fragments;
    bool arrived = false;           // in this backward (counts toward its buckets)
    bool accumulated = false;       // its gradient is in its buckets since the last step
    bool accumulated_ever = false;  // its gradient arrived before (arrival order)
  };

  DistributedFusedOptimizer* owner = nullptr;
  std::string name;  // "DistributedFusedAdam", ... (messages)
  ProcessGroup group;
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  int64_t rank = 0;
  int64_t world = 1;
  ShardingSettings settings;
  at::ScalarType grad_dtype = at::kFloat;
  at::ScalarType param_dtype = at::kFloat;
  ReduceScatter algorithm = ReduceScatter::kAllToAll;

  std::vector<Param> params;
  std::vector<Fragment> fragments;
  std::vector<Bucket> buckets;
  std::vector<int64_t> order;    // the layout: indices into params
  std::vector<int64_t> arrival;  // the first backward's gradient order (follow_arrival_order)
  // init_params_bucket: groups of parameters that lead the layout, each in buckets of its own.
  std::vector<std::vector<int64_t>> fixed;
  bool arrival_final = false;
  std::vector<ShardFragment> local;                                // this rank's
  std::vector<std::vector<std::vector<ShardFragment>>> by_bucket;  // [bucket][rank]
  int64_t shard_elements = 0;                                      // L: equal on every rank

  at::Tensor exp_avg, exp_avg_sq, master, grad_shard;  // [L]
  // store_param_remainders: int16 [L] in place of `master`, which then exists only during a step
  // (merge_masters .. split_masters).
  at::Tensor remainders;
  // The fp32 masters of the half parameters exist only during a step (remainders, or no
  // store_params): made from the parameters (and remainders) before the kernel, dropped after.
  bool transient_masters = false;
  at::Tensor contiguous;       // contiguous_grad_buffer
  std::vector<int64_t> steps;  // per group

  size_t next_launch = 0;
  std::vector<int64_t> in_flight;  // bucket indices, oldest first
  bool sync_enabled = true;
  bool synced = false;    // every bucket reduced since the last step/zero_grad
  bool unscaled = false;  // unscale_grads ran since the last step

  std::string where() const {
    std::ostringstream s;
    s << name << ": rank " << rank << " of " << world;
    return s.str();
  }

  // Lays the parameters out in `order` (indices into params) and allocates this rank's state.
  void build_layout(double bucket_cap_mb) {
    const int64_t unit = world * detail::kAlign;
    const double cap_elems =
        bucket_cap_mb * 1024.0 * 1024.0 / static_cast<double>(c10::elementSize(grad_dtype));
    const int64_t cap =
        std::max<int64_t>(unit, detail::round_up(static_cast<int64_t>(cap_elems), unit));
    // The layout's segments: each init_params_bucket group (they lead `order`), then the rest.
    std::vector<size_t> ends;
    for (const auto& g : fixed) ends.push_back((ends.empty() ? 0 : ends.back()) + g.size());
    ends.push_back(order.size());
    size_t k = 0;  // position in `order`
    for (const size_t end : ends) {
      int64_t total = 0;
      for (size_t i = k; i < end; ++i) total += params[order[i]].numel;
      // Cut the segment's flat sequence of parameters into buckets of `cap`.
      int64_t start = 0;
      int64_t poff = 0;
      while (start < total) {
        Bucket b;
        const int64_t used = std::min(cap, total - start);
        b.size = detail::round_up(used, unit);
        b.shard = b.size / world;
        b.local_offset = shard_elements;
        shard_elements += b.shard;
        const auto bi = static_cast<int64_t>(buckets.size());
        int64_t filled = 0;
        while (filled < used) {
          const int64_t pi = order[k];
          auto& p = params[pi];
          const int64_t len = std::min(p.numel - poff, used - filled);
          Fragment f{pi, poff, bi, filled, len};
          p.fragments.push_back(static_cast<int64_t>(fragments.size()));
          if (p.buckets.empty() || p.buckets.back() != bi) {
            p.buckets.push_back(bi);
            b.params.push_back(pi);
          }
          fragments.push_back(f);
          b.fragments.push_back(f);
          filled += len;
          poff += len;
          if (poff == p.numel) {
            ++k;
            poff = 0;
          }
        }
        buckets.push_back(std::move(b));
        start += used;
      }
      k = end;
    }
    local = shard_fragments(rank);
    by_bucket.assign(buckets.size(), std::vector<std::vector<ShardFragment>>(world));
    for (int64_t r = 0; r < world; ++r) {
      for (const auto& sf : shard_fragments(r)) by_bucket[sf.bucket][r].push_back(sf);
    }
    const auto f32 = params.front().tensor.options().dtype(at::kFloat);
    exp_avg = at::zeros({shard_elements}, f32);
    exp_avg_sq = at::zeros({shard_elements}, f32);
    grad_shard = at::zeros({shard_elements}, f32.dtype(grad_dtype));
    const bool remainder_bits = any_half() && settings.store_param_remainders;
    master = any_half() && !remainder_bits && settings.store_params
                 ? at::zeros({shard_elements}, f32)
                 : at::Tensor();
    // Zero remainders: every master starts as its parameter.
    remainders = remainder_bits ? at::zeros({shard_elements}, f32.dtype(at::kShort)) : at::Tensor();
    transient_masters = any_half() && (remainder_bits || !settings.store_params);
    if (settings.contiguous_grad_buffer) {
      int64_t all = 0;
      for (const auto& b : buckets) all += b.size;
      contiguous = at::zeros({all}, f32.dtype(grad_dtype));
    }
  }

  // After the first step: the layout follows the order in which rank 0's first backward produced
  // the gradients (apex's), so that the first bucket to fill is the first to go. The state moves
  // to the new layout through the gathered whole state. Every rank calls it.
  void follow_arrival_order() {
    if (arrival_final) return;
    arrival_final = true;
    std::string mine;
    for (const int64_t i : arrival) mine += std::to_string(i) + ",";
    const std::string first = group.all_gather_string(mine).front();
    // The init_params_bucket groups stay in front, in their order.
    std::vector<int64_t> next;
    std::vector<char> seen(params.size(), 0);
    for (const auto& g : fixed) {
      for (const int64_t i : g) {
        seen[i] = 1;
        next.push_back(i);
      }
    }
    std::vector<char> arrived(params.size(), 0);
    std::istringstream in(first);
    for (std::string item; std::getline(in, item, ',');) {
      const int64_t i = std::stoll(item);
      TORCH_CHECK(i >= 0 && i < static_cast<int64_t>(params.size()) && !arrived[i], where(),
                  ": internal: rank 0's gradient order is malformed");
      arrived[i] = 1;
      if (seen[i] == 0) next.push_back(i);
      seen[i] = 1;
    }
    for (const int64_t i : order) {
      if (!seen[i]) next.push_back(i);  // no gradient in the first backward: where they were
    }
    arrival.clear();
    if (next != order) relayout(std::move(next));
  }

  // A new layout (`next`, and the buckets `fixed` asks for; every rank calls it): the state moves
  // through the gathered whole state.
  void relayout(std::vector<int64_t> next) {
    const Full full = gather_full();
    const std::vector<int64_t> kept_steps = steps;
    fragments.clear();
    buckets.clear();
    spare.clear();
    shard_elements = 0;
    for (auto& p : params) {
      p.fragments.clear();
      p.buckets.clear();
    }
    order = std::move(next);
    build_layout(settings.bucket_cap_mb);
    install(full, kept_steps);
  }

  // The fragments of rank r's shards, in local order.
  std::vector<ShardFragment> shard_fragments(int64_t r) const {
    std::vector<ShardFragment> out;
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      const auto& b = buckets[bi];
      const int64_t lo = r * b.shard;
      const int64_t hi = lo + b.shard;
      for (const auto& f : b.fragments) {
        const int64_t s = std::max(lo, f.bucket_offset);
        const int64_t e = std::min(hi, f.bucket_offset + f.length);
        if (s >= e) continue;
        ShardFragment sf;
        sf.param = f.param;
        sf.param_offset = f.param_offset + (s - f.bucket_offset);
        sf.bucket = static_cast<int64_t>(bi);
        sf.shard_offset = s - lo;
        sf.local_offset = b.local_offset + (s - lo);
        sf.length = e - s;
        out.push_back(sf);
      }
    }
    return out;
  }

  at::Tensor flat(int64_t param) const { return params[param].tensor.view({-1}); }
  // A shard fragment's piece of its parameter (contiguous: the parameters are).
  at::Tensor piece(const ShardFragment& sf) const {
    return flat(sf.param).narrow(0, sf.param_offset, sf.length);
  }

  bool any_half() const {
    return std::any_of(params.begin(), params.end(),
                       [](const Param& p) { return p.tensor.scalar_type() != at::kFloat; });
  }

  // The pieces of a shard of `shard` elements of `dt` under message_cap_mb.
  std::vector<Piece> pieces_of(int64_t shard, at::ScalarType dt) const {
    int64_t m = shard;
    if (settings.message_cap_mb > 0) {
      const double cap =
          settings.message_cap_mb * 1024.0 * 1024.0 / static_cast<double>(c10::elementSize(dt));
      m = std::max<int64_t>(detail::kAlign,
                            static_cast<int64_t>(cap) / detail::kAlign * detail::kAlign);
    }
    std::vector<Piece> out;
    for (int64_t off = 0; off < shard || out.empty(); off += m) {
      out.push_back({off, std::min(m, shard - off)});
    }
    return out;
  }
  // Piece c's [world][length] block of a bucket-sized buffer in the pieces' layout.
  at::Tensor block(const at::Tensor& buf, const Piece& c) const {
    return buf.narrow(0, world * c.offset, world * c.length);
  }
  // Rank r's shard elements [offset, offset + t.numel()) from `buf` (in the pieces' layout) into
  // `t`, piece by piece.
  void copy_from_pieces(const at::Tensor& buf, const std::vector<Piece>& ps, int64_t r,
                        int64_t offset, at::Tensor t) const {
    for (const auto& c : ps) {
      const int64_t s = std::max(offset, c.offset);
      const int64_t e = std::min(offset + t.numel(), c.offset + c.length);
      if (s < e) {
        t.narrow(0, s - offset, e - s)
            .copy_(block(buf, c).narrow(0, r * c.length + (s - c.offset), e - s));
      }
    }
  }

  // ---- gradients ----

  // Transient buffers (a bucket's gradients, all-to-all outputs, all-gather buffers) are kept for
  // the next step instead of freed: hundreds of MiB freed and allocated again per step are pages
  // the kernel maps and zeroes anew each time (apex-bench zero: 2.3 s instead of 1.2 s per step
  // at W = 2). At most kMaxSpare stay cached; memory() counts them.
  static constexpr size_t kMaxSpare = 8;
  std::vector<at::Tensor> spare;

  at::Tensor take(int64_t n, at::ScalarType dt) {
    for (auto it = spare.begin(); it != spare.end(); ++it) {
      if (it->numel() == n && it->scalar_type() == dt) {
        at::Tensor t = std::move(*it);
        spare.erase(it);
        return t;
      }
    }
    return at::empty({n}, params.front().tensor.options().dtype(dt));
  }

  void give(at::Tensor&& t) {
    if (t.defined() && spare.size() < kMaxSpare) spare.push_back(std::move(t));
    t = at::Tensor();
  }

  at::Tensor& full_buffer(Bucket& b, int64_t bi) {
    if (!b.full.defined()) {
      if (settings.contiguous_grad_buffer) {
        int64_t off = 0;
        for (int64_t i = 0; i < bi; ++i) off += buckets[i].size;
        b.full = contiguous.narrow(0, off, b.size);
      } else {
        b.full = take(b.size, grad_dtype);
      }
      // A parameter's first gradient is copied in, later ones added (accumulation); what no
      // gradient reaches is zeroed when the bucket is sent (fill_missing).
    }
    return b.full;
  }

  void on_grad(int64_t index, const at::Tensor& param) {
    at::Tensor& grad = param.mutable_grad();
    if (!grad.defined()) return;
    auto& p = params[index];
    TORCH_CHECK(!grad.is_sparse(), where(), ": parameter ", index, " got a sparse gradient");
    TORCH_CHECK(grad.sizes() == param.sizes(), where(), ": parameter ", index,
                "'s gradient has shape ", grad.sizes(), ", expected ", param.sizes());
    for (const int64_t fi : p.fragments) {
      const auto& f = fragments[fi];
      const auto& b = buckets[f.bucket];
      TORCH_CHECK(b.state == BucketState::kEmpty || b.state == BucketState::kFilling, where(),
                  ": a gradient of parameter ", index, " (", detail::describe(param),
                  ") arrived after its bucket ", f.bucket,
                  " was synchronized: call step() or zero_grad() between backward passes, "
                  "or run the earlier micro-batches under no_sync()");
    }
    const torch::NoGradGuard no_grad;
    const at::Tensor g = grad.reshape({-1});
    for (const int64_t fi : p.fragments) {
      const auto& f = fragments[fi];
      auto& b = buckets[f.bucket];
      at::Tensor region = full_buffer(b, f.bucket).narrow(0, f.bucket_offset, f.length);
      if (p.accumulated) {
        region.add_(g.narrow(0, f.param_offset, f.length));
      } else {
        region.copy_(g.narrow(0, f.param_offset, f.length));
      }
      b.state = BucketState::kFilling;
    }
    p.accumulated = true;
    grad = at::Tensor();  // the bucket holds it now: p.grad's memory is released
    synced = false;
    if (!arrival_final && !p.accumulated_ever) {
      p.accumulated_ever = true;
      arrival.push_back(index);
    }
    if (!p.arrived) {
      p.arrived = true;
      for (const int64_t bi : p.buckets) ++buckets[bi].arrived;
    }
    if (sync_enabled && settings.overlap_grad_sync) launch_ready();
  }

  // Zeros where no gradient was written: parameters without one (unused in this backward) and
  // the bucket's padding.
  void fill_missing(Bucket& b) {
    int64_t used = 0;
    for (const auto& f : b.fragments) {
      if (!params[f.param].accumulated) b.full.narrow(0, f.bucket_offset, f.length).zero_();
      used = std::max(used, f.bucket_offset + f.length);
    }
    if (used < b.size) b.full.narrow(0, used, b.size - used).zero_();
  }

  void launch_ready() {
    while (next_launch < buckets.size() &&
           buckets[next_launch].arrived ==
               static_cast<int64_t>(buckets[next_launch].params.size())) {
      launch(next_launch++);
    }
  }

  void launch(size_t bi) {
    auto& b = buckets[bi];
    while (static_cast<int64_t>(in_flight.size()) >= std::max<int64_t>(1, settings.pipeline_size)) {
      finish(in_flight.front());
    }
    at::Tensor& full = full_buffer(b, static_cast<int64_t>(bi));
    fill_missing(b);
    if (world == 1) {  // a group of one: the bucket is the shard
      grad_shard.narrow(0, b.local_offset, b.shard).copy_(full);
      if (!settings.contiguous_grad_buffer) give(std::move(b.full));
      b.state = BucketState::kReduced;
      return;
    }
    if (settings.average_grad_sync) full.div_(static_cast<double>(world));
    // In pieces (message_cap_mb): each piece's rows of the bucket side by side, one copy.
    const auto ps = pieces_of(b.shard, grad_dtype);
    if (ps.size() > 1) {
      b.sent = take(b.size, grad_dtype);
      const at::Tensor rows = full.view({world, b.shard});
      for (const auto& c : ps) {
        block(b.sent, c).view({world, c.length}).copy_(rows.narrow(1, c.offset, c.length));
      }
      if (!settings.contiguous_grad_buffer) give(std::move(b.full));
    }
    const at::Tensor& send = ps.size() > 1 ? b.sent : full;
    try {
      if (algorithm == ReduceScatter::kAllToAll) b.received = take(b.size, grad_dtype);
      for (const auto& c : ps) {
        if (algorithm == ReduceScatter::kNative) {
          at::Tensor out = grad_shard.narrow(0, b.local_offset + c.offset, c.length);
          at::Tensor in = block(send, c);
          b.works.push_back(pg->reduce_scatter_single(out, in));
        } else {
          std::vector<int64_t> even;
          at::Tensor out = block(b.received, c);
          at::Tensor in = block(send, c);
          b.works.push_back(pg->all_to_all_single(out, in, even, even));
        }
      }
    } catch (const std::exception& e) {
      TORCH_CHECK(false, where(), ": the reduce-scatter of bucket ", bi,
                  " failed: ", detail::message_of(e));
    }
    b.state = BucketState::kInFlight;
    in_flight.push_back(static_cast<int64_t>(bi));
  }

  void wait(const c10::intrusive_ptr<c10d::Work>& work, const char* what, int64_t bi) {
    try {
      work->wait();
    } catch (const std::exception& e) {
      TORCH_CHECK(false, where(), ": the ", what, " of bucket ", bi, " failed (timeout ",
                  group.timeout().count(), " ms): ", detail::message_of(e));
    }
  }

  void finish(int64_t bi) {
    auto& b = buckets[bi];
    in_flight.erase(std::find(in_flight.begin(), in_flight.end(), bi));
    auto works = std::move(b.works);
    b.works.clear();
    for (const auto& w : works) wait(w, "reduce-scatter", bi);
    if (algorithm == ReduceScatter::kAllToAll) {
      // Rank j's contribution is row j of each piece: summed in rank order, in fp32.
      at::Tensor acc = grad_dtype == at::kFloat ? at::Tensor() : take(b.shard, at::kFloat);
      for (const auto& c : pieces_of(b.shard, grad_dtype)) {
        const at::Tensor rows = block(b.received, c).view({world, c.length});
        at::Tensor out = (acc.defined() ? acc : grad_shard.narrow(0, b.local_offset, b.shard))
                             .narrow(0, c.offset, c.length);
        out.copy_(rows[0]);
        for (int64_t j = 1; j < world; ++j) out.add_(rows[j]);
      }
      if (acc.defined()) {
        grad_shard.narrow(0, b.local_offset, b.shard).copy_(acc);
        give(std::move(acc));
      }
      give(std::move(b.received));
    }
    give(std::move(b.sent));
    if (!settings.contiguous_grad_buffer) give(std::move(b.full));
    b.state = BucketState::kReduced;
  }

  // Every bucket reduced (the ones whose gradients never all arrived too: missing gradients are
  // zeros), in bucket order on every rank.
  void sync_all() {
    if (synced) return;
    while (next_launch < buckets.size()) launch(next_launch++);
    while (!in_flight.empty()) finish(in_flight.front());
    synced = true;
  }

  void reset_grads() {
    for (auto& b : buckets) {
      TORCH_CHECK(b.state != BucketState::kInFlight || b.works.empty(), where(),
                  ": internal: a reduce-scatter is still in flight");
      if (!settings.contiguous_grad_buffer) give(std::move(b.full));
      b.full = at::Tensor();
      give(std::move(b.received));
      give(std::move(b.sent));
      b.arrived = 0;
      b.state = BucketState::kEmpty;
    }
    for (auto& p : params) p.arrived = p.accumulated = false;
    next_launch = 0;
    synced = false;
    unscaled = false;
  }

  at::Tensor found_inf_agreed() {
    at::Tensor found = at::zeros({1}, grad_shard.options().dtype(at::kFloat));
    if (grad_shard.numel() > 0) optim::multi_tensor_check_finite({grad_shard}, found);
    group.all_reduce_max_(found);
    return found;
  }

  // Transient masters: this rank's fp32 masters for one step (the kernel rows read `master`),
  // from the parameters' fragments and the remainders, then back into the remainders (the
  // kernel wrote the parameters).
  void merge_masters() {
    if (!transient_masters) return;
    master = at::empty({shard_elements}, grad_shard.options().dtype(at::kFloat));
    for (const auto& sf : local) {
      if (params[sf.param].tensor.scalar_type() == at::kFloat) continue;
      at::Tensor m = master.narrow(0, sf.local_offset, sf.length);
      if (remainders.defined()) {
        detail::merge_master(piece(sf), remainders.narrow(0, sf.local_offset, sf.length), m);
      } else {
        m.copy_(piece(sf));
      }
    }
  }
  void split_masters() {
    if (!transient_masters || !master.defined()) return;
    if (remainders.defined()) {
      for (const auto& sf : local) {
        if (params[sf.param].tensor.scalar_type() != at::kBFloat16) continue;
        detail::split_master(master.narrow(0, sf.local_offset, sf.length), piece(sf),
                             remainders.narrow(0, sf.local_offset, sf.length));
      }
    }
    master = at::Tensor();
  }

  // The kernel rows of group `group`'s fragments on this rank, one list set per parameter dtype:
  // 0 the parameter's piece (the model's own storage), 1 its gradient, 2 exp_avg, 3 exp_avg_sq,
  // 4 the fp32 master (half parameters only); `params` names each row's parameter.
  struct Rows {
    bridge::ListBuilder lists{5};
    std::vector<int64_t> params;
  };
  std::map<at::ScalarType, Rows> shard_rows(size_t group) {
    std::map<at::ScalarType, Rows> rows;
    for (const auto& sf : local) {
      const auto& p = params[sf.param];
      if (p.group != group) continue;
      const at::ScalarType dt = p.tensor.scalar_type();
      Rows& r = rows[dt];
      const bool half = dt != at::kFloat && master.defined();
      r.lists.add({piece(sf), grad_shard.narrow(0, sf.local_offset, sf.length),
                   exp_avg.narrow(0, sf.local_offset, sf.length),
                   exp_avg_sq.narrow(0, sf.local_offset, sf.length),
                   half ? master.narrow(0, sf.local_offset, sf.length) : at::Tensor()});
      r.params.push_back(sf.param);
    }
    return rows;
  }

  // A shard of more fragments than this is all-gathered packed (see all_gather_params).
  static constexpr size_t kMaxDirectFragments = 64;

  // Every rank's shard of the parameters to every rank, bucket by bucket (pipelined).
  void all_gather_params() {
    // A group of one: the kernel already wrote every parameter.
    if (buckets.empty() || world == 1) return;
    // On Gloo the shard goes to each other rank by point-to-point sends (the same (W-1)/W of the
    // bucket as an all-gather): Gloo's all-gather ran 2.7x slower than its all-to-all for the
    // same bytes (loopback, 2 ranks, 100 MiB buckets), and the sends need no copy of the shard.
    const bool p2p = algorithm == ReduceScatter::kAllToAll;
    std::vector<std::pair<at::Tensor, at::Tensor>> bufs(buckets.size());  // send, receive
    std::vector<std::vector<c10::intrusive_ptr<c10d::Work>>> works(buckets.size());
    std::vector<char> direct(buckets.size(), 0);
    std::vector<std::vector<Piece>> pieces(buckets.size());
    size_t done = 0;
    auto unpack = [&](size_t bi) {
      for (auto& w : works[bi]) wait(w, "parameter all-gather", static_cast<int64_t>(bi));
      works[bi].clear();
      if (direct[bi] != 0) return;  // received in place
      for (int64_t r = 0; r < world; ++r) {
        // This rank's own piece too, from what it sent (rounded as the others received it),
        // unless the sync dtype carries the parameter's values exactly (its own dtype, or fp32):
        // then the piece already holds them.
        for (const auto& sf : by_bucket[bi][r]) {
          const at::ScalarType dt = params[sf.param].tensor.scalar_type();
          if (r == rank && (dt == param_dtype || param_dtype == at::kFloat)) continue;
          if (r == rank) {
            piece(sf).copy_(bufs[bi].first.narrow(0, sf.shard_offset, sf.length));
          } else {
            copy_from_pieces(bufs[bi].second, pieces[bi], r, sf.shard_offset, piece(sf));
          }
        }
      }
      give(std::move(bufs[bi].first));
      give(std::move(bufs[bi].second));
    };
    for (size_t bi = 0; bi < buckets.size(); ++bi) {
      const auto& b = buckets[bi];
      pieces[bi] = pieces_of(b.shard, param_dtype);
      // Point-to-point with every parameter of the bucket in the sync dtype: each fragment goes
      // from its owner's parameter straight into the others' (one message per fragment and
      // peer), with no shard to pack and no buffer to unpack (a third of the step's copies).
      // Many small fragments (biases, norms' weights) go packed: a message costs more than
      // copying them.
      direct[bi] =
          p2p && pieces[bi].size() == 1 &&
          std::all_of(b.params.begin(), b.params.end(),
                      [&](int64_t pi) { return params[pi].tensor.scalar_type() == param_dtype; }) &&
          std::all_of(by_bucket[bi].begin(), by_bucket[bi].end(),
                      [](const auto& f) { return f.size() <= kMaxDirectFragments; });
      if (direct[bi] == 0) {
        at::Tensor send = take(b.shard, param_dtype).zero_();
        for (const auto& sf : by_bucket[bi][rank]) {
          send.narrow(0, sf.shard_offset, sf.length).copy_(piece(sf));
        }
        at::Tensor recv = take(b.size, param_dtype);
        bufs[bi] = {send, recv};
      }
      while (bi - done >= static_cast<size_t>(std::max<int64_t>(1, settings.pipeline_size))) {
        unpack(done++);
      }
      try {
        if (direct[bi] != 0) {
          // Tags: the bucket in the high bits, the fragment's index in its shard in the low ones
          // (both ranks number a shard's fragments alike: the layout is every rank's).
          const auto tag = [bi](size_t j) { return static_cast<int>((bi << 16) | j); };
          for (int64_t r = 0; r < world; ++r) {
            if (r == rank) continue;
            const auto& mine = by_bucket[bi][rank];
            for (size_t j = 0; j < mine.size(); ++j) {
              std::vector<at::Tensor> out{piece(mine[j])};
              works[bi].push_back(pg->send(out, static_cast<int>(r), tag(j)));
            }
            const auto& theirs = by_bucket[bi][r];
            for (size_t j = 0; j < theirs.size(); ++j) {
              std::vector<at::Tensor> in{piece(theirs[j])};
              works[bi].push_back(pg->recv(in, static_cast<int>(r), tag(j)));
            }
          }
        } else if (p2p && pieces[bi].size() == 1) {
          const int tag = static_cast<int>(bi);
          for (int64_t r = 0; r < world; ++r) {
            if (r == rank) continue;
            std::vector<at::Tensor> out{bufs[bi].first};
            std::vector<at::Tensor> in{bufs[bi].second.narrow(0, r * b.shard, b.shard)};
            works[bi].push_back(pg->send(out, static_cast<int>(r), tag));
            works[bi].push_back(pg->recv(in, static_cast<int>(r), tag));
          }
        } else {
          // An all-gather per piece (one without message_cap_mb), which the backend's worker
          // threads run a few at a time (point-to-point messages would all be queued at once).
          for (const auto& c : pieces[bi]) {
            at::Tensor out = block(bufs[bi].second, c);
            at::Tensor in = bufs[bi].first.narrow(0, c.offset, c.length);
            works[bi].push_back(pg->all_gather_single(out, in));
          }
        }
      } catch (const std::exception& e) {
        TORCH_CHECK(false, where(), ": the parameter all-gather of bucket ", bi,
                    " failed: ", detail::message_of(e));
      }
    }
    while (done < buckets.size()) unpack(done++);
  }

  // ---- whole state, for checkpoints ----

  // Per parameter (layout index): fp32 weights, exp_avg, exp_avg_sq, gathered from every rank.
  struct Full {
    std::vector<at::Tensor> param, exp_avg, exp_avg_sq;
  };

  at::Tensor local_param_values() const {
    at::Tensor out = at::zeros({shard_elements}, grad_shard.options().dtype(at::kFloat));
    for (const auto& sf : local) {
      const bool half = params[sf.param].tensor.scalar_type() != at::kFloat;
      at::Tensor dst = out.narrow(0, sf.local_offset, sf.length);
      if (half && remainders.defined()) {
        detail::merge_master(piece(sf), remainders.narrow(0, sf.local_offset, sf.length), dst);
        continue;
      }
      dst.copy_(half && master.defined() ? master.narrow(0, sf.local_offset, sf.length)
                                         : piece(sf));
    }
    return out;
  }

  Full gather_full() const {
    const at::Tensor mine = at::cat({local_param_values(), exp_avg, exp_avg_sq}).cpu();
    const auto all = group.all_gather(mine.to(grad_shard.device()));
    Full full;
    for (const auto& p : params) {
      const auto o = at::TensorOptions().dtype(at::kFloat);
      full.param.push_back(at::zeros({p.numel}, o));
      full.exp_avg.push_back(at::zeros({p.numel}, o));
      full.exp_avg_sq.push_back(at::zeros({p.numel}, o));
    }
    for (int64_t r = 0; r < world; ++r) {
      const at::Tensor t = all[r].cpu();
      for (const auto& sf : shard_fragments(r)) {
        auto put = [&](std::vector<at::Tensor>& dst, int64_t base) {
          dst[sf.param]
              .narrow(0, sf.param_offset, sf.length)
              .copy_(t.narrow(0, base + sf.local_offset, sf.length));
        };
        put(full.param, 0);
        put(full.exp_avg, shard_elements);
        put(full.exp_avg_sq, 2 * shard_elements);
      }
    }
    return full;
  }

  // Installs whole per-parameter state (validated by the caller): this rank's fragments of it.
  void install(const Full& full, const std::vector<int64_t>& new_steps) {
    const torch::NoGradGuard no_grad;
    for (const auto& sf : local) {
      auto take = [&](const std::vector<at::Tensor>& src, at::Tensor& dst) {
        dst.narrow(0, sf.local_offset, sf.length)
            .copy_(src[sf.param].reshape({-1}).narrow(0, sf.param_offset, sf.length));
      };
      take(full.exp_avg, exp_avg);
      take(full.exp_avg_sq, exp_avg_sq);
      if (master.defined() && params[sf.param].tensor.scalar_type() != at::kFloat &&
          full.param[sf.param].defined()) {
        take(full.param, master);
      }
      if (remainders.defined() && params[sf.param].tensor.scalar_type() == at::kBFloat16 &&
          full.param[sf.param].defined()) {
        const at::Tensor values =
            full.param[sf.param].reshape({-1}).narrow(0, sf.param_offset, sf.length).contiguous();
        detail::split_master(values, at::Tensor(),
                             remainders.narrow(0, sf.local_offset, sf.length));
      }
    }
    // With remainders the parameters are the masters' high halves: every rank writes all of them
    // (not only its fragments), so that the ranks hold the same model before the next step.
    if (remainders.defined()) {
      for (size_t i = 0; i < params.size(); ++i) {
        if (params[i].tensor.scalar_type() != at::kBFloat16 || !full.param[i].defined()) continue;
        detail::split_master(full.param[i].reshape({-1}).contiguous(),
                             flat(static_cast<int64_t>(i)), at::Tensor());
      }
    }
    steps = new_steps;
  }

  // The ranks agree before anything changes: every rank's error (or "") to every rank.
  void agree(const std::string& error, const char* what) const {
    const auto all = group.all_gather_string(error);
    TORCH_CHECK(error.empty(), error);
    for (size_t r = 0; r < all.size(); ++r) {
      TORCH_CHECK(all[r].empty(), where(), ": ", what, " failed on rank ", r,
                  ", so no rank changed anything: ", all[r]);
    }
  }
};

}  // namespace apex::parallel
