"""apex.amp: apex's README example at every opt level converging like fp32, overflow injection
skipping exactly those steps, state_dict round trips, the private names real code touches."""
import copy
import functools

import pytest
import torch
import torch.nn.functional as F

from apex import amp
from apex.optimizers import FusedAdam


def blobs(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(3, 16, generator=torch.Generator().manual_seed(7)) * 2
    y = torch.randint(0, 3, (n,), generator=g)
    return centers[y] + torch.randn(n, 16, generator=g), y


def model_and_opt(seed=0, fused=False):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32),
                                torch.nn.ReLU(), torch.nn.Linear(32, 3))
    opt = (FusedAdam(model.parameters(), lr=1e-2) if fused
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, opt


def train(model, opt, steps=60, use_amp=True, inject=()):
    x, y = blobs()
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if use_amp:
            with amp.scale_loss(loss, opt) as scaled_loss:
                scaled_loss.backward()
                if step in inject:
                    next(model.parameters()).grad[0, 0] = float("inf")
        else:
            loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("opt_level", ["O0", "O1", "O2", "O3"])
@pytest.mark.parametrize("fused", [False, True])
def test_readme_example_converges_like_fp32(opt_level, fused):
    ref_model, ref_opt = model_and_opt(fused=fused)
    ref = train(ref_model, ref_opt, use_amp=False)
    model, opt = model_and_opt(fused=fused)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    losses = train(model, opt)
    assert losses[-1] < 0.25 * losses[0]
    assert abs(losses[-1] - ref[-1]) < 0.1 + 0.2 * ref[-1], (losses[-1], ref[-1])
    if opt_level in ("O2", "O3"):
        assert model[0].weight.dtype == torch.bfloat16  # the CPU's default half type
        assert model[1].weight.dtype == (torch.float32 if opt_level == "O2" else torch.bfloat16)
    if opt_level == "O2":
        masters = list(amp.master_params(opt))
        assert all(m.dtype == torch.float32 for m in masters)
    if opt_level == "O0":
        assert losses == ref  # O0 is plain fp32 training


def test_overflow_skips_exactly_those_steps_fp16():
    model, opt = model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    scaler = amp._amp_state.loss_scalers[0]
    assert scaler.dynamic and scaler.loss_scale() == 2.0 ** 16
    x, y = blobs()
    for step in range(6):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        before = [p.detach().clone() for p in model.parameters()]
        masters = [m.detach().clone() for m in amp.master_params(opt)]
        scale = scaler.loss_scale()
        with amp.scale_loss(loss, opt) as scaled_loss:
            scaled_loss.backward()
            if step in (2, 4):
                model[0].weight.grad[0, 0] = float("inf")
        opt.step()
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        same_masters = all(torch.equal(a, b) for a, b in zip(masters, amp.master_params(opt)))
        if step in (2, 4):
            assert same and same_masters, step
            assert scaler.loss_scale() == scale / 2
        else:
            assert not same, step


def test_state_dict_round_trip_with_masters():
    model, opt = model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    train(model, opt, steps=5, inject=(1,))
    state = copy.deepcopy(amp.state_dict())
    assert state["loss_scaler0"]["loss_scale"] == 2.0 ** 15
    assert "master_params" in state
    # The masters of the half parameters (fp32 ones, batchnorm's, are the model's own).
    saved_masters = [m.detach().clone() for m in opt._amp_stash.all_fp32_from_fp16_params]
    model2, opt2 = model_and_opt(seed=5)
    model2, opt2 = amp.initialize(model2, opt2, opt_level="O2", half_dtype=torch.float16,
                                  verbosity=0)
    amp.load_state_dict(state)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0 ** 15
    for a, b, half in zip(saved_masters, opt2._amp_stash.all_fp32_from_fp16_params,
                          opt2._amp_stash.all_fp16_params):
        assert torch.equal(a, b)
        assert torch.equal(half, a.half())  # and the model follows its masters
    bad = copy.deepcopy(state)
    bad["loss_scaler0"]["loss_scale"] = 3.4e38
    with pytest.raises(RuntimeError, match="outside"):
        amp.load_state_dict(bad)
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0 ** 15


def test_private_loss_scale_is_writable():
    # NVIDIA's DLE BERT: amp._amp_state.loss_scalers[0]._loss_scale = 2**20
    model, opt = model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16,
                                verbosity=0)
    amp._amp_state.loss_scalers[0]._loss_scale = 2 ** 20
    loss = torch.tensor(1.5, requires_grad=True)
    with amp.scale_loss(loss, opt) as scaled:
        assert scaled.item() == 1.5 * 2 ** 20


