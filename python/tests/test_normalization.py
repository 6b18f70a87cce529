"""apex.normalization against torch.nn.functional.layer_norm and a float64 RMSNorm, forward and
backward; memory_efficient; the mixed variants; apex's functional defaults; torch.compile."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from apex.normalization import (FusedLayerNorm, FusedRMSNorm, MixedFusedLayerNorm,
                                MixedFusedRMSNorm)
from apex.normalization import fused_layer_norm as fln

TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-2), torch.float16: (1e-3, 1e-3)}


def rms_reference(x, w, eps):
    x64 = x.double()
    y = x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)
    return y * w.double() if w is not None else y


def inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g) * 2 + 0.5).to(dtype).requires_grad_()
    w = (torch.rand(shape[-1:], generator=g) + 0.5).requires_grad_()
    b = torch.randn(shape[-1:], generator=g).requires_grad_()
    dy = torch.randn(shape, generator=g).to(dtype)
    return x, w, b, dy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4, 7), (3, 5, 1024), (2, 300)])
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_layer_norm_matches_torch(dtype, shape, memory_efficient):
    x, w, b, dy = inputs(shape, dtype)
    m = FusedLayerNorm(shape[-1], memory_efficient=memory_efficient)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)
    y = m(x)
    assert y.dtype == dtype
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    br = b.detach().double().requires_grad_()
    yr = F.layer_norm(xr, shape[-1:], wr, br, 1e-5)
    yr.backward(dy.double())
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), yr, rtol=rtol, atol=atol)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=rtol, atol=atol * 10)
    torch.testing.assert_close(m.weight.grad.double(), wr.grad, rtol=rtol, atol=atol * 100)
    torch.testing.assert_close(m.bias.grad.double(), br.grad, rtol=rtol, atol=atol * 100)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_float64(dtype):
    x, w, _, dy = inputs((6, 768), dtype)
    m = FusedRMSNorm(768, eps=1e-6)
    with torch.no_grad():
        m.weight.copy_(w)
    assert [n for n, _ in m.named_parameters()] == ["weight"]  # T5 checkpoints load with one key
    y = m(x)
    y.backward(dy)
    xr = x.detach().double().requires_grad_()
    wr = w.detach().double().requires_grad_()
    yr = rms_reference(xr, wr, 1e-6)
    yr.backward(dy.double())
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(y.double(), yr, rtol=rtol, atol=atol)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=rtol, atol=atol * 10)
    torch.testing.assert_close(m.weight.grad.double(), wr.grad, rtol=rtol, atol=atol * 100)


def test_mixed_variants_return_the_parameters_dtype():
    x, w, b, _ = inputs((4, 64), torch.bfloat16)
    ln = MixedFusedLayerNorm(64)
    assert ln(x).dtype == torch.float32
    rms = MixedFusedRMSNorm(64)
    assert rms(x).dtype == torch.float32
    with pytest.raises(RuntimeError, match="does not support `elementwise_affine = False`"):
        with pytest.warns(UserWarning):
            MixedFusedLayerNorm(64, elementwise_affine=False)


def test_functional_forms_keep_apex_defaults_and_signatures():
    # eps 1e-6 in the functional forms (the modules' is 1e-5).
    assert inspect.signature(fln.fused_layer_norm_affine).parameters["eps"].default == 1e-6
    assert inspect.signature(fln.fused_rms_norm).parameters["eps"].default == 1e-6
    # Megatron checks whether memory_efficient is a parameter of the Function's forward.
    assert "memory_efficient" in inspect.getfullargspec(
        fln.FusedLayerNormAffineFunction.forward).args
    x, w, b, dy = inputs((5, 33), torch.float32)
    y = fln.FusedLayerNormAffineFunction.apply(x, w, b, (33,), 1e-5, False)
    y.backward(dy)
    xr, wr, br = (t.detach().clone().requires_grad_() for t in (x, w, b))
    F.layer_norm(xr, (33,), wr, br, 1e-5).backward(dy)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.grad, wr.grad, rtol=1e-5, atol=1e-4)
    y2 = fln.FusedRMSNormAffineFunction.apply(x.detach(), w.detach(), (33,), 1e-5)
    torch.testing.assert_close(y2.double(), rms_reference(x.detach(), w.detach(), 1e-5),
                               rtol=1e-5, atol=1e-5)


def test_autocast_casts_like_apex():
    x, w, b, _ = inputs((4, 64), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fln.fused_layer_norm_affine(x, w, b, (64,))
    assert y.dtype == torch.bfloat16


def test_gradcheck_in_float64():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    w = torch.rand(8, dtype=torch.float64, requires_grad=True)
    b = torch.randn(8, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: fln.fused_layer_norm_affine(*a, (8,), 1e-5),
                                    (x, w, b))
    assert torch.autograd.gradcheck(lambda *a: fln.fused_rms_norm_affine(*a, (8,), 1e-5), (x, w))


def test_torch_compile_traces_without_graph_breaks():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), FusedLayerNorm(32), torch.nn.GELU(),
                                FusedRMSNorm(32))
    x = torch.randn(4, 32)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    y = compiled(x)
    torch.testing.assert_close(y, model(x))
    y.sum().backward()
    assert model[1].weight.grad is not None


@pytest.mark.regular_ops
@pytest.mark.parametrize("memory_efficient", [False, True])
def test_eager_and_traced_routes_agree(memory_efficient):
    """Eager calls record the C++ library's autograd node (kernels called directly); traced ones
    (torch.compile, fake tensors) the ops' own through the dispatcher. Same values and gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 32), FusedLayerNorm(32, memory_efficient=memory_efficient),
        torch.nn.GELU(), FusedRMSNorm(32, memory_efficient=memory_efficient),
        MixedFusedLayerNorm(32))
    x = torch.randn(6, 32)
    y = model(x)
    assert y.grad_fn.name() == "FusedLayerNormBackward"  # the library's node
    y.square().sum().backward()
    eager = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    yc = compiled(x)
    torch.testing.assert_close(yc, y, rtol=0, atol=0)
    yc.square().sum().backward()
    for p, g in zip(model.parameters(), eager):
        torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)


