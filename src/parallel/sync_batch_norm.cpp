#include <ATen/ops/batch_norm.h>
#include <apex/parallel/sync_batch_norm.h>
#include <c10/util/Exception.h>
#include <torch/autograd.h>
#include <torch/custom_class.h>
#include <torch/nn/init.h>
#include <torch/nn/modules/batchnorm.h>

#include <cmath>

#include "ops/aten/batch_norm.h"

namespace apex::parallel {
namespace {

constexpr const char* kWho = "apex::parallel::SyncBatchNorm";

struct GroupCapsule : torch::CustomClassHolder {
  explicit GroupCapsule(ProcessGroup g) : group(std::move(g)) {}
  ProcessGroup group;
};

at::Tensor float_or_ones(const at::Tensor& t, int64_t c, c10::Device device) {
  return t.defined() ? t.detach().to(at::kFloat).contiguous()
                     : at::ones({c}, at::TensorOptions().dtype(at::kFloat).device(device));
}

// The statistics travel where the group's backend reduces (a CUDA group may have no Gloo for CPU
// tensors) and come back to the CPU, where the merge runs.
at::Tensor to_group(const at::Tensor& t, const ProcessGroup& group) {
  return group.device().is_cpu() ? t : t.to(group.device());
}

struct SyncBatchNormFunction : public torch::autograd::Function<SyncBatchNormFunction> {
  // Optional tensors for what may be undefined (no affine, no running statistics): autograd
  // takes a plain Tensor argument for an input that has a device.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input,
                            const std::optional<at::Tensor>& weight_opt,
                            const std::optional<at::Tensor>& bias_opt,
                            const std::optional<at::Tensor>& running_mean_opt,
                            const std::optional<at::Tensor>& running_var_opt,
                            const std::optional<at::Tensor>& num_batches_tracked_opt, double eps,
                            std::optional<double> momentum, const ProcessGroup& group) {
    const at::Tensor weight = weight_opt.value_or(at::Tensor());
    const at::Tensor bias = bias_opt.value_or(at::Tensor());
    at::Tensor running_mean = running_mean_opt.value_or(at::Tensor());
    at::Tensor running_var = running_var_opt.value_or(at::Tensor());
    at::Tensor num_batches_tracked = num_batches_tracked_opt.value_or(at::Tensor());
    const detail::BatchNormLayout l = detail::batch_norm_layout(input, kWho);
    const at::Tensor x = input.contiguous(l.format);
    const int64_t C = l.shape.channels;
    const auto dbl = at::TensorOptions().dtype(at::kDouble);
    // Local statistics, then [mean, m2, count] of every rank, merged in rank order (Chan).
    const at::Tensor local = detail::batch_norm_stats(x, kWho);
    std::vector<at::Tensor> all = group.all_gather(to_group(local, group));
    std::vector<double> mean(C, 0.0), m2(C, 0.0);
    double total = 0;
    for (auto& r : all) {
      r = r.cpu();
      const double* p = r.data_ptr<double>();
      const double nb = p[2 * C];
      if (nb <= 0) continue;  // an empty batch adds nothing
      const double t = total + nb;
      for (int64_t c = 0; c < C; ++c) {
        const double delta = p[c] - mean[c];
        mean[c] += delta * nb / t;
        m2[c] += p[C + c] + delta * delta * total * nb / t;
      }
      total = t;
    }
    TORCH_CHECK(total > 1, kWho,
                ": expected more than 1 value per channel over all ranks when "
                "training, got input of size ",
                input.sizes(), " on rank ", group.rank(), " and ", total, " values in all");
    at::Tensor mean_f = at::empty({C}, at::kFloat), invstd_f = at::empty({C}, at::kFloat);
    for (int64_t c = 0; c < C; ++c) {
      mean_f.data_ptr<float>()[c] = static_cast<float>(mean[c]);
      invstd_f.data_ptr<float>()[c] = static_cast<float>(1.0 / std::sqrt(m2[c] / total + eps));
    }
    mean_f = mean_f.to(x.device());
    invstd_f = invstd_f.to(x.device());
    if (running_mean.defined()) {
      const at::NoGradGuard no_grad;
      num_batches_tracked.add_(1);
      const double f = momentum.has_value()
                           ? *momentum
                           : 1.0 / static_cast<double>(num_batches_tracked.item<int64_t>());
      at::Tensor gm = at::from_blob(mean.data(), {C}, dbl).clone();
      at::Tensor gv = at::from_blob(m2.data(), {C}, dbl).clone().div_(total - 1);
      running_mean.mul_(1 - f).add_(gm.to(running_mean.device(), running_mean.scalar_type()), f);
      running_var.mul_(1 - f).add_(gv.to(running_var.device(), running_var.scalar_type()), f);
    }
    const at::Tensor w = float_or_ones(weight, C, x.device());
    const at::Tensor b =
        bias.defined() ? bias.detach().to(at::kFloat).contiguous()
                       : at::zeros({C}, at::TensorOptions().dtype(at::kFloat).device(x.device()));
    const at::Tensor scale = w * invstd_f;
    at::Tensor y = detail::batch_norm_elemt(kWho, x, nullptr, mean_f, scale, nullptr, b);

    ctx->save_for_backward({x, weight});
    ctx->saved_data["mean"] = mean_f;
    ctx->saved_data["mean64"] = at::from_blob(mean.data(), {C}, dbl).clone();
    ctx->saved_data["invstd"] = invstd_f;
    ctx->saved_data["total"] = total;
    ctx->saved_data["group"] = c10::IValue::make_capsule(c10::make_intrusive<GroupCapsule>(group));
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& x = saved[0];
    const at::Tensor& weight = saved[1];
    const at::Tensor mean = ctx->saved_data["mean"].toTensor();
    const at::Tensor mean64 = ctx->saved_data["mean64"].toTensor();
    const at::Tensor invstd = ctx->saved_data["invstd"].toTensor();
    const double total = ctx->saved_data["total"].toDouble();
    const auto capsule = ctx->saved_data["group"].toCapsule();
    const ProcessGroup& group = static_cast<GroupCapsule*>(capsule.get())->group;
    const int64_t C = x.size(1);
    const at::Tensor dy = grads[0];
    at::Tensor sums = detail::batch_norm_backward_reduce(kWho, dy, x, mean64);
    // Per-channel float values on x's device.
    const auto channel = [&](const at::Tensor& t) { return t.to(x.device(), at::kFloat); };
    at::Tensor grad_weight, grad_bias, grad_input;
    if (weight.defined() && ctx->needs_input_grad(1)) {
      grad_weight = (channel(sums.slice(0, C, 2 * C)) * invstd).to(weight.scalar_type());
    }
    if (ctx->needs_input_grad(2)) {
      grad_bias =
          channel(sums.slice(0, 0, C)).to(weight.defined() ? weight.scalar_type() : at::kFloat);
    }
    if (ctx->needs_input_grad(0)) {
      at::Tensor global = to_group(sums, group);
      group.all_reduce_(global);  // the global sum_dy and sum_dy_xmu
      sums = global.cpu();
      const at::Tensor w = float_or_ones(weight, C, x.device());
      const at::Tensor s_dy = channel(sums.slice(0, 0, C));
      const at::Tensor s_dyx = channel(sums.slice(0, C, 2 * C));
      const float inv_n = static_cast<float>(1.0 / total);
      const at::Tensor b = (w * invstd).contiguous();
      const at::Tensor a = (-(w * invstd * invstd * invstd) * s_dyx * inv_n).contiguous();
      const at::Tensor k = (-(w * invstd) * s_dy * inv_n).contiguous();
      grad_input = detail::batch_norm_elemt(kWho, x, &dy, mean, a, &b, k);
    }
    return {grad_input,   grad_weight,  grad_bias,    at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

SyncBatchNormImpl::SyncBatchNormImpl(const torch::nn::BatchNormOptions& options_,
                                     ProcessGroup group_, SyncBatchNormState state)
    : options(options_), group(std::move(group_)), adopt_(std::move(state)) {
  TORCH_CHECK(options.num_features() > 0, kWho, ": num_features must be > 0, got ",
              options.num_features());
  TORCH_CHECK(std::isfinite(options.eps()) && options.eps() >= 0, kWho, ": eps must be >= 0, got ",
              options.eps());
  reset();
}

void SyncBatchNormImpl::reset() {
  const int64_t c = options.num_features();
  if (adopt_.weight.defined() || adopt_.running_mean.defined()) {
    // Another module's tensors themselves (convert_sync_batchnorm): registered as they are.
    const SyncBatchNormState s = std::move(adopt_);
    adopt_ = {};
    const auto fits = [&](const at::Tensor& t, const char* what) {
      TORCH_CHECK(t.defined() && t.dim() == 1 && t.size(0) == c, kWho, ": the adopted ", what,
                  " must have ", c, " elements");
    };
    if (options.affine()) {
      fits(s.weight, "weight");
      fits(s.bias, "bias");
      weight = register_parameter("weight", s.weight, s.weight.requires_grad());
      bias = register_parameter("bias", s.bias, s.bias.requires_grad());
    } else {
      weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
      bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
    }
    if (options.track_running_stats()) {
      fits(s.running_mean, "running_mean");
      fits(s.running_var, "running_var");
      running_mean = register_buffer("running_mean", s.running_mean);
      running_var = register_buffer("running_var", s.running_var);
      num_batches_tracked = register_buffer("num_batches_tracked", s.num_batches_tracked);
    } else {
      running_mean = register_buffer("running_mean", at::Tensor());
      running_var = register_buffer("running_var", at::Tensor());
      num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
    }
    return;
  }
  if (options.affine()) {
    weight = register_parameter("weight", at::empty({c}));
    bias = register_parameter("bias", at::empty({c}));
  } else {
    weight = register_parameter("weight", at::Tensor(), /*requires_grad=*/false);
    bias = register_parameter("bias", at::Tensor(), /*requires_grad=*/false);
  }
  if (options.track_running_stats()) {
    running_mean = register_buffer("running_mean", at::zeros({c}));
    running_var = register_buffer("running_var", at::ones({c}));
    num_batches_tracked = register_buffer("num_batches_tracked", at::zeros({}, at::kLong));
  } else {
    running_mean = register_buffer("running_mean", at::Tensor());
    running_var = register_buffer("running_var", at::Tensor());
    num_batches_tracked = register_buffer("num_batches_tracked", at::Tensor());
  }
  reset_parameters();
}

void SyncBatchNormImpl::reset_running_stats() {
  if (!options.track_running_stats()) return;
  const at::NoGradGuard no_grad;
  running_mean.zero_();
  running_var.fill_(1);
  num_batches_tracked.zero_();
}

void SyncBatchNormImpl::reset_parameters() {
  reset_running_stats();
  if (options.affine()) {
    torch::nn::init::ones_(weight);
    torch::nn::init::zeros_(bias);
  }
}

void SyncBatchNormImpl::pretty_print(std::ostream& stream) const {
  stream << "apex::parallel::SyncBatchNorm(" << options.num_features() << ", eps=" << options.eps()
         << ", momentum=";
  if (options.momentum().has_value()) {
    stream << *options.momentum();
  } else {
    stream << "None";
  }
  stream << ", affine=" << options.affine()
         << ", track_running_stats=" << options.track_running_stats() << ")";
}

at::Tensor SyncBatchNormImpl::forward(const at::Tensor& input) {
  TORCH_CHECK(input.dim() >= 2, kWho, ": expected input of shape (N, C, *), got ", input.sizes());
  TORCH_CHECK(input.size(1) == options.num_features(), kWho, ": expected ", options.num_features(),
              " channels (dim 1), got input of size ", input.sizes());
  if (!is_training()) {
    // Evaluation never communicates (as torch's SyncBatchNorm): the running statistics, or,
    // without them, this rank's batch statistics (ATen's own kernel either way).
    const bool batch_stats = !options.track_running_stats();
    return at::batch_norm(input, weight, bias, batch_stats ? at::Tensor() : running_mean,
                          batch_stats ? at::Tensor() : running_var, batch_stats, 0.0, options.eps(),
                          false);
  }
  TORCH_CHECK(input.device().is_cpu() || input.device().is_cuda(), kWho,
              ": expected CPU or CUDA training input, got input on ", input.device());
  TORCH_CHECK(group.valid(), kWho,
              ": no process group (call apex::parallel::init_process_group before constructing "
              "the module, or pass one)");
  const bool track = options.track_running_stats();
  const auto opt = [](bool use, const at::Tensor& t) {
    return use && t.defined() ? std::optional<at::Tensor>(t) : std::nullopt;
  };
  return SyncBatchNormFunction::apply(
      input, opt(true, weight), opt(true, bias), opt(track, running_mean), opt(track, running_var),
      opt(track, num_batches_tracked), options.eps(), options.momentum(), group);
}

namespace {

template <typename Impl>
std::shared_ptr<SyncBatchNormImpl> from_batch_norm(const torch::nn::Module& m,
                                                   const ProcessGroup& group) {
  const auto* bn = dynamic_cast<const Impl*>(&m);
  if (bn == nullptr) return nullptr;
  // The same tensors, so that an optimizer holding them keeps training the converted module.
  auto out = std::make_shared<SyncBatchNormImpl>(
      bn->options, group,
      SyncBatchNormState{bn->weight, bn->bias, bn->running_mean, bn->running_var,
                         bn->num_batches_tracked});
  if (!bn->is_training()) out->eval();
  return out;
}

std::shared_ptr<SyncBatchNormImpl> as_sync(const torch::nn::Module& m, const ProcessGroup& g) {
  if (auto s = from_batch_norm<torch::nn::BatchNorm1dImpl>(m, g)) return s;
  if (auto s = from_batch_norm<torch::nn::BatchNorm2dImpl>(m, g)) return s;
  return from_batch_norm<torch::nn::BatchNorm3dImpl>(m, g);
}

bool holds_batch_norm(const torch::nn::Module& m) {
  for (const auto& c : m.modules(/*include_self=*/true)) {
    if (dynamic_cast<const torch::nn::BatchNorm1dImpl*>(c.get()) != nullptr ||
        dynamic_cast<const torch::nn::BatchNorm2dImpl*>(c.get()) != nullptr ||
        dynamic_cast<const torch::nn::BatchNorm3dImpl*>(c.get()) != nullptr) {
      return true;
    }
  }
  return false;
}

}  // namespace

torch::nn::Sequential convert_sync_batchnorm(const torch::nn::Sequential& module,
                                             ProcessGroup group) {
  torch::nn::Sequential out;
  const auto names = module->named_children();
  size_t i = 0;
  for (const torch::nn::AnyModule& any : *module) {
    const std::string& name = names[i++].key();
    const std::shared_ptr<torch::nn::Module> child = any.ptr();
    if (auto s = as_sync(*child, group)) {
      out->push_back(std::string(name), SyncBatchNorm(s));
      continue;
    }
    TORCH_CHECK(!holds_batch_norm(*child), "apex::parallel::convert_sync_batchnorm: element '",
                name,
                "' of the Sequential holds a BatchNorm in a member of its own, which "
                "LibTorch cannot swap from outside (the member keeps the old module); construct "
                "apex::parallel::SyncBatchNorm there");
    out->push_back(std::string(name), any);
  }
  if (!module->is_training()) out->eval();
  return out;
}

std::shared_ptr<torch::nn::Module> convert_sync_batchnorm(
    const std::shared_ptr<torch::nn::Module>& module, ProcessGroup group) {
  TORCH_CHECK(module != nullptr, "apex::parallel::convert_sync_batchnorm: module is null");
  if (auto s = as_sync(*module, group)) return s;
  if (auto seq = std::dynamic_pointer_cast<torch::nn::SequentialImpl>(module)) {
    return convert_sync_batchnorm(torch::nn::Sequential(seq), group).ptr();
  }
  // Anything else: its members are typed fields we cannot reach.
  for (const auto& child : module->named_children()) {
    TORCH_CHECK(!holds_batch_norm(*child.value()), "apex::parallel::convert_sync_batchnorm: '",
                child.key(), "' of ", module->name(),
                " is (or holds) a BatchNorm in a member of a custom module, which LibTorch cannot "
                "swap from outside (the member keeps the old module); construct "
                "apex::parallel::SyncBatchNorm there, or convert the Sequential where it is built");
  }
  return module;
}

}  // namespace apex::parallel
