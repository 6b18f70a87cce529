"""The stable-ABI op library (_apex_cpp_stable.so, namespace apex_cpp_stable): the same schemas,
results bit for bit and messages as the regular library's multi-tensor ops; the package on it
(APEX_OPS=stable) passing the suite; and the switch to it when the installed torch is not the one
the package was built for."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import apex
from apex import _ops

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(os.path.abspath(apex.__file__))
NAMES = ["multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm",
         "multi_tensor_unscale_l2norm", "multi_tensor_adam", "multi_tensor_sgd",
         "multi_tensor_adagrad", "multi_tensor_lamb", "multi_tensor_novograd", "fused_norm_fwd",
         "fused_norm_bwd", "batch_norm_stats", "batch_norm_elemt", "batch_norm_backward_reduce",
         "batch_norm_backward_elemt"]

torch.ops.load_library(os.path.join(PKG, "_apex_cpp_stable.so"))
_ops._register_multi_tensor_fakes("apex_cpp_stable")
_ops._register_norm_fakes("apex_cpp_stable")
_ops._register_batch_norm_fakes("apex_cpp_stable")
R = torch.ops.apex_cpp
S = torch.ops.apex_cpp_stable


def test_this_run_has_the_regular_library():
    assert not _ops.STABLE and _ops.ops is R


@pytest.mark.parametrize("name", NAMES)
def test_same_schemas(name):
    """Both libraries register the schemas of csrc/schemas.h (one source, so they cannot drift
    apart; this checks that each library registers them, under the op names Python calls)."""
    regular = str(getattr(R, name).default._schema).replace("apex_cpp::", "")
    stable = str(getattr(S, name).default._schema).replace("apex_cpp_stable::", "")
    assert regular == stable
    assert S.cpu_isa() == R.cpu_isa()


def lists(dtype, n_lists, seed, sizes=((1000,), (37, 5), (1,), (70000,))):
    g = torch.Generator().manual_seed(seed)
    return [[torch.randn(s, generator=g).to(dtype) for s in sizes] for _ in range(n_lists)]


def clone(ls):
    return [[t.clone() for t in l] for l in ls]


def both(fn, state):
    """fn(ops, state) on a copy of state per library; the states (and results) after."""
    out = []
    for ops in (R, S):
        s = clone(state)
        res = fn(ops, s)
        out.append((s, res))
    return out


def assert_bit_equal(a, b):
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and a.stride() == b.stride()
        a, b = a.contiguous(), b.contiguous()
        assert torch.equal(a.view(torch.uint8) if a.numel() else a,
                           b.view(torch.uint8) if b.numel() else b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_bit_equal(x, y)
    else:
        assert a == b


def steps(ops, s, call, n=3):
    return [call(ops, s, step) for step in range(1, n + 1)]


CASES = {
    "scale": (3, lambda ops, s, k: ops.multi_tensor_scale(s[2][0].new_zeros(1), s[0], s[1],
                                                           0.5 * k)),
    "axpby": (3, lambda ops, s, k: ops.multi_tensor_axpby(torch.zeros(1, dtype=torch.int32), s[0],
                                                          s[1], s[2], 2.0, -0.5, -1)),
    "l2norm": (1, lambda ops, s, k: ops.multi_tensor_l2norm(torch.zeros(1), s[0], True)),
    "unscale_l2norm": (1, lambda ops, s, k: ops.multi_tensor_unscale_l2norm(
        torch.zeros(1), s[0], torch.tensor([0.25]), k % 2 == 1)),
    "adam": (5, lambda ops, s, k: ops.multi_tensor_adam(
        torch.zeros(1), s[1], s[0], s[2], s[3], [], 1e-2, 0.9, 0.999, 1e-8, k, k % 2 == 1, True,
        0.01, torch.tensor([0.5]), torch.zeros(1))),
    "sgd": (3, lambda ops, s, k: ops.multi_tensor_sgd(
        torch.zeros(1), s[1], s[0], s[2], [], 0.1, 0.9, 0.1, 1e-3, True, k == 1, False, 0.5)),
    "adagrad": (3, lambda ops, s, k: ops.multi_tensor_adagrad(
        torch.zeros(1), s[1], s[0], s[2], [], 0.1, 1e-10, True, 0.01)),
    "lamb": (4, lambda ops, s, k: ops.multi_tensor_lamb(
        torch.zeros(1), s[1], s[0], s[2], s[3], [], 1e-2, 0.9, 0.999, 1e-6, k, True, 0.01, True,
        True, torch.tensor(3.0, dtype=torch.float64), 1.0, False)),
    "novograd": (3, lambda ops, s, k: ops.multi_tensor_novograd(
        torch.zeros(1), s[1], s[0], s[2], [], torch.tensor([1.0, 2.0, 0.5, 4.0]), 1e-2, 0.95,
        0.98, 1e-8, k, True, 0.001, True, False)),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_bit_equal_to_the_regular_library(case, dtype):
    n, call = CASES[case]
    state = lists(dtype, n, seed=len(case))
    if case in ("adam", "lamb", "sgd", "adagrad", "novograd"):
        # Optimizer state is fp32; the parameters and gradients take the dtype.
        for l in range(2, n):
            state[l] = [t.float().abs() for t in state[l]]
    (rs, rr), (ss, sr) = both(lambda ops, s: steps(ops, s, call), state)
    assert_bit_equal(rs, ss)
    assert_bit_equal(rr, sr)


@pytest.mark.parametrize("master_dtype", [torch.bfloat16, torch.float16])
def test_bit_equal_with_fp32_masters(master_dtype):
    p, g = lists(master_dtype, 2, seed=7)
    master = [t.float() for t in p]
    m = [torch.zeros_like(t) for t in master]
    v = [torch.zeros_like(t) for t in master]

    def run(ops, s):
        for k in range(1, 4):
            ops.multi_tensor_adam(torch.zeros(1), s[1], s[0], s[2], s[3], s[4], 1e-2, 0.9, 0.999,
                                  1e-8, k, True, True, 0.01)

    (rs, _), (ss, _) = both(run, [p, g, m, v, master])
    assert_bit_equal(rs, ss)


@pytest.mark.parametrize("dtype,param_dtype", [(torch.float32, torch.float32),
                                               (torch.bfloat16, torch.bfloat16),
                                               (torch.float16, torch.float16),
                                               (torch.bfloat16, torch.float32),
                                               (torch.float16, torch.float32)])
@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("memory_efficient", [False, True])
@pytest.mark.parametrize("shape", [(7, 33), (2, 3, 256), (0, 16)])
def test_norms_bit_equal_to_the_regular_library(dtype, param_dtype, rms, memory_efficient, shape):
    g = torch.Generator().manual_seed(11)
    cols = shape[-1]
    x = torch.randn(shape, generator=g).to(dtype)
    w = (torch.randn(cols, generator=g) + 1.5).to(param_dtype)
    b = None if rms else torch.randn(cols, generator=g).to(param_dtype)
    mixed = param_dtype != dtype
    x_t = x.transpose(0, 1) if len(shape) == 3 else x  # a non-contiguous input too
    outs = []
    for ops in (R, S):
        y, mean, rstd = ops.fused_norm_fwd(x_t, [cols], w, b, 1e-5, rms, mixed, memory_efficient)
        dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype)
        saved = y if memory_efficient else x_t
        grads = ops.fused_norm_bwd(dy, saved, mean, rstd, w, b, [cols], 1e-5, rms, mixed,
                                   memory_efficient, dtype, [True, True, not rms])
        partial = ops.fused_norm_bwd(dy, saved, mean, rstd, w, b, [cols], 1e-5, rms, mixed,
                                     memory_efficient, dtype, [False, True, False])
        outs.append((y, mean, rstd, grads, partial))
    assert_bit_equal(outs[0], outs[1])


def bn_input(shape, dtype, layout):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last if x.dim() == 4
                         else torch.channels_last_3d)
    elif layout == "transposed":
        x = x.transpose(0, -1)
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,layout", [((6, 3), "nc"), ((4, 5, 7), "nc"), ((3, 4, 6, 5), "nc"),
                                          ((3, 4, 6, 5), "channels_last"),
                                          ((2, 3, 4, 5, 6), "channels_last"),
                                          ((5, 4, 6, 5), "transposed"), ((0, 4, 3, 3), "nc"),
                                          ((1, 8, 1, 1), "channels_last")])
def test_batch_norm_bit_equal_to_the_regular_library(dtype, shape, layout):
    x = bn_input(shape, dtype, layout)
    c = x.shape[1]
    g = torch.Generator().manual_seed(3)
    dy = torch.randn(x.shape, generator=g).to(dtype)
    mean64 = torch.randn(c, generator=g, dtype=torch.float64)
    a, b, k = (torch.randn(c, generator=g) for _ in range(3))
    outs = []
    for ops in (R, S):
        y = ops.batch_norm_elemt(x, mean64.float(), a, k)
        dx = ops.batch_norm_backward_elemt(dy, x, mean64.float(), a, b, k)
        outs.append((ops.batch_norm_stats(x), y, y.stride(), ops.batch_norm_backward_reduce(
            dy, x, mean64), dx, dx.stride()))
    assert_bit_equal(outs[0], outs[1])


@pytest.mark.parametrize("bad", [
    lambda ops: ops.batch_norm_stats(torch.randn(5)),
    lambda ops: ops.batch_norm_stats(torch.randn(4, 3, dtype=torch.float64)),
    lambda ops: ops.batch_norm_elemt(torch.randn(4, 3), torch.zeros(2), torch.ones(3),
                                     torch.zeros(3)),
    lambda ops: ops.batch_norm_backward_reduce(torch.randn(4, 2), torch.randn(4, 3),
                                               torch.zeros(3, dtype=torch.float64)),
    lambda ops: ops.batch_norm_backward_elemt(torch.randn(4, 2), torch.randn(4, 3), torch.zeros(3),
                                              torch.ones(3), torch.ones(3), torch.ones(3)),
])
def test_batch_norm_same_messages(bad):
    assert message(lambda: bad(S)) == message(lambda: bad(R))


@pytest.mark.parametrize("bad", [
    lambda ops: ops.fused_norm_fwd(torch.randn(4, 15), [16], None, None, 1e-5, False, False,
                                   False),
    lambda ops: ops.fused_norm_fwd(torch.randn(4, 16), [16], None, None, 0.0, False, False, False),
    lambda ops: ops.fused_norm_fwd(torch.ones(4, 16, dtype=torch.int64), [16], None, None, 1e-5,
                                   False, False, False),
    lambda ops: ops.fused_norm_fwd(torch.randn(4, 16), [16], torch.ones(8), None, 1e-5, False,
                                   False, False),
    lambda ops: ops.fused_norm_fwd(torch.randn(4, 16), [16], torch.ones(16),
                                   torch.ones(16, dtype=torch.bfloat16), 1e-5, False, False,
                                   False),
    lambda ops: ops.fused_norm_bwd(torch.randn(4, 8), torch.randn(4, 16), torch.zeros(4),
                                   torch.ones(4), None, None, [16], 1e-5, False, False, False,
                                   torch.float32, [True, False, False]),
    lambda ops: ops.fused_norm_bwd(torch.randn(4, 16), torch.randn(4, 16), torch.zeros(3),
                                   torch.ones(3), None, None, [16], 1e-5, False, False, False,
                                   torch.float32, [True, False, False]),
    # mixed without a weight; a saved input of another dtype than input_dtype; a bias of another
    # dtype than the weight (each would make the kernels read past a buffer)
    lambda ops: ops.fused_norm_fwd(torch.randn(2, 4), [4], None, None, 1e-5, False, True, False),
    lambda ops: ops.fused_norm_bwd(torch.randn(4, 16, dtype=torch.bfloat16),
                                   torch.randn(4, 16, dtype=torch.bfloat16), torch.zeros(4),
                                   torch.ones(4), None, None, [16], 1e-5, False, False, False,
                                   torch.float32, [True, False, False]),
    lambda ops: ops.fused_norm_bwd(torch.randn(4, 16), torch.randn(4, 16), torch.zeros(4),
                                   torch.ones(4), torch.ones(16, dtype=torch.bfloat16),
                                   torch.zeros(16), [16], 1e-5, False, False, True,
                                   torch.float32, [True, True, True]),
])
def test_norms_same_messages(bad):
    assert message(lambda: bad(S)) == message(lambda: bad(R))


def test_noop_flag_and_skips_as_the_regular_library():
    x = [torch.tensor([1.0, float("inf")]), torch.ones(3)]
    for dtype in (torch.int32, torch.float32, torch.uint8):
        flags = []
        for ops in (R, S):
            flag = torch.zeros(1, dtype=dtype)
            ops.multi_tensor_scale(flag, x, [torch.empty(2), torch.empty(3)], 2.0)
            flags.append(flag)
        assert_bit_equal(flags[0], flags[1])
        assert flags[0].item() == 1
    # A found_inf of 1 skips adam; a set noop flag skips sgd.
    p = [torch.ones(4)]
    for ops in (R, S):
        q = [t.clone() for t in p]
        ops.multi_tensor_adam(torch.zeros(1), [torch.ones(4)], q, [torch.zeros(4)],
                              [torch.zeros(4)], [], 0.1, 0.9, 0.999, 1e-8, 1, True, True, 0.0,
                              None, torch.ones(1))
        ops.multi_tensor_sgd(torch.ones(1), [torch.ones(4)], q, [], [], 0.1, 0.0, 0.0, 0.0,
                             False, False, False, 1.0)
        assert torch.equal(q[0], p[0])


def message(call):
    with pytest.raises(RuntimeError) as info:
        call()
    return str(info.value).strip()


@pytest.mark.parametrize("bad", [
    lambda ops: ops.multi_tensor_scale(torch.zeros(1), [torch.ones(3)], [torch.ones(4)], 1.0),
    lambda ops: ops.multi_tensor_scale(torch.zeros(2), [torch.ones(3)], [torch.ones(3)], 1.0),
    lambda ops: ops.multi_tensor_scale(torch.zeros(1), [torch.ones(3, dtype=torch.float64)],
                                       [torch.ones(3, dtype=torch.float64)], 1.0),
    lambda ops: ops.multi_tensor_scale(torch.zeros(1), [torch.ones(4, 4).t()[0]],
                                       [torch.ones(4, 4).t()[0]], 1.0),
    lambda ops: ops.multi_tensor_axpby(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                       [torch.ones(3)], 1.0, 1.0, 2),
    lambda ops: ops.multi_tensor_adam(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                      [torch.ones(3)], [torch.ones(3)], [], 0.1, 0.9, 0.9, 1e-8,
                                      0, True, True, 0.0),
    lambda ops: ops.multi_tensor_adam(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                      [torch.ones(3)], [], [], 0.1, 0.9, 0.9, 1e-8, 1, True,
                                      True, 0.0),
    lambda ops: ops.multi_tensor_adam(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                      [torch.ones(3)], [torch.ones(3)], [], 0.1, 0.9, 0.9, 1e-8,
                                      1, True, True, 0.0, torch.ones(2)),
    lambda ops: ops.multi_tensor_sgd(torch.zeros(1), [torch.ones(3)], [torch.ones(3)], [], [],
                                     0.1, 0.9, 0.0, 0.0, False, True, False, 1.0),
    lambda ops: ops.multi_tensor_lamb(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                      [torch.zeros(3)], [torch.zeros(3)], [], 0.1, 0.9, 0.99,
                                      1e-6, 1, True, 0.0, True, True, torch.tensor([3.0, 1.0]),
                                      1.0, False),
    lambda ops: ops.multi_tensor_lamb(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                      [torch.zeros(3)], [torch.zeros(3)], [], 0.1, 0.9, 0.99,
                                      1e-6, 1, True, 0.0, True, True, torch.empty(0), 1.0, False),
    lambda ops: ops.multi_tensor_novograd(torch.zeros(1), [torch.ones(3)], [torch.ones(3)],
                                          [torch.ones(3)], [], torch.ones(2), 0.1, 0.9, 0.9,
                                          1e-8, 1, True, 0.0, True, False),
])
def test_same_messages(bad):
    regular, stable = message(lambda: bad(R)), message(lambda: bad(S))
    assert stable == regular


def test_nothing_changes_on_a_refused_call():
    p = [torch.ones(3)]
    for ops in (R, S):
        q = [p[0].clone()]
        with pytest.raises(RuntimeError):
            ops.multi_tensor_adam(torch.zeros(1), [torch.ones(3)], q, [torch.zeros(3)],
                                  [torch.zeros(4)], [], 0.1, 0.9, 0.9, 1e-8, 1, True, True, 0.0)
        assert torch.equal(q[0], p[0])


def test_opcheck_stable_ops():
    from torch.library import opcheck
    p, g = lists(torch.float32, 2, seed=3, sizes=((8,), (3, 4)))
    m = [torch.zeros_like(t) for t in p]
    v = [torch.zeros_like(t) for t in p]
    opcheck(S.multi_tensor_adam.default, (torch.zeros(1), g, p, m, v, [], 1e-3, 0.9, 0.999, 1e-8,
                                          1, True, True, 0.0))
    opcheck(S.multi_tensor_l2norm.default, (torch.zeros(1), g, True))
    opcheck(S.multi_tensor_scale.default, (torch.zeros(1), g, [torch.empty_like(t) for t in g],
                                           2.0))
    x = torch.randn(6, 32, dtype=torch.bfloat16)
    w, b = torch.randn(32), torch.randn(32)
    opcheck(S.fused_norm_fwd.default, (x, [32], w, b, 1e-5, False, True, False))
    y, mean, rstd = S.fused_norm_fwd(x, [32], w, b, 1e-5, False, True, False)
    opcheck(S.fused_norm_bwd.default, (torch.randn_like(y), x, mean, rstd, w, b, [32], 1e-5, False,
                                       True, False, torch.bfloat16, [True, True, True]))


def run(cmd, env=None, cwd=None):
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def test_the_suite_on_the_stable_library():
    """APEX_OPS=stable: the package on the stable library passes the optimizer, amp_C, amp, norm
    and device suites (the tests of the regular library's own routes are marked and skipped).
    The parallel suite (real processes) runs on it in scripts/check_stable_abi; here the
    batch-norm ops it calls are checked bit for bit against the regular library's instead, which
    keeps the multi-process tests to one run per CI."""
    env = dict(os.environ, APEX_OPS="stable")
    files = [os.path.join(HERE, f) for f in ("test_optimizers.py", "test_amp_C.py", "test_amp.py",
                                             "test_normalization.py", "test_devices.py")]
    r = run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files], env=env,
            cwd=HERE)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert " passed" in r.stdout and " failed" not in r.stdout


def test_another_torch_gets_the_stable_library(tmp_path):
    """A package built for another torch release loads _apex_cpp_stable.so, never _apex_cpp.so,
    says so once, and its optimizers and norms work (the build info is rewritten to another
    release; a real second torch is checked by scripts/check_stable_abi)."""
    pkg = tmp_path / "apex"
    shutil.copytree(PKG, pkg, ignore=shutil.ignore_patterns("__pycache__"))
    amp_c = os.path.join(os.path.dirname(PKG), "amp_C.py")
    shutil.copy(amp_c, tmp_path / "amp_C.py")
    (pkg / "_build_info.py").write_text("TORCH_VERSION = '2.10.0+cpu'\n")
    env = dict(os.environ, PYTHONPATH=str(tmp_path))
    env.pop("APEX_OPS", None)
    r = run([sys.executable, os.path.join(HERE, "stable_smoke.py"), "2.10.0+cpu"], env=env,
            cwd=str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "stable ok" in r.stdout


@pytest.mark.parametrize("scale_dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("factors", [(2.0, 0.5, 3, 2), (1.1, 0.7, 1, 1), (3.0, 0.9, 2, 4)])
def test_update_scale_hysteresis_one_rule(scale_dtype, factors):
    """The host form (regular library on CPU tensors, stable library) and the regular library's
    tensor form (its CUDA route, forced here on CPU tensors) step alike, bit for bit."""
    growth, backoff, interval, hysteresis = factors
    g = torch.Generator().manual_seed(11)
    infs = (torch.rand(200, generator=g) < 0.3).tolist()
    states = []
    for ops, tensor_form in ((R, True), (R, False), (S, False)):
        R._update_scale_hysteresis_tensor_form(tensor_form)
        try:
            scale = torch.tensor([65536.0], dtype=scale_dtype)
            tracker = torch.zeros(1, dtype=torch.int32)
            hyst = torch.full((1,), hysteresis, dtype=torch.int32)
            trace = []
            for inf in infs:
                ops.update_scale_hysteresis(scale, tracker, hyst, torch.tensor([float(inf)]),
                                            growth, backoff, interval, hysteresis)
                trace.append((scale.item(), tracker.item(), hyst.item()))
            states.append(trace)
        finally:
            R._update_scale_hysteresis_tensor_form(False)
    assert states[0] == states[1] == states[2]
    assert len({s for s, _, _ in states[0]}) > 3  # the scale moved both ways


@pytest.mark.parametrize("bad", [
    lambda ops: ops.update_scale_hysteresis(torch.ones(2), torch.zeros(1, dtype=torch.int32),
                                            torch.ones(1, dtype=torch.int32), torch.zeros(1), 2.0,
                                            0.5, 2, 1),
    lambda ops: ops.update_scale_hysteresis(torch.ones(1), torch.zeros(1, dtype=torch.int32),
                                            torch.ones(1, dtype=torch.int32), torch.zeros(1), 2.0,
                                            0.5, 0, 1),
])
def test_update_scale_hysteresis_same_messages(bad):
    assert message(lambda: bad(S)) == message(lambda: bad(R))
