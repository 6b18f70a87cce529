"""apex.parallel with real processes over Gloo on 127.0.0.1: SyncBatchNorm on the CPU (uneven
batches, an empty one) against BatchNorm over the concatenated batch, and DistributedDataParallel
with apex's options against one process on the whole batch."""
import faulthandler
import gc
import os
import socket
import sys
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world, fn, *args):
    port = free_port()
    with tempfile.TemporaryDirectory() as out:
        mp.start_processes(_worker, args=(world, port, out, fn, args), nprocs=world, join=True,
                           start_method="spawn")
        return [torch.load(os.path.join(out, f"{r}.pt"), weights_only=False) for r in range(world)]


def _worker(rank, world, port, out, fn, args):
    # A crash prints every thread's Python stack (where a rank aborts tells what it was doing).
    faulthandler.enable()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    torch.set_num_threads(1)
    try:
        torch.save(fn(rank, world, *args), os.path.join(out, f"{rank}.pt"))
        # The rank's DDP and its Reducer (reference cycles) go now, while the interpreter is
        # whole: they hold the Gloo group, whose work objects may hold Python objects (a comm
        # hook's futures), and destroying those during interpreter shutdown aborted a rank in
        # std::terminate ("terminate called without an active exception", ~1 in 10 CI runs).
        gc.collect()
        # Every rank done before any tears its group down: a rank that closed its Gloo pairs
        # while the other's last collective was still in flight made that one abort too.
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Done and saved: leave without the interpreter's shutdown, where torch's Gloo threads and
    # Python finalization can still meet.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


SPLITS = [5, 0, 3]  # rank 1 has an empty batch


def _data(channels_last=False):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(SPLITS), 4, 3, 5, generator=g) * 3 + 1
    dy = torch.randn(x.shape, generator=g)
    return x, dy