def test_module_autocast_casts_like_apex():
    """The modules' op casts under autocast as apex's functional forms do: input and parameters to
    the autocast dtype, the norm without autocast; the fp32 parameters get fp32 gradients."""
    m = FusedLayerNorm(64)
    x = torch.randn(4, 64, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
    assert y.dtype == torch.bfloat16
    ref = torch.nn.functional.layer_norm(x.detach().bfloat16(), (64,), m.weight.detach().bfloat16(),
                                         m.bias.detach().bfloat16(), 1e-5)
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2)
    y.float().sum().backward()
    assert m.weight.grad.dtype == torch.float32 and x.grad.dtype == torch.float32
    y2 = m(x)  # autocast off again: fp32
    assert y2.dtype == torch.float32


_COMPILED_AUTOGRAD = """
import torch
from torch._dynamo import compiled_autograd
from apex.normalization import FusedLayerNorm, FusedRMSNorm
from apex.normalization.fused_layer_norm import FusedLayerNormAffineFunction
class ByFunction(torch.nn.Module):  # Megatron's call: apex's Function
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(16) + 0.5)
        self.b = torch.nn.Parameter(torch.randn(16))
    def forward(self, x):
        return FusedLayerNormAffineFunction.apply(x, self.w, self.b, (16,), 1e-5)
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(16, 16), FusedLayerNorm(16), ByFunction(),
                        FusedRMSNorm(16))
x = torch.randn(4, 16)
m(x).square().sum().backward()
eager = [p.grad.clone() for p in m.parameters()]
m.zero_grad()
loss = m(x).square().sum()
try:
    with compiled_autograd._enable(torch.compile(backend="eager")):
        loss.backward()
except NotImplementedError as e:
    print("refused:", str(e).splitlines()[0])
    raise SystemExit(0)
for p, g in zip(m.parameters(), eager):
    torch.testing.assert_close(p.grad, g, rtol=1e-6, atol=1e-6)
print("traced")
"""


