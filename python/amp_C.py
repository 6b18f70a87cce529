"""apex's ``amp_C`` module on apex-cpp's kernels: the multi-tensor functions fairseq, Megatron-LM
and apex's optimizers call directly, with apex's calling convention
``fn(chunk_size, noop_flag, tensor_lists, *args)``. ``chunk_size`` is accepted and ignored (the
kernels choose their chunks); the noop flag is a one-element tensor of any dtype: scale, axpby and
the norms set it on a non-finite value, sgd and the capturable adam skip when it is set.

Only functions whose whole behaviour is implemented are exported: code that probes for a name
(``hasattr(amp_C, ...)``) falls back to its own path for the others. (``multi_tensor_novograd``
is not: apex's blends the per-tensor norms into its argument in place; apex.optimizers'
FusedNovoGrad calls the op with the blend done.)
"""
import torch

from apex._ops import ops as _ops

__all__ = [
    "multi_tensor_scale", "multi_tensor_axpby", "multi_tensor_l2norm", "multi_tensor_l2norm_mp",
    "multi_tensor_unscale_l2norm", "multi_tensor_adam", "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master", "multi_tensor_sgd", "multi_tensor_adagrad",
    "multi_tensor_lamb", "update_scale_hysteresis",
]


def _lists(tensor_lists, depth, name):
    if len(tensor_lists) not in depth:
        raise RuntimeError(f"amp_C.{name}: expected {' or '.join(map(str, depth))} tensor lists, "
                           f"got {len(tensor_lists)}")
    lengths = {len(lst) for lst in tensor_lists}
    if len(lengths) > 1:
        raise RuntimeError(f"amp_C.{name}: the tensor lists have different lengths {sorted(lengths)}")
    # One device per call: a meta tensor among CPU ones would send the call to the fake kernel,
    # which computes nothing.
    first = None
    for li, lst in enumerate(tensor_lists):
        for i, t in enumerate(lst):
            if first is None:
                first = (li, i, t.device)
            elif t.device != first[2]:
                raise RuntimeError(f"amp_C.{name}: tensor_lists[{li}][{i}] is on {t.device} but "
                                   f"tensor_lists[{first[0]}][{first[1]}] is on {first[2]}; every "
                                   "tensor of one call must be on one device")
    return [list(lst) for lst in tensor_lists]


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    src, dst = _lists(tensor_lists, (2,), "multi_tensor_scale")
    _ops.multi_tensor_scale(noop_flag, src, dst, float(scale))


def multi_tensor_axpby(chunk_size, noop_flag, tensor_lists, a, b, arg_to_check):
    x, y, out = _lists(tensor_lists, (3,), "multi_tensor_axpby")
    _ops.multi_tensor_axpby(noop_flag, x, y, out, float(a), float(b), int(arg_to_check))


def multi_tensor_l2norm(chunk_size, noop_flag, tensor_lists, per_tensor=False):
    """Returns (total norm [1] fp32, per-tensor norms [n] fp32, or an empty tensor)."""
    (x,) = _lists(tensor_lists, (1,), "multi_tensor_l2norm")
    return _ops.multi_tensor_l2norm(noop_flag, x, bool(per_tensor))


multi_tensor_l2norm_mp = multi_tensor_l2norm  # apex's variant for mixed dtypes: ours takes any


def multi_tensor_unscale_l2norm(chunk_size, noop_flag, tensor_lists, inv_scale, per_tensor=False):
    (x,) = _lists(tensor_lists, (1,), "multi_tensor_unscale_l2norm")
    return _ops.multi_tensor_unscale_l2norm(noop_flag, x, inv_scale, bool(per_tensor))


def multi_tensor_adam(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step, mode,
                      bias_correction, weight_decay):
    """lists [g, p, m, v]; mode 1 is AdamW (decoupled weight decay), 0 is L2."""
    g, p, m, v = _lists(tensor_lists, (4,), "multi_tensor_adam")
    _ops.multi_tensor_adam(noop_flag, g, p, m, v, [], float(lr), float(beta1), float(beta2),
                           float(eps), int(step), int(mode) == 1, bool(bias_correction),
                           float(weight_decay))


