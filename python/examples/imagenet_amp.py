"""apex's examples/imagenet/main_amp.py recipe on a small CNN and built-in data, as apex users run
it: channels-last input, `amp.initialize` at O0/O1/O2, `apex.parallel.DistributedDataParallel`
with `convert_syncbn_model`, `amp.scale_loss`, the model's fp32 state_dict, `to_python_float`.

    python imagenet_amp.py --opt-level O2                       # one process
    torchrun --standalone --nproc-per-node 2 imagenet_amp.py    # two ranks over Gloo (CPU)

Exits non-zero when the final accuracy is below --min-accuracy (CI runs it so)."""
import argparse
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from apex import amp
from apex.fp16_utils import to_python_float
from apex.parallel import DistributedDataParallel as DDP
from apex.parallel import convert_syncbn_model


def make_model():
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=16), nn.BatchNorm2d(16), nn.ReLU(),  # depthwise
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 4))


def images(n, seed):
    """Four classes of 16x16 images: a bright quadrant per class, plus noise."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    x = torch.randn(n, 3, 16, 16, generator=g) * 0.5
    for c in range(4):
        r, col = divmod(c, 2)
        x[y == c, :, r * 8:(r + 1) * 8, col * 8:(col + 1) * 8] += 1.5
    return x.contiguous(memory_format=torch.channels_last), y


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--opt-level", default="O2")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--min-accuracy", type=float, default=0.0)
    args = parser.parse_args()

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    rank, world = 0, 1
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)

    model = make_model()
    if distributed:
        model = convert_syncbn_model(model)
    model = model.to(memory_format=torch.channels_last)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=1e-4)
    model, optimizer = amp.initialize(model, optimizer, opt_level=args.opt_level,
                                      keep_batchnorm_fp32=None if args.opt_level == "O1" else True,
                                      verbosity=1 if rank == 0 else 0)
    if distributed:
        model = DDP(model, delay_allreduce=True)

    x_all, y_all = images(args.steps * args.batch_size * world, seed=1)
    model.train()
    for step in range(args.steps):
        # Each rank its own slice of the global batch (a DistributedSampler's shard).
        lo = (step * world + rank) * args.batch_size
        x, y = x_all[lo:lo + args.batch_size], y_all[lo:lo + args.batch_size]
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
        if step % 20 == 0 and rank == 0:
            print(f"step {step:3d}  loss {to_python_float(loss):.4f}  "
                  f"scale {amp._amp_state.loss_scalers[0].loss_scale():g}")

    model.eval()
    x_test, y_test = images(512, seed=2)
    with torch.no_grad():
        correct = (model(x_test).argmax(1) == y_test).float().mean().item() * 100
    # The checkpoint apex code writes: fp32 whatever the level (apex's O2 state-dict hook).
    state = (model.module if distributed else model).state_dict()
    assert all(t.dtype != torch.float16 and t.dtype != torch.bfloat16 for t in state.values())
    if rank == 0:
        print(f"opt level {args.opt_level}, {world} rank(s): test accuracy {correct:.1f} %")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    if correct < args.min_accuracy:
        raise SystemExit(f"imagenet_amp: accuracy {correct:.1f} % below {args.min_accuracy}")


if __name__ == "__main__":
    main()
