"""amp_C called exactly as fairseq and Megatron-LM call it, and every op through
torch.library.opcheck (schema, fake tensor, AOT dispatch)."""
import pytest
import torch

import amp_C
from apex._ops import ops
from apex.multi_tensor_apply import MultiTensorApply, multi_tensor_applier


def grads(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(dtype) for n in (1, 7, 65537, 300)]


def test_fairseq_multi_tensor_total_norm():
    # fairseq/utils.py: multi_tensor_l2norm(chunk 2048*32, a (1, 1) int noop, [grads], False)
    gs = grads()
    has_overflow = torch.zeros((1, 1), dtype=torch.int)
    norm = amp_C.multi_tensor_l2norm(2048 * 32, has_overflow, [gs], False)
    total = norm[0]
    ref = torch.stack([g.double().norm() for g in gs]).norm()
    torch.testing.assert_close(total.double().reshape(()), ref, rtol=1e-6, atol=1e-6)
    assert has_overflow.item() == 0
    gs[2][3] = float("inf")
    amp_C.multi_tensor_l2norm(2048 * 32, has_overflow, [gs], False)
    assert has_overflow.item() == 1


def test_megatron_clip_grads():
    # megatron/core/optimizer/clip_grads.py: norm, _ = applier(l2norm, buf, [grads], False);
    # then applier(scale, buf, [grads, grads], clip_coeff).
    gs = grads(1, torch.bfloat16)
    ref = [g.clone() for g in gs]
    buf = torch.tensor([0], dtype=torch.int)
    grad_norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, buf, [gs], False)
    expected = torch.stack([g.double().norm() for g in ref]).norm()
    torch.testing.assert_close(grad_norm.double().reshape(()), expected, rtol=1e-6, atol=1e-6)
    clip_coeff = 1.0 / (grad_norm.item() + 1e-6)
    multi_tensor_applier(amp_C.multi_tensor_scale, buf, [gs, gs], clip_coeff)
    for g, r in zip(gs, ref):
        torch.testing.assert_close(g, (r.float() * clip_coeff).to(torch.bfloat16), rtol=0, atol=0)
    assert MultiTensorApply.available


def test_per_tensor_norms_scale_copy_and_axpby():
    gs = grads(2)
    buf = torch.zeros(1, dtype=torch.int)
    total, per = amp_C.multi_tensor_l2norm(2048 * 32, buf, [gs], True)
    torch.testing.assert_close(per.double(), torch.stack([g.double().norm() for g in gs]),
                               rtol=1e-6, atol=1e-6)
    # fp16 -> fp32 copies with scale 1.0 (Megatron's master copies).
    half = [g.half() for g in gs]
    out = [torch.empty_like(g) for g in gs]
    amp_C.multi_tensor_scale(2048 * 32, buf, [half, out], 1.0)
    for h, o in zip(half, out):
        assert torch.equal(h.float(), o)
    # axpby: out = 2x + 0.5y, arg_to_check 0 sees only x.
    y = grads(3)
    res = [torch.empty_like(g) for g in gs]
    y[0][0] = float("nan")
    amp_C.multi_tensor_axpby(2048 * 32, buf, [gs, y, res], 2.0, 0.5, 0)
    assert buf.item() == 0
    torch.testing.assert_close(res[1], 2 * gs[1] + 0.5 * y[1])
    amp_C.multi_tensor_axpby(2048 * 32, buf, [gs, y, res], 2.0, 0.5, -1)
    assert buf.item() == 1


def test_sgd_exits_early_on_noop_and_adam_ignores_it():
    p = [torch.randn(10)]
    g = [torch.randn(10)]
    mom = [torch.zeros(10)]
    before = p[0].clone()
    flag = torch.ones(1, dtype=torch.int)
    amp_C.multi_tensor_sgd(2048 * 32, flag, [g, p, mom], 0.0, 0.9, 0.0, 0.1, False, True, False,
                           1.0)
    assert torch.equal(p[0], before)
    m, v = [torch.zeros(10)], [torch.zeros(10)]
    amp_C.multi_tensor_adam(2048 * 32, flag, [g, p, m, v], 1e-3, 0.9, 0.999, 1e-8, 1, 1, 1, 0.0)
    assert not torch.equal(p[0], before)


def test_update_scale_hysteresis():
    scale = torch.tensor([1024.0])
    growth = torch.tensor([0], dtype=torch.int)
    hyst = torch.tensor([2], dtype=torch.int)
    inf = torch.ones(1)
    amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 3, 2)
    assert scale.item() == 1024.0 and hyst.item() == 1  # one overflow tolerated
    amp_C.update_scale_hysteresis(scale, growth, hyst, inf, 2.0, 0.5, 3, 2)
    assert scale.item() == 512.0 and hyst.item() == 0
    clean = torch.zeros(1)
    for _ in range(3):
        amp_C.update_scale_hysteresis(scale, growth, hyst, clean, 2.0, 0.5, 3, 2)
    assert scale.item() == 1024.0 and growth.item() == 0 and hyst.item() == 2


