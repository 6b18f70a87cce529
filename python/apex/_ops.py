"""The compiled half of the package: apex-cpp's kernels as torch custom ops (``torch.ops.apex_cpp``).

The op library ``_apex_cpp.so`` is built from the same C++ kernel layer as the C++ library. Here
it is loaded, and every op gets a fake (meta) implementation so that ``torch.compile`` and
``torch.export`` trace through it (the norms' autograd is registered in C++).
"""
import os

import torch

_LIB = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_apex_cpp.so")
if not os.path.exists(_LIB):
    raise ImportError(
        f"apex (apex-cpp): the op library {_LIB} is missing; reinstall with "
        "`pip install --no-build-isolation <checkout>/python`")
try:
    from apex._build_info import TORCH_VERSION as _BUILT_FOR
except ImportError:  # built by CMake directly (-DAPEX_BUILD_PYTHON=ON), not by pip
    _BUILT_FOR = None
if _BUILT_FOR is not None and _BUILT_FOR != torch.__version__:
    # LibTorch's C++ ABI changes between releases, and a +cpu and a +cu130 build of one release
    # differ in their libraries: loading it anyway fails on a missing symbol at best.
    raise ImportError(
        f"apex (apex-cpp): the op library was built for torch {_BUILT_FOR}, but torch "
        f"{torch.__version__} is installed; reinstall with "
        "`pip install --no-build-isolation <checkout>/python`")
torch.ops.load_library(_LIB)
ops = torch.ops.apex_cpp


def _check_noop(noop_flag):
    torch._check(noop_flag.numel() == 1, lambda: "noop_flag must be a one-element tensor")


# ---- fake implementations: shapes and dtypes only -----------------------------------------------

for _name in ("multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_adam", "multi_tensor_sgd",
              "multi_tensor_adagrad", "multi_tensor_lamb", "multi_tensor_novograd",
              "update_scale_hysteresis"):
    # Mutating ops that return nothing: the fake does nothing.
    torch.library.register_fake(f"apex_cpp::{_name}")(lambda *args, **kwargs: None)


@torch.library.register_fake("apex_cpp::multi_tensor_l2norm")
def _l2norm_fake(noop_flag, tensors, per_tensor):
    device = tensors[0].device if tensors else noop_flag.device
    total = torch.empty(1, dtype=torch.float32, device=device)
    per = torch.empty(len(tensors) if per_tensor and tensors else 0, dtype=torch.float32,
                      device=device)
    return total, per


@torch.library.register_fake("apex_cpp::multi_tensor_unscale_l2norm")
def _unscale_l2norm_fake(noop_flag, tensors, inv_scale, per_tensor):
    return _l2norm_fake(noop_flag, tensors, per_tensor)


def _rows(input, normalized_shape):
    rows = 1
    for d in input.shape[: input.dim() - len(normalized_shape)]:
        rows *= d
    return rows


@torch.library.register_fake("apex_cpp::fused_norm_fwd")
def _norm_fwd_fake(input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient):
    rows = _rows(input, normalized_shape)
    out_dtype = weight.dtype if mixed else input.dtype
    y = torch.empty(input.shape, dtype=out_dtype, device=input.device)
    # Statistics are fp32, or float64 on the float64 path (any float64 input).
    f64 = any(t is not None and t.dtype == torch.float64 for t in (input, weight, bias))
    stat = torch.float64 if f64 else torch.float32
    mean = input.new_empty((0 if rms else rows,), dtype=stat)
    rstd = input.new_empty((rows,), dtype=stat)
    return y, mean, rstd


@torch.library.register_fake("apex_cpp::fused_norm")
def _norm_fake(input, normalized_shape, weight, bias, eps, rms, mixed, memory_efficient):
    out_dtype = weight.dtype if mixed else input.dtype
    return torch.empty(input.shape, dtype=out_dtype, device=input.device)


@torch.library.register_fake("apex_cpp::fused_norm_bwd")
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


@torch.library.register_fake("apex_cpp::batch_norm_stats")
def _bn_stats_fake(input):
    return input.new_empty((2 * input.shape[1] + 1,), dtype=torch.float64)


@torch.library.register_fake("apex_cpp::batch_norm_elemt")
def _bn_elemt_fake(input, mean, scale, shift):
    return torch.empty_like(input)


@torch.library.register_fake("apex_cpp::batch_norm_backward_reduce")
def _bn_reduce_fake(grad_out, input, mean):
    return input.new_empty((2 * input.shape[1],), dtype=torch.float64)


@torch.library.register_fake("apex_cpp::batch_norm_backward_elemt")
def _bn_bwd_elemt_fake(grad_out, input, mean, a, b, k):
    return torch.empty_like(input)


# The norms' autograd is registered in C++ (python/csrc/ops.cpp, NormFunction): a Python
# registration cost tens of microseconds per call, which short rows notice.


def cpu_isa():
    """The SIMD code path of the CPU kernels ("avx512bf16", "avx512", "avx2" or "baseline")."""
    return ops.cpu_isa()