def _syncbn_rank(rank, world, channels_last):
    from apex.parallel import SyncBatchNorm
    x, dy = _data()
    start = sum(SPLITS[:rank])
    xs = x[start:start + SPLITS[rank]].clone()
    if channels_last:
        xs = xs.contiguous(memory_format=torch.channels_last)
    xs.requires_grad_()
    torch.manual_seed(1)
    bn = SyncBatchNorm(4, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    y = bn(xs)
    y.backward(dy[start:start + SPLITS[rank]])
    return dict(y=y.detach(), dx=xs.grad, dw=bn.weight.grad, db=bn.bias.grad,
                rm=bn.running_mean, rv=bn.running_var)


@pytest.mark.parametrize("channels_last", [False, True])
def test_sync_batch_norm_equals_batch_norm_on_the_whole_batch(channels_last):
    results = run(3, _syncbn_rank, channels_last)
    x, dy = _data()
    x = x.double().requires_grad_()
    torch.manual_seed(1)
    bn = torch.nn.BatchNorm2d(4, momentum=0.3)
    with torch.no_grad():
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-1, 1)
    bn = bn.double()
    y = bn(x)
    y.backward(dy.double())
    ys = torch.cat([r["y"] for r in results])
    dxs = torch.cat([r["dx"] for r in results])
    torch.testing.assert_close(ys.double(), y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dxs.double(), x.grad, rtol=1e-5, atol=1e-5)
    # Weight and bias gradients are per rank (DDP sums them): their sum is BatchNorm's.
    torch.testing.assert_close(sum(r["dw"] for r in results).double(), bn.weight.grad,
                               rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sum(r["db"] for r in results).double(), bn.bias.grad,
                               rtol=1e-5, atol=1e-5)
    for r in results:
        torch.testing.assert_close(r["rm"].double(), bn.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(r["rv"].double(), bn.running_var, rtol=1e-5, atol=1e-6)


def _net():
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _ddp_rank(rank, world, options):
    from apex.parallel import DistributedDataParallel
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 8, generator=g)
    y = torch.randn(12, 2, generator=g)
    options = dict(options)
    net = _WithUnused() if options.pop("unused", False) else _net()
    model = DistributedDataParallel(net, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    per = 12 // world
    for _ in range(3):
        opt.zero_grad()
        out = model(x[rank * per:(rank + 1) * per])
        torch.nn.functional.mse_loss(out, y[rank * per:(rank + 1) * per]).backward()
        opt.step()
    module = model.module.net if isinstance(model.module, _WithUnused) else model.module
    return [p.detach() for p in module.parameters()]


class _WithUnused(torch.nn.Module):
    """_net() and a layer no forward uses (apex's delay_allreduce reduced what had gradients)."""

    def __init__(self):
        super().__init__()
        self.net = _net()
        self.unused = torch.nn.Linear(3, 3)

    def forward(self, x):
        return self.net(x)


# gradient_average=False with gradient_predivide_factor = world size 2: apex's sum of
# grad / 2, which is the average here.
@pytest.mark.parametrize("options", [{}, {"delay_allreduce": True},
                                     {"allreduce_always_fp32": True,
                                      "gradient_predivide_factor": 2.0},
                                     {"gradient_average": False, "gradient_predivide_factor": 2.0},
                                     {"message_size": 64},
                                     {"delay_allreduce": True, "unused": True}])
def test_ddp_equals_one_process_on_the_whole_batch(options):
    results = run(2, _ddp_rank, options)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(12, 8, generator=g)
    y = torch.randn(12, 2, generator=g)
    model = _net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for r in results:
        for a, b in zip(r, model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)


def _amp_ddp_rank(rank, world, bucket_view):
    """apex.amp (dynamic scale: the stashing path) under DDP, two scale_loss scopes per step,
    gradients cleared to None and, in the last step, zeroed in place (bucket views kept)."""
    from apex import amp
    from apex.parallel import DistributedDataParallel
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(12, 8, generator=g) for _ in range(6)]
    ys = [torch.randn(12, 2, generator=g) for _ in range(6)]
    torch.manual_seed(5)
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    net, opt = amp.initialize(net, opt, opt_level="O1", loss_scale="dynamic", verbosity=0)
    model = DistributedDataParallel(net, gradient_as_bucket_view=bucket_view) if world else net
    per = 12 // max(world, 1)
    rows = slice(rank * per, (rank + 1) * per) if world else slice(None)
    views = 0
    for step in range(3):
        opt.zero_grad(set_to_none=step < 2)
        for k in range(2):
            i = 2 * step + k
            loss = torch.nn.functional.mse_loss(model(xs[i][rows]), ys[i][rows])
            with amp.scale_loss(loss, opt) as scaled:
                scaled.backward()
            views += int(net[0].weight.grad._is_view())
        opt.step()
    return dict(params=[p.detach().clone() for p in net.parameters()], views=views)


def test_amp_ddp_gradient_as_bucket_view_accumulates_as_without():
    """A stash that aliased DDP's bucket was overwritten by the next backward's gradient."""
    viewed = run(2, _amp_ddp_rank, True)
    plain = run(2, _amp_ddp_rank, False)
    assert all(r["views"] > 0 for r in viewed)  # the case under test was reached
    for v, p in zip(viewed, plain):
        for a, b in zip(v["params"], p["params"]):
            assert torch.equal(a, b)
    whole = _amp_ddp_rank(0, 0, False)  # one process on the whole batch (bf16 autocast)
    for a, b in zip(plain[0]["params"], whole["params"]):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-3)


def _convert_rank(rank, world):
    from apex.parallel import SyncBatchNorm, convert_syncbn_model
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4))
    m[1].running_mean.fill_(0.5)
    m.eval()
    c = convert_syncbn_model(m)
    return dict(is_sync=isinstance(c[1], SyncBatchNorm), training=c[1].training,
                same_weight=c[1].weight is m[1].weight, rm=c[1].running_mean.clone())


def test_convert_syncbn_model_keeps_state():
    r = run(2, _convert_rank)[0]
    assert r["is_sync"] and not r["training"] and r["same_weight"]
    assert torch.all(r["rm"] == 0.5)
