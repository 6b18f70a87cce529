#!/usr/bin/env python3
"""Proof that the emulated CUDA kernel suite bites: plants one defect at a time in a copy of a
kernel file (a removed barrier, a divergent shuffle or barrier, an off-by-one bound), recompiles
that kernel against the emulation, links it with the suite's objects and checks that the suite
FAILS under at least one of the two CI schedules. Each kernel file is first rebuilt unchanged the
same way and must pass the same tests (so a failure is the defect's, not the build's).

Run by CTest (cuda_emu.mutants) with the configuration CMake writes (mutants.json):
  check_mutants.py --config build/tests/cuda_emu/mutants.json --work build/tests/cuda_emu/mutants
A defect whose anchor text is no longer in its file is an error: update the list with the kernel.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

KERNEL_FILES = ["common.cuh", "multi_tensor_apply.cuh", "multi_tensor.cu", "norm.cu"]
SCHEDULES = ["warp-forward", "rr-reverse"]

# (name, file, anchor text, replacement, gtest filter, what should catch it)
MUTANTS = [
    ("block_reduce_barrier_removed", "multi_tensor_apply.cuh",
     "  __syncthreads();\n  if (warp == 0) {\n",
     "  if (warp == 0) {\n",
     "*MultiTensorEmu.Norms/tensors1:*MultiTensorEmu.Norms/tensors150",
     "numbers (warp 0 reads the other warps' partials before they are written)"),
    ("block_reduce_divergent_shuffle", "multi_tensor_apply.cuh",
     "  if (warp == 0) {\n",
     "  if (warp == 0 && lane < kWarps) {\n",
     "*MultiTensorEmu.Norms/tensors1",
     "the emulation (a full-mask shuffle names lanes that have exited)"),
    ("frame_count_off_by_one", "multi_tensor_apply.cuh",
     "const int count = min_int(kILP, n - first);",
     "const int count = min_int(kILP, n - first + 1);",
     "*MultiTensorEmu.Scale/tensors150",
     "guards (one element written past a tensor)"),
    ("norm_store_off_by_one", "norm.cu",
     "    if (c < cols) store_vec<T, V>(base + c, r[k]);",
     "    if (c <= cols) store_vec<T, V>(base + c, r[k]);",
     "*NormFwdEmu.Forward/ln_f32_f32_f32_wb_3x7*:*NormFwdEmu.Forward/ln_f32_f32_f32_wb_5x31*",
     "guards and numbers (an element past the row)"),
    ("dwdb_transfer_barrier_removed", "norm.cu",
     "          acc_b[k][i] += transfer[slots + (k * V + i) * t.threads + t.j];\n"
     "        }\n      }\n    }\n    __syncthreads();\n",
     "          acc_b[k][i] += transfer[slots + (k * V + i) * t.threads + t.j];\n"
     "        }\n      }\n    }\n",
     "*NormBwdEmu.Backward/ln_f32_f32_f32_wb_300x64*:*NormBwdEmu.Backward/ln_f32_f32_f32_wb_33x64*",
     "numbers (a team overwrites the transfer buffer before team 0 has read it)"),
    ("forward_divergent_barrier", "norm.cu",
     "    team_sum(q, red, phase, t);\n"
     "    const float rstd = 1.0f / sqrtf(q[0] * inv_n + p.eps);\n"
     "    if (!live) continue;\n",
     "    if (!live) continue;\n"
     "    team_sum(q, red, phase, t);\n"
     "    const float rstd = 1.0f / sqrtf(q[0] * inv_n + p.eps);\n",
     "*NormFwdEmu.Forward/ln_f32_f32_f32_wb_3x1024*",
     "the emulation (threads of a dead row skip a __syncthreads)"),
]

WRAPPERS = {"multi_tensor_apply.cuh": "kernels_multi_tensor.cpp",
            "multi_tensor.cu": "kernels_multi_tensor.cpp",
            "common.cuh": None,
            "norm.cu": "kernels_norm.cpp"}


def run(cmd, **kw):
    return subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **kw)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--only", help="run the mutants whose name contains this text")
    args = ap.parse_args()
    cfg = json.load(open(args.config))
    src = os.path.join(cfg["source_root"], "src")
    emu_dir = os.path.join(cfg["source_root"], "tests", "cuda_emu")
    objects = [o for o in cfg["objects"].split(";") if o]
    kernel_objects = [o for o in cfg["kernel_objects"].split(";") if o]
    libs = [lib for lib in cfg["libs"].split(";") if lib]
    san = ["-fsanitize=" + cfg["sanitize"].replace(";", ","), "-fno-omit-frame-pointer"] \
        if cfg["sanitize"] else []
    includes = ["-I" + cfg["emu_include"]]
    if cfg["toolkit_include"] != "/usr/include":
        includes += ["-isystem", cfg["toolkit_include"]]
    # -O0: a third of -O2's compile time, and the filtered tests stay quick.
    cxx = [cfg["cxx"]] + cfg["flags"].split() + ["-std=c++20", "-O0", "-w"] + san

    shutil.rmtree(args.work, ignore_errors=True)
    os.makedirs(args.work)
    start = time.time()

    def build_and_run(tag, root, wrapper, filt):
        """Compiles `wrapper` with kernel sources from root (then src), links, runs `filt` under
        each schedule. Returns (built, failed_schedules, log)."""
        obj = os.path.join(args.work, tag + ".o")
        exe = os.path.join(args.work, tag + ".test")
        c = run(cxx + ["-I" + root, "-I" + src] + includes +
                ["-c", os.path.join(emu_dir, wrapper), "-o", obj])
        if c.returncode != 0:
            return False, [], c.stdout
        others = [o for o in kernel_objects if not os.path.basename(o).startswith(wrapper)]
        link = run([cfg["cxx"]] + san + objects + others + [obj] + libs + ["-pthread", "-o", exe])
        if link.returncode != 0:
            return False, [], link.stdout
        failed, log = [], ""
        for schedule in SCHEDULES:
            env = dict(os.environ, CUDA_EMU_SCHEDULE=schedule)
            r = run([exe, "--gtest_filter=" + filt, "--gtest_brief=1", "--gtest_fail_fast"],
                    env=env, timeout=300)
            if r.returncode != 0:
                failed.append(schedule)
                log += "--- %s (exit %d)\n%s" % (schedule, r.returncode, r.stdout[-3000:])
        return True, failed, log

    problems = 0
    mutants = [m for m in MUTANTS if not args.only or args.only in m[0]]
    # The unchanged kernels, built the same way, must pass every filter used below.
    for wrapper in sorted({WRAPPERS[m[1]] for m in mutants}):
        filt = ":".join(m[4] for m in mutants if WRAPPERS[m[1]] == wrapper)
        root = os.path.join(args.work, "pristine")
        os.makedirs(os.path.join(root, "kernels", "cuda"), exist_ok=True)
        built, failed, log = build_and_run("pristine_" + wrapper[:-4], root, wrapper, filt)
        ok = built and not failed
        print("baseline %-28s %s" % (wrapper, "passes" if ok else "FAILS"), flush=True)
        if not ok:
            print(log)
            problems += 1

    for name, fname, anchor, repl, filt, catcher in mutants:
        root = os.path.join(args.work, name)
        kdir = os.path.join(root, "kernels", "cuda")
        os.makedirs(kdir)
        for f in KERNEL_FILES:
            shutil.copy(os.path.join(src, "kernels", "cuda", f), kdir)
        path = os.path.join(kdir, fname)
        text = open(path).read()
        if text.count(anchor) != 1:
            print("mutant %-32s ERROR: its anchor occurs %d times in %s (update check_mutants.py)"
                  % (name, text.count(anchor), fname))
            problems += 1
            continue
        open(path, "w").write(text.replace(anchor, repl))
        built, failed, log = build_and_run(name, root, WRAPPERS[fname], filt)
        if not built:
            print("mutant %-32s ERROR: does not build\n%s" % (name, log[-3000:]))
            problems += 1
        elif not failed:
            print("mutant %-32s SURVIVED: the suite passed under %s (expected: %s)"
                  % (name, " and ".join(SCHEDULES), catcher))
            problems += 1
        else:
            lines = log.splitlines()
            why = next((ln[ln.find("emulated kernel fault"):] for ln in lines
                        if "emulated kernel fault" in ln), "")
            why = why or next((ln for ln in lines if "was overwritten" in ln or "elements off" in ln),
                              "")
            why = why or next((ln for ln in lines if "Failure" in ln), "")
            print("mutant %-32s caught under %s: %s" % (name, ", ".join(failed), why.strip()[:200]),
                  flush=True)
    print("check_mutants: %d mutants, %d problems, %.0f s" % (len(mutants), problems,
                                                             time.time() - start))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