def test_errors_are_clear():
    with pytest.raises(RuntimeError, match="expected 2 tensor lists, got 1"):
        amp_C.multi_tensor_scale(2048 * 32, torch.zeros(1, dtype=torch.int), [grads()], 1.0)
    a = grads()
    with pytest.raises(RuntimeError, match=r"dst\[1\] has shape \[8\] but src\[1\] has shape \[7\]"):
        amp_C.multi_tensor_scale(2048 * 32, torch.zeros(1, dtype=torch.int),
                                 [a, [torch.empty(1), torch.empty(8), torch.empty(65537),
                                      torch.empty(300)]], 1.0)
    with pytest.raises(RuntimeError, match="noop_flag must be a one-element tensor"):
        amp_C.multi_tensor_scale(2048 * 32, torch.zeros(2), [a, a], 1.0)


def _opcheck(op, args, kwargs=None):
    torch.library.opcheck(op, args, kwargs or {},
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_static",
                                      "test_aot_dispatch_dynamic"))


@pytest.mark.regular_ops
def test_opcheck_every_op():
    gs = grads()
    noop = torch.zeros(1, dtype=torch.int)
    like = lambda ts: [torch.zeros_like(t) for t in ts]  # noqa: E731
    p = [g.clone() for g in gs]
    _opcheck(ops.multi_tensor_scale, (noop, gs, like(gs), 0.5))
    _opcheck(ops.multi_tensor_axpby, (noop, gs, gs, like(gs), 1.0, 2.0, -1))
    _opcheck(ops.multi_tensor_l2norm, (noop, gs, True))
    _opcheck(ops.multi_tensor_unscale_l2norm, (noop, gs, torch.tensor([0.5]), False))
    _opcheck(ops.multi_tensor_adam,
             (noop, gs, p, like(p), like(p), [], 1e-3, 0.9, 0.999, 1e-8, 1, True, True, 0.0))
    _opcheck(ops.multi_tensor_sgd,
             (noop, gs, p, like(p), [], 0.1, 0.9, 0.0, 0.0, False, True, False, 1.0))
    _opcheck(ops.multi_tensor_adagrad, (noop, gs, p, like(p), [], 0.1, 1e-10, False, 0.0))
    _opcheck(ops.multi_tensor_lamb,
             (noop, gs, p, like(p), like(p), [], 1e-3, 0.9, 0.999, 1e-6, 1, True, 0.01, True,
              True, torch.tensor([1.0]), 1.0, False))
    _opcheck(ops.multi_tensor_novograd,
             (noop, gs, p, like(p), [], torch.ones(len(p)), 1e-3, 0.9, 0.999, 1e-8, 1, True,
              0.0, True, False))
    _opcheck(ops.update_scale_hysteresis,
             (torch.tensor([4.0]), torch.tensor([0], dtype=torch.int),
              torch.tensor([1], dtype=torch.int), torch.zeros(1), 2.0, 0.5, 2, 1))
    x = torch.randn(3, 5, 16, requires_grad=True)
    w = torch.rand(16, requires_grad=True)
    b = torch.randn(16, requires_grad=True)
    for rms in (False, True):
        for me in (False, True):
            torch.library.opcheck(ops.fused_norm_fwd, (x, [16], w, None if rms else b, 1e-5, rms,
                                                       False, me))
            torch.library.opcheck(ops.fused_norm, (x, [16], w, None if rms else b, 1e-5, rms,
                                                   False, me))
    y, mean, rstd = ops.fused_norm_fwd(x.detach(), [16], w.detach(), b.detach(), 1e-5, False,
                                       False, False)
    _opcheck(ops.fused_norm_bwd, (torch.randn_like(y), x.detach(), mean, rstd, w.detach(),
                                  b.detach(), [16], 1e-5, False, False, False, torch.float32,
                                  [True, True, True]))
    xb = torch.randn(4, 3, 5)
    stats = ops.batch_norm_stats(xb)
    _opcheck(ops.batch_norm_stats, (xb,))
    mean = stats[:3].float()
    _opcheck(ops.batch_norm_elemt, (xb, mean, torch.ones(3), torch.zeros(3)))
    _opcheck(ops.batch_norm_backward_reduce, (torch.randn_like(xb), xb, stats[:3]))
    _opcheck(ops.batch_norm_backward_elemt,
             (torch.randn_like(xb), xb, mean, torch.ones(3), torch.ones(3), torch.zeros(3)))
