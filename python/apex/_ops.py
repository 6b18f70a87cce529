"""The compiled half of the package: apex-cpp's kernels as torch custom ops (``torch.ops.apex_cpp``).

The op library ``_apex_cpp.so`` is built from the same C++ kernel layer as the C++ library,
against LibTorch's regular C++ API: it serves the torch it was built for. Under another torch
(2.10 or later) the package loads ``_apex_cpp_stable.so`` instead: the multi-tensor ops, the
norms' forward and backward and SyncBatchNorm's pieces on LibTorch's stable ABI (namespace
``apex_cpp_stable``, the same schemas), and says what it lacks. Every op gets a fake (meta)
implementation so that ``torch.compile`` and ``torch.export`` trace through it (the norms'
autograd is registered in C++, or in Python on the stable library: apex._stable_norms).
"""
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_LIB = os.path.join(_HERE, "_apex_cpp.so")
_STABLE_LIB = os.path.join(_HERE, "_apex_cpp_stable.so")
_REINSTALL = "reinstall with `pip install --no-build-isolation <checkout>/python`"
if not os.path.exists(_LIB):
    raise ImportError(f"apex (apex-cpp): the op library {_LIB} is missing; {_REINSTALL}")
try:
    from apex._build_info import TORCH_VERSION as _BUILT_FOR
except ImportError:  # built by CMake directly (-DAPEX_BUILD_PYTHON=ON), not by pip
    _BUILT_FOR = None


def _torch_at_least(major, minor):
    parts = torch.__version__.split("+")[0].split(".")
    return (int(parts[0]), int(parts[1])) >= (major, minor)


class _StableOps:
    """The ops of _apex_cpp_stable.so (LibTorch's stable ABI: the multi-tensor ops, the norms'
    forward and backward, SyncBatchNorm's pieces, update_scale_hysteresis and cpu_isa, on CPU
    tensors) under apex_cpp's names, and what the rest of the package asks of the others: the CPU
    half-precision route is unavailable, the norms' autograd is Python's (apex._stable_norms), and
    the rest (CUDA kernels, the bench helper) say to reinstall."""

    def cpu_half_fallback_available(self, dtype=None):
        return False

    def cpu_half_fallback_active(self):
        return False

    def cpu_half_fallback_enter(self):
        return False

    def cpu_half_fallback_exit(self):
        pass

    def cpu_half_fallback_prepare(self):
        pass

    def __getattr__(self, name):
        if not name.startswith("__") and hasattr(torch.ops.apex_cpp_stable, name):
            op = getattr(torch.ops.apex_cpp_stable, name)
            setattr(self, name, op)  # found once; later lookups are plain attribute reads
            return op
        if name.startswith("__"):
            raise AttributeError(name)
        built = f"built for torch {_BUILT_FOR}" if _BUILT_FOR else "of this build"
        raise AttributeError(
            f"apex (apex-cpp): {name} is in the regular op library ({built}), not in the "
            f"stable-ABI library that serves torch {torch.__version__}; {_REINSTALL}")


# APEX_OPS=stable loads the stable-ABI library even where the regular one fits (tests, comparison).
_FORCE_STABLE = os.environ.get("APEX_OPS") == "stable"
STABLE = _FORCE_STABLE or (_BUILT_FOR is not None and _BUILT_FOR != torch.__version__)
if STABLE:
    # LibTorch's C++ ABI changes between releases, and a +cpu and a +cu130 build of one release
    # differ in their libraries: _apex_cpp.so must not be loaded under another torch. The stable
    # library was built against the stable ABI of torch 2.10 and loads into any later torch.
    if not os.path.exists(_STABLE_LIB) or not _torch_at_least(2, 10):
        raise ImportError(
            f"apex (apex-cpp): the op library was built for torch {_BUILT_FOR}, but torch "
            f"{torch.__version__} is installed; {_REINSTALL}")
    torch.ops.load_library(_STABLE_LIB)
    ops = _StableOps()
    _NS = "apex_cpp_stable"
    if not _FORCE_STABLE:
        import warnings
        warnings.warn(
            f"apex (apex-cpp) was built for torch {_BUILT_FOR} and runs under torch "
            f"{torch.__version__} on its stable-ABI op library: optimizers, amp_C, amp, norms "
            "and SyncBatchNorm on apex-cpp's CPU kernels; no CPU half-precision route, no CUDA "
            f"kernels. For all of it, {_REINSTALL}", stacklevel=2)
else:
    torch.ops.load_library(_LIB)
    ops = torch.ops.apex_cpp
    _NS = "apex_cpp"


def _check_noop(noop_flag):
    torch._check(noop_flag.numel() == 1, lambda: "noop_flag must be a one-element tensor")


# ---- fake implementations: shapes and dtypes only -----------------------------------------------

