#!/usr/bin/env python3
"""The Python peer of `apex-bench train`: apex-train's transformer and resnet defaults written in
PyTorch (same architecture, sizes and batch), trained with the Python mixed-precision recipe
(torch.autocast + torch.amp.GradScaler + torch.optim.AdamW(fused=True)). Prints one JSON line per
run: {"model", "mode", "samples_per_s", "steps", "batch"}.

  train_peer.py --model transformer --mode autocast --steps 60 --threads 2
"""
import argparse
import json
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class EncoderLayer(nn.Module):
    """Post-LN BERT block, as tools/train/models.cpp's EncoderLayerImpl."""

    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln1 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)
        self.ln2 = nn.LayerNorm(d)

    def forward(self, x):
        b, t, d = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2]).transpose(1, 2).reshape(b, t, d)
        h = self.ln1(x + self.proj(a))
        return self.ln2(h + self.fc2(F.gelu(self.fc1(h))))


class Transformer(nn.Module):
    def __init__(self, vocab=64, seq_len=64, d=256, depth=2, heads=4, classes=4):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq_len, d)
        self.ln = nn.LayerNorm(d)
        self.layers = nn.ModuleList(EncoderLayer(d, heads) for _ in range(depth))
        self.classifier = nn.Linear(d, classes)

    def forward(self, tokens):
        x = self.ln(self.tok(tokens) + self.pos(torch.arange(tokens.shape[1])))
        for layer in self.layers:
            x = layer(x)
        return self.classifier(x.mean(1))


class BasicBlock(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = self.bn2(self.conv2(h))
        return F.relu(h + (self.down(x) if self.down is not None else x))


class ResNet(nn.Module):
    def __init__(self, channels=1, width=16, depth=1, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(channels, width, 3, 1, 1, bias=False)
        self.stem_bn = nn.BatchNorm2d(width)
        blocks = []
        cin = width
        for stage in range(3):
            cout = width << stage
            for b in range(depth):
                blocks.append(BasicBlock(cin, cout, 2 if stage > 0 and b == 0 else 1))
                cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Linear(cin, classes)

    def forward(self, x):
        x = F.relu(self.stem_bn(self.stem(x)))
        return self.classifier(self.blocks(x).mean((2, 3)))


# The families the peers know (apex-train's defaults; its table is model_families() in
# tools/train/models.cpp): name -> (model class, inputs of one batch from a generator, classes).
FAMILIES = {
    "transformer": (Transformer, lambda n, g: torch.randint(0, 64, (n, 64), generator=g), 4),
    "resnet": (ResNet, lambda n, g: torch.randn(n, 1, 32, 32, generator=g), 10),
}


def model_and_inputs(name, batch_size):
    """The model, a function drawing one batch of inputs from a generator, and the classes."""
    model, inputs, classes = FAMILIES[name]
    return model(), lambda g: inputs(batch_size, g), classes


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=sorted(FAMILIES), default="transformer")
    p.add_argument("--mode", choices=["fp32", "autocast"], default="autocast")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    a = p.parse_args()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    model, make, classes = model_and_inputs(a.model, a.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=True)
    half = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    scaler = torch.amp.GradScaler("cpu", enabled=a.mode == "autocast")
    g = torch.Generator().manual_seed(1)
    batches = [(make(g), torch.randint(0, classes, (a.batch_size,), generator=g)) for _ in range(8)]
    start = None
    for step in range(a.warmup + a.steps):
        if step == a.warmup:
            start = time.perf_counter()
        x, y = batches[step % len(batches)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=half, enabled=a.mode == "autocast"):
            loss = F.cross_entropy(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        loss.item()
    elapsed = time.perf_counter() - start
    print(json.dumps({"model": a.model, "mode": a.mode, "steps": a.steps, "batch": a.batch_size,
                      "threads": torch.get_num_threads(),
                      "samples_per_s": a.steps * a.batch_size / elapsed}))


if __name__ == "__main__":
    main()