def test_gradient_accumulation_with_delay_unscale():
    model, opt = model_and_opt()
    ref_model, ref_opt = model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O1", half_dtype=torch.float16,
                                loss_scale=128.0, verbosity=0)
    x, y = blobs()
    opt.zero_grad()
    ref_opt.zero_grad()
    for i, (xs, ys) in enumerate(((x[:128], y[:128]), (x[128:], y[128:]))):
        with amp.scale_loss(F.cross_entropy(model(xs), ys), opt, delay_unscale=i == 0) as s:
            s.backward()
        F.cross_entropy(ref_model(xs), ys).backward()
    for p, r in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=2e-3)


def test_bad_input_messages():
    model, opt = model_and_opt()
    with pytest.raises(RuntimeError, match="Unexpected optimization level 'O4'"):
        amp.initialize(model, opt, opt_level="O4")
    with pytest.raises(RuntimeError, match="letter O, not the number zero"):
        amp.initialize(model, opt, opt_level="00")
    with pytest.raises(RuntimeError, match="It doesn't make sense to use master_weights with O1"):
        amp.initialize(model, opt, opt_level="O1", master_weights=True)
    with pytest.raises(RuntimeError, match="must be float32"):
        amp.initialize(model.half(), opt, opt_level="O2")


def test_accumulation_keeps_gradients_a_later_scope_does_not_reach():
    """Scope 1 reaches A and B, scope 2 only A: B keeps scope 1's gradient (apex restores it)."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    (a, b), opt = amp.initialize([a, b], opt, opt_level="O1", half_dtype=torch.float16,
                                 loss_scale=128.0, verbosity=0)
    x = torch.randn(2, 4)
    opt.zero_grad()
    with amp.scale_loss((a(x).sum() + b(x).sum()).float(), opt) as s:
        s.backward()
    a_grad, b_grad = a.weight.grad.clone(), b.weight.grad.clone()
    with amp.scale_loss(a(x).sum().float(), opt) as s:
        s.backward()
    assert b.weight.grad is not None and torch.equal(b.weight.grad, b_grad)
    # A accumulates: the same input twice, so twice the first scope's gradient.
    torch.testing.assert_close(a.weight.grad, 2 * a_grad, rtol=1e-3, atol=1e-3)


def test_o2_training_recovers_after_a_skipped_step():
    """A huge loss overflows once: the step is skipped, the masters' overflowed gradients are
    dropped, and training goes on with finite weights (apex's skip clears them too)."""
    model, opt = model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O2", half_dtype=torch.float16,
                                verbosity=0)
    x, y = blobs()
    for step in range(4):
        loss = F.cross_entropy(model(x), y) * (1e30 if step == 0 else 1.0)
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()
        model.zero_grad()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert amp._amp_state.loss_scalers[0].loss_scale() == 2.0 ** 15


# ---- half matmuls through fp32 on CPUs without fast ones (apex.amp.cpu_half_fallback) -----------

@pytest.fixture
def forced_fallback():
    """The fp32 route made available whatever this CPU's half path (tests only), then decided
    from the CPU again."""
    ops = torch.ops.apex_cpp
    ops._cpu_half_fallback_force(1)
    yield
    ops._cpu_half_fallback_force(-1)


@pytest.mark.regular_ops
def test_cpu_half_fallback_decided_per_dtype(forced_fallback):
    """Each half dtype has its own decision (forced on here: both); either one makes the scope
    available; other dtypes are refused with the one expected."""
    assert amp.cpu_half_fallback_available(torch.bfloat16)
    assert amp.cpu_half_fallback_available(torch.float16)
    torch.ops.apex_cpp._cpu_half_fallback_force(-1)
    per = [amp.cpu_half_fallback_available(t) for t in (torch.bfloat16, torch.float16)]
    assert amp.cpu_half_fallback_available() == any(per)
    with pytest.raises(ValueError, match="expected torch.bfloat16 or torch.float16, got torch.float32"):
        amp.cpu_half_fallback_available(torch.float32)


