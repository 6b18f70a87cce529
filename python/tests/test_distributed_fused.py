"""apex.contrib.optimizers.DistributedFusedAdam / DistributedFusedLAMB: real processes
(torch.multiprocessing, Gloo on 127.0.0.1) against single-process training on the whole batch."""
import gc
import os
import socket
import sys
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from apex import _ops

pytestmark = pytest.mark.skipif(_ops.STABLE or not dist.is_available(),
                                reason="the sharded optimizers are in the regular op library")

STEPS = 4


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batches():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def make_opt(kind, params, **kw):
    if kind == "adam":
        from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
        return DistributedFusedAdam(params, lr=1e-2, weight_decay=0.01, **kw)
    from apex.contrib.optimizers.distributed_fused_lamb import DistributedFusedLAMB
    return DistributedFusedLAMB(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0, **kw)


def reference(kind, skip=(), clip=None, micro=1):
    """Single-process training on the whole batch: torch's AdamW, or apex's FusedLAMB."""
    m = make_model()
    if kind == "adam":
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-8)
    else:
        from apex.optimizers import FusedLAMB
        opt = FusedLAMB(m.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-8, max_grad_norm=1.0)
    norms = []
    for step, (x, y) in enumerate(batches()):
        sum(F.mse_loss(m(xk), yk) for xk, yk in zip(x.chunk(micro), y.chunk(micro))).backward()
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
        if step not in skip:
            opt.step()
        opt.zero_grad()
    if clip is not None:
        return m, opt, norms
    return m, opt