@pytest.mark.regular_ops
@pytest.mark.parametrize("eager_route", ["1", "0"])
def test_compiled_autograd(eager_route):
    """Compiled autograd traces the modules' traceable route and apex's Functions' own node
    (APEX_NORM_EAGER_AUTOGRAD=0) to the eager gradients; over the library's node (the default) it
    fails saying what to set."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, APEX_NORM_EAGER_AUTOGRAD=eager_route)
    r = subprocess.run([sys.executable, "-c", _COMPILED_AUTOGRAD], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if eager_route == "0":
        assert "traced" in r.stdout, r.stdout
    else:
        assert "refused: FusedRMSNormBackward: compiled autograd cannot trace" in r.stdout, r.stdout
        assert "APEX_NORM_EAGER_AUTOGRAD=0" in r.stdout


def test_double_backward_is_refused_clearly():
    m = FusedLayerNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    (g,) = torch.autograd.grad(m(x).square().sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward is not supported"):
        g.sum().backward()


def test_bad_input_messages():
    m = FusedLayerNorm(16)
    with pytest.raises(RuntimeError, match=r"normalized_shape \[16\] does not match"):
        m(torch.randn(4, 15))
    with pytest.raises(RuntimeError, match="eps must be > 0"):
        fln.fused_layer_norm(torch.randn(2, 4), (4,), eps=0.0)
    with pytest.raises(RuntimeError, match="input must be a floating-point tensor"):
        fln.fused_layer_norm(torch.ones(2, 4, dtype=torch.int64), (4,))


def eager_module():
    """apex._eager: built wherever this Python's headers are (always in CI); skips otherwise."""
    import os
    import sysconfig
    if not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no Python headers here: apex._eager is not built")
    from apex import _eager
    return _eager


def test_without_the_direct_entry(monkeypatch):
    """Built without Python's headers (no apex._eager), modules, functional forms and Functions
    run through torch.ops alone: the same values and gradients."""
    x, w, b, dy = inputs((6, 24), torch.float32)
    m = FusedLayerNorm(24)
    with torch.no_grad():
        m.weight.copy_(w)
        m.bias.copy_(b)

    def run():
        outs = [m(x), fln.fused_rms_norm_affine(x, w, (24,)),
                fln.FusedLayerNormAffineFunction.apply(x, w, b, (24,), 1e-5)]
        return outs + list(torch.autograd.grad(sum((o * dy).sum() for o in outs),
                                               (x, w, b, m.weight)))

    with_entry = run()
    monkeypatch.setattr(fln, "_direct", None)
    monkeypatch.setattr(fln, "_direct_fwd", None)
    without = run()
    for a, c in zip(with_entry, without):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


