"""apex.contrib.optimizers.distributed_fused_lamb: ZeRO-2 LAMB on apex-cpp's C++ sharded
optimizer (per-parameter norms of fragments summed over ranks, a global clipping norm)."""
import torch

from apex.contrib.optimizers._sharded import ShardedOptimizer


class DistributedFusedLAMB(ShardedOptimizer):
    """apex's DistributedFusedLAMB (its leading arguments, in its order; its dwu_* tuning knobs
    are apex's NCCL pipeline and have no counterpart) on the machinery of DistributedFusedAdam:
    FusedLAMB's math on the shards, a parameter's norm summed over its fragments on every rank,
    the clipping norm global (max_grad_norm 0: no clipping). The sharding options are
    DistributedFusedAdam's, keyword-only."""

    _KIND = "lamb"
    _HYPER = ("lr", "betas", "eps", "weight_decay", "bias_correction", "adam_w_mode",
              "grad_averaging", "max_grad_norm", "use_nvlamb")

    def __init__(self, params, lr=1e-3, bias_correction=True, grad_averaging=True,
                 betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, max_grad_norm=0.0,
                 adam_w_mode=True, use_nvlamb=False, step_supports_amp_scaling=True,
                 overlap_reductions=True, *, dtype=torch.float32, grad_sync_dtype=None,
                 param_sync_dtype=None, device=None, process_group=None,
                 distributed_process_group=None, average_grad_sync=True, bucket_cap_mb=100.0,
                 pipeline_size=2, contiguous_grad_buffer=False, reduce_scatter="auto",
                 timeout=None, message_cap_mb=0.0):
        if not step_supports_amp_scaling:
            raise RuntimeError("DistributedFusedLAMB: step_supports_amp_scaling=False is not "
                               "supported (GradScaler reaches the sharded gradients only "
                               "through step(grad_scaler=...))")
        overlap_grad_sync = overlap_reductions
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                        weight_decay=weight_decay, adam_w_mode=adam_w_mode,
                        grad_averaging=grad_averaging, max_grad_norm=max_grad_norm,
                        use_nvlamb=use_nvlamb)
        super().__init__(
            "DistributedFusedLAMB", params, defaults, dtype=dtype,
            grad_sync_dtype=grad_sync_dtype, param_sync_dtype=param_sync_dtype, device=device,
            process_group=process_group, distributed_process_group=distributed_process_group,
            redundant_process_group=None, average_grad_sync=average_grad_sync,
            overlap_grad_sync=overlap_grad_sync, bucket_cap_mb=bucket_cap_mb,
            pipeline_size=pipeline_size, contiguous_grad_buffer=contiguous_grad_buffer,
            reduce_scatter=reduce_scatter, timeout=timeout, message_cap_mb=message_cap_mb,
            unsupported=[])