def worker(rank, world, port, kind, case, out):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
        m = make_model()
        # A tiny bucket: parameters cut into fragments across buckets and ranks.
        opt = make_opt(kind, m.parameters(), bucket_cap_mb=1e-4)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2) \
            if case == "scaler" else None
        result = {}
        todo = list(enumerate(batches()))
        if case == "remainders":
            # The same bf16 model under two optimizers, fp32 masters and 16-bit remainders, fed
            # the same gradients (ones that do not depend on the parameters).
            del opt
            m = make_model().to(torch.bfloat16)
            other = make_model().to(torch.bfloat16)
            opt = make_opt(kind, m.parameters(), bucket_cap_mb=1e-4, store_params=False,
                           store_param_remainders=True)
            masters = make_opt(kind, other.parameters(), bucket_cap_mb=1e-4)
            g = torch.Generator().manual_seed(11 + rank)
            for _ in range(STEPS):
                grads = [torch.randn(p.shape, generator=g) for p in m.parameters()]
                for model, o in ((m, opt), (other, masters)):
                    sum((p.float() * d).sum() for p, d in zip(model.parameters(), grads)).backward()
                    o.step()
                    o.zero_grad()
            result["masters_state"] = masters.state_dict()
            result["masters_memory"] = masters.memory()
            third = make_model().to(torch.bfloat16)
            result["nostore_memory"] = make_opt(kind, third.parameters(), bucket_cap_mb=1e-4,
                                                store_params=False).memory()
            result["masters_params"] = [p.detach().clone() for p in other.parameters()]
            del masters
            todo = []
        if case == "pieces":
            # One bucket, exchanged in collectives of 32 elements per peer (message_cap_mb).
            del opt
            m = make_model()
            opt = make_opt(kind, m.parameters(), bucket_cap_mb=100.0, message_cap_mb=1e-4)
        if case == "bucketed":
            # apex's init_params / init_params_bucket: the first layer in a bucket of its own.
            del opt
            m = make_model()
            opt = make_opt(kind, m.parameters(), bucket_cap_mb=100.0)
            opt.init_params()
            opt.init_params(m.parameters())
            try:
                opt.init_params(torch.ones(3))
            except RuntimeError as e:
                result["refused"] = str(e)
            opt.init_params_bucket([m[0].weight, m[0].bias])
        if case == "first-half":
            todo = todo[:2]
        elif case == "second-half":
            # Another world size goes on from the first half's format-2 state (rank 0's model).
            saved = torch.load(out + ".in", weights_only=False)
            with torch.no_grad():
                for p, q in zip(m.parameters(), saved["params"]):
                    p.copy_(q)
            opt.load_state_dict(saved["state"])
            todo = todo[2:]
        for step, (x, y) in todo:
            loss = F.mse_loss(m(x.chunk(world)[rank]), y.chunk(world)[rank])
            if case == "accumulate":
                # Two micro-batches: the first accumulates without communicating.
                for k in range(2):
                    xk, yk = x.chunk(2)[k].chunk(world)[rank], y.chunk(2)[k].chunk(world)[rank]
                    if k == 0:
                        with opt.no_sync():
                            F.mse_loss(m(xk), yk).backward()
                    else:
                        F.mse_loss(m(xk), yk).backward()
                opt.step()
            elif case == "clip":
                # apex's order: unscale through the optimizer, clip, then step.
                scaler = scaler or torch.amp.GradScaler("cpu", init_scale=256.0)
                scaler.scale(loss).backward()
                opt.unscale_grads(grad_scaler=scaler)
                result.setdefault("norms", []).append(float(opt.clip_grad_norm(0.05)))
                scaler.step(opt)
                scaler.update()
            elif scaler is None:
                loss.backward()
                opt.step()
            else:
                if step == 1 and rank == world - 1:
                    loss = loss * float("inf")  # an overflow on one rank skips every rank
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                result.setdefault("scales", []).append(scaler.get_scale())
            opt.zero_grad()
            if case == "resume" and step == 1:
                # A fresh optimizer on a copy of the model, loaded from format 2, goes on alike.
                state = opt.state_dict()
                m2 = make_model()
                with torch.no_grad():
                    for a, b in zip(m2.parameters(), m.parameters()):
                        a.copy_(b)
                opt2 = make_opt(kind, m2.parameters(), bucket_cap_mb=1e-3)
                opt2.load_state_dict(state)
        if case == "resume":
            for x, y in batches()[2:]:
                F.mse_loss(m2(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
                opt2.step()
                opt2.zero_grad()
            result["resumed"] = [p.detach().clone() for p in m2.parameters()]
        if case == "misuse":
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(F.mse_loss(m(batches()[0][0]), batches()[0][1])).backward()
            scaler.unscale_(opt)
            try:
                scaler.step(opt)
            except RuntimeError as e:
                result["error"] = str(e)
        result["params"] = [p.detach().clone() for p in m.parameters()]
        result["state"] = opt.state_dict()
        result["memory"] = opt.memory()
        if rank == 0:
            torch.save(result, out)
        # As test_parallel.py ends its ranks: the optimizers (which hold the Gloo group) go while
        # the interpreter is whole, every rank is done before any tears the group down, and the
        # process leaves without the interpreter's shutdown (a rank that closed its pairs under
        # another's last collective, or Gloo threads meeting Python's finalization, aborted in
        # std::terminate about once in four runs).
        del opt
        if case == "resume":
            del opt2
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def assert_params_match(r, m):
    """The ranks' parameters against the single-process reference model's."""
    for got, want in zip(r["params"], m.parameters()):
        torch.testing.assert_close(got, want.detach(), rtol=1e-5, atol=1e-6)


def run(tmp_path, kind, case, world=2):
    out = str(tmp_path / f"{kind}-{case}.pt")
    mp.start_processes(worker, args=(world, free_port(), kind, case, out), nprocs=world,
                       join=True, start_method="spawn")
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_two_ranks_train_as_one_process_on_the_whole_batch(tmp_path, kind):
    r = run(tmp_path, kind, "plain")
    m, ref = reference(kind)
    assert_params_match(r, m)
    # apex's format 2: per parameter its fp32 param and moments, and each group's step.
    state = r["state"]
    assert state["format"] == 2
    assert state["param_groups"][0]["step"] == STEPS
    if kind == "adam":
        for i, p in enumerate(m.parameters()):
            torch.testing.assert_close(state["state"][i]["exp_avg"], ref.state[p]["exp_avg"],
                                       rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(state["state"][i]["param"], p.detach(), rtol=1e-5,
                                       atol=1e-6)
    # Each rank holds half of the state (three fp32 values per element, padding aside).
    n = sum(p.numel() for p in m.parameters())
    assert r["memory"]["params"] == n
    assert r["memory"]["state_bytes"] < 3 * 4 * n


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_init_params_bucket_gives_a_layer_its_own_bucket(tmp_path, kind):
    r = run(tmp_path, kind, "bucketed")
    m, _ = reference(kind)
    assert_params_match(r, m)
    # Two padded buckets (144 and 68 elements, to multiples of 64) instead of one (212 to 256).
    assert r["memory"]["shard_elements"] == (192 + 128) // 2
    assert "is not one of this optimizer's parameters" in r["refused"]


@pytest.mark.parametrize("kind", ["adam", "lamb"])
def test_message_cap_sends_a_bucket_in_pieces_to_the_same_result(tmp_path, kind):
    r = run(tmp_path, kind, "pieces")
    m, _ = reference(kind)
    assert_params_match(r, m)


def test_grad_scaler_skips_an_overflow_on_every_rank(tmp_path):
    r = run(tmp_path, "adam", "scaler")
    m, _ = reference("adam", skip=(1,))
    assert_params_match(r, m)
    # torch's GradScaler saw the skip (backoff) and the clean steps (growth every 2).
    assert r["scales"] == [1024.0, 512.0, 512.0, 1024.0]
    assert r["state"]["param_groups"][0]["step"] == STEPS - 1


def test_unscale_grads_then_clip_as_torch_clips_the_whole_batch(tmp_path):
    r = run(tmp_path, "adam", "clip")
    m, _, norms = reference("adam", clip=0.05)
    assert r["norms"] == pytest.approx(norms, rel=1e-5)
    assert min(norms) > 0.05  # every step clipped
    assert_params_match(r, m)


def test_no_sync_micro_batches_equal_their_sum_on_the_whole_batch(tmp_path):
    r = run(tmp_path, "adam", "accumulate")
    m, _ = reference("adam", micro=2)
    assert_params_match(r, m)


def test_format_2_moves_from_two_ranks_to_one(tmp_path):
    first = run(tmp_path, "adam", "first-half", world=2)
    torch.save(first, str(tmp_path / "adam-second-half.pt.in"))
    r = run(tmp_path, "adam", "second-half", world=1)
    m, _ = reference("adam")
    assert_params_match(r, m)
    assert r["state"]["param_groups"][0]["step"] == STEPS


def test_format_2_resumes_bit_identically(tmp_path):
    r = run(tmp_path, "adam", "resume")
    for a, b in zip(r["resumed"], r["params"]):
        assert torch.equal(a, b)


def test_scaler_unscale_is_refused_with_what_to_call_instead(tmp_path):
    r = run(tmp_path, "adam", "misuse")
    assert "unscale_grads(grad_scaler=scaler)" in r["error"]


def test_under_torchrun_equal_to_ddp_with_adamw(tmp_path):
    """Two ranks started by torchrun: apex's DFA and torch's DDP + AdamW on the same batches."""
    import subprocess
    out = str(tmp_path / "torchrun.pt")
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dfa_torchrun.py")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc_per_node=2",
           "--master_addr=127.0.0.1", f"--master_port={free_port()}", script, out]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    got = torch.load(out, weights_only=False)
    assert got["world"] == 2
    for a, b in zip(got["dfa"], got["ddp"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # Format 2 reloads at world size 1 (test_format_2_moves_from_two_ranks_to_one goes on
    # training from it); here: its entries are the parameters DDP trained.
    for i, b in enumerate(got["ddp"]):
        torch.testing.assert_close(got["state"]["state"][i]["param"], b, rtol=1e-5, atol=1e-6)


def test_param_remainders_keep_the_fp32_masters_bit_for_bit(tmp_path):
    """store_param_remainders=True: bf16 parameters plus 16-bit remainders are the fp32 masters
    (equal bit for bit to an optimizer keeping fp32 masters, fed the same gradients), each
    parameter its master's high half rounded half up, in 10 bytes of state per element, not 12."""
    r = run(tmp_path, "adam", "remainders")
    got, want = r["state"]["state"], r["masters_state"]["state"]
    for i in want:
        for key in ("param", "exp_avg", "exp_avg_sq"):
            assert torch.equal(got[i][key], want[i][key]), (i, key)
    for i, (p, q) in enumerate(zip(r["params"], r["masters_params"])):
        bits = got[i]["param"].reshape(-1).view(torch.int32).to(torch.int64)
        low = bits & 0xFFFF
        high = ((bits >> 16) + (low >= 0x8000).to(torch.int64)) & 0xFFFF
        assert torch.equal(p.reshape(-1).view(torch.int16).to(torch.int64) & 0xFFFF, high), i
        away = low != 0x8000  # round-half-up and round-to-nearest-even differ only at ties
        assert torch.equal(p.reshape(-1)[away], q.reshape(-1)[away]), i
    shard = r["memory"]["shard_elements"]
    assert r["memory"]["state_bytes"] == 10 * shard
    assert r["masters_memory"]["state_bytes"] == 12 * shard
    assert r["nostore_memory"]["state_bytes"] == 8 * shard  # store_params=False: no masters


def test_bad_arguments_are_refused_before_anything():
    from apex.contrib.optimizers.distributed_fused_adam import DistributedFusedAdam
    p = [torch.nn.Parameter(torch.ones(3))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        DistributedFusedAdam(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="with_scaled_states"):
        DistributedFusedAdam(p, with_scaled_states=True)
    # apex's rule: the remainders replace the stored parameters.
    with pytest.raises(RuntimeError, match="store_params=False with store_param_remainders=True"):
        DistributedFusedAdam(p, store_param_remainders=True)
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            DistributedFusedAdam(p)
