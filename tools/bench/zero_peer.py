#!/usr/bin/env python3
"""The Python peers of `apex-bench zero`: bench_zero.cpp's BERT-base-sized stack of linear layers
in fp32 on `--world` Gloo ranks of one thread each, per-rank batch 4, torch.optim.AdamW:
  fsdp2: torch.distributed.fsdp.fully_shard(model, reshard_after_forward=False) (ZeRO-2-like);
  zero1: DistributedDataParallel + ZeroRedundancyOptimizer (ZeRO-1).
Rendezvous through a FileStore; Gloo on loopback. Prints one JSON line with the median step time
of each ({"fsdp2_step_ms", "zero1_step_ms"}; -1 when a peer failed, with its error on stderr).

  zero_peer.py --world 2 --steps 10
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

HIDDEN, BLOCKS, VOCAB, BATCH = 768, 12, 30522, 4


class BertSized(torch.nn.Module):
    def __init__(self):
        super().__init__()
        layers = []
        for _ in range(BLOCKS):
            layers += [torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(4)]
            layers += [torch.nn.Linear(HIDDEN, 4 * HIDDEN), torch.nn.Linear(4 * HIDDEN, HIDDEN)]
        layers.append(torch.nn.Linear(HIDDEN, VOCAB))
        self.layers = torch.nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers[:-1]:
            y = torch.tanh(layer(x))
            x = x + y if layer.in_features == layer.out_features else y
        return self.layers[-1](x)


def run(rank, a, init_file, kind, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank,
                            world_size=a.world)
    try:
        torch.manual_seed(0)
        model = BertSized()
        if kind == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard
            mesh = init_device_mesh("cpu", (a.world,))
            fully_shard(model, mesh=mesh, reshard_after_forward=False)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        else:
            from torch.distributed.optim import ZeroRedundancyOptimizer
            model = torch.nn.parallel.DistributedDataParallel(model)
            opt = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.AdamW,
                                          lr=1e-4)
        x = torch.randn(BATCH, HIDDEN)
        times = []
        for step in range(a.steps + 1):
            dist.barrier()
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            model(x).pow(2).mean().backward()
            opt.step()
            times.append((time.perf_counter() - t0) * 1e3)
        dist.barrier()
        if rank == 0:
            with open(out, "w") as f:
                f.write(str(statistics.median(times[1:])))
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--steps", type=int, default=10)
    a = p.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as d:
        for kind in ("fsdp2", "zero1"):
            out = os.path.join(d, kind)
            try:
                mp.spawn(run, args=(a, os.path.join(d, kind + ".store"), kind, out),
                         nprocs=a.world, join=True)
                result[kind + "_step_ms"] = float(open(out).read())
            except Exception as e:  # a peer that cannot run is reported, not fatal
                print(f"zero_peer.py: {kind} failed: {e}", file=sys.stderr)
                result[kind + "_step_ms"] = -1.0
    print(json.dumps(result))


if __name__ == "__main__":
    main()
