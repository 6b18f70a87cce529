"""apex.amp.scale_loss: ``with amp.scale_loss(loss, optimizer) as scaled_loss:
scaled_loss.backward()``. On exit the gradients are unscaled (into the fp32 masters under O2) with
an overflow check on apex-cpp's kernels; an overflow lowers a dynamic scale and makes the
optimizer's next ``step()`` a no-op, as apex did."""
import contextlib

import torch

from ._amp_state import _amp_state, maybe_print
from .cpu_half import cpu_half_fallback


def _optimizers_of(optimizers):
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)


def _grad_lists(optimizer):
    """(model params whose grads backward writes, the params the optimizer steps)."""
    stash = optimizer._amp_stash
    if stash.master_weights:
        return (stash.all_fp16_params + stash.all_fp32_from_fp32_params,
                stash.all_fp32_from_fp16_params + stash.all_fp32_from_fp32_params)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return params, params


def _own(grad):
    """A gradient that shares its storage (a view into DistributedDataParallel's bucket under
    gradient_as_bucket_view) is stashed as a copy: the Reducer writes the next backward's gradient
    into that bucket, which would overwrite a stash that aliases it."""
    if grad is None or grad.is_sparse:
        return grad
    if grad._is_view() or grad.untyped_storage().nbytes() > grad.numel() * grad.element_size():
        return grad.clone()
    return grad


def _prepare_backward(optimizer):
    """Gradients already there (accumulated by earlier scopes) are stashed, so that this scope's
    backward writes fresh scaled gradients, which are unscaled and added to them on exit."""
    stash = optimizer._amp_stash
    model_params, master_params = _grad_lists(optimizer)
    stash.stashed = [_own(m.grad) for m in master_params]
    for p in model_params:
        p.grad = None
    if stash.master_weights:
        for m in master_params:
            m.grad = None


def _post_backward(optimizer, scaler):
    stash = optimizer._amp_stash
    model_params, master_params = _grad_lists(optimizer)
    # None after a full scope: a scope that follows delayed ones (delay_unscale) stashed nothing.
    stashed = getattr(stash, "stashed", None) or [None] * len(master_params)
    model_grads, master_grads, stashed_grads = [], [], []
    plain = ([], [])
    for p, m, s in zip(model_params, master_params, stashed):
        if p.grad is None:
            # This backward did not reach p: its accumulated gradient stays as it was.
            if s is not None:
                m.grad = s
            continue
        if m.grad is None or m is p:
            if m is not p:
                m.grad = torch.empty_like(m)
        if s is not None:
            model_grads.append(p.grad)
            stashed_grads.append(s)
            master_grads.append(m.grad if m is not p else p.grad)
        else:
            plain[0].append(p.grad)
            plain[1].append(m.grad if m is not p else p.grad)
    scale = scaler.loss_scale()
    scaler.unscale(plain[0], plain[1], scale)
    if model_grads:
        scaler.unscale_with_stashed(model_grads, stashed_grads, master_grads, scale)
    if stash.master_weights:
        for p in stash.all_fp16_params:
            p.grad = None
    stash.stashed = None


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False,
               delay_overflow_check=False):
    """Yields ``loss * loss_scale``; see the module's documentation."""
    props = _amp_state.opt_properties
    if props is None:
        raise RuntimeError("amp.scale_loss: call amp.initialize first")
    if not props.enabled:
        yield loss
        return
    if loss_id < 0 or loss_id >= len(_amp_state.loss_scalers):
        raise RuntimeError(f"amp.scale_loss: loss_id {loss_id} but amp.initialize was given "
                           f"num_losses={len(_amp_state.loss_scalers)}")
    scaler = _amp_state.loss_scalers[loss_id]
    opts = _optimizers_of(optimizers)
    for o in opts:
        if not hasattr(o, "_amp_stash"):
            raise RuntimeError("amp.scale_loss: the optimizer was not passed to amp.initialize")
    # The backward of a model that computes in half, on a CPU without fast half matmuls: through
    # fp32 (cpu_half.py; a no-op elsewhere).
    half_cpu = _amp_state.device_type == "cpu" and props.computes_in_half()
    # apex's fast path: nothing to scale or check (O0, static 1, no masters).
    if not props.master_weights and not scaler.dynamic and scaler.loss_scale() == 1.0:
        with cpu_half_fallback(half_cpu):
            yield loss.float()
        return
    for o in opts:
        o._amp_lazy_init()  # O2: masters from the model's weights as they are now
    if not delay_unscale:
        for o in opts:
            if not o._amp_stash.params_have_scaled_gradients:
                _prepare_backward(o)
    with cpu_half_fallback(half_cpu):
        yield loss.float() * scaler.loss_scale()
    if delay_unscale:
        for o in opts:
            o._amp_stash.params_have_scaled_gradients = True
        return
    scaler.clear_overflow_state()
    for o in opts:
        _post_backward(o, scaler)
        o._amp_stash.params_have_scaled_gradients = False
    should_skip = False if delay_overflow_check else scaler.update_scale()
    if should_skip:
        for o in opts:
            o._amp_stash.skip_next_step = True
            # zero_grad of the model does not reach the masters: drop their overflowed gradients
            # here, or the next scope would stash and add them.
            if o._amp_stash.master_weights:
                for m in o._amp_stash.all_fp32_from_fp16_params:
                    m.grad = None
        maybe_print(f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss "
                    f"scale to {scaler.loss_scale()}")