@pytest.mark.regular_ops
def test_direct_eager_entry_and_its_fallbacks(monkeypatch):
    """Eager module and functional calls enter apex_cpp::fused_norm directly (apex._eager,
    csrc/eager.cpp: no torch.ops argument parsing); what only torch.ops handles goes to the op
    object passed in: tensor subclasses and torch function modes see the op, other argument types
    are converted by it. Same values and gradients either way."""
    _eager = eager_module()
    op = torch.ops.apex_cpp.fused_norm.default
    fallbacks = []

    def counting_op(*args):
        fallbacks.append(args)
        return op(*args)

    x, w, b, dy = inputs((5, 32), torch.float32)
    direct = _eager.fused_norm(counting_op, x, [32], w, b, 1e-5, False, False, False)
    assert not fallbacks
    assert direct.grad_fn.name() == "FusedLayerNormBackward"
    via_op = op(x, [32], w, b, 1e-5, False, False, False)
    torch.testing.assert_close(direct, via_op, rtol=0, atol=0)
    for a, c in zip(torch.autograd.grad(direct, (x, w, b), dy),
                    torch.autograd.grad(via_op, (x, w, b), dy)):
        torch.testing.assert_close(a, c, rtol=0, atol=0)
    # torch.Size and tuple shapes and an int or numpy eps are taken directly; other types fall
    # back.
    import numpy as np
    for shape, eps in ((torch.Size([32]), 1), ((32,), 1e-5), ([32], np.float64(1e-5))):
        y = _eager.fused_norm(counting_op, x, shape, w, None, eps, True, False, False)
        torch.testing.assert_close(y, op(x, [32], w, None, float(eps), True, False, False),
                                   rtol=0, atol=0)
    assert not fallbacks
    y = _eager.fused_norm(counting_op, x, [32], w, b, 1e-5, 1, False, False)  # rms=1: not a bool
    assert len(fallbacks) == 1
    torch.testing.assert_close(y, op(x, [32], w, b, 1e-5, True, False, False), rtol=0, atol=0)
    with pytest.raises(TypeError, match="expected 9 arguments"):
        _eager.fused_norm(op, x)

    # The modules and functional forms go through it.
    calls = []
    monkeypatch.setattr(fln, "_direct", lambda *args: calls.append(args[0]) or _eager.fused_norm(*args))
    FusedRMSNorm(32)(x)
    FusedLayerNorm(32)(x)
    fln.fused_layer_norm_affine(x, w, b, (32,))
    assert calls == [op, op, op]

    # A torch function mode and a tensor subclass with __torch_function__ see the op itself.
    seen = []

    class Mode(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    m = FusedRMSNorm(32)
    with Mode():
        m(x)
    assert op in seen

    class Sub(torch.Tensor):
        calls = []

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.calls.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    ys = m(x.detach().as_subclass(Sub))
    assert op in Sub.calls and type(ys) is Sub
    torch.testing.assert_close(ys.as_subclass(torch.Tensor), m(x.detach()), rtol=0, atol=0)


@pytest.mark.parametrize("name,args", [
    ("FusedLayerNormAffineFunction", "wb"), ("FusedLayerNormAffineMixedDtypesFunction", "wb"),
    ("FusedRMSNormAffineFunction", "w"), ("FusedRMSNormAffineMixedDtypesFunction", "w"),
    ("FusedLayerNormFunction", ""), ("FusedRMSNormFunction", "")])
@pytest.mark.regular_ops
@pytest.mark.parametrize("memory_efficient", [None, False, True])
def test_functions_apply_directly_in_eager_mode(name, args, memory_efficient):
    """apex's Functions' apply calls fused_norm_fwd directly in eager mode (the library's node)
    and gives the Function's own values and gradients (torch.autograd.Function.apply)."""
    cls = getattr(fln, name)
    x, w, b, dy = inputs((6, 40), torch.bfloat16 if "Mixed" in name else torch.float32)
    tensors = [x] + ([w] if "w" in args else []) + ([b] if "b" in args else [])
    rest = [(40,), 1e-5] + ([] if memory_efficient is None else [memory_efficient])
    y = cls.apply(*tensors, *rest)
    # the library's node, not <name>Backward
    assert y.grad_fn.name() == ("FusedRMSNormBackward" if "RMS" in name
                                else "FusedLayerNormBackward")
    ref = torch.autograd.Function.apply.__func__(cls, *tensors, *rest)
    assert ref.grad_fn.name() == name + "Backward"
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    for a, c in zip(torch.autograd.grad(y, tensors, dy), torch.autograd.grad(ref, tensors, dy)):
        torch.testing.assert_close(a, c, rtol=0, atol=0)


def test_functions_apply_keeps_apex_semantics():
    """No autocast cast (apex's Functions have none); a subclass with its own forward, keyword
    arguments and tensor subclasses take the Function itself; torch.compile traces apply."""
    x, w, b, dy = inputs((4, 16), torch.float32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert fln.FusedLayerNormAffineFunction.apply(x, w, b, (16,), 1e-5).dtype == torch.float32
        assert fln.fused_layer_norm_affine(x, w, b, (16,)).dtype == torch.bfloat16

    class Doubled(fln.FusedLayerNormAffineFunction):
        @staticmethod
        def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
            return 2 * fln.FusedLayerNormAffineFunction.forward(
                ctx, input, weight, bias, normalized_shape, eps, memory_efficient)

    y = fln.FusedLayerNormAffineFunction.apply(x, w, b, (16,), 1e-5)
    y2 = Doubled.apply(x, w, b, (16,), 1e-5)
    assert y2.grad_fn.name() == "DoubledBackward"
    torch.testing.assert_close(y2, 2 * y)

    class OwnBackward(fln.FusedLayerNormAffineFunction):  # a subclass takes the Function
        @staticmethod
        def backward(ctx, grad_output):
            return (None,) * 6

    assert OwnBackward.apply(x, w, b, (16,), 1e-5).grad_fn.name() == "OwnBackwardBackward"
    # Keyword arguments go to the Function (torch 2.11's apply refuses them; 2.13's takes them).
    kw = dict(normalized_shape=(16,), eps=1e-5)
    try:
        torch.autograd.Function.apply.__func__(fln.FusedLayerNormAffineFunction, x, w, b, **kw)
    except TypeError:
        with pytest.raises(TypeError):
            fln.FusedLayerNormAffineFunction.apply(x, w, b, **kw)
    else:
        yk = fln.FusedLayerNormAffineFunction.apply(x, w, b, **kw)
        assert yk.grad_fn.name() == "FusedLayerNormAffineFunctionBackward"
        torch.testing.assert_close(yk, y, rtol=0, atol=0)

    def f(x):
        return fln.FusedRMSNormAffineFunction.apply(
            fln.FusedLayerNormAffineFunction.apply(x, w, b, (16,), 1e-5, False), w, (16,), 1e-5)

    assert torch._dynamo.explain(f)(x).graph_break_count == 0
    yc = torch.compile(f, backend="aot_eager", fullgraph=True)(x)
    ye = f(x)
    torch.testing.assert_close(yc, ye)
    for a, c in zip(torch.autograd.grad(yc, (x, w, b), dy), torch.autograd.grad(ye, (x, w, b), dy)):
        torch.testing.assert_close(a, c)


def test_modules_read_their_parameters_as_torch_does():
    """The modules read weight/bias from _parameters directly; a parametrized weight (a property
    in place of the parameter), a replaced parameter and elementwise_affine=False still behave as
    attribute access does."""
    import torch.nn.utils.parametrize as parametrize

    class Double(torch.nn.Module):
        def forward(self, w):
            return 2 * w

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 16, generator=g)
    ln, rms, mixed = FusedLayerNorm(16), FusedRMSNorm(16), MixedFusedLayerNorm(16)
    for m in (ln, rms, mixed):
        parametrize.register_parametrization(m, "weight", Double())
    w2 = 2 * ln.parametrizations.weight.original
    torch.testing.assert_close(ln(x), F.layer_norm(x, (16,), w2, ln.bias, 1e-5))
    torch.testing.assert_close(mixed(x), F.layer_norm(x, (16,), w2, mixed.bias, 1e-5))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w2
    torch.testing.assert_close(rms(x), want)
    plain = FusedLayerNorm(16)
    plain.weight = torch.nn.Parameter(torch.full((16,), 3.0))
    torch.testing.assert_close(plain(x), F.layer_norm(x, (16,), plain.weight, plain.bias, 1e-5))
    bare = FusedLayerNorm(16, elementwise_affine=False)
    torch.testing.assert_close(bare(x), F.layer_norm(x, (16,), None, None, 1e-5))
