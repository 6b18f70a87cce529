"""``python -m apex.bench [--threads N] [--repeats N] [--json FILE]``: apex's Python front door
against torch in the same run, on the same threads.

* FusedAdam against ``torch.optim.AdamW(fused=True)`` and ``(foreach=True)`` on the ResNet-50 and
  BERT-base parameter lists (fp32; one step over every parameter);
* FusedLayerNorm against ``torch.nn.LayerNorm`` (``F.layer_norm``) and FusedRMSNorm against
  ``torch.nn.RMSNorm`` (``F.rms_norm``), module against module with the same parameters, forward +
  backward, over ``apex-bench norm``'s shapes (fp32 and bf16); a short call is repeated within
  each timed sample so that a sample lasts about 2 ms;
* the per-call overhead of a tiny op through Python (``torch.ops.apex_cpp.multi_tensor_scale`` on
  one element) against the same function called from C++ in the same process;
* apex.amp's training step at O1 and O2 against O0 (fp32) on an MLP (``--only amp``; on CPUs
  without fast half matmuls, the fp32 route of ``apex.amp.cpu_half_fallback``).

Ours and the peer alternate, run by run (amp's levels run one after another); each reports its
median.
"""
import argparse
import json
import statistics
import time

import torch

from apex._ops import ops
from apex.normalization import FusedLayerNorm, FusedRMSNorm
from apex.optimizers import FusedAdam


def resnet50_shapes():
    s = [(64, 3, 7, 7), (64,), (64,)]
    cin = 64
    for layer, blocks in enumerate((3, 4, 6, 3)):
        w = 64 << layer
        for b in range(blocks):
            s += [(w, cin, 1, 1), (w,), (w,), (w, w, 3, 3), (w,), (w,), (4 * w, w, 1, 1),
                  (4 * w,), (4 * w,)]
            if b == 0:
                s += [(4 * w, cin, 1, 1), (4 * w,), (4 * w,)]
            cin = 4 * w
    return s + [(1000, 2048), (1000,)]


def bert_base_shapes():
    h = 768
    s = [(30522, h), (512, h), (2, h), (h,), (h,)]
    for _ in range(12):
        s += [(h, h), (h,)] * 4 + [(h,), (h,), (4 * h, h), (4 * h,), (h, 4 * h), (h,), (h,), (h,)]
    return s + [(h, h), (h,)]


def timed(fn, sync=lambda: None):
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def alternate(cases, repeats, warmup):
    """{name: median seconds}: every case run once per round, rounds repeated."""
    for _ in range(warmup):
        for fn in cases.values():
            fn()
    times = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    return {name: statistics.median(t) for name, t in times.items()}


def params_for(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g)
    return ps


def bench_adam(repeats, warmup, rows):
    for model, shapes in (("resnet50", resnet50_shapes()), ("bert", bert_base_shapes())):
        a, b, c = params_for(shapes), params_for(shapes), params_for(shapes)
        n = sum(p.numel() for p in a)
        ours = FusedAdam(a, lr=1e-4, weight_decay=0.01)
        fused = torch.optim.AdamW(b, lr=1e-4, weight_decay=0.01, fused=True)
        foreach = torch.optim.AdamW(c, lr=1e-4, weight_decay=0.01, foreach=True)
        t = alternate({"ours": ours.step, "fused": fused.step, "foreach": foreach.step}, repeats,
                      warmup)
        for peer in ("fused", "foreach"):
            rows.append(dict(area="optim", model=model, case=f"FusedAdam vs AdamW({peer}=True)",
                             ours_ms=t["ours"] * 1e3, peer_ms=t[peer] * 1e3,
                             speedup=t[peer] / t["ours"], gbs=28 * n / t["ours"] / 1e9))


NORM_SHAPES = [(4096, 64), (4096, 768), (4096, 1024), (4096, 4096), (8192, 2048),
               (16384, 1024), (1, 64), (8, 1024), (32, 4096), (128, 768), (2048, 1024)]


def bench_norms(repeats, warmup, rows):
    """Module against module, as a user swaps them: FusedLayerNorm for torch.nn.LayerNorm (which
    calls F.layer_norm), FusedRMSNorm for torch.nn.RMSNorm (F.rms_norm), same parameters."""
    for dtype in (torch.float32, torch.bfloat16):
        for rows_, h in NORM_SHAPES:
            g = torch.Generator().manual_seed(0)
            x = torch.randn(rows_, h, generator=g).to(dtype).requires_grad_()
            dy = torch.randn(rows_, h, generator=g).to(dtype)
            for name, ours_mod, peer_mod in (
                    ("LayerNorm", FusedLayerNorm(h).to(dtype), torch.nn.LayerNorm(h, eps=1e-5)),
                    ("RMSNorm", FusedRMSNorm(h).to(dtype), torch.nn.RMSNorm(h, eps=1e-5))):
                peer_mod.to(dtype)
                peer_mod.weight = ours_mod.weight
                if name == "LayerNorm":
                    peer_mod.bias = ours_mod.bias

                ours_mod(x).backward(dy)
                calls = max(1, min(200, int(2e-3 / timed(lambda: ours_mod(x).backward(dy)))))

                def run_ours(m=ours_mod):
                    for _ in range(calls):
                        m(x).backward(dy)

                def run_peer(m=peer_mod):
                    for _ in range(calls):
                        m(x).backward(dy)

                t = alternate({"ours": run_ours, "peer": run_peer}, repeats, warmup)
                t = {k: v / calls for k, v in t.items()}
                rows.append(dict(area="norm", model=f"{rows_}x{h} {str(dtype)[6:]}",
                                 case=f"Fused{name} fwd+bwd vs nn.{name} (F.{name.lower().replace('norm', '_norm')})",
                                 ours_ms=t["ours"] * 1e3, peer_ms=t["peer"] * 1e3,
                                 speedup=t["peer"] / t["ours"]))


