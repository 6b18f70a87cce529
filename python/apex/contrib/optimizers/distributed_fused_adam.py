"""apex.contrib.optimizers.distributed_fused_adam: ZeRO-2 Adam/AdamW on apex-cpp's C++ sharded
optimizer (each rank keeps its shard of the fp32 state and of the reduced gradients)."""
import torch

from apex.contrib.optimizers._sharded import ShardedOptimizer


class DistributedFusedAdam(ShardedOptimizer):
    """apex's DistributedFusedAdam: the same constructor, param_groups, ``step(grad_scaler=)``,
    ``unscale_grads``, ``clip_grad_norm``, ``no_sync`` and ``state_dict()`` format 2.

    ``device`` defaults to the parameters' device (apex: "cuda"). ``store_params=False``: no
    fp32 copy of half parameters (each step updates them from their own values);
    ``store_params=False, store_param_remainders=True`` (bf16 CPU parameters): 16-bit
    remainders instead of fp32 masters (both True is refused, as apex refuses it).
    ``message_cap_mb`` (ours, default 0: off): a bucket's exchanges in collectives of at most
    this many MiB per peer, for slow links between hosts (docs/distributed.md). Not supported
    (a clear error): amsgrad, redundant_process_group, with_scaled_states, nccl_ub, capturable,
    contiguous_param_buffer. overlap_param_sync is accepted; parameters are all-gathered at the
    end of step()."""

    _KIND = "adam"
    _HYPER = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode")

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0.0, amsgrad=False, dtype=torch.float32,
                 grad_sync_dtype=None, param_sync_dtype=None, device=None, process_group=None,
                 distributed_process_group=None, redundant_process_group=None,
                 average_grad_sync=True, overlap_grad_sync=True, overlap_param_sync=False,
                 bucket_cap_mb=100.0, pipeline_size=2, contiguous_param_buffer=False,
                 contiguous_grad_buffer=False, store_params=True, store_param_remainders=False,
                 with_scaled_states=False, nccl_ub=False, capturable=False,
                 reduce_scatter="auto", timeout=None, message_cap_mb=0.0):
        if amsgrad:
            raise RuntimeError("DistributedFusedAdam does not support the AMSGrad variant.")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        adam_w_mode=adam_w_mode, weight_decay=weight_decay)
        super().__init__(
            "DistributedFusedAdam", params, defaults, dtype=dtype,
            grad_sync_dtype=grad_sync_dtype, param_sync_dtype=param_sync_dtype, device=device,
            process_group=process_group, distributed_process_group=distributed_process_group,
            redundant_process_group=redundant_process_group, average_grad_sync=average_grad_sync,
            overlap_grad_sync=overlap_grad_sync, bucket_cap_mb=bucket_cap_mb,
            pipeline_size=pipeline_size, contiguous_grad_buffer=contiguous_grad_buffer,
            reduce_scatter=reduce_scatter, timeout=timeout,
            store_params=store_params, store_param_remainders=store_param_remainders,
            message_cap_mb=message_cap_mb,
            unsupported=[("with_scaled_states", with_scaled_states, False),
                         ("nccl_ub", nccl_ub, False), ("capturable", capturable, False),
                         ("contiguous_param_buffer", contiguous_param_buffer, False)])
