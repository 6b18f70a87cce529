import torch
from torch.optim.optimizer import required

from apex._ops import ops

from ._base import _FusedOptimizer, grads_of


class FusedSGD(_FusedOptimizer):
    """SGD with momentum (torch.optim.SGD's update, apex's ``wd_after_momentum`` option), all
    parameters of a group in one pass per (device, dtype). State: ``momentum_buffer`` (fp32).
    ``materialize_master_grads`` is accepted for apex's signature (amp O2 keeps its own fp32
    gradients here)."""

    _elementwise_state = ("momentum_buffer", "master_param")

    def __init__(self, params, lr=required, momentum=0.0, dampening=0.0, weight_decay=0.0,
                 nesterov=False, wd_after_momentum=False, materialize_master_grads=True,
                 set_grad_none=False):
        # torch.optim's `required` rule (and apex's): no default lr is fine when every parameter
        # group sets its own; a group without one is refused when it is added.
        if lr is not required and not (isinstance(lr, (int, float)) and lr >= 0.0):
            raise ValueError(f"FusedSGD: invalid learning rate: {lr} (expected a number >= 0)")
        if not momentum >= 0.0:  # NaN too
            raise ValueError(f"FusedSGD: invalid momentum value: {momentum}")
        if not weight_decay >= 0.0:
            raise ValueError(f"FusedSGD: invalid weight_decay value: {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("FusedSGD: nesterov momentum requires a momentum and zero dampening")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov)
        super().__init__(params, defaults, set_grad_none)
        self.wd_after_momentum = wd_after_momentum
        self.materialize_master_grads = materialize_master_grads
        self.most_recent_scale = 1.0
        self.scale_set_by_backward = False
        import amp_C
        self.multi_tensor_sgd = amp_C.multi_tensor_sgd

    def __setstate__(self, state):
        super().__setstate__(state)
        for group in self.param_groups:
            group.setdefault("nesterov", False)

    def _step(self, scaling):
        super()._step(scaling)
        self.most_recent_scale = 1.0

    def _step_group(self, group, scaling):
        device = group["params"][0].device
        inv_scale, found_inf = self._on(scaling, device)
        if self._skip(found_inf, group["params"], inv_scale):
            return
        scale = 1.0 / self.most_recent_scale
        if inv_scale is not None:
            scale *= float(inv_scale.item())
        momentum = group["momentum"]
        for bucket in self._buckets(group, "FusedSGD"):
            # The first step of a parameter seeds its momentum buffer with the gradient (as
            # torch does): such parameters take a call of their own.
            seeded = [p for p in bucket if momentum == 0 or "momentum_buffer" in self.state[p]]
            fresh = [p for p in bucket if momentum != 0 and "momentum_buffer" not in self.state[p]]
            for params, first_run in ((seeded, False), (fresh, True)):
                if not params:
                    continue
                bufs = ([self._state_zeros(p, "momentum_buffer") for p in params]
                        if momentum != 0 else [])
                noop = self._noop(params[0].device)
                noop.zero_()
                ops.multi_tensor_sgd(noop, grads_of(params), params, bufs, [], float(group["lr"]),
                                     momentum, group["dampening"], group["weight_decay"],
                                     bool(group["nesterov"]), first_run, self.wd_after_momentum,
                                     scale, inv_scale is not None)
