"""python/examples/imagenet_amp.py (apex's main_amp.py recipe: channels-last, amp O0-O2,
apex's DDP + SyncBatchNorm) trains to accuracy in one process and in two ranks over Gloo on
127.0.0.1."""
import os
import socket
import subprocess
import sys

import pytest

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "examples", "imagenet_amp.py")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(world, level):
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        if world == 1:
            for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
                env.pop(k)
        procs.append(subprocess.Popen(
            [sys.executable, EXAMPLE, "--opt-level", level, "--steps", "40", "--min-accuracy", "90"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
        outs.append((p.returncode, out))
    return outs


@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_imagenet_recipe_one_process(level):
    [(rc, out)] = run_ranks(1, level)
    assert rc == 0, out
    assert f"opt level {level}, 1 rank(s): test accuracy" in out


def test_imagenet_recipe_two_ranks_ddp_syncbn():
    outs = run_ranks(2, "O2")
    for rank, (rc, out) in enumerate(outs):
        assert rc == 0, f"rank {rank}: {out}"
    assert "opt level O2, 2 rank(s): test accuracy" in outs[0][1]