@pytest.mark.regular_ops
def test_cpu_half_fallback_scope(forced_fallback):
    """On in its thread while open (nested, through exceptions), off outside and in other
    threads; the covered ops give torch's fp32 result on the widened inputs, rounded once."""
    import threading
    assert amp.cpu_half_fallback_available()
    assert not amp.cpu_half_fallback_active()
    g = torch.Generator().manual_seed(0)
    # The products' inputs multiples of 1/8 in [-1, 1], so that every sum is exact in fp32 and
    # apex's product (its own summation order) equals torch's fp32 product bit for bit.
    a = (torch.randint(-8, 9, (37, 70), generator=g) / 8).bfloat16()
    b = (torch.randint(-8, 9, (70, 23), generator=g) / 8).bfloat16()
    w = torch.randn(8, 3, 3, 3, generator=g).half()
    img = torch.randn(2, 3, 9, 9, generator=g).half()
    seen = []
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    with amp.cpu_half_fallback():
        assert amp.cpu_half_fallback_active()
        with amp.cpu_half_fallback():
            assert amp.cpu_half_fallback_active()
        assert amp.cpu_half_fallback_active()
        t = threading.Thread(target=lambda: seen.append(amp.cpu_half_fallback_active()))
        t.start()
        t.join()
        before = calls()
        mm = a @ b
        routed = calls() - before
        lin = F.linear(a, b.t())
        conv = F.conv2d(img, w, padding=1)
    assert seen == [False]
    # The route computed the product (its thread's counter); outside the scope it does not.
    assert routed == 1
    before = calls()
    a @ b
    assert calls() == before
    assert not amp.cpu_half_fallback_active()
    torch.testing.assert_close(mm, (a.float() @ b.float()).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(lin, F.linear(a.float(), b.t().float()).bfloat16(), rtol=0, atol=0)
    torch.testing.assert_close(conv, F.conv2d(img.float(), w.float(), padding=1).half(),
                               rtol=0, atol=0)
    with pytest.raises(ValueError):
        with amp.cpu_half_fallback():
            raise ValueError("inside")
    assert not amp.cpu_half_fallback_active()
    with amp.cpu_half_fallback(enabled=False):
        assert not amp.cpu_half_fallback_active()
    torch.ops.apex_cpp._cpu_half_fallback_force(0)  # APEX_CPU_HALF_FALLBACK=0: a no-op
    with amp.cpu_half_fallback():
        assert not amp.cpu_half_fallback_active()
    with pytest.raises(RuntimeError, match="no scope of this thread is open"):
        torch.ops.apex_cpp.cpu_half_fallback_exit()


@pytest.mark.regular_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_fallback_in_place_and_out_variants(forced_fallback, dtype):
    """addbmm, the in-place products and out= take the route too (fairseq's ConvTBC is addmm_ on
    slices; torch's MultiheadAttention fast path writes products into out=): torch's fp32 result
    on the widened inputs, rounded once; out= resized as torch resizes it."""
    g = torch.Generator().manual_seed(2)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    b1, b2, c, m1, m2 = r(3, 5, 8), r(3, 8, 2), r(5, 2), r(5, 8), r(8, 2)
    w = lambda t: t.float()  # noqa: E731
    want = {
        "addbmm": torch.addbmm(w(c), w(b1), w(b2), beta=0.5, alpha=2.0),
        "addmm_": w(c).addmm_(w(m1), w(m2), alpha=0.5),
        "mm out": torch.mm(w(m1), w(m2)),
        "bmm out": torch.bmm(w(b1), w(b2)),
    }
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    prod = b1 @ b2
    out_mm, out_bmm = torch.empty(0, dtype=dtype), torch.empty(3, 5, 2, dtype=dtype)
    ops = {
        "addbmm": lambda: torch.addbmm(c, b1, b2, beta=0.5, alpha=2.0),
        "addmm_": lambda: c.clone().addmm_(m1, m2, alpha=0.5),
        "baddbmm_": lambda: prod.clone().baddbmm_(b1, b2),
        "mm out": lambda: torch.mm(m1, m2, out=out_mm),
        "bmm out": lambda: torch.bmm(b1, b2, out=out_bmm),
        "conv_tbc": lambda: torch.conv_tbc(r(9, 5, 2), r(3, 2, 4), r(4), 1),
    }
    want["baddbmm_"] = w(prod).baddbmm_(w(b1), w(b2))
    for k, op in ops.items():
        with amp.cpu_half_fallback():
            before = calls()
            got = op()
            assert calls() > before, f"{k} was left to torch's half kernel"
        assert got.dtype == dtype
        if k in want:
            torch.testing.assert_close(got, want[k].to(dtype), rtol=0, atol=0, msg=k)
    assert out_mm.shape == (5, 2) and ops["mm out"]() is out_mm


@pytest.mark.regular_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_fallback_conv1d(forced_fallback, dtype):
    """1-D convolutions (wav2vec 2.0's feature encoder: stride 2; its grouped, padded positional
    convolution; a vocoder's transposed upsampling; a 1x1 2-D one): the route's result and
    gradients equal torch's fp32 ones rounded once. Values multiples of 1/8, so every fp32 sum is
    exact in any order and the comparison is bit for bit."""
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return (torch.randint(-8, 9, shape, generator=g) / 8).to(dtype)

    conv, up = F.conv1d, F.conv_transpose1d
    cases = [
        (conv, r(3, 32, 101), r(32, 32, 3), None, dict(stride=2)),
        (conv, r(2, 64, 49), r(64, 16, 5), r(64), dict(padding=2, groups=4)),
        (conv, r(2, 1, 400), r(16, 1, 10), None, dict(stride=5)),
        (up, r(2, 32, 40), r(32, 16, 8), r(16), dict(stride=4, padding=2)),
        (F.conv2d, r(2, 32, 6, 6), r(32, 32, 1, 1), r(32), {}),  # 1x1: over H * W
    ]
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    for fn, x, w, b, kw in cases:
        leaves = [t.requires_grad_() for t in (x, w, b) if t is not None]
        refs = [t.detach().float().requires_grad_() for t in leaves]
        with amp.cpu_half_fallback():
            before = calls()
            y = fn(*leaves, **kw)
            assert calls() > before
            gy = r(*y.shape)
            y.backward(gy)
        want = fn(*refs, **kw)
        want.backward(gy.float())
        assert y.dtype == dtype
        torch.testing.assert_close(y, want.to(dtype), rtol=0, atol=0)
        for t, ref in zip(leaves, refs):
            torch.testing.assert_close(t.grad, ref.grad.to(dtype), rtol=0, atol=0)


@pytest.mark.regular_ops
def test_cpu_half_fallback_lstm_gru(forced_fallback):
    """nn.LSTM/nn.GRU/nn.RNN cast to bf16 run as the fp32 layer on the widened values in the scope
    (torch steps through them in bf16, tens of times slower), outputs rounded once, gradients
    reaching the half weights; on packed sequences too."""
    torch.manual_seed(4)
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    relu_rnn = functools.partial(torch.nn.RNN, nonlinearity="relu")
    for cls in (torch.nn.LSTM, torch.nn.GRU, torch.nn.RNN, relu_rnn):
        half = cls(6, 5, num_layers=2, batch_first=True).bfloat16()
        ref = copy.deepcopy(half).float()
        x = torch.randn(3, 7, 6).bfloat16()
        with amp.cpu_half_fallback():
            before = calls()
            y = half(x)[0]
            assert calls() > before
            y.float().sum().backward()
        want = ref(x.float())[0]
        want.sum().backward()
        assert y.dtype == torch.bfloat16
        torch.testing.assert_close(y, want.bfloat16(), rtol=0, atol=0)
        for p, q in zip(half.parameters(), ref.parameters()):
            torch.testing.assert_close(p.grad, q.grad.bfloat16(), rtol=0, atol=0)
        # Packed sequences (variable lengths) likewise.
        pack = torch.nn.utils.rnn.pack_padded_sequence
        with amp.cpu_half_fallback():
            got = half(pack(x, [7, 4, 2], batch_first=True))[0].data
        want = ref(pack(x.float(), [7, 4, 2], batch_first=True))[0].data
        torch.testing.assert_close(got, want.bfloat16(), rtol=0, atol=0)


@pytest.mark.regular_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_fallback_matrix_vector(forced_fallback, dtype):
    """mv, addmv (its in-place and out= forms), matmul of a matrix and a vector, and products
    with a few rows (a small-batch linear, up to 64) take the route: the matrix read in place by
    apex's vector kernels (torch's own bf16 addmv is ~4x its fp32 one on AVX2), the fp32 result
    on the same values rounded once, to one unit in the last place (the kernels sum in another
    order than torch's fp32 one)."""
    g = torch.Generator().manual_seed(5)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    def q(*shape):  # multiples of 1/8 in [-1, 1]: every product and sum exact in fp32
        return (torch.randint(-8, 9, shape, generator=g) / 8).to(dtype)

    m, v, s = r(300, 700), r(700), r(300)
    mq, sq, x, x2 = q(300, 700), q(300), q(31, 700), q(31, 300)
    w = lambda t: t.float()  # noqa: E731
    out = torch.empty(0, dtype=dtype)
    cases = {
        "mv": (lambda: torch.mv(m, v), torch.mv(w(m), w(v))),
        "mv transposed": (lambda: torch.mv(m.t(), v[:300]), torch.mv(w(m).t(), w(v[:300]))),
        "addmv": (lambda: torch.addmv(s, m, v, beta=0.5, alpha=2.0),
                  torch.addmv(w(s), w(m), w(v), beta=0.5, alpha=2.0)),
        "addmv_": (lambda: s.clone().addmv_(m, v), w(s).addmv_(w(m), w(v))),
        "addmv out": (lambda: torch.addmv(s, m, v, out=out), torch.addmv(w(s), w(m), w(v))),
        "matmul": (lambda: m @ v, w(m) @ w(v)),
        "linear 31 rows (matrix by rows)": (lambda: torch.nn.functional.linear(x, mq, sq),
                                            torch.nn.functional.linear(w(x), w(mq), w(sq))),
        "mm 31 rows (matrix by columns)": (lambda: x2 @ mq, w(x2) @ w(mq)),
    }
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    for k, (op, want) in cases.items():
        with amp.cpu_half_fallback():
            before = calls()
            got = op()
            assert calls() > before, f"{k} was left to torch's half kernel"
        assert got.dtype == dtype and got.shape == want.shape, k
        off = (_ordinal(got) - _ordinal(want.to(dtype))).abs().max().item()
        assert off <= 1, f"{k}: {off} units from fp32 rounded once"
    assert out.shape == (300,)


@pytest.mark.regular_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_fallback_half_plus_fp32_bias(forced_fallback, dtype):
    """`y += bias` of a half y and an fp32 bias (how LibTorch's C++ Linear adds its bias at O1)
    takes the route's one-pass kernel: the same values as torch's widen-add-round; other
    broadcasts are torch's."""
    g = torch.Generator().manual_seed(6)
    y = torch.randn(3, 5, 700, generator=g).to(dtype)
    bias, col = torch.randn(700, generator=g), torch.randn(5, 1, generator=g)
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    for other, alpha, taken in ((bias, 1.0, True), (bias, 0.5, True), (col, 1.0, False)):
        want = y.clone().add_(other, alpha=alpha)
        got = y.clone()
        with amp.cpu_half_fallback():
            before = calls()
            got.add_(other, alpha=alpha)
            assert (calls() > before) == taken
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def _ordinal(t):
    """Each 16-bit float's position on the number line (neighbours differ by one, -0 == +0)."""
    b = t.view(torch.int16).to(torch.int32)
    return torch.where(b < 0, -(b & 0x7FFF), b)


@pytest.mark.regular_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_fallback_gelu(forced_fallback, dtype):
    """GELU of half tensors in the scope: every finite value within one unit in the last place of
    float64's x * Phi(x) (torch's own half kernel is not, in the negative tail), and its backward
    through autograd as the library computes it."""
    import math
    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    want = torch.tensor([v * 0.5 * math.erfc(-v / math.sqrt(2)) for v in x.double().tolist()],
                        dtype=torch.float64)
    finite = torch.isfinite(want)
    xr = x.clone().requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    with amp.cpu_half_fallback():
        y = F.gelu(xr)
        y.backward(g)
        dx = torch.ops.aten.gelu_backward(g, x)
    off = (_ordinal(y.detach()) - _ordinal(want.to(dtype))).abs()
    assert off[finite].max().item() <= 1
    torch.testing.assert_close(y.detach()[~finite].double(), want[~finite], equal_nan=True)
    torch.testing.assert_close(xr.grad, dx, rtol=0, atol=0, equal_nan=True)


@pytest.mark.regular_ops
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_half_fallback_silu(forced_fallback, dtype):
    """SiLU of half tensors in the scope (nn.SiLU, in place too): every finite value within one
    unit in the last place of float64's x * sigmoid(x), its backward through autograd as the
    library computes it."""
    import math

    def silu64(v):
        if math.isnan(v) or v == -math.inf:
            return math.nan
        return v / (1 + math.exp(-v)) if v > -700 else -0.0

    x = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    want = torch.tensor([silu64(v) for v in x.double().tolist()], dtype=torch.float64)
    finite = torch.isfinite(want)
    xr = x.clone().requires_grad_()
    g = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(dtype)
    calls = torch.ops.apex_cpp._cpu_half_route_calls
    with amp.cpu_half_fallback():
        before = calls()
        y = torch.nn.SiLU()(xr)
        y.backward(g)
        dx = torch.ops.aten.silu_backward(g, x)
        in_place = torch.nn.SiLU(inplace=True)(x.clone())
        assert calls() >= before + 4
    off = (_ordinal(y.detach()) - _ordinal(want.to(dtype))).abs()
    assert off[finite].max().item() <= 1
    torch.testing.assert_close(xr.grad, dx, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(in_place.view(torch.int16), y.detach().view(torch.int16))


@pytest.mark.regular_ops
@pytest.mark.parametrize("opt_level", ["O1", "O2"])
def test_amp_computes_through_fp32_where_half_is_slow(forced_fallback, opt_level):
    """apex.amp opens the scope around the patched forward and the backward in scale_loss, and
    trains as without it."""
    model, opt = model_and_opt(fused=True)
    model, opt = amp.initialize(model, opt, opt_level=opt_level, verbosity=0)
    during = []
    model[0].register_forward_hook(lambda *_: during.append(("forward",
                                                             amp.cpu_half_fallback_active())))
    model[0].weight.register_hook(lambda g: during.append(("backward",
                                                           amp.cpu_half_fallback_active())))
    losses = train(model, opt, steps=40)
    assert ("forward", True) in during and ("backward", True) in during
    assert all(active for _, active in during), during
    assert not amp.cpu_half_fallback_active()
    assert losses[-1] < 0.25 * losses[0]


def test_bench_amp_area_runs():
    """`python -m apex.bench --only amp` (issue 19's measurement from Python) runs and reports
    O1 and O2 against O0."""
    import json

    from apex import bench
    model, opt = model_and_opt()
    model, opt = amp.initialize(model, opt, opt_level="O1", verbosity=0)
    before = dict(amp._amp_state.__dict__)
    rows = []
    bench.bench_amp(1, 0, rows)  # not bench.main: it would change this process's malloc settings
    assert [r["case"].split()[0] for r in rows] == ["O1", "O2"]
    assert all(r["ours_ms"] > 0 and r["peer_ms"] > 0 for r in rows)
    assert amp._amp_state.__dict__ == before  # the caller's amp state is back
    assert json.dumps(rows)


def _run_fresh(script, **env):
    """script in a new process (the route's kernels and GELU tables are set up once per process),
    with `env` added to this one's environment."""
    import os
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                       env={**os.environ, **env})
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.regular_ops
def test_amp_initialize_registers_the_route_at_setup():
    """apex.amp.initialize at O1 on a CPU model puts the route's kernels into the dispatcher at
    once, not on the first forward (torch's dispatcher is not safe to change while other threads
    call the same ops); O0 does not."""
    out = _run_fresh("""
import torch
from apex import amp
torch.ops.apex_cpp._cpu_half_fallback_force(1)
ours = lambda: "amp/cpu_half/scope.cpp" in torch._C._dispatch_dump("aten::mm")
before = ours()
amp.initialize(torch.nn.Linear(4, 4), opt_level="O0", verbosity=0)
after_o0 = ours()
amp.initialize(torch.nn.Linear(4, 4), opt_level="O1", verbosity=0)
print(before, after_o0, ours())
""")
    assert out.split() == ["False", "False", "True"]


@pytest.mark.regular_ops
@pytest.mark.parametrize("limit", ["AVX2", "AVX512_CORE"])
def test_cpu_half_route_follows_onednn_isa_limit(limit):
    """torch sends bf16 matmuls to oneDNN on AVX-512 CPUs even when ONEDNN_MAX_CPU_ISA holds it
    to AVX2, where it multiplies them tens of times slower than fp32, or to AVX512_CORE, where it
    emulates bf16 below fp32's speed (as on Skylake to Ice Lake servers): the route is decided on
    then (on every CPU the route has kernels for), and O1 takes it."""
    flags = set()
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    if not {"avx2", "fma", "f16c"} <= flags:
        pytest.skip("the route's kernels need AVX2, FMA and F16C")
    if "APEX_CPU_HALF_FALLBACK" in __import__("os").environ:
        pytest.skip("APEX_CPU_HALF_FALLBACK set: the decision is forced")
    out = _run_fresh("""
import torch
from apex import amp
ours = lambda: "amp/cpu_half/scope.cpp" in torch._C._dispatch_dump("aten::mm")
amp.initialize(torch.nn.Linear(4, 4), opt_level="O1", verbosity=0)
print(amp.cpu_half_fallback_available(torch.bfloat16), ours())
""", ONEDNN_MAX_CPU_ISA=limit)
    assert out.split() == ["True", "True"]


@pytest.mark.regular_ops
def test_cpu_half_gelu_tables_ignore_flush_to_zero():
    """GELU's tables built on a thread that flushes subnormals to zero (torch.set_flush_denormal)
    still hold the subnormal results: they serve every thread afterwards."""
    out = _run_fresh("""
import torch
from apex import amp
torch.ops.apex_cpp._cpu_half_fallback_force(1)
# bf16 subnormals with an even last bit: gelu(x) rounds to exactly x / 2
bits = [0x0010, 0x0020, 0x8040, 0x0002, 0x807E]
x = torch.tensor([b - 0x10000 if b & 0x8000 else b for b in bits],
                 dtype=torch.int16).view(torch.bfloat16)
assert torch.set_flush_denormal(True)
with amp.cpu_half_fallback():
    torch.nn.functional.gelu(x)  # the table is built here, under flush-to-zero
torch.set_flush_denormal(False)
with amp.cpu_half_fallback():
    y = torch.nn.functional.gelu(x)
assert torch.equal(y.view(torch.int16), (x.double() / 2).to(torch.bfloat16).view(torch.int16)), y
assert (y != 0).all()
print("ok")
""")
    assert "ok" in out


@pytest.mark.regular_ops
def test_cpu_half_attention_masks(forced_fallback):
    """A floating mask of another half dtype than the query is refused as torch refuses it; a
    broadcast (expanded) mask gives the result of the same mask materialised."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 3, 5, 8, generator=g).bfloat16() for _ in range(3))
    attn = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    bad = torch.zeros(5, 5, dtype=torch.float16)
    with pytest.raises(RuntimeError):
        attn(q, k, v, attn_mask=bad)
    with amp.cpu_half_fallback():
        assert amp.cpu_half_fallback_active()
        with pytest.raises(RuntimeError):
            attn(q, k, v, attn_mask=bad)
        mask = torch.randn(1, 1, 5, 5, generator=g).bfloat16()
        expanded = attn(q, k, v, attn_mask=mask.expand(2, 3, 5, 5))
        full = attn(q, k, v, attn_mask=mask.expand(2, 3, 5, 5).contiguous())
    for a, b in zip(expanded, full):
        assert torch.equal(a, b)


def test_delay_unscale_accumulation_over_iterations():
    """apex's accumulation pattern, delay_unscale=(k + 1) % accumulate != 0, over several
    iterations: the same parameters as fp32 training with summed gradients."""
    import copy
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    model, opt = amp.initialize(model, opt, opt_level="O0", loss_scale="dynamic", verbosity=0)
    for _ in range(3):
        for k in range(2):
            x = torch.randn(5, 4)
            with amp.scale_loss(model(x).square().mean(), opt, delay_unscale=k == 0) as s:
                s.backward()
            ref(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    for a, b in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(a, b)


def _o2(model, lr=0.1, loss_scale=128.0):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    return amp.initialize(model, opt, opt_level="O2", loss_scale=loss_scale, verbosity=0,
                          half_dtype=torch.bfloat16)


def test_o2_masters_do_not_pile_up_under_model_zero_grad():
    """Code that zeroes the model's gradients (model.zero_grad(), as HF's apex path does) trains as
    code that zeroes the optimizer's: the masters' gradients are cleared by step, as apex did."""
    import copy
    torch.manual_seed(1)
    base = torch.nn.Linear(4, 2)
    x = torch.randn(6, 4)
    results = []
    for zero in ("model", "optimizer"):
        model, opt = _o2(copy.deepcopy(base))
        for _ in range(3):
            with amp.scale_loss(model(x.bfloat16()).float().square().mean(), opt) as s:
                s.backward()
            opt.step()
            (model if zero == "model" else opt).zero_grad()
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        assert torch.equal(a, b)


def test_o2_trains_the_weights_loaded_after_initialize():
    """apex built its masters at the first backward, so initialize-then-load_state_dict trains
    the loaded weights (a step with lr 0 leaves them as loaded)."""
    torch.manual_seed(2)
    model, opt = _o2(torch.nn.Linear(4, 2), lr=0.0)
    loaded = {"weight": torch.full((2, 4), 0.25), "bias": torch.full((2,), 7.0)}
    model.load_state_dict(loaded)
    with amp.scale_loss(model(torch.randn(3, 4).bfloat16()).float().sum(), opt) as s:
        s.backward()
    opt.step()
    assert torch.equal(model.bias.float(), loaded["bias"])
    assert torch.equal(model.weight.float(), loaded["weight"])


def test_o2_param_group_added_after_initialize():
    """A group added after initialize gets fp32 masters and unscaled gradients too."""
    torch.manual_seed(3)
    model, opt = _o2(torch.nn.Linear(4, 2), lr=1.0, loss_scale=128.0)
    extra = torch.nn.Parameter(torch.tensor([1.0, 2.0]).bfloat16())
    opt.add_param_group({"params": [extra]})
    master = opt.param_groups[-1]["params"][0]
    assert master.dtype == torch.float32 and master is not extra
    c = torch.tensor([0.5, -0.25])
    with amp.scale_loss((extra.float() * c).sum() + model(torch.randn(2, 4).bfloat16()).sum(),
                        opt) as s:
        s.backward()
    assert torch.equal(master.grad, c)  # unscaled
    opt.step()
    assert torch.equal(extra.float(), torch.tensor([0.5, 2.25]))


@pytest.mark.regular_ops
def test_cpu_half_scope_serves_attention_where_half_matmuls_are_fast():
    """On a CPU whose half matmuls LibTorch runs fast (AVX512-BF16 and AVX512-FP16, AMX: forced
    here), the route is off but attention's own kernels serve the scope, as in C++: Python's
    scope used to open only for the route, so amp on such CPUs never got them."""
    ops = torch.ops.apex_cpp
    calls = ops._cpu_half_route_calls
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 64, 32, generator=g).bfloat16() for _ in range(3))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float())
    ops._cpu_half_fallback_force(2)
    try:
        with amp.cpu_half_fallback():
            assert amp.cpu_half_fallback_active()
            before = calls()
            a = torch.randn(40, 40, generator=g).bfloat16()
            torch.mm(a, a)  # not the route's: LibTorch's own half matmul
            assert calls() == before
            out = F.scaled_dot_product_attention(q, k, v)
            assert calls() > before  # attention's own kernels took it
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
    finally:
        ops._cpu_half_fallback_force(-1)


@pytest.mark.parametrize("half_dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_python_opt_level_table_is_the_cpp_one(level, half_dtype):
    """apex.amp's table (frontend._LEVELS) and the C++ library's (amp::Properties::resolve)
    resolve every level alike; apex's None ("does not apply") is C++'s false."""
    from apex import _ops
    from apex.amp import frontend
    if _ops.STABLE:
        pytest.skip("the table is the regular op library's")
    cpp = dict(line.split(":", 1) for line in
               torch.ops.apex_cpp._amp_level_defaults(level, half_dtype).splitlines())
    cpp = {k.strip(): v.strip() for k, v in cpp.items()}
    p = frontend._resolve(level, True, half_dtype, {})
    names = {torch.float32: "Float", torch.float16: "Half", torch.bfloat16: "BFloat16"}
    assert cpp["cast_model_type"] == (names[p.cast_model_type] if p.cast_model_type else "None")
    assert cpp["patch_torch_functions"] == str(bool(p.patch_torch_functions))
    assert cpp["keep_batchnorm_fp32"] == str(bool(p.keep_batchnorm_fp32))
    assert cpp["master_weights"] == str(bool(p.master_weights))
    if p.loss_scale == "dynamic":
        assert cpp["loss_scale"] == "dynamic"
    else:
        assert float(cpp["loss_scale"]) == float(p.loss_scale)
