"""Smoke check of the package on its stable-ABI op library under a torch it was not built for:
python stable_smoke.py <the torch release apex was built for>, with apex importable and built for
another torch. Run by test_stable_abi.py (the build info rewritten) and by scripts/check_stable_abi
(a second, real torch)."""
import sys
import warnings
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import apex
import torch
from apex import _ops
from apex.optimizers import FusedAdam
from apex.normalization import FusedLayerNorm
import amp_C
assert _ops.STABLE
text = [str(w.message) for w in caught if "stable-ABI" in str(w.message)]
assert len(text) == 1 and f"built for torch {sys.argv[1]}" in text[0], text
maps = open("/proc/self/maps").read()
assert "_apex_cpp_stable.so" in maps and "/_apex_cpp.so" not in maps
assert "_eager" not in maps
torch.manual_seed(0)
model = torch.nn.Linear(16, 4)
ref = torch.nn.Linear(16, 4)
ref.load_state_dict(model.state_dict())
opt = FusedAdam(model.parameters(), lr=1e-2, weight_decay=0.01)
ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
for _ in range(5):
    x = torch.randn(8, 16)
    for m, o in ((model, opt), (ref, ref_opt)):
        o.zero_grad()
        m(x).square().mean().backward()
        o.step()
for a, b in zip(model.parameters(), ref.parameters()):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
ln = FusedLayerNorm(16)
x = torch.randn(4, 16, requires_grad=True)
y = ln(x)
y.sum().backward()
torch.testing.assert_close(y, torch.nn.functional.layer_norm(x, (16,), ln.weight, ln.bias,
                                                             1e-5))
norm, _ = amp_C.multi_tensor_l2norm(65536, torch.zeros(1, dtype=torch.int),
                                    [[torch.ones(4)]], False)
assert norm.item() == 2.0
from apex.parallel import SyncBatchNorm  # noqa: F401  (its kernels are in the stable library)
x = torch.randn(4, 3, 5, 5)
stats = _ops.ops.batch_norm_stats(x)
torch.testing.assert_close(stats[:3], x.double().mean(dim=(0, 2, 3)))
assert not hasattr(_ops.ops, "bench_scale_calls")  # a regular-library op: a clear AttributeError
try:
    _ops.ops.bench_scale_calls(torch.zeros(1), [], [], 1)
except AttributeError as e:
    assert "reinstall" in str(e), e
else:
    raise AssertionError("bench_scale_calls ran without its library")
print("stable ok")
