#!/usr/bin/env python3
"""Which half-precision CPU ops are slower than fp32 on this CPU, inside apex's CPU half route.

Each case runs one op in fp32 and in bf16 (or fp16) inside ``apex.amp.cpu_half_fallback()``, on
the same shapes, and prints the half time over the fp32 time; ``<<<`` marks a case over 2.5x.
Ops the route covers show what it costs; the others show where a model cast to half (O2/O3, or
autocast's half list) would run on torch's own half kernel, which on CPUs without AVX512-BF16/AMX
can be tens of times slower. A screening tool, not a benchmark: each side is timed on a few runs
(median of the timed runs; at most ~0.5 s per side), so read ratios under ~1.5x as noise.

    /opt/apex-cpp/venv/bin/python scripts/half_op_sweep.py [--dtype fp16] [CASE ...]

Needs the ``apex`` package installed (``pip install ./python``). To look at an AVX2-only CPU from
an AVX-512 one, run under the emulation of docs/perf-notes.md (its environment variables).
"""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

from apex.amp import cpu_half_fallback


def timed(fn, budget_s=0.5, most=7):
    fn()
    runs = []
    while len(runs) < most and sum(runs) < budget_s:
        t = time.perf_counter()
        fn()
        runs.append(time.perf_counter() - t)
    return statistics.median(runs) * 1e3


def r(*shape, dtype):
    return torch.randn(*shape).to(dtype)


def cases():
    """name -> make(dtype) returning a zero-argument callable that runs the op once."""
    def mm_like(shape_a, shape_b, op):
        return lambda dt: (lambda a=r(*shape_a, dtype=dt), b=r(*shape_b, dtype=dt): op(a, b))

    def unary(shape, op):
        return lambda dt: (lambda a=r(*shape, dtype=dt): op(a))

    def module(make_module, shape, run):
        def make(dt):
            m, x = make_module().to(dt), r(*shape, dtype=dt)
            return lambda: run(m, x)
        return make

    def rnn_step(m, x):
        m(x)[0].sum().backward()

    def mha(m, x):
        with torch.no_grad():  # torch's fast path (_native_multi_head_attention)
            return m(x, x, x, need_weights=False)

    return {
        "mm": mm_like((2048, 256), (256, 1024), torch.mm),
        "mm out=": mm_like((2048, 256), (256, 1024),
                           lambda a, b: torch.mm(a, b, out=torch.empty(2048, 1024, dtype=a.dtype))),
        "addmm_": mm_like((1024, 256), (256, 1024),
                          lambda a, b: torch.zeros(1024, 1024, dtype=a.dtype).addmm_(a, b)),
        "addbmm": mm_like((16, 256, 256), (16, 256, 256),
                          lambda a, b: torch.addbmm(torch.zeros(256, 256, dtype=a.dtype), a, b)),
        "matmul 4-D": mm_like((8, 4, 128, 64), (8, 4, 64, 128), torch.matmul),
        "einsum": mm_like((8, 128, 256), (8, 128, 256),
                          lambda a, b: torch.einsum("bik,bjk->bij", a, b)),
        "mv": mm_like((4096, 1024), (1024,), torch.mv),
        "addmv": mm_like((4096, 1024), (1024,),
                         lambda a, b: torch.addmv(torch.zeros(4096, dtype=a.dtype), a, b)),
        "linear 1-D input": mm_like((1024,), (4096, 1024), F.linear),
        "linear 8 rows": mm_like((8, 1024), (4096, 1024), F.linear),
        "linear 16 rows": mm_like((16, 1024), (4096, 1024), F.linear),
        "linear 64 rows": mm_like((64, 1024), (4096, 1024), F.linear),
        "dot": mm_like((1 << 20,), (1 << 20,), torch.dot),
        "conv2d": mm_like((32, 64, 32, 32), (64, 64, 3, 3), lambda a, b: F.conv2d(a, b, padding=1)),
        "conv2d groups 4": mm_like((32, 64, 32, 32), (64, 16, 3, 3),
                                   lambda a, b: F.conv2d(a, b, padding=1, groups=4)),
        "conv3d": mm_like((4, 16, 16, 32, 32), (32, 16, 3, 3, 3),
                          lambda a, b: F.conv3d(a, b, padding=1)),
        "conv_transpose1d": mm_like((16, 64, 400), (64, 64, 4),
                                    lambda a, b: F.conv_transpose1d(a, b, stride=2)),
        "conv_tbc": mm_like((200, 32, 256), (3, 256, 256),
                            lambda a, b: torch.conv_tbc(a, b, torch.zeros(256, dtype=a.dtype), 1)),
        "sdpa causal": mm_like(
            (16, 4, 128, 64), (16, 4, 128, 64),
            lambda a, b: F.scaled_dot_product_attention(a, b, b, is_causal=True)),
        "MultiheadAttention (no grad)": module(
            lambda: nn.MultiheadAttention(256, 4, batch_first=True), (32, 64, 256), mha),
        "LSTM fwd+bwd": module(lambda: nn.LSTM(256, 256, batch_first=True), (16, 32, 256),
                               rnn_step),
        "RNN tanh fwd+bwd": module(lambda: nn.RNN(256, 256, batch_first=True), (16, 32, 256),
                                   rnn_step),
        "GRU fwd": module(lambda: nn.GRU(256, 256, batch_first=True), (16, 32, 256),
                          lambda m, x: m(x)),
        "softmax": unary((4096, 1024), lambda a: torch.softmax(a, -1)),
        "layer_norm": unary((4096, 1024), lambda a: F.layer_norm(a, (1024,))),
        "group_norm": unary((32, 64, 64, 64), lambda a: F.group_norm(a, 8)),
        "silu": unary((4096, 1024), F.silu),
        "tanh": unary((4096, 1024), torch.tanh),
        "max_pool2d": unary((32, 64, 64, 64), lambda a: F.max_pool2d(a, 2)),
        "avg_pool2d": unary((32, 64, 64, 64), lambda a: F.avg_pool2d(a, 2)),
        "interpolate bilinear": unary((16, 64, 64, 64),
                                      lambda a: F.interpolate(a, scale_factor=2, mode="bilinear")),
        "cumsum": unary((4096, 1024), lambda a: a.cumsum(-1)),
        "topk": unary((4096, 1024), lambda a: a.topk(8, -1)),
    }


def main():
    all_cases = cases()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", choices=["bf16", "fp16"], default="bf16")
    p.add_argument("case", nargs="*", help="case names (default: all): " + ", ".join(all_cases))
    a = p.parse_args()
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float16
    unknown = [c for c in a.case if c not in all_cases]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}; expected one of: {', '.join(all_cases)}")
    torch.manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {a.dtype} in the route's "
          f"scope against fp32")
    for name in a.case or all_cases:
        make = all_cases[name]
        t32 = timed(make(torch.float32))
        half = make(dtype)
        with cpu_half_fallback():
            th = timed(half)
        flag = "  <<<" if th > 2.5 * t32 else ""
        print(f"{name:30s} fp32 {t32:9.3f} ms  {a.dtype} {th:9.3f} ms  {th / t32:6.2f}x{flag}",
              flush=True)


if __name__ == "__main__":
    main()
