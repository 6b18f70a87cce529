"""apex.normalization's ops where the package runs on its stable-ABI op library
(apex._ops.STABLE): fused_norm_fwd and fused_norm_bwd of _apex_cpp_stable.so (apex-cpp's CPU
kernels) for fp32, bf16 and fp16 CPU tensors, and the same semantics on torch's own ops for
float64 (the regular library's float64 path) and for other devices (the stable library has CPU
kernels only). The autograd node and the autocast rule of apex_cpp::fused_norm are here in
Python, since the stable ABI registers backend kernels only.

Semantics: math in fp32, or float64 when any operand is float64; the output in the input's dtype,
or the parameters' for the mixed variants; memory-efficient mode saves the output and recovers
x_hat from it, dividing by the weight clamped by magnitude to at least eps, as apex does.
"""
import torch

from apex import _ops


def _compute_dtype(*tensors):
    f64 = any(t is not None and t.dtype == torch.float64 for t in tensors)
    return torch.float64 if f64 else torch.float32


def _who(rms):
    return "FusedRMSNorm" if rms else "FusedLayerNorm"


def _check(who, input, shape, weight, bias, eps, mixed=False):
    """The C++ norms' checks and messages (src/normalization/norm.cpp)."""
    if not input.is_floating_point():
        name = str(input.dtype).replace("torch.", "")
        raise RuntimeError(f"{who}: input must be a floating-point tensor, got {name}")
    if not eps > 0:
        raise RuntimeError(f"{who}: eps must be > 0, got {eps}")
    if mixed and weight is None:
        raise RuntimeError(f"{who}: the mixed-dtype variants need a weight")
    if not shape:
        raise RuntimeError(f"{who}: normalized_shape must not be empty")
    n = len(shape)
    if input.dim() < n or list(input.shape[input.dim() - n:]) != list(shape):
        raise RuntimeError(f"{who}: normalized_shape {list(shape)} does not match the trailing "
                           f"dimensions of an input of shape {list(input.shape)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if list(t.shape) != list(shape):
            raise RuntimeError(f"{who}: {name} must have shape {list(shape)}, got {list(t.shape)}")
        if t.device != input.device:
            raise RuntimeError(f"{who}: {name} is on {t.device} but the input is on "
                               f"{input.device}")


def _rows_cols(input, shape):
    cols = 1
    for d in shape:
        cols *= d
    return input.numel() // cols if cols else 0, cols


_KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
if _ops.STABLE:
    _fwd_op = torch.ops.apex_cpp_stable.fused_norm_fwd.default
    _bwd_op = torch.ops.apex_cpp_stable.fused_norm_bwd.default


def _kernel(*tensors):
    """Whether the stable library's kernels take these operands (fp32, bf16, fp16 on the CPU)."""
    if not _ops.STABLE:
        return False
    for t in tensors:
        if t is not None and (t.dtype not in _KERNEL_DTYPES or t.device.type != "cpu"):
            return False
    return True


def fwd(input, shape, weight, bias, eps, rms, mixed, memory_efficient):
    """fused_norm_fwd: (y, mean, rstd)."""
    if _kernel(input, weight, bias):
        return _fwd_op(input, list(shape), weight, bias, float(eps), rms, mixed, memory_efficient)
    return torch_fwd(input, shape, weight, bias, eps, rms, mixed, memory_efficient)


def bwd(grad_out, saved, mean, rstd, weight, bias, shape, eps, rms, mixed, memory_efficient,
        input_dtype, output_mask):
    """fused_norm_bwd: (dx, dw, db), empty where not wanted."""
    if (_kernel(grad_out, saved, weight, bias) and rstd.dtype == torch.float32
            and input_dtype != torch.float64):
        return _bwd_op(grad_out, saved, mean, rstd, weight, bias, list(shape), float(eps), rms,
                       mixed, memory_efficient, input_dtype, [bool(m) for m in output_mask])
    return torch_bwd(grad_out, saved, mean, rstd, weight, bias, shape, eps, rms, mixed,
                     memory_efficient, input_dtype, output_mask)


def torch_fwd(input, shape, weight, bias, eps, rms, mixed, memory_efficient):
    """(y, mean, rstd) on torch's ops: mean is empty for RMSNorm; statistics per row in the compute
    dtype."""
    _check(_who(rms), input, shape, weight, bias, eps, mixed)
    ct = _compute_dtype(input, weight, bias)
    rows, cols = _rows_cols(input, shape)
    x = input.to(ct).reshape(rows, cols)
    if rms:
        rstd = torch.rsqrt(x.square().mean(dim=1) + eps)
        mean = x.new_empty((0,))
        xhat = x * rstd[:, None]
    else:
        mean = x.mean(dim=1)
        rstd = torch.rsqrt((x - mean[:, None]).square().mean(dim=1) + eps)
        xhat = (x - mean[:, None]) * rstd[:, None]
    y = xhat
    if weight is not None:
        y = y * weight.to(ct).reshape(1, cols)
    if bias is not None:
        y = y + bias.to(ct).reshape(1, cols)
    out_dtype = weight.dtype if mixed and weight is not None else input.dtype
    return y.to(out_dtype).reshape(input.shape), mean, rstd


def _divisor(w, eps):
    return torch.where(w >= 0, torch.clamp(w, min=eps), torch.clamp(w, max=-eps))


def torch_bwd(grad_out, saved, mean, rstd, weight, bias, shape, eps, rms, mixed,
              memory_efficient, input_dtype, output_mask):
    """(dx, dw, db) on torch's ops, empty where not wanted; saved is x, or y in memory-efficient
    mode."""
    ct = _compute_dtype(saved, weight, bias, rstd)
    rows, cols = _rows_cols(saved, shape)
    dy = grad_out.to(ct).reshape(rows, cols)
    r = rstd.to(ct)[:, None]
    w = weight.to(ct).reshape(1, cols) if weight is not None else None
    if memory_efficient:
        xhat = saved.to(ct).reshape(rows, cols)
        if bias is not None:
            xhat = xhat - bias.to(ct).reshape(1, cols)
        if w is not None:
            xhat = xhat / _divisor(w, eps)
    else:
        x = saved.to(ct).reshape(rows, cols)
        xhat = (x if rms else x - mean.to(ct)[:, None]) * r
    empty = saved.new_empty((0,))
    dx = dw = db = empty
    if output_mask[0]:
        g = dy * w if w is not None else dy
        proj = (g * xhat).mean(dim=1, keepdim=True)
        inner = g - xhat * proj if rms else g - g.mean(dim=1, keepdim=True) - xhat * proj
        dx = (r * inner).to(input_dtype).reshape(saved.shape)
    if output_mask[1] and weight is not None:
        dw = (dy * xhat).sum(dim=0).to(weight.dtype).reshape(weight.shape)
    if output_mask[2] and bias is not None:
        db = dy.sum(dim=0).to(bias.dtype).reshape(bias.shape)
    return dx, dw, db


class _Norm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, input, weight, bias, shape, eps, rms, mixed, memory_efficient):
        y, mean, rstd = fwd(input, shape, weight, bias, eps, rms, mixed, memory_efficient)
        ctx.spec = (shape, eps, rms, mixed, memory_efficient, input.dtype)
        ctx.save_for_backward(y if memory_efficient else input, mean, rstd, weight, bias)
        return y

    @staticmethod
    def backward(ctx, grad_out):
        saved, mean, rstd, weight, bias = ctx.saved_tensors
        shape, eps, rms, mixed, memory_efficient, input_dtype = ctx.spec
        wants = ctx.needs_input_grad
        mask = [wants[0], weight is not None and wants[1], bias is not None and wants[2]]
        # Computed without a graph, as the regular library's node does: under create_graph the
        # gradients carry a node that refuses a second backward (the stable op has no autograd
        # kernel, so it would otherwise give None there without a word).
        create_graph = torch.is_grad_enabled()
        with torch.no_grad():
            dx, dw, db = bwd(grad_out, saved, mean, rstd, weight, bias, shape, eps, rms, mixed,
                             memory_efficient, input_dtype, mask)
        if create_graph:
            sources = [t for t in (grad_out, saved, weight, bias)
                       if t is not None and t.requires_grad]
            if sources:
                dx, dw, db = _NoDoubleBackward.apply(_who(rms), len(sources), *sources, dx, dw,
                                                     db)
        return (dx if mask[0] else None, dw if mask[1] else None, db if mask[2] else None,
                None, None, None, None, None)


class _NoDoubleBackward(torch.autograd.Function):
    """Passes gradients on (copies); differentiating them raises the regular library's message."""

    @staticmethod
    def forward(ctx, who, n_sources, *tensors):
        ctx.who = who
        return tuple(t.clone() for t in tensors[n_sources:])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"{ctx.who}: double backward is not supported")


def norm(input, shape, weight, bias, eps, rms, mixed, memory_efficient):
    """apex_cpp::fused_norm: under autocast, floating-point operands other than float64 in the
    autocast dtype and the norm run without autocast (apex's rule for its fused functions)."""
    device = input.device.type
    if torch.is_autocast_enabled(device):
        dt = torch.get_autocast_dtype(device)
        cast = (lambda t: t.to(dt) if t is not None and t.is_floating_point()
                and t.dtype != torch.float64 else t)
        input, weight, bias = cast(input), cast(weight), cast(bias)
        with torch.autocast(device, enabled=False):
            return _Norm.apply(input, weight, bias, shape, eps, rms, mixed, memory_efficient)
    return _Norm.apply(input, weight, bias, shape, eps, rms, mixed, memory_efficient)
