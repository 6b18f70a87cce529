import torch
import torch.distributed as dist


def _apex_hook(allreduce_always_fp32, gradient_predivide_factor, gradient_average):
    """apex's reduction: optionally in fp32, divided by `predivide` before the sum and by
    world / predivide after it (without gradient_average: the sum of grad / predivide)."""

    def hook(process_group, bucket):
        group = process_group if process_group is not None else dist.group.WORLD
        world = dist.get_world_size(group)
        buf = bucket.buffer()
        t = buf.float() if allreduce_always_fp32 and buf.dtype != torch.float32 else buf
        if gradient_predivide_factor != 1.0:
            t.div_(gradient_predivide_factor)
        fut = dist.all_reduce(t, group=group, async_op=True).get_future()

        def finish(f):
            out = f.value()[0]
            # apex: the sum of grad / predivide, then averaged by world / predivide; without
            # gradient_average the sum of grad / predivide stays as it is.
            if gradient_average:
                out.mul_(gradient_predivide_factor / world)
            if out.dtype != buf.dtype:
                buf.copy_(out)
                return buf
            return out

        return fut.then(finish)

    return hook


class DistributedDataParallel(torch.nn.parallel.DistributedDataParallel):
    """apex's DistributedDataParallel, on torch's DDP (its Reducer: buckets reduced while backward
    still runs). apex's options map to it:

    * ``message_size`` (elements) -> the bucket size (``bucket_cap_mb`` at 4 bytes per element);
    * ``delay_allreduce`` -> one bucket, reduced when the whole backward is done, with
      ``find_unused_parameters`` (apex reduced whatever had a gradient);
    * ``allreduce_always_fp32``, ``gradient_predivide_factor``, ``gradient_average`` -> a comm hook
      (no hook when they are at their defaults: the Reducer's own averaging runs).

    ``shared_param``, ``allreduce_trigger_params``, ``retain_allreduce_buffers``,
    ``num_allreduce_streams``, ``allreduce_communicators``, ``gradient_average_split_factor`` and
    ``prof`` are accepted for apex's signature; the ones that would change the result raise when
    set to anything but their default.
    """

    def __init__(self, module, message_size=10000000, delay_allreduce=False, shared_param=None,
                 allreduce_trigger_params=None, retain_allreduce_buffers=False,
                 allreduce_always_fp32=False, num_allreduce_streams=1,
                 allreduce_communicators=None, gradient_average=True,
                 gradient_predivide_factor=1.0, gradient_average_split_factor=None, prof=False,
                 process_group=None, **ddp_kwargs):
        if shared_param is not None:
            raise ValueError("shared_param is no longer supported as an option.  It was misleadingly "
                             "named from the start.  It turns out overlapping communication with "
                             "computation should work fine with shared parameters.")
        if allreduce_trigger_params is not None:
            raise ValueError("apex.parallel.DistributedDataParallel: allreduce_trigger_params is "
                             "not supported (torch's Reducer triggers buckets itself)")
        if gradient_average_split_factor is not None:
            gradient_predivide_factor = gradient_average_split_factor
        if message_size <= 0 or gradient_predivide_factor <= 0:
            raise ValueError(f"apex.parallel.DistributedDataParallel: message_size and "
                             f"gradient_predivide_factor must be > 0, got {message_size} and "
                             f"{gradient_predivide_factor}")
        if not dist.is_initialized():
            raise RuntimeError("apex.parallel.DistributedDataParallel: call "
                               "torch.distributed.init_process_group first")
        bucket_cap_mb = 1e9 if delay_allreduce else message_size * 4 / (1 << 20)
        if delay_allreduce:
            # apex reduced whatever had a gradient once backward was done, so parameters unused
            # in an iteration were fine there; torch's Reducer needs to be told to look for them.
            ddp_kwargs.setdefault("find_unused_parameters", True)
        device_ids = None
        params = list(module.parameters())
        if params and params[0].is_cuda and "device_ids" not in ddp_kwargs:
            device_ids = [params[0].device.index]
        super().__init__(module, device_ids=device_ids, bucket_cap_mb=bucket_cap_mb,
                         process_group=process_group, **ddp_kwargs)
        self.message_size = message_size
        self.delay_allreduce = delay_allreduce
        self.allreduce_always_fp32 = allreduce_always_fp32
        self.gradient_average = gradient_average
        self.gradient_predivide_factor = gradient_predivide_factor
        self.retain_allreduce_buffers = retain_allreduce_buffers
        if allreduce_always_fp32 or gradient_predivide_factor != 1.0 or not gradient_average:
            self.register_comm_hook(process_group,
                                    _apex_hook(allreduce_always_fp32, gradient_predivide_factor,
                                               gradient_average))


class Reducer:
    """apex's manual reducer: ``reduce()`` all-reduces (and averages) the gradients of `module_or
    _grads_list`'s parameters in one flat call, for code that triggers reduction itself."""

    def __init__(self, module_or_grads_list):
        if isinstance(module_or_grads_list, torch.nn.Module):
            self.module = module_or_grads_list
            for p in self.module.state_dict().values():
                if torch.is_tensor(p):
                    dist.broadcast(p, 0)
        else:
            self.module = None
            self.grads = list(module_or_grads_list)

    def reduce(self):
        grads = ([p.grad for p in self.module.parameters() if p.grad is not None]
                 if self.module is not None else self.grads)
        if not grads:
            return
        world = dist.get_world_size()
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat.div_(world)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