def bench_overhead(repeats, rows):
    noop = torch.zeros(1, dtype=torch.int)
    x = [torch.ones(1)]
    y = [torch.ones(1)]
    calls = 2000

    def python_calls():
        for _ in range(calls):
            ops.multi_tensor_scale(noop, x, y, 1.0)

    py = []
    cpp = []
    for _ in range(repeats):
        py.append(timed(python_calls) / calls)
        cpp.append(ops.bench_scale_calls(noop, x, y, calls))
    t_py, t_cpp = statistics.median(py), statistics.median(cpp)
    rows.append(dict(area="overhead", model="1 element",
                     case="multi_tensor_scale: Python op call vs C++ call",
                     ours_ms=t_py * 1e3, peer_ms=t_cpp * 1e3, speedup=t_cpp / t_py,
                     added_us=(t_py - t_cpp) * 1e6))


def bench_amp(repeats, warmup, rows):
    """apex.amp's training step at O1 and O2 against O0 (fp32) on an MLP (2 x 256 -> 1024 -> GELU
    -> 256, a classifier; batch 4096; FusedAdam). Levels run one after another, not alternately:
    amp's state is global. On CPUs without fast half matmuls this measures the fp32 route."""
    from apex import amp
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(0)
    d = 256
    x = torch.randn(4096, d, generator=g)
    y = torch.randint(0, 10, (4096,), generator=g)
    times = {}
    saved_state = dict(amp._amp_state.__dict__)  # amp's state is global: the caller's comes back
    try:
        for level in ("O0", "O1", "O2"):
            torch.manual_seed(0)
            layers = [m for _ in range(2) for m in (torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                                                    torch.nn.Linear(4 * d, d))]
            model = torch.nn.Sequential(*layers, torch.nn.Linear(d, 10))
            opt = FusedAdam(model.parameters(), lr=1e-3)
            model, opt = amp.initialize(model, opt, opt_level=level, verbosity=0)

            def step(model=model, opt=opt):
                opt.zero_grad()
                loss = F.cross_entropy(model(x).float(), y)
                with amp.scale_loss(loss, opt) as scaled:
                    scaled.backward()
                opt.step()

            for _ in range(max(1, warmup)):
                step()
            times[level] = statistics.median(timed(step) for _ in range(repeats))
    finally:
        amp._amp_state.__dict__.clear()
        amp._amp_state.__dict__.update(saved_state)
    route = "fp32 route" if amp.cpu_half_fallback_available(torch.bfloat16) else "torch's half path"
    for level in ("O1", "O2"):
        rows.append(dict(area="amp", model="mlp 4096x256", case=f"{level} step vs O0 ({route})",
                         ours_ms=times[level] * 1e3, peer_ms=times["O0"] * 1e3,
                         speedup=times["O0"] / times[level]))


def keep_freed_memory():
    """As apex-bench does: glibc keeps freed blocks instead of unmapping them, so that every call
    does not fault a fresh output's pages in (which cost more than a norm over them, and varied
    from call to call)."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(-4, 0)  # M_MMAP_MAX
        libc.mallopt(-1, -1)  # M_TRIM_THRESHOLD
    except OSError:
        pass


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m apex.bench")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--only", choices=["optim", "norm", "overhead", "amp"], action="append")
    p.add_argument("--json")
    a = p.parse_args(argv)
    if not 0 <= a.threads <= 4096 or not 1 <= a.repeats <= 100000 or not 0 <= a.warmup <= 1000:
        p.error("--threads in [0, 4096], --repeats in [1, 100000], --warmup in [0, 1000]")
    if a.threads:
        torch.set_num_threads(a.threads)
    keep_freed_memory()
    areas = a.only or ["optim", "norm", "overhead", "amp"]
    rows = []
    if "optim" in areas:
        bench_adam(a.repeats, a.warmup, rows)
    if "norm" in areas:
        bench_norms(a.repeats, a.warmup, rows)
    if "overhead" in areas:
        bench_overhead(a.repeats, rows)
    if "amp" in areas:
        bench_amp(a.repeats, a.warmup, rows)
    print(f"python -m apex.bench  threads={torch.get_num_threads()} cpu_isa={ops.cpu_isa()} "
          f"torch={torch.__version__}")
    print(f"{'area':9} {'shape/model':18} {'case':44} {'ours ms':>9} {'peer ms':>9} {'speedup':>8}")
    for r in rows:
        print(f"{r['area']:9} {r['model']:18} {r['case']:44} {r['ours_ms']:9.4f} "
              f"{r['peer_ms']:9.4f} {r['speedup']:7.2f}x"
              + (f"  +{r['added_us']:.2f} us" if "added_us" in r else ""))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"threads": torch.get_num_threads(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
