"""Code written for NVIDIA apex, as it calls the package: FusedSGD with per-group learning rates
only, amp.initialize(cast_model_type=False), _amp_state.allow_incoming_model_not_fp32,
apex.parallel.LARC, apex.fp16_utils and the legacy amp.init(). Each checked against torch or a
float64 loop."""
import copy
import math

import pytest
import torch
import torch.nn.functional as F

from apex import amp
from apex.optimizers import FusedAdagrad, FusedAdam, FusedLAMB, FusedNovoGrad, FusedSGD


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def batch(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(32, 8, generator=g), torch.randint(0, 3, (32,), generator=g)


def test_fused_sgd_takes_per_group_learning_rates_without_a_default():
    model = small_model()
    ref = copy.deepcopy(model)
    groups = [{"params": model[0].parameters(), "lr": 0.1},
              {"params": model[2].parameters(), "lr": 0.05}]
    ref_groups = [{"params": ref[0].parameters(), "lr": 0.1},
                  {"params": ref[2].parameters(), "lr": 0.05}]
    opt = FusedSGD(groups, momentum=0.9)
    ref_opt = torch.optim.SGD(ref_groups, momentum=0.9)
    for s in range(5):
        x, y = batch(s)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            F.cross_entropy(m(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    # A group without its own lr, with no default: torch's message.
    with pytest.raises(ValueError, match="required optimization parameter lr"):
        FusedSGD([{"params": small_model().parameters()}])


@pytest.mark.parametrize("cls", [FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad, FusedSGD])
@pytest.mark.parametrize("arg", ["lr", "eps", "weight_decay"])
def test_nan_hyperparameters_are_refused(cls, arg):
    if cls is FusedSGD and arg == "eps":
        pytest.skip("FusedSGD has no eps")
    kwargs = {"lr": 0.1, arg: float("nan")}
    with pytest.raises(ValueError):
        cls(small_model().parameters(), **kwargs)


def test_cast_model_type_false_keeps_the_model_fp32():
    for level in ("O2", "O3"):
        model = small_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = amp.initialize(model, opt, opt_level=level, cast_model_type=False,
                                    verbosity=0)
        assert all(p.dtype == torch.float32 for p in model.parameters())
        x, y = batch(0)
        loss = F.cross_entropy(model(x), y)
        assert loss.dtype == torch.float32
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_allow_incoming_model_not_fp32():
    model = small_model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(RuntimeError, match="incoming model parameters must be float32"):
        amp.initialize(model, opt, opt_level="O2", verbosity=0)
    amp._amp_state.allow_incoming_model_not_fp32 = True
    try:
        model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
        x, y = batch(1)
        with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
            scaled.backward()
        opt.step()
    finally:
        amp._amp_state.allow_incoming_model_not_fp32 = False


def test_legacy_amp_init_names_initialize():
    with pytest.raises(RuntimeError, match=r"amp.initialize\(model, optimizer"):
        amp.init()


def larc_reference(params, grads, lr, momentum, weight_decay, trust, clip, eps, bufs):
    """LARC + SGD(momentum) in float64, one step, written from the formula."""
    out = []
    for i, (p, g) in enumerate(zip(params, grads)):
        p, g = p.double(), g.double()
        pn, gn = p.norm(), g.norm()
        factor = 1.0
        if pn != 0 and gn != 0:
            local = trust * pn / (gn + pn * weight_decay + eps)
            factor = min(local / lr, 1.0) if clip else local
        d = (g + weight_decay * p) * factor
        bufs[i] = d if bufs[i] is None else momentum * bufs[i] + d
        out.append(p - lr * bufs[i])
    return out


@pytest.mark.parametrize("clip", [True, False])
def test_larc_matches_a_float64_loop(clip):
    from apex.parallel.LARC import LARC  # the import path real code uses
    model = small_model(3)
    base = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)
    opt = LARC(base, trust_coefficient=0.02, clip=clip)
    params = [p.detach().double().clone() for p in model.parameters()]
    bufs = [None] * len(params)
    for s in range(4):
        x, y = batch(10 + s)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        grads = [p.grad.detach().double().clone() for p in model.parameters()]
        params = larc_reference(params, grads, 0.1, 0.9, 1e-3, 0.02, clip, 1e-8, bufs)
        # The reference steps from the model's own fp32 weights, as the optimizer does.
        opt.step()
        for p, r in zip(model.parameters(), params):
            torch.testing.assert_close(p.double(), r, rtol=1e-5, atol=1e-6)
        params = [p.detach().double().clone() for p in model.parameters()]
        assert base.param_groups[0]["weight_decay"] == 1e-3  # restored after the step
    assert opt.param_groups is base.param_groups
    assert "momentum_buffer" in opt.state_dict()["state"][0]


def test_fp16_utils_helpers():
    from apex.fp16_utils import (master_params_to_model_params, model_grads_to_master_grads,
                                 network_to_half, prep_param_lists, to_python_float)
    assert to_python_float(torch.tensor([2.5])) == 2.5
    assert to_python_float(3) == 3.0
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
    half = network_to_half(copy.deepcopy(net), torch.bfloat16)
    assert half[1][0].weight.dtype == torch.bfloat16
    assert half[1][1].weight.dtype == torch.float32  # BatchNorm stays fp32
    assert half(torch.randn(4, 8)).dtype == torch.bfloat16  # fp32 input cast on the way in
    model = small_model().to(torch.bfloat16)
    for flat in (False, True):
        model_params, masters = prep_param_lists(model, flat_master=flat)
        assert all(m.dtype == torch.float32 and m.requires_grad for m in masters)
        x, y = batch(2)
        model.zero_grad()
        F.cross_entropy(model(x.to(torch.bfloat16)).float(), y).backward()
        model_grads_to_master_grads(model_params, masters, flat_master=flat)
        if flat:
            want = torch.cat([p.grad.float().reshape(-1) for p in model_params])
            torch.testing.assert_close(masters[0].grad, want, rtol=0, atol=0)
        else:
            for p, m in zip(model_params, masters):
                torch.testing.assert_close(m.grad, p.grad.float(), rtol=0, atol=0)
        with torch.no_grad():
            for m in masters:
                m.add_(0.5)
        master_params_to_model_params(model_params, masters, flat_master=flat)
        if flat:
            torch.testing.assert_close(torch.cat([p.float().reshape(-1) for p in model_params]),
                                       masters[0].detach().to(torch.bfloat16).float())
        else:
            for p, m in zip(model_params, masters):
                assert torch.equal(p, m.detach().to(torch.bfloat16))


def test_fp16_optimizer_trains_like_fp32_masters_and_skips_overflow():
    from apex.fp16_utils import FP16_Optimizer
    model = small_model(5)
    ref = copy.deepcopy(model)
    model.half()
    with pytest.warns(DeprecationWarning):
        FP16_Optimizer._warned = False
        opt = FP16_Optimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                             dynamic_loss_scale=True,
                             dynamic_loss_args={"init_scale": 2.0 ** 10, "scale_window": 3},
                             verbose=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for s in range(6):
        x, y = batch(20 + s)
        opt.zero_grad()
        loss = F.cross_entropy(model(x.half()).float(), y)
        if s == 2:
            loss = loss * float("inf")
        opt.backward(loss)
        before = [m.detach().clone() for m in opt.fp32_from_fp16_groups[0]]
        opt.step()
        if s == 2:
            assert opt.overflow
            assert opt.loss_scale == 2.0 ** 9
            assert all(torch.equal(a, m) for a, m in zip(before, opt.fp32_from_fp16_groups[0]))
            continue
        # The fp32 reference takes the half model's gradients (the masters' inputs) in fp32.
        ref_opt.zero_grad()
        for r, p in zip(ref.parameters(), model.parameters()):
            r.grad = p.grad.float() / (2.0 ** 10 if s < 2 else 2.0 ** 9) if p.grad is not None \
                else None
        with torch.no_grad():
            for r, m in zip(ref.parameters(), before):
                r.copy_(m)
        ref_opt.step()
        for r, m, p in zip(ref.parameters(), opt.fp32_from_fp16_groups[0], model.parameters()):
            torch.testing.assert_close(m, r, rtol=1e-6, atol=1e-7)
            assert torch.equal(p, m.detach().half())
    assert math.isclose(opt.loss_scale, 2.0 ** 10)  # grew back after 3 clean steps
    state = opt.state_dict()
    fresh = FP16_Optimizer(torch.optim.SGD(small_model(9).half().parameters(), lr=0.1),
                           verbose=False)
    fresh.load_state_dict(state)
    assert fresh.loss_scale == opt.loss_scale
    for a, b in zip(fresh.fp32_from_fp16_groups[0], opt.fp32_from_fp16_groups[0]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("level", ["O2", "O3"])
def test_half_model_state_dict_is_fp32_and_loads_into_an_fp32_model(level):
    model = small_model(7)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = batch(3)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    sd = model.state_dict()
    assert all(v.dtype == torch.float32 for v in sd.values())
    # The values are the half weights, widened exactly.
    for (k, v), p in zip(sd.items(), model.parameters()):
        assert torch.equal(v, p.detach().float()), k
    plain = small_model(0)
    plain.load_state_dict(sd)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), model(x).float(), rtol=2e-2, atol=2e-2)
    # And back into the half model (load_state_dict casts), unchanged.
    model.load_state_dict(sd)
    for (k, v), p in zip(sd.items(), model.parameters()):
        assert p.dtype == torch.bfloat16 and torch.equal(v, p.detach().float()), k


class ChannelsLastNet(torch.nn.Module):
    """LeNet-like, with a 1-channel input conv (weight [6, 1, 5, 5]) and a depthwise conv
    (weight [6, 1, 3, 3]): channels-last training gives their weights' gradients strides that
    differ from the parameters' only on the size-1 dimension."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 6, 5)
        self.depthwise = torch.nn.Conv2d(6, 6, 3, groups=6, padding=1)
        self.conv2 = torch.nn.Conv2d(6, 8, 3)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.relu(self.depthwise(x))
        x = F.relu(self.conv2(x))
        return self.fc(x.mean((2, 3)))


@pytest.mark.parametrize("autocast", [False, True])
def test_channels_last_gradients_are_accepted_and_match_torch_adam(autocast):
    torch.manual_seed(0)
    model = ChannelsLastNet()  # contiguous weights, channels-last input (the case)
    ref = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-3)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    g = torch.Generator().manual_seed(1)
    seen_odd_strides = False
    for step in range(100):
        x = torch.randn(4, 1, 9, 9, generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 3, (4,), generator=g)
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, ref_scaler)):
            o.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = F.cross_entropy(m(x).float(), y)
            s.scale(loss).backward()
            if m is model:
                for w in (model.conv1.weight, model.depthwise.weight):
                    seen_odd_strides |= w.grad.stride() != w.stride()
            s.step(o)
            s.update()
    # fp32 channels-last convolutions give such gradients; under autocast the weights' gradients
    # come back through the cast to bf16, contiguous, and the run checks the values only.
    assert seen_odd_strides or autocast, "the case this test is about did not occur"
    # fp32: the two Adams differ by fp32 rounding only. Under bf16 autocast those last-bit
    # differences flip bf16 roundings of the forward, and 100 steps amplify them to ~1e-3 (a
    # gradient left scaled, or skipped, would be off by the step size itself, ~1e-1).
    tol = dict(rtol=2e-2, atol=2e-3) if autocast else dict(rtol=1e-4, atol=1e-5)
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_later_loss_does_not_report_an_earlier_losss_overflow(level):
    """Two losses on one optimizer, the first overflowing: only its scaler backs off (apex checks
    the incoming gradients only), and the step is skipped once."""
    model = small_model(11)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=torch.float16,
                                num_losses=2, verbosity=0)
    scalers = amp._amp_state.loss_scalers
    for scaler in scalers:
        scaler._loss_scale = 2.0 ** 10  # as apex users set it; 2^16 overflows fp16 here at once
    x, y = batch(4)
    for s in range(3):
        opt.zero_grad()
        loss0 = F.cross_entropy(model(x), y)
        if s == 1:
            loss0 = loss0 * float("inf")
        with amp.scale_loss(loss0, opt, loss_id=0) as scaled:
            scaled.backward()
        with amp.scale_loss(F.cross_entropy(model(x), y) * 0.5, opt, loss_id=1) as scaled:
            scaled.backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert changed == (s != 1), s
    assert scalers[0].loss_scale() == 2.0 ** 9
    assert scalers[1].loss_scale() == 2.0 ** 10


def test_o1_loss_outside_the_model_is_fp32():
    """apex's O1: F.cross_entropy & co. run in fp32 wherever they are called; the model's own
    output stays half (autocast's)."""
    model = small_model(12)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.bfloat16,
                                verbosity=0)
    x, y = batch(5)
    out = model(x)
    assert out.dtype == torch.bfloat16
    for loss in (F.cross_entropy(out, y), torch.nn.CrossEntropyLoss()(out, y),
                 F.mse_loss(out, torch.zeros_like(out)), F.log_softmax(out, 1)):
        assert loss.dtype == torch.float32
    torch.testing.assert_close(F.cross_entropy(out, y), F.cross_entropy(out.float(), y))
    # O2 is not O1: no patching effect there (the model returns fp32 anyway).
    model2 = small_model(12)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1)
    amp.initialize(model2, opt2, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    assert F.mse_loss(out, torch.zeros_like(out)).dtype == torch.bfloat16


def _snapshot(opt):
    out = []
    for g in opt.param_groups:
        out.append({k: (v.clone() if torch.is_tensor(v) else copy.deepcopy(v))
                    for k, v in g.items() if k != "params"})
        out.extend(p.detach().clone() for p in g["params"])
    for st in opt.state.values():
        out.extend(v.clone() if torch.is_tensor(v) else v for v in st.values())
    return out


def _same(a, b):
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if torch.is_tensor(x):
            if not torch.equal(x, y):
                return False
        elif x != y:
            return False
    return True


@pytest.mark.parametrize("make", [
    lambda ps: FusedAdam(ps, lr=1e-2),
    lambda ps: FusedSGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    lambda ps: FusedLAMB(ps, lr=1e-2),
    lambda ps: FusedNovoGrad(ps, lr=1e-2),
    lambda ps: FusedAdagrad(ps, lr=1e-2),
])
@pytest.mark.parametrize("bad", ["shape", "dtype", "transposed", "sparse"])
def test_a_refused_step_changes_nothing(make, bad):
    torch.manual_seed(0)
    a = [torch.randn(4, 5, requires_grad=True), torch.randn(3, requires_grad=True)]
    b = [torch.randn(5, 4).t().contiguous().requires_grad_(True), torch.randn(6, requires_grad=True)]
    opt = make([{"params": a}, {"params": b}])
    for p in a + b:
        p.grad = torch.randn_like(p)
    opt.step()  # state exists now
    for p in a + b:
        p.grad = torch.randn_like(p)
    # torch refuses such gradients on assignment; .data swaps (as code that casts or reshapes
    # parameters by hand does) get them past it.
    if bad == "shape":
        b[1].data = torch.randn(7)
    elif bad == "dtype":
        b[1].grad.data = torch.ones(6, dtype=torch.float64)
    elif bad == "transposed":
        b[0].grad.data = torch.randn(5, 4).t()  # [4, 5], in the other memory order
    else:
        b[1].grad = torch.randn(6).to_sparse()
    before = _snapshot(opt)
    with pytest.raises(RuntimeError):
        opt.step()
    assert _same(_snapshot(opt), before), "a refused step changed the optimizer"


def test_amp_C_refuses_mixed_devices_before_writing():
    import amp_C
    flag = torch.zeros(1, dtype=torch.int)
    src = [torch.randn(5), torch.randn(3, device="meta")]
    dst = [torch.zeros(5), torch.zeros(3)]
    with pytest.raises(RuntimeError, match=r"tensor_lists\[0\]\[1\] is on meta but "
                                           r"tensor_lists\[0\]\[0\] is on cpu"):
        amp_C.multi_tensor_scale(2048, flag, [src, dst], 2.0)
    with pytest.raises(RuntimeError, match="every tensor of one call must be on one device"):
        amp_C.multi_tensor_l2norm(2048, flag, [src])
    assert torch.equal(dst[0], torch.zeros(5))


@pytest.mark.parametrize("kwargs, message", [
    (dict(min_loss_scale=8.0, max_loss_scale=4.0), "min_loss_scale (8.0) must be <= max_loss"),
    (dict(max_loss_scale=float("nan")), "max_loss_scale must be a finite number > 0, got nan"),
    (dict(max_loss_scale=0), "max_loss_scale must be a finite number > 0, got 0"),
    (dict(max_loss_scale=-1.0), "max_loss_scale must be a finite number > 0, got -1.0"),
    (dict(min_loss_scale=float("inf")), "min_loss_scale must be a finite number > 0"),
    (dict(cast_model_outputs=torch.int64), "cast_model_outputs must be a floating dtype"),
])
def test_amp_initialize_validates_before_changing_anything(kwargs, message):
    model = small_model(13)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step, zero_grad = opt.step, opt.zero_grad
    with pytest.raises(RuntimeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        amp.initialize(model, opt, opt_level="O2", verbosity=0, **kwargs)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert not hasattr(opt, "_amp_stash") and opt.step == step and opt.zero_grad == zero_grad


def test_amp_load_state_dict_validates_masters_first():
    model = small_model(14)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O2", verbosity=0)
    x, y = batch(6)
    with amp.scale_loss(F.cross_entropy(model(x), y), opt) as scaled:
        scaled.backward()
    opt.step()
    state = amp.state_dict()
    scale_before = amp._amp_state.loss_scalers[0].loss_scale()
    masters_before = [m.clone() for m in amp.master_params(opt)]
    bad = copy.deepcopy(state)
    bad["loss_scaler0"]["loss_scale"] = 8.0
    bad["master_params"][0][0] = torch.zeros(bad["master_params"][0][0].shape, dtype=torch.int32)
    with pytest.raises(RuntimeError, match=r"master_params\[0\]\[0\] is a torch.int32 tensor"):
        amp.load_state_dict(bad)
    assert amp._amp_state.loss_scalers[0].loss_scale() == scale_before
    assert all(torch.equal(a, b) for a, b in zip(masters_before, amp.master_params(opt)))


def test_load_state_dict_checks_before_replacing_and_reads_torch_adamw():
    model = small_model(15)
    opt = FusedAdam(model.parameters(), lr=1e-2)
    x, y = batch(7)
    F.cross_entropy(model(x), y).backward()
    opt.step()
    good = copy.deepcopy(opt.state_dict())
    before = _snapshot(opt)
    # A moment of the wrong shape, another optimizer's state, a foreign object: clear errors,
    # nothing replaced.
    wrong = copy.deepcopy(good)
    wrong["state"][0]["exp_avg"] = torch.zeros(3)
    # state_dict's checksum refuses an edited tensor first; without it (apex's own files, or a
    # deliberate edit) the shape check does.
    with pytest.raises(ValueError, match="does not match its checksum"):
        opt.load_state_dict(wrong)
    assert _same(_snapshot(opt), before)
    del wrong["apex_crc32"]
    sgd = FusedSGD(small_model(15).parameters(), lr=0.1, momentum=0.9)
    F.cross_entropy(small_model(15)(x), y)
    for p in sgd.param_groups[0]["params"]:
        p.grad = torch.randn_like(p)
    sgd.step()
    for bad, message in ((wrong, r"'exp_avg' of parameter 0 is torch.float32 \(3,\), expected"),
                         (sgd.state_dict(), "holds 'momentum_buffer', which FusedAdam does not"),
                         ({"weights": 1}, "expected an optimizer state dict")):
        with pytest.raises(ValueError, match=message):
            opt.load_state_dict(bad)
        assert _same(_snapshot(opt), before)
    # torch.optim.AdamW's own state (step per parameter) converts: the next steps are equal.
    ref_model = small_model(15)
    fused_model = copy.deepcopy(ref_model)
    ref = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    for s in range(3):
        ref.zero_grad()
        F.cross_entropy(ref_model(*batch(20 + s)[:1]), batch(20 + s)[1]).backward()
        ref.step()
    with torch.no_grad():
        for a, b in zip(fused_model.parameters(), ref_model.parameters()):
            a.copy_(b)
    fused = FusedAdam(fused_model.parameters(), lr=1e-2)
    fused.load_state_dict(copy.deepcopy(ref.state_dict()))  # torch shares the tensors
    assert fused.param_groups[0]["step"] == 3
    for s in range(3, 6):
        xb, yb = batch(20 + s)
        for m, o in ((ref_model, ref), (fused_model, fused)):
            o.zero_grad()
            F.cross_entropy(m(xb), yb).backward()
            o.step()
    for a, b in zip(fused_model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_overlapping_parameters_are_refused_before_any_change():
    base = torch.randn(10, requires_grad=True)
    a = base[:6].detach().requires_grad_(True)   # views of one storage, overlapping at 4..5
    b = base[4:].detach().requires_grad_(True)
    opt = FusedAdam([a, b], lr=1e-2)
    a.grad, b.grad = torch.randn(6), torch.randn(6)
    before = base.detach().clone()
    with pytest.raises(RuntimeError, match="parameter 1 of group 0 shares memory with parameter 0 "
                                           "of group 0"):
        opt.step()
    assert torch.equal(base.detach(), before) and not opt.state
    # Disjoint views of one storage are fine.
    c = base[:5].detach().requires_grad_(True)
    d = base[5:].detach().requires_grad_(True)
    opt2 = FusedSGD([c, d], lr=0.1)
    c.grad, d.grad = torch.ones(5), torch.ones(5)
    opt2.step()
    torch.testing.assert_close(base.detach(), before - 0.1)
