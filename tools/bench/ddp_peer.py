#!/usr/bin/env python3
"""The Python peer of `apex-bench ddp`: train_peer.py's transformer or resnet in fp32 under
torch.nn.parallel.DistributedDataParallel with Gloo, `--world` ranks of `--threads` threads each,
the same per-rank batch (0 ranks: the bare model in one process). Rendezvous through a FileStore
and Gloo on the loopback interface: nothing listens beyond 127.0.0.1. Prints one JSON line:
{"model", "world", "samples_per_s" (summed over ranks), "steps", "batch"}.

  ddp_peer.py --model transformer --world 2 --steps 20 --threads 1
"""
import argparse
import json
import os
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_peer import FAMILIES, model_and_inputs  # noqa: E402


def run(rank, a, init_file, out):
    torch.set_num_threads(a.threads)
    ddp = a.world > 0
    if ddp:
        dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                                world_size=a.world)
    torch.manual_seed(0)
    model, make, classes = model_and_inputs(a.model, a.batch_size)
    if ddp:
        # An explicit bucket_cap_mb sizes the first bucket too (torch 2.13); None: 25 MiB, first 1.
        model = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=a.bucket_cap_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    g = torch.Generator().manual_seed(1 + rank)
    batches = [(make(g), torch.randint(0, classes, (a.batch_size,), generator=g)) for _ in range(8)]
    start = None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            if ddp:
                dist.barrier()
            start = time.perf_counter()
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        loss.item()
    if ddp:
        dist.barrier()
    elapsed = time.perf_counter() - start
    if rank == 0:
        world = max(1, a.world)
        with open(out, "w") as f:
            f.write(json.dumps({"model": a.model, "world": a.world, "steps": a.steps,
                                "batch": a.batch_size, "threads": a.threads,
                                "samples_per_s": world * a.steps * a.batch_size / elapsed}))
    if ddp:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(FAMILIES), default="transformer")
    p.add_argument("--world", type=int, default=2, help="ranks (0: no DDP at all)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--bucket-cap-mb", type=float, default=None, help="DDP's (default: its own)")
    a = p.parse_args()
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with tempfile.TemporaryDirectory() as d:
        init_file, out = os.path.join(d, "store"), os.path.join(d, "out.json")
        if a.world > 0:
            mp.spawn(run, args=(a, init_file, out), nprocs=a.world, join=True)
        else:
            run(0, a, init_file, out)
        with open(out) as f:
            print(f.read())


if __name__ == "__main__":
    main()
