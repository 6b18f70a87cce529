// The CPU half fallback's attention (fallback.h): the CPU flash attention, forward and backward,
// by apex's own half kernels (kernels/attention.h) where they serve, else widened around
// LibTorch's fp32 kernel inside the fallback.
#include <ATen/ExpandUtils.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_backward_cpu_dispatch.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_cpu_dispatch.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "amp/cpu_half/fallback.h"
#include "bridge/bridge.h"
#include "kernels/attention.h"

#include <cmath>
#include <optional>
#include <tuple>

namespace apex::amp::cpu_half {
namespace {

// A mask the fallback takes: none, a boolean one, or a floating one in the query's half dtype
// (LibTorch refuses a floating mask of another dtype; an fp32 one goes to LibTorch's kernel).
bool mask_taken(const at::Tensor& m, const at::Tensor& q) {
  return !m.defined() || !m.is_floating_point() || m.scalar_type() == q.scalar_type();
}

// A floating mask widened to fp32 without materialising its broadcast dimensions: the stored
// values are widened, then expanded again (LibTorch's kernel reads zero strides).
at::Tensor wide_mask(const at::Tensor& m) {
  at::Tensor compact = m;
  for (int64_t d = 0; d < m.dim(); ++d) {
    if (m.stride(d) == 0 && m.size(d) > 1) compact = compact.narrow(d, 0, 1);
  }
  return wide(compact).expand(m.sizes());
}

// Attention through apex's own kernels (kernels/attention.h): no dropout, one head of K and V per
// head of Q, one head size (LibTorch's flash attention refuses others), sequences and heads up to
// kAttentionMaxLength (all keys' scores held at once), an additive mask in the query's dtype of 2
// or 4 dimensions that broadcasts to [B, H, Lq, Lk] (or none). Otherwise widened for LibTorch's
// fp32 flash attention (in the fallback), or LibTorch's half kernel (beyond it).
bool own_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& mask, double dropout_p) {
  using kernels::cpu::kAttentionMaxLength;
  if (dropout_p != 0.0 || q.dim() != 4 || k.dim() != 4 || v.dim() != 4) {
    return false;
  }
  const auto fits = [](int64_t n) { return n >= 1 && n <= kAttentionMaxLength; };
  const bool shapes = q.size(0) >= 1 && q.size(1) >= 1 && k.size(0) == q.size(0) &&
                      v.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(1) == q.size(1) &&
                      k.size(3) == q.size(3) && v.size(3) == q.size(3) && v.size(2) == k.size(2) &&
                      fits(q.size(2)) && fits(k.size(2)) && fits(q.size(3)) && fits(v.size(3));
  if (!shapes || !mask.defined()) return shapes;
  return mask.scalar_type() == q.scalar_type() && (mask.dim() == 2 || mask.dim() == 4) &&
         at::is_expandable_to(mask.sizes(), {q.size(0), q.size(1), q.size(2), k.size(2)});
}

// The mask as [B, H, Lq, Lk] with zero strides where it broadcasts.
at::Tensor mask_4d(const at::Tensor& mask, const at::Tensor& q, const at::Tensor& k) {
  const at::Tensor m = mask.dim() == 2 ? mask.unsqueeze(0).unsqueeze(0) : mask;
  return m.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
}

kernels::cpu::HalfView half_view(const at::Tensor& x) {
  return {x.const_data_ptr(), x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}
kernels::cpu::HalfOut half_out(at::Tensor& x) {
  return {x.mutable_data_ptr(), x.stride(0), x.stride(1), x.stride(2), x.stride(3)};
}

kernels::cpu::HalfAttention attention_of(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& mask4,
                                         bool is_causal, std::optional<double> scale) {
  kernels::cpu::HalfAttention a;
  a.t = bridge::kernel_dtype(q, "scaled_dot_product_attention");
  a.batch = q.size(0);
  a.heads = q.size(1);
  a.lq = q.size(2);
  a.lk = k.size(2);
  a.d = q.size(3);
  a.dv = v.size(3);
  a.q = half_view(q);
  a.k = half_view(k);
  a.v = half_view(v);
  if (mask4.defined()) a.mask = half_view(mask4);
  // LibTorch's default: 1 / sqrt(head size), in double, then fp32.
  a.scale =
      static_cast<float>(scale.has_value() ? *scale : 1.0 / std::sqrt(static_cast<double>(a.d)));
  a.causal = is_causal;
  return a;
}

// In a scope, inputs of one half dtype that attention's own kernels serve and can take.
bool take_own_attention(c10::ArrayRef<const at::Tensor*> ts, const at::Tensor& q,
                        const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                        double dropout_p) {
  const std::optional<at::ScalarType> dtype = scoped_half_dtype(ts);
  if (!dtype.has_value() || !serves_attention(*dtype) || !own_attention(q, k, v, mask, dropout_p)) {
    return false;
  }
  ++taken_calls;
  ++own_product_calls;
  return true;
}

std::tuple<at::Tensor, at::Tensor> flash_attention(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& v, double dropout_p,
                                                   bool is_causal,
                                                   const std::optional<at::Tensor>& attn_mask,
                                                   std::optional<double> scale) {
  const at::Tensor m = attn_mask.value_or(at::Tensor());
  if (take_own_attention({&q, &k, &v}, q, k, v, m, dropout_p)) {
    const at::Tensor m4 = m.defined() ? mask_4d(m, q, k) : m;
    // The layouts LibTorch's kernel gives: the output like the query, lse [B, L, H] transposed.
    at::Tensor out = q.size(3) == v.size(3)
                         ? at::empty_like(q, at::MemoryFormat::Preserve)
                         : at::empty({q.size(0), q.size(1), q.size(2), v.size(3)}, q.options());
    at::Tensor lse =
        at::empty({q.size(0), q.size(2), q.size(1)}, q.options().dtype(at::kFloat)).transpose(1, 2);
    kernels::cpu::half_attention_forward(attention_of(q, k, v, m4, is_causal, scale), half_out(out),
                                         lse.mutable_data_ptr<float>(), lse.stride(0),
                                         lse.stride(1), lse.stride(2));
    return {out, lse};
  }
  if (!take({&q, &k, &v}) || !mask_taken(m, q)) {
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                attn_mask, scale);
  }
  const std::optional<at::Tensor> wm =
      m.defined() && m.is_floating_point() ? std::optional<at::Tensor>(wide_mask(m)) : attn_mask;
  auto [out, lse] = at::cpu::_scaled_dot_product_flash_attention_for_cpu(
      wide(q), wide(k), wide(v), dropout_p, is_causal, wm, scale);
  return {out.to(q.scalar_type()), lse};  // logsumexp is fp32 for half inputs too
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> flash_attention_backward(
    const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& logsumexp, double dropout_p, bool is_causal,
    const std::optional<at::Tensor>& attn_mask, std::optional<double> scale) {
  const at::Tensor m = attn_mask.value_or(at::Tensor());
  if (grad_out.sizes() == out.sizes() && out.dim() == 4 && q.dim() == 4 && v.dim() == 4 &&
      out.sizes() == at::IntArrayRef{q.size(0), q.size(1), q.size(2), v.size(3)} &&
      logsumexp.scalar_type() == at::kFloat && logsumexp.dim() == 3 &&
      logsumexp.sizes() == q.sizes().slice(0, 3) &&
      take_own_attention({&grad_out, &q, &k, &v, &out}, q, k, v, m, dropout_p)) {
    const at::Tensor m4 = m.defined() ? mask_4d(m, q, k) : m;
    // LibTorch's layout for the gradients, whatever the inputs': [B, L, H, D] seen transposed.
    const auto blhd = [](const at::Tensor& x) {
      return at::empty({x.size(0), x.size(2), x.size(1), x.size(3)}, x.options()).transpose(1, 2);
    };
    at::Tensor gq = blhd(q), gk = blhd(k), gv = blhd(v);
    kernels::cpu::half_attention_backward(
        attention_of(q, k, v, m4, is_causal, scale), half_view(grad_out), half_view(out),
        logsumexp.const_data_ptr<float>(), logsumexp.stride(0), logsumexp.stride(1),
        logsumexp.stride(2), half_out(gq), half_out(gk), half_out(gv));
    return {gq, gk, gv};
  }
  if (!take({&grad_out, &q, &k, &v, &out}) || !mask_taken(m, q)) {
    return at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, attn_mask, scale);
  }
  const std::optional<at::Tensor> wm =
      m.defined() && m.is_floating_point() ? std::optional<at::Tensor>(wide_mask(m)) : attn_mask;
  auto [gq, gk, gv] = at::cpu::_scaled_dot_product_flash_attention_for_cpu_backward(
      wide(grad_out), wide(q), wide(k), wide(v), wide(out), logsumexp, dropout_p, is_causal, wm,
      scale);
  const auto t = q.scalar_type();
  return {gq.to(t), gk.to(t), gv.to(t)};
}

}  // namespace

void register_attention(torch::Library& cpu) {
  cpu.impl("_scaled_dot_product_flash_attention_for_cpu", TORCH_FN(flash_attention));
  cpu.impl("_scaled_dot_product_flash_attention_for_cpu_backward",
           TORCH_FN(flash_attention_backward));
}

}  // namespace apex::amp::cpu_half
