"""apex.optimizers against torch.optim (Adam/AdamW, SGD, Adagrad) and float64 references (LAMB,
NovoGrad), over 20 steps, several groups, fp32/bf16/fp16 parameters."""
import copy
import math

import pytest
import torch

import amp_C
from apex import _ops
from apex.multi_tensor_apply import multi_tensor_applier
from apex.optimizers import (FusedAdagrad, FusedAdam, FusedLAMB, FusedMixedPrecisionLamb,
                             FusedNovoGrad, FusedSGD)

STEPS = 20
SIZES = [1, 7, 65537, 300]


def make_params(dtype=torch.float32, seed=0, sizes=SIZES):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype).requires_grad_() for n in sizes]


def set_grads(params, step, seed=1, scale=1.0, dtype=None):
    for i, p in enumerate(params):
        g = torch.Generator().manual_seed(seed * 100003 + step * 7919 + i)
        p.grad = (torch.randn(p.shape, generator=g) * scale).to(dtype or p.dtype)


def groups(params, **second):
    return [{"params": params[:2]}, {"params": params[2:], **second}]


def close(a, b, rtol=1e-5, atol=1e-6):
    for x, y in zip(a, b):
        torch.testing.assert_close(x.detach().double(), y.detach().double(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_fused_adam_matches_torch(adam_w_mode):
    ours = make_params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdam(groups(ours, lr=3e-3, weight_decay=0.02), lr=1e-2, weight_decay=0.01,
                    adam_w_mode=adam_w_mode)
    peer_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    peer = peer_cls(groups(ref, lr=3e-3, weight_decay=0.02), lr=1e-2, weight_decay=0.01)
    for step in range(STEPS):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        peer.step()
    close(ours, ref)
    # apex's layout: the step count in the group, fp32 moments per parameter.
    assert opt.param_groups[0]["step"] == STEPS
    assert set(opt.state[ours[0]]) == {"exp_avg", "exp_avg_sq"}
    close([opt.state[p]["exp_avg"] for p in ours], [peer.state[p]["exp_avg"] for p in ref])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_params_follow_fp32_reference(dtype):
    ours = make_params(dtype)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    opt = FusedAdam(ours, lr=1e-3)
    peer = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    for step in range(STEPS):
        set_grads(ref, step)
        for p, r in zip(ours, ref):
            p.grad = r.grad.to(dtype)
        opt.step()
        peer.step()
        # Each step: our half parameter is the fp32 update of the half value, rounded once.
        with torch.no_grad():
            for r, p in zip(ref, ours):
                r.copy_(p.float())
    tol = {torch.bfloat16: 1.6e-2, torch.float16: 1e-3}[dtype]
    close(ours, [r.to(dtype) for r in ref], rtol=tol, atol=tol)


def test_capturable_master_weights_track_fp32():
    ours = make_params(torch.bfloat16)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    opt = FusedAdam(ours, lr=1e-3, capturable=True, master_weights=True)
    peer = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    for step in range(STEPS):
        set_grads(ref, step)
        for p, r in zip(ours, ref):
            p.grad = r.grad.to(torch.bfloat16)
        opt.step()
        peer.step()
    close([opt.state[p]["master_param"] for p in ours], ref, rtol=1e-2, atol=1e-3)
    assert int(opt.param_groups[0]["step"]) == STEPS


def test_grad_scaler_unscales_in_kernel_and_skips_on_overflow():
    ours = make_params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdam(ours, lr=1e-2)
    peer = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.0)
    s_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    skipped = 0
    for step in range(8):
        for params, opt_, scaler in ((ours, opt, s_ours), (ref, peer, s_ref)):
            scaler.scale(torch.ones(()))  # as scaler.scale(loss) does before backward
            set_grads(params, step, scale=scaler.get_scale())
            if step == 3:
                params[2].grad[5] = float("inf")
            before = [p.detach().clone() for p in params]
            scaler.step(opt_)
            scaler.update()
            if step == 3:
                skipped += int(all(torch.equal(a, b) for a, b in zip(before, params)))
    assert skipped == 2
    assert s_ours.get_scale() == s_ref.get_scale() == 512.0
    close(ours, ref)
    # torch's contract: p.grad unscaled after scaler.step (torch unscales in place; the kernel
    # writes grad * inv_scale back in the update's pass), the skipped step's too.
    for a, b in zip(ours, ref):
        assert torch.equal(a.grad, b.grad)


FUSED = {
    "FusedAdam": lambda ps: FusedAdam(ps, lr=1e-2, weight_decay=0.01),
    "FusedAdam capturable": lambda ps: FusedAdam(ps, lr=1e-2, capturable=True),
    "FusedSGD": lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    "FusedLAMB": lambda ps: FusedLAMB(ps, lr=1e-2),
    "FusedNovoGrad": lambda ps: FusedNovoGrad(ps, lr=1e-2),
    "FusedAdagrad": lambda ps: FusedAdagrad(ps, lr=1e-2),
    "FusedMixedPrecisionLamb": lambda ps: FusedMixedPrecisionLamb(ps, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(FUSED))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_scaler_leaves_unscaled_gradients(name, dtype):
    """After scaler.step(opt), p.grad holds the unscaled gradient, as torch's GradScaler leaves
    it (unscale_ in place) and apex's capturable kernel writes it: code that reads or clips
    p.grad after the step sees true gradients. Skipped steps too. The update is the one the
    kernel makes without the write-back (compared with the gradients unscaled by hand first)."""
    ours = make_params(dtype)
    twin = [p.detach().clone().requires_grad_() for p in ours]
    opt, opt_twin = FUSED[name](ours), FUSED[name](twin)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        scaler.scale(torch.ones(()))
        scale = scaler.get_scale()
        set_grads(ours, step, scale=scale)
        if step == 2:
            ours[1].grad[3] = float("inf")
        scaled = [p.grad.clone() for p in ours]
        inv = (1.0 / torch.tensor(scale, dtype=torch.float64)).float()
        want = [(g.float() * inv).to(g.dtype) for g in scaled]
        scaler.step(opt)
        scaler.update()
        for i, (p, w) in enumerate(zip(ours, want)):
            assert torch.equal(p.grad, w), f"{name} {dtype} step {step} tensor {i}"
        if step != 2:  # the twin steps on the same gradients, unscaled by torch's own op
            for p, w in zip(twin, want):
                p.grad = w.clone()
            opt_twin.step()
    for a, b in zip(ours, twin):
        close([a.float()], [b.float()], rtol=1e-2 if dtype == torch.bfloat16 else 1e-5,
              atol=1e-3 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("nesterov,momentum,wd", [(False, 0.0, 0.0), (False, 0.9, 0.01),
                                                   (True, 0.9, 0.0)])
def test_fused_sgd_matches_torch(nesterov, momentum, wd):
    ours = make_params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedSGD(groups(ours, lr=0.05), lr=0.1, momentum=momentum, weight_decay=wd,
                   nesterov=nesterov)
    peer = torch.optim.SGD(groups(ref, lr=0.05), lr=0.1, momentum=momentum, weight_decay=wd,
                           nesterov=nesterov)
    for step in range(STEPS):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        peer.step()
    close(ours, ref)
    if momentum:
        assert "momentum_buffer" in opt.state[ours[0]]


def test_fused_adagrad_matches_torch():
    ours = make_params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdagrad(ours, lr=0.05, weight_decay=0.01, lr_decay=0.01)
    peer = torch.optim.Adagrad(ref, lr=0.05, weight_decay=0.01, lr_decay=0.01)
    for step in range(STEPS):
        set_grads(ours, step)
        set_grads(ref, step)
        opt.step()
        peer.step()
    close(ours, ref)


def lamb_reference(params, grads_per_step, lr, b1, b2, eps, wd, max_grad_norm, adam_w=True):
    """float64 LAMB (apex's FusedLAMB: global clipping, bias correction, trust ratio)."""
    p = [x.detach().double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [torch.zeros_like(x) for x in p]
    for step, grads in enumerate(grads_per_step, start=1):
        g = [x.double() for x in grads]
        gnorm = math.sqrt(sum(float((x * x).sum()) for x in g))
        clip = gnorm / max_grad_norm if max_grad_norm > 0 and gnorm > max_grad_norm else 1.0
        bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
        for i in range(len(p)):
            gi = g[i] / clip
            if not adam_w:
                gi = gi + wd * p[i]
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            u = (m[i] / bc1) / ((v[i] / bc2).sqrt() + eps)
            if adam_w:
                u = u + wd * p[i]
            pn, un = float(p[i].norm()), float(u.norm())
            ratio = lr * pn / un if (wd != 0 and pn != 0 and un != 0) else lr
            p[i] = p[i] - ratio * u
    return p


def test_fused_lamb_matches_float64():
    ours = make_params()
    opt = FusedLAMB(ours, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    all_grads = []
    for step in range(STEPS):
        set_grads(ours, step, scale=0.3)
        all_grads.append([p.grad.clone() for p in ours])
        opt.step()
    ref = lamb_reference(make_params(), all_grads, 1e-2, 0.9, 0.999, 1e-6, 0.01, 1.0)
    close(ours, ref, rtol=1e-4, atol=1e-5)
    # Unlike apex, the gradients are not overwritten by the update.
    assert torch.equal(ours[0].grad, all_grads[-1][0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_mixed_precision_lamb_masters_match_float64(dtype):
    """Half parameters stepped through fp32 masters: the masters follow the float64 LAMB on the
    same gradients, the parameters are the masters rounded once, lr and step are tensors."""
    ours = make_params(dtype)
    start = [p.detach().float() for p in ours]
    opt = FusedMixedPrecisionLamb(ours, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0,
                                  reduced_precision_dtype=dtype)
    all_grads = []
    for step in range(STEPS):
        set_grads(ours, step, scale=0.3)
        all_grads.append([p.grad.float() for p in ours])
        opt.step()
    ref = lamb_reference(start, all_grads, 1e-2, 0.9, 0.999, 1e-6, 0.01, 1.0)
    masters = opt.param_groups_full_precision[0]["params"]
    close(masters, ref, rtol=1e-4, atol=1e-5)
    for p, m in zip(ours, masters):
        assert p.dtype == dtype and torch.equal(p.detach(), m.to(dtype))
    group = opt.param_groups[0]
    assert torch.is_tensor(group["lr"]) and torch.is_tensor(group["step"])
    assert int(group["step"]) == STEPS
    assert all(opt.state[p]["exp_avg"].dtype == torch.float32 for p in ours)


def test_fused_mixed_precision_lamb_skips_overflow_and_round_trips():
    ours = make_params(torch.bfloat16)
    opt = FusedMixedPrecisionLamb(ours, lr=1e-2, reduced_precision_dtype=torch.bfloat16)
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    for step in range(4):
        scaler.scale(torch.ones(()))
        set_grads(ours, step, scale=scaler.get_scale())
        if step == 2:
            ours[1].grad[3] = float("inf")
        before = [p.detach().clone() for p in ours]
        scaler.step(opt)
        scaler.update()
        if step == 2:
            assert all(torch.equal(a, b) for a, b in zip(before, ours))
    assert int(opt.param_groups[0]["step"]) == 3  # the skipped step did not count
    # Round trip: moments stay fp32, masters are rebuilt from the loaded parameters, and both
    # optimizers then step alike.
    saved = copy.deepcopy(opt.state_dict())
    twin = [p.detach().clone().requires_grad_() for p in ours]
    opt_b = FusedMixedPrecisionLamb(twin, lr=0.5, reduced_precision_dtype=torch.bfloat16)
    opt_b.load_state_dict(saved)
    assert opt_b.state[twin[0]]["exp_avg"].dtype == torch.float32
    assert float(opt_b.param_groups[0]["lr"]) == pytest.approx(1e-2)
    opt.param_groups_full_precision = []  # as after a load: masters from the parameters
    for step in range(4, 6):
        set_grads(ours, step)
        set_grads(twin, step)
        opt.step()
        opt_b.step()
    for x, y in zip(ours, twin):
        assert torch.equal(x, y)


def novograd_reference(params, grads_per_step, lr, b1, b2, eps, wd):
    p = [x.detach().double().clone() for x in params]
    m = [torch.zeros_like(x) for x in p]
    v = [None] * len(p)
    for step, grads in enumerate(grads_per_step, start=1):
        bc1, bc2 = 1 - b1 ** step, math.sqrt(1 - b2 ** step)
        for i, gi in enumerate(grads):
            gi = gi.double()
            n = float(gi.norm())
            v[i] = n if v[i] is None else math.sqrt(b2 * v[i] ** 2 + (1 - b2) * n * n)
            m[i] = b1 * m[i] + (1 - b1) * gi
            p[i] = p[i] - lr * ((m[i] / bc1) / (v[i] / bc2 + eps) + wd * p[i])
    return p


def test_fused_novograd_matches_float64():
    ours = make_params()
    opt = FusedNovoGrad(ours, lr=1e-2, weight_decay=0.01)
    all_grads = []
    for step in range(STEPS):
        set_grads(ours, step)
        all_grads.append([p.grad.clone() for p in ours])
        opt.step()
    ref = novograd_reference(make_params(), all_grads, 1e-2, 0.9, 0.999, 1e-8, 0.01)
    close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("cls,kwargs", [(FusedAdam, {}), (FusedSGD, {"lr": 0.1, "momentum": 0.9}),
                                        (FusedLAMB, {}), (FusedNovoGrad, {}),
                                        (FusedAdagrad, {})])
def test_state_dict_round_trip_resumes_identically(cls, kwargs):
    a = make_params()
    opt_a = cls(a, **kwargs)
    for step in range(3):
        set_grads(a, step)
        opt_a.step()
    saved = copy.deepcopy(opt_a.state_dict())
    b = [p.detach().clone().requires_grad_() for p in a]
    opt_b = cls(b, **kwargs)
    opt_b.load_state_dict(saved)
    for step in range(3, 6):
        set_grads(a, step)
        set_grads(b, step)
        opt_a.step()
        opt_b.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_fairseq_style_subclass_calls_amp_C_directly():
    """fairseq's FusedAdamV2 reads multi_tensor_adam, _dummy_overflow_buf and adam_w_mode, and
    steps fp32 copies of fp16 parameters itself."""

    class FusedAdamV2(FusedAdam):
        def step(self, closure=None):
            for group in self.param_groups:
                group["step"] = group.get("step", 0) + 1
                g, p32, m, v, p16 = [], [], [], [], []
                for p in group["params"]:
                    state = self.state[p]
                    if not state:
                        state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32)
                        state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32)
                    g.append(p.grad.float())
                    p32.append(p.data.float())
                    m.append(state["exp_avg"])
                    v.append(state["exp_avg_sq"])
                    p16.append(p)
                beta1, beta2 = group["betas"]
                multi_tensor_applier(self.multi_tensor_adam, self._dummy_overflow_buf,
                                     [g, p32, m, v], group["lr"], beta1, beta2, group["eps"],
                                     group["step"], self.adam_w_mode, group["bias_correction"],
                                     group["weight_decay"])
                for q16, q32 in zip(p16, p32):
                    q16.data.copy_(q32)

    ours = make_params(torch.float16)
    ref = [p.detach().float().clone().requires_grad_() for p in ours]
    opt = FusedAdamV2(ours, lr=1e-3)
    peer = torch.optim.AdamW(ref, lr=1e-3, weight_decay=0.0)
    for step in range(5):
        set_grads(ref, step)
        for p, r in zip(ours, ref):
            p.grad = r.grad.half()
        opt.step()
        peer.step()
        with torch.no_grad():
            for r, p in zip(ref, ours):
                r.copy_(p.float())
    close(ours, [r.half() for r in ref], rtol=1e-3, atol=1e-4)


def test_bad_input_clear_messages_and_nothing_changes():
    p = make_params()
    with pytest.raises(RuntimeError, match="does not support the AMSGrad variant"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(RuntimeError, match="Master weights is currently only supported"):
        FusedAdam(p, master_weights=True)
    with pytest.raises(ValueError, match=r"betas\[0\] must be in \[0, 1\)"):
        FusedAdam(p, betas=(1.0, 0.9))
    # No lr at all (torch's and apex's `required` rule: per-group lrs alone are fine).
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD(p)
    opt = FusedAdam(p)
    with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
        opt.step(grads=[1])
    set_grads(p, 0)
    p[1].grad = p[1].grad.to_sparse()
    before = [x.detach().clone() for x in p]
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, p))
    d = torch.zeros(3, dtype=torch.float64, requires_grad=True)
    d.grad = torch.ones(3, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="expected float32, float16 or bfloat16"):
        FusedAdam([d]).step()
    # A momentum-less FusedSGD skips nothing and needs no buffers; a bad lr is refused.
    with pytest.raises(ValueError, match="invalid learning rate: -1"):
        FusedSGD(p, lr=-1)


def test_zero_grad_follows_set_grad_none():
    p = make_params()
    set_grads(p, 0)
    FusedAdam(p).zero_grad()
    assert p[0].grad is None
    set_grads(p, 0)
    FusedSGD(p, lr=0.1).zero_grad()  # apex's FusedSGD: set_grad_none=False
    assert p[0].grad is not None and not p[0].grad.any()


def test_grad_scaler_unscale_then_clip_then_step():
    """scaler.unscale_(opt), clipping, scaler.step(opt): the gradients are not unscaled twice."""
    ours = make_params()
    ref = [p.detach().clone().requires_grad_() for p in ours]
    opt = FusedAdam(ours, lr=0.1, eps=1e-2)
    peer = torch.optim.AdamW(ref, lr=0.1, eps=1e-2, weight_decay=0.0)
    s_ours = torch.amp.GradScaler("cpu", init_scale=1024.0)
    s_ref = torch.amp.GradScaler("cpu", init_scale=1024.0)
    for step in range(4):
        for params, opt_, scaler in ((ours, opt, s_ours), (ref, peer, s_ref)):
            scaler.scale(torch.ones(()))
            set_grads(params, step, scale=scaler.get_scale())
            scaler.unscale_(opt_)
            torch.nn.utils.clip_grad_norm_(params, 5.0)
            scaler.step(opt_)
            scaler.update()
    close(ours, ref)


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-2),
    lambda ps: FusedAdam(ps, lr=1e-2, capturable=True, master_weights=True),
    lambda ps: FusedLAMB(ps, lr=1e-2),
    lambda ps: FusedSGD(ps, lr=1e-2, momentum=0.9),
    lambda ps: FusedAdagrad(ps, lr=1e-2),
    lambda ps: FusedNovoGrad(ps, lr=1e-2),
])
def test_half_params_resume_from_state_dict(make):
    """torch's load_state_dict casts state to each parameter's dtype; the fused optimizers keep
    their state fp32 (the kernels write it as fp32): a resumed optimizer steps as the original."""
    torch.manual_seed(5)
    params = [torch.nn.Parameter(torch.randn(33).bfloat16()), torch.nn.Parameter(torch.randn(4, 5))]

    def grads(k):
        g = torch.Generator().manual_seed(k)
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(p.dtype)

    opt = make(params)
    for k in range(2):
        grads(k)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    snapshot = [p.detach().clone() for p in params]
    grads(2)
    opt.step()
    expected = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p, s in zip(params, snapshot):
            p.copy_(s)
    resumed = make(params)
    resumed.load_state_dict(saved)
    for st in resumed.state.values():
        for v in st.values():
            if torch.is_tensor(v) and v.is_floating_point():
                assert v.dtype == torch.float32
    grads(2)
    resumed.step()
    for p, e in zip(params, expected):
        assert torch.equal(p.detach(), e)


def test_state_of_another_dtype_is_refused():
    """The kernels keep optimizer state in fp32: a bf16 moment is refused, not written past."""
    p = [torch.ones(4, dtype=torch.bfloat16)]
    with pytest.raises(RuntimeError, match="exp_avgs must be float32"):
        _ops.ops.multi_tensor_adam(torch.zeros(1), [torch.ones(4, dtype=torch.bfloat16)], p,
                                   [torch.zeros(4, dtype=torch.bfloat16)], [torch.zeros(4)], [],
                                   0.1, 0.9, 0.99, 1e-8, 1, True, True, 0.0)
    assert torch.equal(p[0], torch.ones(4, dtype=torch.bfloat16))


def test_empty_groups_and_groups_added_later():
    """An empty group is skipped (apex does); a group added to a capturable FusedAdam gets its
    step counter."""
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    FusedAdam([{"params": []}, {"params": [p]}], lr=0.1).step()
    FusedSGD([{"params": []}, {"params": [p]}], lr=0.1).step()
    assert p.detach().lt(1).all()
    opt = FusedAdam([torch.nn.Parameter(torch.ones(2))], lr=0.1, capturable=True)
    q = torch.nn.Parameter(torch.ones(2))
    q.grad = torch.ones(2)
    opt.add_param_group({"params": [q]})
    opt.step()
    assert q.detach().lt(1).all() and int(opt.param_groups[-1]["step"]) == 1