def multi_tensor_adam_capturable(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step,
                                 mode, bias_correction, weight_decay, inv_scale):
    """lr and step are one-element device tensors; skips when noop_flag is set; grads are
    multiplied by inv_scale inside the kernel (they are not written)."""
    g, p, m, v = _lists(tensor_lists, (4,), "multi_tensor_adam_capturable")
    found_inf = noop_flag.reshape(1).to(torch.float32)
    _ops.multi_tensor_adam(noop_flag, g, p, m, v, [], 0.0, float(beta1), float(beta2), float(eps),
                           1, int(mode) == 1, bool(bias_correction), float(weight_decay),
                           inv_scale.reshape(1).to(torch.float32), found_inf,
                           lr.reshape(1).to(torch.float32), step.reshape(1).to(torch.float32))


def multi_tensor_adam_capturable_master(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps,
                                        step, mode, bias_correction, weight_decay, inv_scale):
    """lists [g, p (model dtype), m, v, p_master (fp32)]."""
    g, p, m, v, master = _lists(tensor_lists, (5,), "multi_tensor_adam_capturable_master")
    found_inf = noop_flag.reshape(1).to(torch.float32)
    _ops.multi_tensor_adam(noop_flag, g, p, m, v, master, 0.0, float(beta1), float(beta2),
                           float(eps), 1, int(mode) == 1, bool(bias_correction),
                           float(weight_decay), inv_scale.reshape(1).to(torch.float32), found_inf,
                           lr.reshape(1).to(torch.float32), step.reshape(1).to(torch.float32))


def multi_tensor_sgd(chunk_size, noop_flag, tensor_lists, weight_decay, momentum, dampening, lr,
                     nesterov, first_run, wd_after_momentum, scale):
    """lists [g, p, momentum] or [g, p_fp32, momentum, p_model] (the fp32 master is updated and
    the model copy written from it); gradients are multiplied by ``scale``."""
    lists = _lists(tensor_lists, (3, 4), "multi_tensor_sgd")
    if len(lists) == 3:
        g, p, mom = lists
        master = []
    else:
        g, master, mom, p = lists
    _ops.multi_tensor_sgd(noop_flag, g, p, mom, master, float(lr), float(momentum),
                          float(dampening), float(weight_decay), bool(nesterov), bool(first_run),
                          bool(wd_after_momentum), float(scale))


def multi_tensor_adagrad(chunk_size, noop_flag, tensor_lists, lr, eps, mode, weight_decay):
    """lists [g, p, h]; mode 1 decays the weights directly (adagrad_w_mode), 0 adds wd*p to g."""
    g, p, h = _lists(tensor_lists, (3,), "multi_tensor_adagrad")
    _ops.multi_tensor_adagrad(noop_flag, g, p, h, [], float(lr), float(eps), int(mode) == 1,
                              float(weight_decay))


def multi_tensor_lamb(chunk_size, noop_flag, tensor_lists, lr, beta1, beta2, eps, step,
                      bias_correction, weight_decay, grad_averaging, mode, global_grad_norm,
                      max_grad_norm, use_nvlamb=False):
    """lists [g, p, m, v]; both LAMB stages. Unlike apex, the gradients are not overwritten."""
    g, p, m, v = _lists(tensor_lists, (4,), "multi_tensor_lamb")
    _ops.multi_tensor_lamb(noop_flag, g, p, m, v, [], float(lr), float(beta1), float(beta2),
                           float(eps), int(step), bool(bias_correction), float(weight_decay),
                           bool(grad_averaging), int(mode) == 1, global_grad_norm,
                           float(max_grad_norm), bool(use_nvlamb))


def update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                            growth_factor, backoff_factor, growth_interval, hysteresis):
    _ops.update_scale_hysteresis(current_scale, growth_tracker, hysteresis_tracker, found_inf,
                                 float(growth_factor), float(backoff_factor),
                                 int(growth_interval), int(hysteresis))
    return current_scale
