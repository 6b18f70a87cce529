"""The package on every device: the same checks on CPU tensors and, where torch sees a GPU, on CUDA
tensors (skipped with a reason otherwise; scripts/gpu_check.sh runs them on the GPU machine).
Each result is compared on the CPU against float64 or torch's own implementation fed the same
(rounded) inputs."""
import pytest
import torch
import torch.nn.functional as F

import amp_C
from apex.multi_tensor_apply import multi_tensor_applier
from apex.normalization import FusedLayerNorm, FusedRMSNorm
from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD

DEVICES = [
    pytest.param("cpu"),
    # The stable-ABI op library has CPU kernels only (regular_ops: skipped where it runs).
    pytest.param("cuda", marks=[pytest.mark.skipif(not torch.cuda.is_available(),
                                                   reason="no CUDA device"),
                                pytest.mark.regular_ops]),
]
HALF_TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (4e-2, 4e-2),
            torch.float16: (5e-3, 5e-3)}


def rand(shape, seed, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64) * scale + shift


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rms", [False, True])
def test_norm_forward_backward(device, dtype, rms):
    rows, hidden = 37, 300
    module = (FusedRMSNorm(hidden) if rms else FusedLayerNorm(hidden)).to(device, dtype)
    with torch.no_grad():
        module.weight.copy_(rand(hidden, 1, 0.3, 1.0))
        if not rms:
            module.bias.copy_(rand(hidden, 2, 0.3))
    x = rand((rows, hidden), 3, 2.0, 0.5).to(device, dtype).requires_grad_()
    dy = rand((rows, hidden), 4).to(device, dtype)
    y = module(x)
    y.backward(dy)
    assert y.dtype == dtype and y.device.type == device
    # float64 reference on the CPU from the same rounded values
    xr = x.detach().cpu().double().requires_grad_()
    wr = module.weight.detach().cpu().double().requires_grad_()
    if rms:
        yr = xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + module.eps) * wr
    else:
        br = module.bias.detach().cpu().double().requires_grad_()
        yr = F.layer_norm(xr, (hidden,), wr, br, module.eps)
    yr.backward(dy.cpu().double())
    rtol, atol = HALF_TOL[dtype]
    torch.testing.assert_close(y.detach().cpu().double(), yr.detach(), rtol=rtol, atol=atol)
    torch.testing.assert_close(x.grad.cpu().double(), xr.grad, rtol=rtol, atol=atol)
    # parameter gradients sum over the rows: looser for half storage
    torch.testing.assert_close(module.weight.grad.cpu().double(), wr.grad, rtol=rtol * 4,
                               atol=atol * 4 * rows ** 0.5)


def params_on(device, seed=0, sizes=(5, 300, 4099)):
    return [rand(n, seed + i).float().to(device).requires_grad_() for i, n in enumerate(sizes)]


def set_grads(params, step):
    for i, p in enumerate(params):
        p.grad = rand(p.shape, 1000 + 31 * step + i).float().to(p.device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["adam", "adamw", "sgd", "lamb"])
def test_optimizer_matches_reference(device, name):
    ours = params_on(device)
    ref = [p.detach().cpu().double().requires_grad_() for p in ours]
    if name in ("adam", "adamw"):
        opt = FusedAdam(ours, lr=1e-2, weight_decay=0.1, adam_w_mode=name == "adamw")
        ref_opt = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(
            ref, lr=1e-2, weight_decay=0.1, foreach=False)
    elif name == "sgd":
        opt = FusedSGD(ours, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3)
        ref_opt = torch.optim.SGD(ref, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3,
                                  foreach=False)
    else:
        opt = FusedLAMB(ours, lr=1e-2, weight_decay=0.01)
        ref_opt = None
    for step in range(5):
        set_grads(ours, step)
        opt.step()
        if ref_opt is not None:
            for p, q in zip(ref, ours):
                p.grad = q.grad.detach().cpu().double()
            ref_opt.step()
    if ref_opt is None:
        # LAMB: the device's result against the same optimizer on the CPU (tested there against
        # a float64 LAMB in test_optimizers.py)
        cpu = params_on("cpu")
        cpu_opt = FusedLAMB(cpu, lr=1e-2, weight_decay=0.01)
        for step in range(5):
            set_grads(cpu, step)
            cpu_opt.step()
        ref = cpu
    for p, q in zip(ours, ref):
        assert p.device.type == device
        torch.testing.assert_close(p.detach().cpu().double(), q.detach().double(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_amp_c_norms_and_scale(device):
    xs = [rand(n, 50 + n).float().to(device) for n in (1, 333, 70000)]
    noop = torch.zeros(1, dtype=torch.int, device=device)
    total, per = multi_tensor_applier(amp_C.multi_tensor_l2norm, noop, [xs], True)
    ref = torch.stack([x.cpu().double().norm() for x in xs])
    torch.testing.assert_close(per.cpu().double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(total.cpu().double().reshape(()), ref.norm(), rtol=1e-5, atol=1e-6)
    out = [torch.empty_like(x, dtype=torch.float16) for x in xs]
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [xs, out], 0.5)
    for x, o in zip(xs, out):
        torch.testing.assert_close(o.cpu(), (x.cpu() * 0.5).half())
    assert noop.item() == 0
    xs[1][7] = float("inf")
    multi_tensor_applier(amp_C.multi_tensor_scale, noop, [xs, out], 0.5)
    assert noop.item() == 1


@pytest.mark.parametrize("device", DEVICES)
def test_grad_scaler_overflow_skips_fused_adam(device):
    params = params_on(device)
    before = [p.detach().clone() for p in params]
    opt = FusedAdam(params, lr=1e-2)
    scaler = torch.amp.GradScaler(device, init_scale=1024.0)
    loss = sum((p * p).sum() for p in params)
    scaler.scale(loss).backward()
    params[1].grad[3] = float("inf")
    scaler.step(opt)
    scaler.update()
    for p, b in zip(params, before):
        assert torch.equal(p.detach(), b)
    assert scaler.get_scale() == 512.0
    assert not opt.state or all(float(s["exp_avg"].abs().sum()) == 0 for s in opt.state.values())
