"""apex's fused LayerNorm and RMSNorm on apex-cpp's kernels, on CPU and CUDA tensors.

The modules, the functional forms (default eps 1e-6, as apex's) and the autograd Functions keep
apex's names and arguments (Megatron inspects ``FusedLayerNormAffineFunction.forward``). The modules
and functional forms run the custom op ``torch.ops.apex_cpp.fused_norm`` (apex's autocast rule
inside it), the autograd Functions ``fused_norm_fwd``/``fused_norm_bwd``; eager calls record the
C++ library's autograd node, traced ones (``torch.compile``) the ops' own, so that it traces them
without a graph break. Statistics and math are fp32 whatever the storage dtype; float64 inputs
take a float64 path (gradcheck).
"""
import numbers

import torch
from torch.nn import init
from torch.nn.parameter import Parameter

from apex import _ops
from apex._ops import ops

if _ops.STABLE:
    # The stable-ABI op library's forward and backward, with autograd and autocast in Python
    # (apex._stable_norms).
    from apex._stable_norms import bwd as _bwd
    from apex._stable_norms import fwd as _fwd
    from apex._stable_norms import norm as _norm_call
    _direct = _direct_fwd = None
else:
    try:
        from apex._eager import fused_norm as _direct
        from apex._eager import fused_norm_fwd_output as _direct_fwd
    except ImportError:  # built without Python's headers (a CMake warning said so): torch.ops alone
        _direct = _direct_fwd = None

    # The overloads themselves: calling the packet resolves the overload on every call.
    _fwd = ops.fused_norm_fwd.default
    _bwd = ops.fused_norm_bwd.default
    # The modules' and functional forms' op (its builtin `_op` would save ~0.1 us a call, but
    # dynamo does not trace through it).
    _norm_call = ops.fused_norm.default

# Eager calls take _direct(_norm_call, ...): the same op through the dispatcher without torch.ops'
# argument parsing (~1.5 us less a call), or _norm_call itself for tensor subclasses, torch
# function modes and arguments of other types (csrc/eager.cpp). Traced code sees _norm_call.
_is_compiling = torch.compiler.is_compiling

__all__ = [
    "FusedLayerNorm", "FusedRMSNorm", "MixedFusedLayerNorm", "MixedFusedRMSNorm",
    "FusedLayerNormAffineFunction", "FusedRMSNormAffineFunction", "FusedLayerNormFunction",
    "FusedRMSNormFunction", "FusedLayerNormAffineMixedDtypesFunction",
    "FusedRMSNormAffineMixedDtypesFunction", "fused_layer_norm_affine", "fused_layer_norm",
    "fused_rms_norm_affine", "fused_rms_norm", "mixed_dtype_fused_layer_norm_affine",
    "mixed_dtype_fused_rms_norm_affine",
]


def _shape(normalized_shape):
    if isinstance(normalized_shape, numbers.Integral):
        return [int(normalized_shape)]
    return [int(d) for d in normalized_shape]


def _param(module, name):
    """module.<name> for a registered parameter (or None), read from ``_parameters`` as
    ``nn.Module.__getattr__`` does, without the failed ordinary lookup that precedes it there (it
    raises and clears an AttributeError: ~0.5-1 us per read, a tenth of a small norm's forward).
    Anything else, such as a parametrization's property, through getattr."""
    p = module._parameters
    return p[name] if name in p else getattr(module, name)


def _run(*args):
    """apex_cpp::fused_norm(input, shape, weight, bias, eps, rms, mixed, memory_efficient): through
    the direct entry in eager mode, torch.ops where it is absent or traced."""
    if _direct is None or _is_compiling():
        return _norm_call(*args)
    return _direct(_norm_call, *args)


def _norm(input, weight, bias, normalized_shape, eps, rms, mixed, memory_efficient):
    # Under autocast the op casts its floating-point tensors to the autocast dtype and runs
    # without autocast (apex's rule for its fused functions).
    return _run(input, _shape(normalized_shape), weight, bias, float(eps), rms, mixed,
                bool(memory_efficient))


# ---- autograd Functions (apex's classes, over the same forward and backward ops) ----------------

def _function_forward(ctx, input, weight, bias, normalized_shape, eps, rms, mixed,
                      memory_efficient):
    shape = _shape(normalized_shape)
    y, mean, rstd = _fwd(input, shape, weight, bias, float(eps), rms, mixed,
                                       bool(memory_efficient))
    ctx.spec = (shape, float(eps), rms, mixed, bool(memory_efficient), input.dtype)
    ctx.has = (weight is not None, bias is not None)
    ctx.save_for_backward(y if memory_efficient else input, mean, rstd, weight, bias)
    return y


