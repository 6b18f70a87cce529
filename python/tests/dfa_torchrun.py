"""Run by test_distributed_fused.py under torchrun (2 ranks, Gloo on 127.0.0.1): apex's
DistributedFusedAdam and torch's DDP + AdamW train the same model on the same per-rank batches;
rank 0 writes both models' parameters and the optimizer's format-2 state to argv[1]."""
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from apex.contrib.optimizers import DistributedFusedAdam


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def main(out):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    a, b = model(), model()
    dfa = DistributedFusedAdam(a.parameters(), lr=1e-2, weight_decay=0.01, bucket_cap_mb=1e-4)
    ddp = DistributedDataParallel(b)
    adamw = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.01)
    g = torch.Generator().manual_seed(5)
    for _ in range(4):
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
        xs, ys = x.chunk(world)[rank], y.chunk(world)[rank]
        F.mse_loss(a(xs), ys).backward()
        dfa.step()
        dfa.zero_grad()
        F.mse_loss(ddp(xs), ys).backward()
        adamw.step()
        adamw.zero_grad()
    state = dfa.state_dict()
    if rank == 0:
        torch.save({"dfa": [p.detach() for p in a.parameters()],
                    "ddp": [p.detach() for p in b.parameters()], "state": state,
                    "world": world}, out)
    del dfa, ddp, adamw
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