def _l2norm_fake(noop_flag, tensors, per_tensor):
    device = tensors[0].device if tensors else noop_flag.device
    total = torch.empty(1, dtype=torch.float32, device=device)
    per = torch.empty(len(tensors) if per_tensor and tensors else 0, dtype=torch.float32,
                      device=device)
    return total, per


def _unscale_l2norm_fake(noop_flag, tensors, inv_scale, per_tensor):
    return _l2norm_fake(noop_flag, tensors, per_tensor)


def _register_multi_tensor_fakes(ns):
    """The fakes of the multi-tensor ops, which both libraries have, in namespace ns."""
    for name in ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_adam",
                 "multi_tensor_sgd", "multi_tensor_adagrad", "multi_tensor_lamb",
                 "multi_tensor_novograd"):
        # Mutating ops that return nothing: the fake does nothing.
        torch.library.register_fake(f"{ns}::{name}")(lambda *args, **kwargs: None)
    torch.library.register_fake(f"{ns}::multi_tensor_l2norm")(_l2norm_fake)
    torch.library.register_fake(f"{ns}::multi_tensor_unscale_l2norm")(_unscale_l2norm_fake)


_register_multi_tensor_fakes(_NS)


def _rows(input, normalized_shape):
    rows = 1
    for d in input.shape[: input.dim() - len(normalized_shape)]:
        rows *= d
    return rows


def _norm_fwd_fake(input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient):
    rows = _rows(input, normalized_shape)
    out_dtype = weight.dtype if mixed and weight is not None else input.dtype
    y = torch.empty(input.shape, dtype=out_dtype, device=input.device)
    # Statistics are fp32, or float64 on the float64 path (any float64 input).
    f64 = any(t is not None and t.dtype == torch.float64 for t in (input, weight, bias))
    stat = torch.float64 if f64 else torch.float32
    mean = input.new_empty((0 if rms else rows,), dtype=stat)
    rstd = input.new_empty((rows,), dtype=stat)
    return y, mean, rstd


def _norm_bwd_fake(grad_out, saved, mean, rstd, weight, bias, normalized_shape, eps, rms, mixed,
                   memory_efficient, input_dtype, output_mask):
    dx = (torch.empty(saved.shape, dtype=input_dtype, device=saved.device) if output_mask[0]
          else saved.new_empty((0,)))
    param = weight if weight is not None else bias
    dw = (torch.empty_like(weight) if output_mask[1] and weight is not None
          else saved.new_empty((0,)))
    db = (torch.empty(param.shape, dtype=bias.dtype, device=saved.device)
          if output_mask[2] and bias is not None else saved.new_empty((0,)))
    return dx, dw, db


def _register_norm_fakes(ns):
    """The fakes of the norms' forward and backward, which both libraries have, in namespace ns."""
    torch.library.register_fake(f"{ns}::fused_norm_fwd")(_norm_fwd_fake)
    torch.library.register_fake(f"{ns}::fused_norm_bwd")(_norm_bwd_fake)


_register_norm_fakes(_NS)


def _bn_stats_fake(input):
    return input.new_empty((2 * input.shape[1] + 1,), dtype=torch.float64)


def _bn_elemt_fake(input, mean, scale, shift):
    return torch.empty_like(input)


def _bn_reduce_fake(grad_out, input, mean):
    return input.new_empty((2 * input.shape[1],), dtype=torch.float64)


def _bn_bwd_elemt_fake(grad_out, input, mean, a, b, k):
    return torch.empty_like(input)


def _register_batch_norm_fakes(ns):
    """The fakes of SyncBatchNorm's CPU pieces, which both libraries have, in namespace ns."""
    torch.library.register_fake(f"{ns}::batch_norm_stats")(_bn_stats_fake)
    torch.library.register_fake(f"{ns}::batch_norm_elemt")(_bn_elemt_fake)
    torch.library.register_fake(f"{ns}::batch_norm_backward_reduce")(_bn_reduce_fake)
    torch.library.register_fake(f"{ns}::batch_norm_backward_elemt")(_bn_bwd_elemt_fake)


_register_batch_norm_fakes(_NS)
torch.library.register_fake(f"{_NS}::update_scale_hysteresis")(lambda *a, **k: None)


if not STABLE:  # the ops below are in the regular library only

    @torch.library.register_fake("apex_cpp::fused_norm")
    def _norm_fake(input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient):
        out_dtype = weight.dtype if mixed else input.dtype
        return torch.empty(input.shape, dtype=out_dtype, device=input.device)


# The norms' autograd is registered in C++ (python/csrc/ops.cpp, NormFunction): a Python
# registration cost tens of microseconds per call, which short rows notice.


def cpu_isa():
    """The SIMD code path of the CPU kernels ("avx512bf16", "avx512", "avx2" or "baseline")."""
    return ops.cpu_isa()