def _function_backward(ctx, grad_output):
    """(dx, dw, db), None where not wanted or absent."""
    saved, mean, rstd, weight, bias = ctx.saved_tensors
    shape, eps, rms, mixed, memory_efficient, input_dtype = ctx.spec
    wants = ctx.needs_input_grad
    mask = [wants[0], ctx.has[0] and wants[1], ctx.has[1] and len(wants) > 2 and wants[2]]
    dx, dw, db = _bwd(grad_output, saved, mean, rstd, weight, bias, shape, eps, rms,
                                    mixed, memory_efficient, input_dtype, mask)
    return (dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None)


class FusedLayerNormAffineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, bias, normalized_shape, eps, False, False,
                                 memory_efficient)

    @staticmethod
    def backward(ctx, grad_output):
        dx, dw, db = _function_backward(ctx, grad_output)
        return dx, dw, db, None, None, None


class FusedLayerNormAffineMixedDtypesFunction(FusedLayerNormAffineFunction):
    @staticmethod
    def forward(ctx, input, weight, bias, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, bias, normalized_shape, eps, False, True,
                                 memory_efficient)


class FusedRMSNormAffineFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, None, normalized_shape, eps, True, False,
                                 memory_efficient)

    @staticmethod
    def backward(ctx, grad_output):
        dx, dw, _ = _function_backward(ctx, grad_output)
        return dx, dw, None, None, None


class FusedRMSNormAffineMixedDtypesFunction(FusedRMSNormAffineFunction):
    @staticmethod
    def forward(ctx, input, weight, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, weight, None, normalized_shape, eps, True, True,
                                 memory_efficient)


class FusedLayerNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, None, None, normalized_shape, eps, False, False,
                                 memory_efficient)

    @staticmethod
    def backward(ctx, grad_output):
        return _function_backward(ctx, grad_output)[0], None, None, None


class FusedRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, normalized_shape, eps, memory_efficient=False):
        return _function_forward(ctx, input, None, None, normalized_shape, eps, True, False,
                                 memory_efficient)

    @staticmethod
    def backward(ctx, grad_output):
        return _function_backward(ctx, grad_output)[0], None, None, None


# APEX_NORM_EAGER_AUTOGRAD=0 (for compiled autograd, which cannot trace the library's node) also
# sends apex's Functions through their own Python node, which it traces. The op library reads the
# switch (one place); without the direct entry (_direct_fwd None) it does not matter.
_EAGER_AUTOGRAD = _direct_fwd is None or bool(ops._norm_eager_autograd())


def _eager_apply(owner, rms, mixed, has_weight, has_bias):
    """`owner.apply`: in eager mode the output of apex_cpp::fused_norm_fwd, called directly (the
    library's autograd node, as the modules get; ~14 us less per forward + backward than a Python
    Function, which Megatron's FusedLayerNorm calls per layer); the Function itself under
    torch.compile, for subclasses (whatever they redefine), keyword arguments, tensor subclasses,
    torch function modes and with APEX_NORM_EAGER_AUTOGRAD=0. fused_norm_fwd has no autocast
    rule, as apex's Functions have none.
    """
    n = 3 + has_weight + has_bias  # input, [weight], [bias], normalized_shape, eps

    def apply(cls, *args, **kwargs):
        if (_direct_fwd is not None and _EAGER_AUTOGRAD and cls is owner and not kwargs
                and n <= len(args) <= n + 1 and not _is_compiling()):
            y = _direct_fwd(args[0], _shape(args[n - 2]), args[1] if has_weight else None,
                            args[2] if has_bias else None, float(args[n - 1]), rms, mixed,
                            bool(args[n]) if len(args) > n else False)
            if y is not NotImplemented:
                return y
        return super(owner, cls).apply(*args, **kwargs)

    return classmethod(apply)


for _cls, _spec in ((FusedLayerNormAffineFunction, (False, False, True, True)),
                    (FusedLayerNormAffineMixedDtypesFunction, (False, True, True, True)),
                    (FusedRMSNormAffineFunction, (True, False, True, False)),
                    (FusedRMSNormAffineMixedDtypesFunction, (True, True, True, False)),
                    (FusedLayerNormFunction, (False, False, False, False)),
                    (FusedRMSNormFunction, (True, False, False, False))):
    _cls.apply = _eager_apply(_cls, *_spec)


# ---- functional forms (apex's defaults: eps 1e-6) ------------------------------------------------

def fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                            memory_efficient=False):
    return _norm(input, weight, bias, normalized_shape, eps, False, False, memory_efficient)


def fused_layer_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, None, None, normalized_shape, eps, False, False, memory_efficient)


