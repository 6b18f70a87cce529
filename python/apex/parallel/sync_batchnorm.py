import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.modules.batchnorm import _BatchNorm

from apex._ops import ops


class _SyncBatchNormCpu(torch.autograd.Function):
    """Batch statistics over every rank's batch on apex-cpp's CPU kernels: per rank [mean, M2,
    count] (Welford blocks, fp64 sums, fixed order), all-gathered and merged in rank order (Chan's
    formula; empty batches add nothing); the backward's two reductions all-reduced once."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, num_batches_tracked, eps,
                momentum, process_group):
        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        c = input.shape[1]
        local = ops.batch_norm_stats(input)
        gathered = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(gathered, local, group=group)
        mean = torch.zeros(c, dtype=torch.float64)
        m2 = torch.zeros(c, dtype=torch.float64)
        total = 0.0
        for r in gathered:
            nb = float(r[2 * c])
            if nb <= 0:
                continue
            t = total + nb
            delta = r[:c] - mean
            mean += delta * (nb / t)
            m2 += r[c:2 * c] + delta * delta * (total * nb / t)
            total = t
        if total <= 1:
            raise ValueError(f"SyncBatchNorm: expected more than 1 value per channel over all ranks "
                             f"when training, got input of size {list(input.shape)} on rank "
                             f"{dist.get_rank(group)} and {int(total)} values in all")
        invstd = (1.0 / torch.sqrt(m2 / total + eps)).float()
        mean_f = mean.float()
        if running_mean is not None:
            with torch.no_grad():
                num_batches_tracked.add_(1)
                f = momentum if momentum is not None else 1.0 / float(num_batches_tracked.item())
                running_mean.mul_(1 - f).add_(mean.to(running_mean.dtype), alpha=f)
                running_var.mul_(1 - f).add_((m2 / (total - 1)).to(running_var.dtype), alpha=f)
        w = weight.detach().float() if weight is not None else torch.ones(c)
        b = bias.detach().float() if bias is not None else torch.zeros(c)
        y = ops.batch_norm_elemt(input, mean_f, w * invstd, b)
        ctx.save_for_backward(input, weight, mean_f, mean, invstd)
        ctx.total = total
        ctx.group = group
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, mean_f, mean64, invstd = ctx.saved_tensors
        c = x.shape[1]
        sums = ops.batch_norm_backward_reduce(grad_out, x, mean64)
        grad_weight = grad_bias = grad_input = None
        wdtype = weight.dtype if weight is not None else torch.float32
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = (sums[c:].float() * invstd).to(wdtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = sums[:c].float().to(wdtype)
        if ctx.needs_input_grad[0]:
            sums = sums.clone()
            dist.all_reduce(sums, group=ctx.group)
            w = weight.detach().float() if weight is not None else torch.ones(c)
            s_dy = sums[:c].float()
            s_dyx = sums[c:].float()
            inv_n = 1.0 / ctx.total
            b = w * invstd
            a = -(w * invstd ** 3) * s_dyx * inv_n
            k = -(w * invstd) * s_dy * inv_n
            grad_input = ops.batch_norm_backward_elemt(grad_out, x, mean_f, a, b, k)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """apex's SyncBatchNorm: BatchNorm whose training statistics come from every rank's batch
    (uneven per-rank batches and empty ones included), running statistics updated as BatchNorm
    does. On the CPU it runs apex-cpp's kernels (a feature torch.nn.SyncBatchNorm lacks); on CUDA,
    torch's. Outside training, or in a group of one, it is plain BatchNorm. ``channel_last`` is
    accepted for apex's signature (the layout is read from the input); ``fuse_relu`` applies a ReLU
    after the normalization."""

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True,
                 track_running_stats=True, process_group=None, channel_last=False,
                 fuse_relu=False):
        super().__init__(num_features, eps=eps, momentum=momentum, affine=affine,
                         track_running_stats=track_running_stats)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input, z=None):
        self._check_input_dim(input)
        distributed = (self.training and dist.is_available() and dist.is_initialized() and
                       dist.get_world_size(self.process_group or dist.group.WORLD) > 1)
        if not distributed:
            out = super().forward(input)
        elif input.is_cuda:
            from torch.nn.modules._functions import SyncBatchNorm as _TorchSync
            group = self.process_group or dist.group.WORLD
            if self.track_running_stats:
                self.num_batches_tracked.add_(1)
            momentum = self.momentum if self.momentum is not None else (
                1.0 / float(self.num_batches_tracked.item()))
            out = _TorchSync.apply(input, self.weight, self.bias, self.running_mean,
                                   self.running_var, self.eps, momentum, group,
                                   dist.get_world_size(group))
        else:
            track = self.track_running_stats
            out = _SyncBatchNormCpu.apply(input, self.weight, self.bias,
                                          self.running_mean if track else None,
                                          self.running_var if track else None,
                                          self.num_batches_tracked if track else None, self.eps,
                                          self.momentum, self.process_group)
        if z is not None:
            out = out + z
        if self.fuse_relu:
            out = F.relu(out)
        return out


def convert_syncbn_model(module, process_group=None, channel_last=False):
    """Replaces every BatchNorm layer of `module` (recursively) by a SyncBatchNorm holding the
    same parameters, buffers and train/eval state; returns the converted module."""
    mod = module
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        mod = SyncBatchNorm(module.num_features, module.eps, module.momentum, module.affine,
                            module.track_running_stats, process_group, channel_last=channel_last)
        if module.affine:
            with torch.no_grad():
                mod.weight = module.weight
                mod.bias = module.bias
        if module.track_running_stats:
            mod.running_mean = module.running_mean
            mod.running_var = module.running_var
            mod.num_batches_tracked = module.num_batches_tracked
        mod.train(module.training)
    for name, child in module.named_children():
        mod.add_module(name, convert_syncbn_model(child, process_group, channel_last))
    return mod
