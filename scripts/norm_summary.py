#!/usr/bin/env python3
"""Summary of an `apex-bench norm` JSON file against issue 4's targets.

Usage: scripts/norm_summary.py apex-bench-norm.json

Per dtype and shape set (cached = small activations, large = against the streaming limit): the
range of speed-ups over the peer (at::layer_norm, or the composite RMSNorm) for each case, and for
the large shapes the fraction of the limit at hidden >= 1024, which is what the targets name
(CPU: never slower than LibTorch, RMSNorm forward + backward >= 3x, >= 70 % of the limit; H200:
>= 85 % of copy bandwidth forward, >= 75 % backward).
"""
import json
import sys


def main(path):
    data = json.load(open(path))
    rows = data["rows"]
    print(f"apex-bench norm summary: device={data.get('device')} threads={data.get('threads')}")
    cases = ["LayerNorm fwd vs", "LayerNorm fwd+bwd", "RMSNorm fwd vs", "RMSNorm fwd+bwd"]
    below = []
    for dtype in ("fp32", "bf16", "fp16"):
        for cached in (1, 0):
            for case in cases:
                sel = [r for r in rows if r["model"].endswith(dtype) and
                       int(r.get("cached", 0)) == cached and r["case"].startswith(case)]
                if not sel:
                    continue
                speed = [r["speedup"] for r in sel]
                line = (f"  {dtype} {'cached' if cached else 'large '} {case:18} "
                        f"{min(speed):5.2f}-{max(speed):5.2f}x")
                wide = [r for r in sel if "of_limit" in r and
                        int(r["model"].split("x")[1].split()[0]) >= 1024]
                if wide:
                    frac = [100 * r["of_limit"] for r in wide]
                    line += f"   of limit at hidden >= 1024: {min(frac):4.0f}-{max(frac):4.0f} %"
                print(line)
                below += [f"{r['model']} {r['case']} {r['speedup']:.2f}x" for r in sel
                          if r["speedup"] < 1.0]
    print("  slower than the peer:", ", ".join(below) if below else "none")


if __name__ == "__main__":
    main(sys.argv[1])