def mixed_dtype_fused_layer_norm_affine(input, weight, bias, normalized_shape, eps=1e-6,
                                        memory_efficient=False):
    return _norm(input, weight, bias, normalized_shape, eps, False, True, memory_efficient)


def fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, weight, None, normalized_shape, eps, True, False, memory_efficient)


def fused_rms_norm(input, normalized_shape, eps=1e-6, memory_efficient=False):
    return _norm(input, None, None, normalized_shape, eps, True, False, memory_efficient)


def mixed_dtype_fused_rms_norm_affine(input, weight, normalized_shape, eps=1e-6,
                                      memory_efficient=False):
    return _norm(input, weight, None, normalized_shape, eps, True, True, memory_efficient)


# ---- modules --------------------------------------------------------------------------------------

class _FusedNorm(torch.nn.Module):
    """What the two norms' modules share: apex's arguments, parameters and repr."""

    def __init__(self, normalized_shape, eps, elementwise_affine, memory_efficient, has_bias):
        super().__init__()
        self.normalized_shape = torch.Size(_shape(normalized_shape))
        self._shape_list = list(self.normalized_shape)
        self.eps = eps
        self.elementwise_affine = elementwise_affine
        self.memory_efficient = memory_efficient
        if self.elementwise_affine:
            self.weight = Parameter(torch.empty(*self.normalized_shape))
        else:
            self.register_parameter("weight", None)
        if self.elementwise_affine and has_bias:
            self.bias = Parameter(torch.empty(*self.normalized_shape))
        elif has_bias:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self):
        if self.elementwise_affine:
            init.ones_(self.weight)
            if getattr(self, "bias", None) is not None:
                init.zeros_(self.bias)

    def extra_repr(self):
        return ("{normalized_shape}, eps={eps}, elementwise_affine={elementwise_affine}"
                .format(**self.__dict__))


class FusedLayerNorm(_FusedNorm):
    r"""LayerNorm over the trailing ``normalized_shape`` dimensions, as ``torch.nn.LayerNorm``
    (apex's FusedLayerNorm: same arguments, parameters ``weight`` and ``bias``, output in the
    input's dtype). ``memory_efficient`` saves the output instead of the input for the backward.
    Runs apex-cpp's kernels on CPU and CUDA tensors alike (apex fell back to ``F.layer_norm`` off
    CUDA)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__(normalized_shape, eps, elementwise_affine, memory_efficient, True)

    def forward(self, input):
        return _run(input, self._shape_list, _param(self, "weight"), _param(self, "bias"),
                    self.eps, False, False, self.memory_efficient)


class FusedRMSNorm(_FusedNorm):
    r"""RMSNorm: ``x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape``
    dimensions (apex's FusedRMSNorm: one parameter, ``weight``)."""

    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True,
                 memory_efficient=False):
        super().__init__(normalized_shape, eps, elementwise_affine, memory_efficient, False)

    def forward(self, input):
        return _run(input, self._shape_list, _param(self, "weight"), None, self.eps, True, False,
                    self.memory_efficient)


def _always_affine(name, kwargs):
    """apex's mixed variants warn about `elementwise_affine` and refuse it False."""
    if "elementwise_affine" in kwargs:
        import warnings
        warnings.warn(f"{name} does not support `elementwise_affine` argument")
        elementwise_affine = kwargs.pop("elementwise_affine")
        if not elementwise_affine:
            raise RuntimeError(f"{name} does not support "
                               f"`elementwise_affine = {elementwise_affine}`")


class MixedFusedLayerNorm(FusedLayerNorm):
    """FusedLayerNorm whose output has the parameters' dtype (typically fp32 parameters over an
    fp16/bf16 input: Megatron's and NeMo's mixed variant). Always affine."""

    def __init__(self, normalized_shape, eps=1e-5, **kwargs):
        _always_affine("MixedFusedLayerNorm", kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         **kwargs)

    def forward(self, input):
        return mixed_dtype_fused_layer_norm_affine(input, _param(self, "weight"),
                                                   _param(self, "bias"),
                                                   self.normalized_shape, self.eps,
                                                   self.memory_efficient)


class MixedFusedRMSNorm(FusedRMSNorm):
    """FusedRMSNorm whose output has the weight's dtype. Always affine."""

    def __init__(self, normalized_shape, eps=1e-5, **kwargs):
        _always_affine("MixedFusedRMSNorm", kwargs)
        super().__init__(normalized_shape=normalized_shape, eps=eps, elementwise_affine=True,
                         **kwargs)

    def forward(self, input):
        return mixed_dtype_fused_rms_norm_affine(input, _param(self, "weight"), self.normalized_shape,
                                                 self.eps, self.memory_efficient)
